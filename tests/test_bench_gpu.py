"""The GPU benchmark (``python -m p2pdiloco.bench.gpu``) end to end at its smoke size on the CPU, so
the command that runs on a lent GPU has run here; and ``train.autocast``, which it trains with."""
from __future__ import annotations

import json
import os

import pytest
import torch

from p2pdiloco.bench import gpu
from p2pdiloco.config import load_config
from p2pdiloco.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_smoke_runs_every_part_and_writes_the_results(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert gpu.main(["--smoke", "--out", str(out), "--work", str(work)]) == 0
    res = json.loads((out / "results.json").read_text())
    parts = res["parts"]
    assert list(parts) == list(gpu.PARTS)
    assert {n: p["status"] for n, p in parts.items()} == {n: "ok" for n in gpu.PARTS}, \
        {n: p.get("error") for n, p in parts.items()}

    tp = parts["throughput"]["result"]
    assert tp["solo"]["tokens_per_s"] > 0 and tp["model"]["params"] > 0
    assert len(tp["swarm"]["tokens_per_s"]) == 2 and all(r and r > 0 for r in tp["swarm"]["tokens_per_s"])
    assert tp["swarm"]["sync_by_fragment"] and all(v["ok"] >= 1 for v in tp["swarm"]["sync_by_fragment"].values())
    assert {r["name"] for r in tp["codecs"]["rows"]} >= {"fp32", "e3m0"}

    ex = parts["exactness"]["result"]  # the stand-in: two CPU kernel builds
    assert ex["digests_equal"] and ex["syncs_compared"] >= 1, ex
    assert ex["state_downloads"] == 0 and not ex["failed_syncs"]

    dp = parts["dp_gap"]["result"]
    assert dp["runs"] and dp["dp"]["final_val"] > 0
    for r in dp["runs"]:  # the gap is the DiLoCo run's final loss against data parallelism's, in %
        assert r["gap_pct"] == pytest.approx(100 * (r["final_val_loss"] / dp["dp"]["final_val"] - 1), abs=0.01)
        assert r["peers_agree"]
    assert dp["tokens"] == dp["outer_steps"] * dp["H"] * dp["global_batch_tokens"]

    sync = parts["sync"]["result"]
    assert sync["network"].startswith("loopback")
    assert sync["ours"]["rows"][0]["identical"] and sync["hivemind"]["rows"]

    table = (out / "table.md").read_text()
    for name in gpu.PARTS:
        assert f"| {name} | ok |" in table
    assert (out / "dp_gap.png").exists() and (out / "throughput.png").exists()
    # a lent device returns at most 8 files from its output folder: the work stays out of it
    assert len(os.listdir(out)) <= 8


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert gpu.main(["--smoke", "--parts", "prep,bogus", "--out", str(tmp_path / "o")]) == 2
    assert gpu.main(["--smoke", "--peers", "5", "--out", str(tmp_path / "o")]) == 2
    assert gpu.main(["--parts", "sync", "--out", str(tmp_path / "o")]) == 2  # no tokenizer from an earlier run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


def test_autocast_bf16_runs_the_forward_in_bf16_and_keeps_fp32_state():
    from p2pdiloco.data import load_corpus
    from p2pdiloco.train.inner import forward_loss, inner_setup, inner_step

    tiny = os.path.join(ROOT, "peers", "tiny-cpu.toml")
    with pytest.raises(ConfigError, match="train.autocast"):
        load_config(tiny, ["train.autocast=fp8"])
    losses = {}
    for mode in ("off", "bf16"):
        cfg = load_config(tiny, [f"train.autocast={mode}"])
        corpus = load_corpus(cfg.data)
        model, opt, stream = inner_setup(cfg, corpus, 0)
        seen = []
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        x, y = stream.next_batch("cpu")
        losses[mode] = forward_loss(cfg, model, x, y).item()
        inner_step(cfg, model, opt, stream, 0)
        hook.remove()
        assert seen[0] == (torch.bfloat16 if mode == "bf16" else torch.float32)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim())
    assert losses["bf16"] != losses["off"] and losses["bf16"] == pytest.approx(losses["off"], rel=0.02)
