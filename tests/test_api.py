"""The public API: exactly the intended names, and any nn.Module trains through it (examples/)."""
from __future__ import annotations

import os
import re

import pytest

import p2pdiloco
from conftest import ROOT

INTENDED = {
    "__version__", "DiLoCo", "SyncReport", "join_swarm", "leave_swarm", "model_signature", "RunConfig",
    "load_config", "GPT", "ModelConfig", "build_model", "DataConfig", "Corpus", "load_corpus", "BatchStream",
    "evaluate", "P2PDilocoError", "UserError", "ConfigError", "CheckpointError", "SyncFailed", "WireError",
}


def test_exported_names_are_the_intended_ones():
    assert set(p2pdiloco.__all__) == INTENDED
    for name in p2pdiloco.__all__:
        assert hasattr(p2pdiloco, name), name


def test_solo_diloco_equals_hand_written_outer_step():
    """DiLoCo with no swarm: after H steps θ ← SGD-Nesterov(θ, θ − θ_m): bitwise the written-out formula
    with one rounding per operation (what every CPU and GPU computes alike), and torch.optim.SGD's
    result to an ulp (torch may fuse a multiply-add on this CPU)."""
    import torch

    cfg = p2pdiloco.load_config(None, ["scheme=diloco"])  # one fragment, blocking, fp32
    cfg.inner.sync_every = 3
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    init = [p.detach().clone() for p in model.parameters()]
    diloco = p2pdiloco.DiLoCo(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        local = [p.detach().clone() for p in model.parameters()]  # θ_m just before the sync
        reports = diloco.after_inner_step(8)
    assert len(reports) == 1 and reports[0].ok and reports[0].round == 0
    ref = [p.clone().requires_grad_() for p in init]
    outer = torch.optim.SGD(ref, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    for r, i, l in zip(ref, init, local):
        r.grad = i - l
    outer.step()
    mu, lr = cfg.outer.momentum, cfg.outer.lr
    for r, i, l, p in zip(ref, init, local, model.parameters()):
        g = i - l
        b = g  # the first step: b = 0·μ + g
        written = i - (g + b * mu) * lr
        assert torch.equal(written, p.detach())
        torch.testing.assert_close(r.detach(), p.detach(), rtol=2e-7, atol=1e-9)


@pytest.mark.timeout(420)
def test_custom_module_example_trains_in_a_swarm(procs, tmp_path):
    addr = procs.bootstrap()
    runs = [procs.start_script(f"{ROOT}/examples/custom_module.py", "--initial-peers", addr, "--shard", str(i),
                               "--steps", "80", "--min-peers", "2", name=f"ex{i}") for i in range(2)]
    for p in runs:
        assert procs.wait(p, 360) == 0, procs.err(p.name)[-3000:]
    lines = [dict(re.findall(r"outer step (\d+) ok with 2 peer\(s\).*digest (\w+)", procs.out(f"ex{i}")))
             for i in range(2)]
    # both peers synced together at least once (a peer that missed the first round catches up before the
    # second), and held the same state after every round they synced together
    together = sorted(set(lines[0]) & set(lines[1]))
    assert together, [procs.out(f"ex{i}") for i in range(2)]
    assert all(lines[0][k] == lines[1][k] for k in together), lines
    assert all("done: synced step" in procs.out(f"ex{i}") for i in range(2)), [procs.out(f"ex{i}") for i in range(2)]


def test_library_peer_and_cli_peer_publish_the_same_fingerprint(monkeypatch):
    """join_swarm (the library API) and the training loop behind ``p2pdiloco join`` hash the same fields
    the same way: a library peer configured exactly like a CLI run is accepted by it (not refused as
    differing "in 0 field(s)")."""
    from p2pdiloco import api
    from p2pdiloco.run_identity import fingerprint_fields, run_fingerprint

    checked = []

    class FakeNode:
        def shutdown(self):
            pass

    class FakeSwarm:
        def __init__(self, node, run_id, **kwargs):
            self.node = node

        def check_fingerprint(self, fp, fields):
            checked.append((fp, fields))

        def update_progress(self, **kwargs):
            pass

        def publish_progress(self, wait=False):
            pass

        def start_publishing(self):
            pass

    monkeypatch.setattr(api, "SwarmNode", lambda *a, **k: FakeNode())
    monkeypatch.setattr(api, "Swarm", FakeSwarm)
    cfg = p2pdiloco.load_config(os.path.join(ROOT, "tests", "tiny-diloco.toml"))
    api.join_swarm(cfg)
    (fp, fields), = checked
    assert fields == fingerprint_fields(cfg)
    assert fp == run_fingerprint(cfg)


@pytest.mark.timeout(300)
def test_a_library_peer_that_missed_a_round_catches_up_before_it_syncs_again(procs):
    """Two peers of the library API (tests/library_peer.py); the second pauses before its first sync
    until that round has failed or closed without it, and the first peer goes on alone. The second must
    adopt the swarm's state (a verified download) before it syncs again: every later round of both
    peers holds one state on both. (Without the catch-up both report later rounds ok in a group of 2
    with different digests: each averaged from its own base.)"""
    addr = procs.bootstrap()
    runs = [procs.start_script(f"{ROOT}/tests/library_peer.py", "--initial-peers", addr, "--shard", str(i),
                               "--steps", "100", *(["--pause-before", "20", "--pause", "12"] if i else []),
                               name=f"lib{i}") for i in range(2)]
    for p in runs:
        assert procs.wait(p, 240) == 0, procs.err(p.name)[-3000:]
    syncs = [re.findall(r"sync step (\d+) round (\d+) (\w+) group (\d+) digest (\w*)$", procs.out(f"lib{i}"), re.M)
             for i in range(2)]
    assert "pausing 12.0 s before step 20" in procs.out("lib1")
    # the pause cost the second peer its first round (the scenario this test is about): the group it had
    # joined ahead failed at the all-reduce, or the round closed before it came
    assert syncs[1] and syncs[1][0][:3] in {("20", "0", "failed"), ("20", "0", "missed")}, syncs[1]
    assert any(s[2] == "ok" and s[3] == "1" for s in syncs[0]), syncs[0]  # the first went on alone meanwhile
    ok = [{(s[0], s[1]): s[4] for s in peer if s[2] == "ok" and s[3] == "2"} for peer in syncs]
    together = sorted(set(ok[0]) & set(ok[1]), key=lambda k: int(k[0]))
    assert together, syncs
    assert all(ok[0][k] == ok[1][k] for k in together), syncs
    assert "caught up with the swarm" in procs.err("lib1"), procs.err("lib1")[-3000:]
