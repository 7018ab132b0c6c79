"""What only a GPU can measure, in one command: ``python -m p2pdiloco.bench.gpu --out DIR``.

Four parts, each in its own child process with its own time cap, in this order; after each one the
results so far are written to ``DIR/results.json`` and ``DIR/table.md`` (a run cut off keeps the
parts that finished). The work (tokenizer, token cache, peers' run folders and logs) goes to
``--work`` (default ``DIR/../gpu-work``), so that ``DIR`` holds a handful of files.

0. ``prep``: a byte-level BPE tokenizer trained on the embedded corpus (``p2pdiloco tokenizer train``,
   the real CLI) and the corpus tokenized once into a shared cache.
1. ``throughput``: a Hugging Face Llama of ~126M parameters (bf16 autocast, ``train.autocast``) trained
   first alone in this process (no swarm: the baseline), then by ``--peers`` volunteers started as
   ``p2pdiloco join`` processes sharing the GPU beside a ``p2pdiloco bootstrap``, with the default
   scheme (4 fragments, tau overlap, 4-bit). Reported: tokens/s of each peer (inner steps x batch x
   context over its training seconds) and their sum against the baseline's, model FLOPs utilization
   (6 N + 12 L d T FLOPs per token over the GPU's dense bf16 peak: H100/H200 989 TFLOP/s), each
   fragment's mean sync seconds (``sync_seconds``: group, all-reduce and outer step, off the training
   path) and wait seconds (training blocked on a sync), each peer's peak GPU memory (``nvidia-smi``,
   sampled), and every codec's encode/decode speed on a GPU tensor of the largest fragment's size
   (``bench.codecs``; the codecs copy to the CPU, so this includes the copy).
2. ``exactness``: a small model (``peers/tiny-cpu.toml``, the default scheme) trained by two CLI
   volunteers, one with ``train.device=cuda`` and one with ``train.device=cpu``: every sync ok in a
   group of two, the same digest on both peers after every (fragment, round), the same initial
   digest, and no state downloaded to repair a divergence (no ``catch_up`` or ``digest_mismatch``).
3. ``dp_gap``: DiLoCo with 4 replicas in process (``bench.eager``'s blocking variant: the real
   ``DiLoCo``, a hub averaging in fp32) against data parallelism (``bench.dp_reference``) on the same
   batches and global batch, H = 30, a Llama of ~37M parameters, outer lr over a grid; the relative
   gap of the final validation loss, beside Charles et al. 2025's +2.0% (35M, M = 4, H = 30, tuned;
   their token budgets are Chinchilla-optimal, ours is far below, and stated).
4. ``sync``: ``bench.syncwan``'s all-reduce of 4 x 100M values in e3m0 at 100 Mbit/s against the
   bandwidth-optimal bound 2(N-1)/N E/R, then hivemind's averager (fp16, to fit the cap) on the same
   emulated WAN, when this machine can build network namespaces (root, ``ip``, ``tc``, a namespace
   made and removed as a probe); else ``bench.allreduce`` on loopback, unshaped, said as such.

``--smoke`` runs every part at toy sizes on the CPU (no CUDA needed): part 2's GPU peer becomes a CPU
peer on another ATen kernel build (``ATEN_CPU_CAPABILITY``), part 4 always runs on loopback (the
default test suite creates no namespaces; ``tests/test_syncwan.py`` covers the namespace path).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError, UserError
from .procs import LocalProcs as _Procs, child_env as _child_env

__all__ = ["PARTS", "SIZES", "main", "format_table"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ("prep", "throughput", "exactness", "dp_gap", "sync")
#: dense bf16 peak FLOP/s by GPU name (no sparsity): what MFU is measured against
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
CHARLES_2025_GAP_35M = 2.0  # % (Table 4: M = 4, H = 30, tuned, 35M parameters)

_LLAMA_BASE = os.path.join(_REPO, "peers", "llama-cpu.toml")
_TINY = os.path.join(_REPO, "peers", "tiny-cpu.toml")

#: per size: caps (s) and the settings of each part. The full caps add up to 435 s.
SIZES: Dict[str, Dict[str, Any]] = {
    "full": {
        "caps": {"prep": 40, "throughput": 190, "exactness": 45, "dp_gap": 95, "sync": 65},
        "vocab": 16384, "max_bytes": 16_000_000,
        "tp_model": dict(d_model=768, n_layers=16, n_heads=12, hf_kv_heads=12, hf_intermediate_size=2048, seq_len=1024),
        "tp_batch": 8, "tp_solo_steps": (3, 12), "tp_H": 20, "tp_outer": 2, "tp_max_seconds": 70, "codec_numel": None,
        "ex_H": 20, "ex_outer": 3, "peers": 4, "sync_peers": 4,
        "dp_model": dict(d_model=512, n_layers=9, n_heads=8, hf_kv_heads=8, hf_intermediate_size=1408, seq_len=512),
        "dp_batch": 16, "dp_H": 30, "dp_outer": 6, "dp_grid": (0.7, 0.5, 0.9),
        "sync_numel": "100M", "sync_rate": 100, "sync_delay": 50,
    },
    "smoke": {
        "caps": {"prep": 60, "throughput": 120, "exactness": 90, "dp_gap": 60, "sync": 90},
        "vocab": 300, "max_bytes": 300_000,
        "tp_model": dict(d_model=32, n_layers=4, n_heads=2, hf_kv_heads=2, hf_intermediate_size=64, seq_len=32),
        "tp_batch": 2, "tp_solo_steps": (1, 3), "tp_H": 20, "tp_outer": 1, "tp_max_seconds": 60, "codec_numel": 1 << 14,
        "ex_H": 20, "ex_outer": 1, "peers": 2, "sync_peers": 2,
        "dp_model": dict(d_model=32, n_layers=2, n_heads=2, hf_kv_heads=2, hf_intermediate_size=64, seq_len=32),
        "dp_batch": 2, "dp_H": 4, "dp_outer": 2, "dp_grid": (0.7,),
        "sync_numel": "20K", "sync_rate": 100, "sync_delay": 50,
    },
}


# ----------------------------------------------------------------------------- shared helpers
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_info() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if info["cuda"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return info


def _peak_flops() -> Optional[float]:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _model_sets(m: Dict[str, Any], vocab: int) -> List[str]:
    return [f"model.{k}={v}" for k, v in m.items()] + [f"model.vocab_size={vocab}"]


def _data_sets(ctx: Dict[str, Any]) -> List[str]:
    return [f"data.tokenizer={ctx['tokenizer']}", f"data.cache_dir={ctx['cache']}", f"data.max_bytes={ctx['max_bytes']}",
            "data.source=stdlib"]


def _count(cfg: Any) -> int:
    import torch

    from ..model import seeded_model

    with torch.device("meta"):
        return sum(p.numel() for p in seeded_model(cfg.model, 0).parameters())


def _flops_per_token(cfg: Any, params: int) -> float:
    m = cfg.model
    return 6.0 * params + 12.0 * m.n_layers * m.d_model * m.seq_len


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


class _GpuMemory(threading.Thread):
    """Each pid's largest GPU memory (MiB) seen by ``nvidia-smi`` every 0.5 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: Dict[int, int] = {}
        self.stop = threading.Event()
        self.tool = shutil.which("nvidia-smi")

    def run(self) -> None:
        while self.tool and not self.stop.wait(0.5):
            try:
                out = subprocess.run([self.tool, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.splitlines():
                try:
                    pid, mib = (int(x) for x in line.split(","))
                except ValueError:
                    continue
                self.peak[pid] = max(self.peak.get(pid, 0), mib)


def _metrics(run_dir: str) -> List[Dict[str, Any]]:
    from ..metrics import read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    return read_metrics(path) if os.path.exists(path) else []


# ----------------------------------------------------------------------------- part 0: tokenizer and token cache
def part_prep(ctx: Dict[str, Any], size: Dict[str, Any], save) -> Dict[str, Any]:
    from ..config import load_config
    from ..data import load_corpus
    from ..tokenizer import tokenizer_vocab_size

    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "tokenizer", "train", "--data", "stdlib",
                           "--vocab-size", str(size["vocab"]), "--out", ctx["tokenizer"],
                           "--max-bytes", str(size["max_bytes"])],
                          capture_output=True, text=True, env=_child_env(), cwd=ctx["work"])
    if proc.returncode != 0:
        raise RuntimeError(f"p2pdiloco tokenizer train failed: {proc.stderr[-1500:]}")
    t_tok = time.time() - t0
    ctx["vocab"] = tokenizer_vocab_size(ctx["tokenizer"])
    cfg = load_config(_LLAMA_BASE, _model_sets(size["dp_model"], ctx["vocab"]) + _data_sets(ctx))
    corpus = load_corpus(cfg.data)  # fills the shared cache: the peers read it
    return {"vocab": ctx["vocab"], "vocab_asked": size["vocab"], "corpus_bytes": size["max_bytes"],
            "train_tokens": int(corpus.train.numel()),
            "val_tokens": int(corpus.val.numel()), "tokenizer_seconds": round(t_tok, 1),
            "seconds": round(time.time() - t0, 1)}


# ----------------------------------------------------------------------------- part 1: throughput
def _solo(cfg: Any, steps: Sequence[int], device: str) -> Dict[str, Any]:
    """The same model and inner step, alone in this process: tokens/s after ``steps[0]`` warm-up steps."""
    import torch

    from ..data import load_corpus
    from ..train.inner import inner_setup, inner_step

    corpus = load_corpus(cfg.data)
    model, opt, stream = inner_setup(cfg, corpus, 0, device)
    warm, timed = steps
    for s in range(warm):
        inner_step(cfg, model, opt, stream, s, device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for s in range(warm, warm + timed):
        inner_step(cfg, model, opt, stream, s, device)  # .item() of the loss syncs every step, as in a peer
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"steps_timed": timed, "seconds": round(dt, 3),
           "tokens_per_s": round(timed * cfg.inner.batch_size * cfg.model.seq_len / dt, 1)}
    if device == "cuda":
        out["peak_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _peer_rates(runs: List[List[Dict[str, Any]]], batch: int, seq: int) -> List[Optional[float]]:
    """Tokens/s of each peer in its steady state: the inner steps from its first to its last sync over
    the time between them (syncs, outer steps, validation and checkpoints included; the first steps'
    warm-up and the run's end not), else over its whole run (the summary's seconds)."""
    rates: List[Optional[float]] = []
    for recs in runs:
        syncs = [r for r in recs if r["event"] == "sync"]
        if len(syncs) >= 2 and syncs[-1]["time"] > syncs[0]["time"] and syncs[-1]["step"] > syncs[0]["step"]:
            rates.append(round((syncs[-1]["step"] - syncs[0]["step"]) * batch * seq
                               / (syncs[-1]["time"] - syncs[0]["time"]), 1))
            continue
        rates.append(_whole_run_rate(recs, batch, seq))
    return rates


def _whole_run_rate(recs: List[Dict[str, Any]], batch: int, seq: int) -> Optional[float]:
    summ = [r for r in recs if r["event"] == "summary"]
    if summ and summ[0]["seconds"] > 0:
        return round(summ[0]["inner_steps"] * batch * seq / summ[0]["seconds"], 1)
    return None


def _sync_by_fragment(runs: List[List[Dict[str, Any]]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    syncs = [r for recs in runs for r in recs if r["event"] == "sync"]
    for frag in sorted({r["fragment"] for r in syncs}):
        mine = [r for r in syncs if r["fragment"] == frag]
        ok = [r for r in mine if r["ok"]]
        out[str(frag)] = {"syncs": len(mine), "ok": len(ok),
                          "mean_sync_s": round(sum(r["sync_seconds"] for r in ok) / len(ok), 3) if ok else None,
                          "mean_wait_s": round(sum(r.get("wait_seconds") or 0 for r in ok) / len(ok), 3) if ok else None,
                          "mean_bytes": round(sum(r["sync_bytes"] for r in ok) / len(ok)) if ok else None}
    return out


def part_throughput(ctx: Dict[str, Any], size: Dict[str, Any], save) -> Dict[str, Any]:
    import torch

    from ..bench import codecs as codec_bench
    from ..config import load_config
    from ..diloco.fragments import split_fragments
    from ..model import seeded_model

    cuda = ctx["cuda"]
    device = "cuda" if cuda else "cpu"
    peers = ctx["peers"]
    sets = (_model_sets(size["tp_model"], ctx["vocab"]) + _data_sets(ctx)
            + [f"train.device={device}", f"train.autocast={'bf16' if cuda else 'off'}",
               f"inner.batch_size={size['tp_batch']}", f"inner.sync_every={size['tp_H']}", "inner.round_samples=0",
               "inner.warmup_steps=10", "streaming.fragments=4", "streaming.pattern=balanced", "train.eval_batches=2",
               "train.progress_bar=false", f"data.num_shards={peers}"] + ctx.get("peer_sets", []))
    cfg = load_config(_LLAMA_BASE, sets)
    params = _count(cfg)
    fpt = _flops_per_token(cfg, params)
    peak = _peak_flops()
    res: Dict[str, Any] = {"model": dict(size["tp_model"], vocab=ctx["vocab"], params=params, kind="hf llama"),
                           "batch": cfg.inner.batch_size, "H": cfg.inner.sync_every, "peers": peers,
                           "autocast": cfg.train.autocast, "device": device, "flops_per_token": fpt,
                           "peak_flops": peak, "scheme": "4 fragments (balanced), tau overlap, 4-bit (the default)",
                           "peer_sets": ctx.get("peer_sets", [])}
    solo = _solo(cfg, size["tp_solo_steps"], device)
    solo["mfu"] = round(solo["tokens_per_s"] * fpt / peak, 4) if peak else None
    res["solo"] = solo
    save(res)

    procs = _Procs(ctx["work"])
    mem = _GpuMemory()
    mem.start()
    try:
        addr = procs.bootstrap()
        names = [f"tp{i}" for i in range(peers)]
        for i, n in enumerate(names):
            procs.start(n, "join", "--initial-peers", addr, "--config", _LLAMA_BASE, *sum((["--set", s] for s in sets + [
                "swarm.run_id=gpu-throughput", f"swarm.min_peers_to_start={peers}", f"data.shard={i}",
                f"train.max_outer_steps={size['tp_outer']}", f"train.max_seconds={size['tp_max_seconds']}",
                f"train.run_dir={os.path.join(ctx['work'], n)}"]), []))
        codes = procs.wait(names, ctx["cap"] - (time.time() - ctx["t0"]) - 10)  # then read what they wrote
        pids = {n: p.pid for n, p in zip(names, procs.procs[1:])}
    finally:
        mem.stop.set()
        procs.close()
    runs = [_metrics(os.path.join(ctx["work"], n)) for n in names]
    rates = _peer_rates(runs, cfg.inner.batch_size, cfg.model.seq_len)
    total = sum(r for r in rates if r) if any(rates) else None
    res["swarm"] = {
        "exit_codes": codes, "tokens_per_s": rates, "tokens_per_s_sum": round(total, 1) if total else None,
        "tokens_per_s_whole_run": [_whole_run_rate(recs, cfg.inner.batch_size, cfg.model.seq_len) for recs in runs],
        "sum_over_solo": round(total / solo["tokens_per_s"], 3) if total else None,
        "mfu_sum": round(total * fpt / peak, 4) if (total and peak) else None,
        "outer_steps": [next((r["outer_steps"] for r in recs if r["event"] == "summary"), None) for recs in runs],
        "sync_by_fragment": _sync_by_fragment(runs),
        "gpu_memory_mib": ({n: mem.peak.get(pid) for n, pid in pids.items()} if mem.tool
                           else "n/a: no nvidia-smi on this machine"),
        "errors": {n: procs.tail(n) for n, c in codes.items() if c != 0},
    }
    save(res)
    # the codecs last: the swarm's figures matter more when the cap is short
    with torch.device("meta"):
        layout = split_fragments(seeded_model(cfg.model, 0), cfg.streaming.fragments, cfg.streaming.pattern)
    res["fragment_numels"] = list(layout.numels)
    numel = size["codec_numel"] or min(max(layout.numels), 1 << 24)
    if ctx["cap"] - (time.time() - ctx["t0"]) < 15:
        res["codecs"] = {"skipped": "under 15 s left of the cap"}
    else:
        res["codecs"] = {"device": device, "numel": numel, "rows": codec_bench.run(numel, 2, device)}
    return res


# ----------------------------------------------------------------------------- part 2: exactness across devices
def part_exactness(ctx: Dict[str, Any], size: Dict[str, Any], save) -> Dict[str, Any]:
    import torch

    cuda = ctx["cuda"]
    if cuda:
        kinds = [("cuda", {}), ("cpu", {})]
    else:  # the stand-in: two CPU kernel builds (what different CPUs select), both on the CPU
        kinds = [("cpu", {"ATEN_CPU_CAPABILITY": "default"}),
                 ("cpu", {"ATEN_CPU_CAPABILITY": torch.backends.cpu.get_cpu_capability().lower()})]
    H, K = size["ex_H"], size["ex_outer"]
    procs = _Procs(ctx["work"])
    names = ["ex0", "ex1"]
    try:
        addr = procs.bootstrap()
        for i, (n, (dev, env)) in enumerate(zip(names, kinds)):
            procs.start(n, "join", "--initial-peers", addr, "--config", _TINY, *sum((["--set", s] for s in [
                f"train.device={dev}", f"inner.sync_every={H}", f"train.max_outer_steps={K}", "inner.batch_size=4",
                "train.progress_bar=false", "swarm.run_id=gpu-exact", "swarm.min_peers_to_start=2",
                f"data.shard={i}", "data.num_shards=2", f"train.run_dir={os.path.join(ctx['work'], n)}"]), []), env=env)
        codes = procs.wait(names, ctx["cap"] - (time.time() - ctx["t0"]) - 5)
    finally:
        procs.close()
    digests: Dict[str, Dict[str, str]] = {}
    peers, repairs, bad = [], {}, []
    for n in names:
        recs = _metrics(os.path.join(ctx["work"], n))
        start = next((r for r in recs if r["event"] == "start"), {})
        peers.append({"name": n, "device": start.get("device"), "cpu_capability": start.get("cpu_capability")})
        digests.setdefault("start", {})[n] = start.get("digest")
        for r in recs:
            if r["event"] == "sync":
                digests.setdefault(f"f{r['fragment']}:r{r['outer_step']}", {})[n] = r["digest"]
                if not (r["ok"] and r["group_size"] == 2):
                    bad.append(f"{n} f{r['fragment']} r{r['outer_step']}: ok={r['ok']} group={r['group_size']}")
        repairs[n] = [r["event"] for r in recs if r["event"] in ("catch_up", "digest_mismatch")]
    differ = {k: v for k, v in digests.items() if len(v) != 2 or len(set(v.values())) != 1}
    syncs = len(digests) - 1
    return {"peers": peers, "exit_codes": codes, "syncs_compared": syncs, "digests_equal": not differ and syncs > 0,
            "differing": differ, "state_downloads": sum(len(v) for v in repairs.values()), "failed_syncs": bad,
            "stand_in": None if cuda else "no CUDA: both peers on the CPU under different ATEN_CPU_CAPABILITY",
            "errors": {n: procs.tail(n) for n, c in codes.items() if c != 0}}


# ----------------------------------------------------------------------------- part 3: DiLoCo vs data parallelism
def part_dp_gap(ctx: Dict[str, Any], size: Dict[str, Any], save) -> Dict[str, Any]:
    from ..bench.dp_reference import dp_curve
    from ..bench.eager import run_variant
    from ..config import load_config

    cuda, M, H, K = ctx["cuda"], 4, size["dp_H"], size["dp_outer"]
    sets = (_model_sets(size["dp_model"], ctx["vocab"]) + _data_sets(ctx)
            + [f"train.device={'cuda' if cuda else 'cpu'}", f"train.autocast={'bf16' if cuda else 'off'}",
               f"inner.batch_size={size['dp_batch']}", f"inner.sync_every={H}", "inner.round_samples=0",
               "inner.warmup_steps=30", "inner.lr=1e-3", "train.eval_batches=8", f"data.num_shards={M}",
               "scheme=diloco", "streaming.fragments=1"])  # blocking DiLoCo, one fragment (the base TOML has 2)
    cfg = load_config(_LLAMA_BASE, sets)
    params = _count(cfg)
    tokens = K * H * M * cfg.inner.batch_size * cfg.model.seq_len
    res: Dict[str, Any] = {
        "model": dict(size["dp_model"], vocab=ctx["vocab"], params=params, kind="hf llama"), "replicas": M, "H": H,
        "outer_steps": K, "global_batch_tokens": M * cfg.inner.batch_size * cfg.model.seq_len, "tokens": tokens,
        "chinchilla_tokens": 20 * params, "budget_vs_chinchilla": round(tokens / (20 * params), 4),
        "inner": {"lr": cfg.inner.lr, "warmup_steps": cfg.inner.warmup_steps, "schedule": cfg.inner.lr_schedule},
        "autocast": cfg.train.autocast, "charles_2025_gap_pct": CHARLES_2025_GAP_35M, "runs": []}
    save(res)
    t0 = time.time()
    dp = dp_curve(cfg, M, K * H, H)
    res["dp"] = {"final_val": dp["curve"][-1]["val"], "curve": dp["curve"], "seconds": dp["seconds"]}
    save(res)
    per_run = time.time() - t0
    for lr in size["dp_grid"]:
        left = ctx["cap"] - (time.time() - ctx["t0"])
        if left < 1.3 * per_run:
            res.setdefault("skipped", []).append(f"outer lr {lr}: ~{per_run:.0f} s needed, {left:.0f} s left of the cap")
            continue
        t1 = time.time()
        r = run_variant(_LLAMA_BASE, sets, f"blocking@{lr}", M, K, eval_batches=cfg.train.eval_batches)
        per_run = max(per_run, time.time() - t1)
        r["gap_pct"] = round(100 * (r["final_val_loss"] - res["dp"]["final_val"]) / res["dp"]["final_val"], 2)
        res["runs"].append(r)
        best = min(res["runs"], key=lambda x: x["final_val_loss"])
        res["best"] = {"outer_lr": best["outer_lr"], "final_val": best["final_val_loss"], "gap_pct": best["gap_pct"]}
        save(res)
    return res


# ----------------------------------------------------------------------------- part 4: the sync at scale
def _netns_usable() -> Optional[str]:
    """None when network namespaces can be built here, else why not (one probe namespace made and removed)."""
    from ..bench.wan import require_root

    try:
        require_root()
    except UserError as e:
        return str(e)
    name = f"p2pdgpu-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _syncwan(ctx: Dict[str, Any], size: Dict[str, Any], tag: str, codecs: str, hivemind: str, cap: float) -> Dict[str, Any]:
    out = os.path.join(ctx["work"], f"syncwan-{tag}")
    argv = [sys.executable, "-m", "p2pdiloco.bench.syncwan", "--peers", str(size["sync_peers"]), "--numel", size["sync_numel"],
            "--rates", str(size["sync_rate"]), "--delay", str(size["sync_delay"]), "--codecs", codecs,
            "--hivemind", hivemind, "--repeat", "1", "--probe-seconds", "3", "--timeout", str(int(cap)),
            "--cleanup-stale", "--out", out]
    with open(os.path.join(ctx["work"], f"syncwan-{tag}.log"), "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
        try:
            code = p.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)  # syncwan tears its namespaces down on an interrupt
            try:
                code = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                code = p.wait()
    path = os.path.join(out, "results.json")
    got = json.load(open(path)) if os.path.exists(path) else {}
    res = {"command": " ".join(argv[1:]), "exit_code": code, "rows": got.get("rows", []), "links": got.get("links")}
    if code != 0:
        with open(os.path.join(ctx["work"], f"syncwan-{tag}.log")) as f:
            res["log_tail"] = f.read()[-1500:]
    return res


def part_sync(ctx: Dict[str, Any], size: Dict[str, Any], save) -> Dict[str, Any]:
    from ..bench import allreduce
    from ..bench.allreduce import _parse_sizes

    why = "smoke: loopback (the default test suite builds no namespaces)" if ctx["smoke"] else _netns_usable()
    n = size["sync_peers"]
    res: Dict[str, Any] = {"peers": n, "numel": size["sync_numel"], "rate_mbit": size["sync_rate"],
                           "delay_ms": size["sync_delay"], "cpus": os.cpu_count()}
    if why is None:
        res["network"] = "emulated WAN in network namespaces (bench.syncwan)"
        budget = ctx["cap"] - (time.time() - ctx["t0"]) - 5
        res["ours"] = _syncwan(ctx, size, "ours", "e3m0", "", budget * 0.65)
        save(res)
        if res["ours"]["rows"]:
            res["hivemind"] = _syncwan(ctx, size, "hivemind", "", "fp16",
                                       ctx["cap"] - (time.time() - ctx["t0"]) - 5)
            return res
        # namespaces were made, but the emulated WAN did not run (a qdisc the kernel lacks, say)
        res["syncwan_failed"] = res.pop("ours")
        why = f"bench.syncwan exited {res['syncwan_failed']['exit_code']} (syncwan_failed.log_tail)"
    res["network"] = f"loopback, unshaped (bench.allreduce): {why}"
    numel = _parse_sizes(size["sync_numel"])[0]
    res["ours"] = {"rows": allreduce.run_ours(n, numel, ["e3m0"], repeat=1, timeout=120)}
    save(res)
    res["hivemind"] = {"rows": allreduce.run_hivemind(n, numel, ["fp16"], repeat=1, timeout=120)}
    return res


_FUNCS = {"prep": part_prep, "throughput": part_throughput, "exactness": part_exactness, "dp_gap": part_dp_gap,
          "sync": part_sync}


# ----------------------------------------------------------------------------- the table and the plots
def _f(x: Any, fmt: str = "{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


def format_table(results: Dict[str, Any]) -> str:
    """The markdown summary of every part present in ``results``."""
    parts = results.get("parts", {})
    lines = [f"# GPU benchmark{' (smoke)' if results.get('smoke') else ''}", "",
             f"device: {json.dumps(results.get('device'))}; commit {results.get('git')}; {results.get('date')}", "",
             "| part | status | seconds | result |", "|---|---|---|---|"]
    for name in PARTS:
        p = parts.get(name)
        if p is None:
            continue
        r = p.get("result") or {}
        errs = (r.get("swarm") or r).get("errors") or (p.get("error") and {name: p["error"]})
        note = f" (errors: {', '.join(errs)}; see results.json)" if errs else ""
        lines.append(f"| {name} | {p['status']} | {_f(p.get('seconds'), '{:.0f}')} | {_summary(name, r)}{note} |")
    return "\n".join(lines) + "\n"


def _summary(name: str, r: Dict[str, Any]) -> str:
    if name == "prep":
        return f"BPE {r.get('vocab')} ids, {_f(r.get('train_tokens'), '{:,}')} train tokens"
    if name == "throughput":
        s, w = r.get("solo") or {}, r.get("swarm") or {}
        frag = "; ".join(f"f{k} sync {_f(v['mean_sync_s'])} s wait {_f(v['mean_wait_s'])} s"
                         for k, v in (w.get("sync_by_fragment") or {}).items())
        sets = f"peers with {', '.join(r['peer_sets'])}; " if r.get("peer_sets") else ""
        return (f"{_f((r.get('model') or {}).get('params'), '{:,}')} params, {r.get('autocast')}: alone "
                f"{_f(s.get('tokens_per_s'), '{:,.0f}')} tok/s (MFU {_f(s.get('mfu'))}); {r.get('peers')} peers "
                f"{w.get('tokens_per_s')} tok/s between first and last sync "
                f"(whole run {w.get('tokens_per_s_whole_run')}), {sets}"
                f"sum/alone {_f(w.get('sum_over_solo'))}, MFU sum {_f(w.get('mfu_sum'))}; "
                f"GPU MiB {w.get('gpu_memory_mib')}; {frag}")
    if name == "exactness":
        return (f"{[p.get('device') for p in r.get('peers', [])]}: {r.get('syncs_compared')} syncs, digests equal "
                f"{r.get('digests_equal')}, state downloads {r.get('state_downloads')}"
                + (f" ({r['stand_in']})" if r.get("stand_in") else ""))
    if name == "dp_gap":
        runs = ", ".join(f"lr {x['outer_lr']}: {x['final_val_loss']} ({x['gap_pct']:+.2f}%)" for x in r.get("runs", []))
        return (f"{_f((r.get('model') or {}).get('params'), '{:,}')} params, {_f(r.get('tokens'), '{:,}')} tokens "
                f"({_f(r.get('budget_vs_chinchilla'))} of Chinchilla's 20/param): DP {(r.get('dp') or {}).get('final_val')}; "
                f"DiLoCo M=4 H={r.get('H')}: {runs}; best gap {_f((r.get('best') or {}).get('gap_pct'))}% "
                f"(Charles et al. 2025: +{CHARLES_2025_GAP_35M}% at 35M, Chinchilla budget)")
    if name == "sync":
        out = [r.get("network", "")]
        for impl in ("ours", "hivemind"):
            for row in (r.get(impl) or {}).get("rows", []):
                bound = f", x bound {_f(row.get('x_limit_b'))} (bound {_f(row.get('limit_b'))} s)" if "x_limit_b" in row else ""
                out.append(f"{row.get('impl')} {row.get('codec')}: {_f(row.get('seconds'))} s{bound}")
        return "; ".join(out)
    return ""


def _plots(results: Dict[str, Any], out: str) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # missing, or built against another numpy than the one imported: no plots
        return []
    made = []
    dp = ((results.get("parts", {}).get("dp_gap") or {}).get("result") or {})
    if dp.get("dp"):
        fig, ax = plt.subplots(figsize=(7, 4))
        c = dp["dp"]["curve"]
        ax.plot([p["step"] for p in c], [p["val"] for p in c], marker="o", label=f"data parallel ({dp['dp']['final_val']})")
        for r in dp.get("runs", []):
            ys = r["val_after_each_outer_step"]
            ax.plot([dp["H"] * (i + 1) for i in range(len(ys))], ys, marker="s",
                    label=f"DiLoCo M=4 outer lr {r['outer_lr']} ({r['final_val_loss']}, {r['gap_pct']:+.2f}%)")
        ax.set_xlabel("global step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"DiLoCo vs data parallelism, {dp['model']['params'] / 1e6:.1f}M params, {dp['tokens']:,} tokens")
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(os.path.join(out, "dp_gap.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    tp = ((results.get("parts", {}).get("throughput") or {}).get("result") or {})
    if (tp.get("swarm") or {}).get("tokens_per_s"):
        fig, ax = plt.subplots(figsize=(7, 4))
        rates = tp["swarm"]["tokens_per_s"]
        labels = ["alone"] + [f"peer {i}" for i in range(len(rates))] + ["peers' sum"]
        vals = [tp["solo"]["tokens_per_s"]] + [x or 0 for x in rates] + [tp["swarm"]["tokens_per_s_sum"] or 0]
        ax.bar(labels, vals)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{tp['model']['params'] / 1e6:.0f}M Llama, {tp['autocast']}, {tp['device']}")
        fig.tight_layout()
        made.append(os.path.join(out, "throughput.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


# ----------------------------------------------------------------------------- the driver
def _git() -> str:
    """The commit: ``P2PDILOCO_COMMIT`` when set (a device machine's copy of the working tree may carry the
    .git of an older commit, or none), else git's."""
    if os.environ.get("P2PDILOCO_COMMIT"):
        return os.environ["P2PDILOCO_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", _REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        head = ""
    return head or "unknown"


def _run_part(name: str, args: argparse.Namespace, cap: float) -> Dict[str, Any]:
    """Run one part in a child process (its own process group) for at most ``cap`` seconds."""
    path = os.path.join(args.work, f"{name}.json")
    if os.path.exists(path):
        os.remove(path)
    argv = [sys.executable, "-m", "p2pdiloco.bench.gpu", "--part", name, "--cap", str(cap), "--out", args.out,
            "--work", args.work, "--peers", str(args.peers), *(["--smoke"] if args.smoke else []),
            *sum((["--peer-set", s] for s in args.peer_set), [])]
    t0 = time.time()
    with open(os.path.join(args.work, f"part-{name}.log"), "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
        try:
            code: Optional[int] = p.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its peers and daemons too
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    got = json.load(open(path)) if os.path.exists(path) else {}
    status = ("ok" if code == 0 and got.get("done") else f"cut at its cap of {cap:.0f} s" if code is None
              else f"failed (exit {code})")
    entry = {"status": status, "seconds": round(time.time() - t0, 1), "cap_s": cap, "result": got.get("result"),
             "error": got.get("error")}
    if status.startswith("failed") and not got.get("error"):
        with open(os.path.join(args.work, f"part-{name}.log")) as f:
            entry["error"] = f.read()[-2000:]
    return entry


def _child(args: argparse.Namespace) -> int:
    size = SIZES["smoke" if args.smoke else "full"]
    ctx = {"work": args.work, "tokenizer": os.path.join(args.work, "tok.json"), "cache": os.path.join(args.work, "tokens"),
           "max_bytes": size["max_bytes"], "peers": args.peers, "smoke": args.smoke, "cap": args.cap, "t0": time.time(),
           "cuda": _cuda() and not args.smoke, "peer_sets": list(args.peer_set)}
    if args.part != "prep" and os.path.exists(ctx["tokenizer"]):
        from ..tokenizer import tokenizer_vocab_size

        ctx["vocab"] = tokenizer_vocab_size(ctx["tokenizer"])
    path = os.path.join(args.work, f"{args.part}.json")
    save = lambda res: _write_json(path, {"done": False, "result": res})  # noqa: E731
    if args.smoke:
        import torch

        torch.set_num_threads(1)
    try:
        res = _FUNCS[args.part](ctx, size, save)
    except Exception as e:  # the part's failure is its result; the next part still runs
        import traceback

        prev = json.load(open(path)) if os.path.exists(path) else {}
        _write_json(path, {"done": False, "result": prev.get("result"), "error": traceback.format_exc()[-3000:]})
        print(f"{args.part}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    _write_json(path, {"done": True, "result": res})
    return 0


def _parse_caps(text: str) -> Dict[str, float]:
    caps: Dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, sec = item.partition("=")
        try:
            caps[name] = float(sec)
        except ValueError:
            raise ConfigError(f"--caps: expected PART=SECONDS, got {item!r}") from None
        if name not in PARTS or caps[name] <= 0:
            raise ConfigError(f"--caps: {item!r}: the part must be one of {', '.join(PARTS)} and the seconds > 0")
    return caps


def run_all(args: argparse.Namespace) -> Dict[str, Any]:
    size = SIZES["smoke" if args.smoke else "full"]
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    results: Dict[str, Any] = {
        "command": " ".join(["python -m p2pdiloco.bench.gpu", *args.argv]), "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "git": _git(),
        "device": _device_info(), "parts": {}}
    caps = dict(size["caps"], **getattr(args, "caps", {}))
    for name in args.parts:
        print(f"[gpu bench] {name}: cap {caps[name]:g} s", flush=True)
        results["parts"][name] = _run_part(name, args, caps[name])
        print(f"[gpu bench] {name}: {results['parts'][name]['status']} in {results['parts'][name]['seconds']:.0f} s",
              flush=True)
        _write_json(os.path.join(args.out, "results.json"), results)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(format_table(results))
        _plots(results, args.out)
    print(format_table(results), flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results folder: results.json, table.md, plots "
                                                "(default bench_results/gpu-<UTC time>)")
    ap.add_argument("--work", default=None, help="work folder: tokenizer, token cache, peers' runs and logs "
                                                 "(default <out>/../gpu-work-<name of out>)")
    ap.add_argument("--smoke", action="store_true", help="every part at toy sizes on the CPU (well under a minute)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order (default {','.join(PARTS)})")
    ap.add_argument("--peers", type=int, default=None,
                    help="volunteers sharing the GPU in the throughput part, 2-4 (default 4; --smoke: 2)")
    ap.add_argument("--caps", default="", help="seconds per part over the defaults, e.g. throughput=200,sync=60")
    ap.add_argument("--peer-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config setting for the throughput part's volunteers over the benchmark's own "
                         "(repeatable), e.g. train.threads=4")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # the child process of one part
    ap.add_argument("--cap", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        args.out = os.path.join(_REPO, "bench_results", f"gpu-{stamp}")
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or os.path.join(os.path.dirname(args.out),
                                                          f"gpu-work-{os.path.basename(args.out)}"))
    if args.part:
        return _child(args)
    try:
        args.parts = [p for p in args.parts.split(",") if p]
        bad = [p for p in args.parts if p not in PARTS]
        if bad:
            raise ConfigError(f"--parts: unknown {', '.join(bad)}; known: {', '.join(PARTS)}")
        args.caps = _parse_caps(args.caps)
        args.peers = args.peers or SIZES["smoke" if args.smoke else "full"]["peers"]
        if not 2 <= args.peers <= 4:
            raise ConfigError(f"--peers must be 2, 3 or 4, got {args.peers}")
        if args.parts and args.parts[0] != "prep" and not os.path.exists(os.path.join(args.work, "tok.json")):
            raise ConfigError(f"--parts without prep needs the tokenizer of an earlier run in {args.work}")
        run_all(args)
    except (ConfigError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
