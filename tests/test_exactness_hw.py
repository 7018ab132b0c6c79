"""Peers on different hardware end bitwise identical: volunteers started with different
``ATEN_CPU_CAPABILITY`` values (ATen's CPU kernel builds: what different CPUs select on their own)
train together through the real CLI, with fp32, 4-bit and low-rank pseudo-gradients and every
streaming mode. Before p2pdiloco.exact, the same runs disagreed after every sync (the outer step's
fused multiply-add, the initial weights' vectorised normal sampler).

Asserts: each peer really ran the kernels it was given (its start event); every sync succeeded in a
full group; all peers log the same digest for each (fragment, round); nobody downloaded a state to
repair a divergence (no catch_up, no digest_mismatch event); the initial digests are equal too.
"""
from __future__ import annotations

from typing import Dict, List

import pytest

from conftest import TINY
from p2pdiloco.metrics import read_metrics


def _capabilities() -> List[str]:
    """The ATen CPU kernel builds this machine can run (x86: default, avx2, avx512)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    caps = ["default"]
    if {"avx2", "fma"} <= flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    return caps


CAPS = _capabilities()
H, OUTER_STEPS = 8, 3
#: every sync must be in the full group, so a peer paused for seconds by a loaded machine is waited for (up to
#: swarm.matchmaking_timeout) rather than left behind by the speed-derived wait: leaving stragglers behind is
#: what tests/test_elastic_faults.py and test_heterogeneous.py assert, not these runs
BASE = [f"inner.sync_every={H}", f"train.max_outer_steps={OUTER_STEPS}", "inner.batch_size=4",
        "train.progress_bar=false", "swarm.adaptive_timeouts=false"]
#: name -> (settings, kernel builds of the peers, in start order)
RUNS: Dict[str, tuple] = {
    "fp32-tau": (["compression.codec=fp32", "streaming.fragments=2", "streaming.tau=2", "streaming.alpha=0.5"],
                 ["default", "avx2", "avx512"]),
    "e3m0-delay": (["compression.codec=e3m0", "streaming.fragments=2", "streaming.mode=delay"],
                   ["avx512", "default"]),
    "lowrank-eager": (["compression.codec=e3m0", "compression.lowrank=true", "compression.rank=4",
                       "streaming.fragments=2", "streaming.mode=eager"], ["avx2", "default", "avx512"]),
    "sparse-tau": (["compression.codec=sparse", "outer.lr=1", "outer.momentum=0", "compression.sparse_chunk=1024",
                    "compression.sparse_k=16", "streaming.fragments=2", "streaming.tau=2"], ["avx2", "default", "avx512"]),
    "lowrank-keep-tau": (["compression.codec=nf4", "compression.lowrank=true", "compression.rank=4",
                          "compression.error_feedback=true", "compression.feedback_form=model", "streaming.fragments=2",
                          "streaming.tau=2"], ["avx2", "default", "avx512"]),
    "q2-lowrank-keep-tau": (["compression.codec=q2", "compression.lowrank=true", "compression.rank=4",
                             "compression.error_feedback=true", "compression.feedback_form=model",
                             "streaming.fragments=2", "streaming.tau=2"], ["default", "avx2"]),
    "q1-keep-tau": (["compression.codec=q1", "compression.error_feedback=true", "compression.feedback_form=model",
                     "streaming.fragments=2", "streaming.tau=2"], ["avx2", "default"]),
    # a group of 4 capped at 2: two subgroups of 2, each shard averaged across them by its column
    "capped-e3m0-tau": (["compression.codec=e3m0", "swarm.group_cap=2", "streaming.fragments=2", "streaming.tau=2"],
                        ["default", "avx2", "avx512", "avx2"]),
    # low-rank's phases (P, then Q) each capped
    "capped-lowrank-eager": (["compression.codec=e3m0", "compression.lowrank=true", "compression.rank=4",
                              "swarm.group_cap=2", "streaming.fragments=2", "streaming.mode=eager"],
                             ["avx2", "default", "avx512", "default"]),
    "nf4-eager-heuristic": (["compression.codec=nf4", "compression.error_feedback=true", "streaming.mode=eager",
                             "streaming.eager_estimate=fresh_heuristic"], ["default", "avx2"]),
}


#: in the default suite: three kernel builds each, fp32 with tau (the default mode), low-rank 4-bit with eager and
#: sparse (relayed parts, every member averaging them) with tau, and a capped group (two levels) with tau;
#: the others (~25 s each) in make test-slow
DEFAULT_RUNS = ("fp32-tau", "lowrank-eager", "sparse-tau", "capped-e3m0-tau")


@pytest.mark.skipif(len(CAPS) < 2, reason=f"this CPU offers one ATen kernel build only ({CAPS})")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", [pytest.param(r, marks=[] if r in DEFAULT_RUNS else [pytest.mark.slow]) for r in RUNS])
def test_peers_on_different_kernels_stay_bitwise_identical(procs, tmp_path, run):
    settings, wanted = RUNS[run]
    caps = [c if c in CAPS else CAPS[i % len(CAPS)] for i, c in enumerate(wanted)]
    assert len(set(caps)) >= 2
    n = len(caps)
    addr = procs.bootstrap()
    peers = [procs.start("join", "--initial-peers", addr, "--config", TINY, *sum(
        (["--set", s] for s in BASE + settings + [f"swarm.run_id=hw-{run}", f"swarm.min_peers_to_start={n}",
                                                  f"data.shard={i}", f"train.run_dir={tmp_path}/p{i}"]), []),
        name=f"p{i}", env={"ATEN_CPU_CAPABILITY": cap}) for i, cap in enumerate(caps)]
    for p in peers:
        assert procs.wait(p, 240) == 0, procs.err(p.name)[-3000:]

    assert_one_state_everywhere(tmp_path, run, n, lambda i, start: (
        start["cpu_capability"].lower() == caps[i].lower(), (caps[i], start["cpu_capability"])))  # the fault fired
    if "swarm.group_cap=2" in settings:  # every round really averaged in two subgroups
        for i in range(n):
            syncs = [r for r in read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl")) if r["event"] == "sync"]
            assert all(r.get("subgroups") == 2 for r in syncs), [r.get("subgroups") for r in syncs]


def assert_one_state_everywhere(tmp_path, run: str, n: int, ran_as_told) -> None:
    """Peers ``p0..p{n-1}`` under ``tmp_path``: each ran as it was told (``ran_as_told(i, start event)``
    gives (ok, what to show)), every sync succeeded in a full group, no state was repaired, and all
    peers log the same digest at the start and after every (fragment, round)."""
    digests: Dict[tuple, Dict[int, str]] = {}
    for i in range(n):
        recs = read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"))
        start = [r for r in recs if r["event"] == "start"][0]
        ok, shown = ran_as_told(i, start)
        assert ok, shown
        digests.setdefault(("start",), {})[i] = start["digest"]
        syncs = [r for r in recs if r["event"] == "sync"]
        assert syncs and all(r["ok"] and r["group_size"] == n for r in syncs), \
            f"peer {i} synced without the full group:\n{_what_each_peer_did(tmp_path, n)}"
        for r in syncs:
            digests.setdefault((r["fragment"], r["outer_step"]), {})[i] = r["digest"]
        repairs = [r["event"] for r in recs if r["event"] in ("catch_up", "digest_mismatch")]
        assert not repairs, f"peer {i} repaired its state: {repairs}"
    assert len(digests) >= 1 + OUTER_STEPS
    for key, per_peer in digests.items():
        assert len(per_peer) == n and len(set(per_peer.values())) == 1, f"{run}: digests differ at {key}: {per_peer}"


def _what_each_peer_did(tmp_path, n: int) -> str:
    """Every peer's syncs (fragment, outer step, ok, group size, error), other events, and its log's end:
    which peer a group went on without, and what that peer was doing meanwhile."""
    out = []
    for i in range(n):
        recs = read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"))
        syncs = [(r["fragment"], r["outer_step"], r["ok"], r["group_size"], r.get("error"))
                 for r in recs if r["event"] == "sync"]
        others = sorted({r["event"] for r in recs} - {"sync", "progress"})
        log = (tmp_path / f"p{i}.err").read_text(errors="replace").splitlines()
        out.append(f"p{i} syncs {syncs}; events {others}; its log's end:\n  " + "\n  ".join(
            line[:300] for line in log[-25:]))
    return "\n".join(out)
