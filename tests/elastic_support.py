"""Helpers shared by the elastic / fault-tolerance tests (test_elastic*, test_checkpoint*, test_partition*).

Every peer is the real ``p2pdiloco join`` command (started through the ``procs`` fixture, so it
runs in its own process group and nothing survives the test). Faults are placed with the
``P2PDILOCO_FAULTS`` environment variable (p2pdiloco/faults.py); each firing is a ``fault`` event
in the peer's metrics.jsonl, which is how the tests know a fault really happened.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from conftest import TINY

#: a tiny, fast swarm: a 0.12M-parameter, 2-layer model (8 ms per inner step), short rounds, quick
#: failure detection
FAST = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=64",
    "inner.batch_size=4", "train.eval_batches=1", "train.progress_bar=false", "train.threads=1",
    "swarm.progress_period=1", "swarm.matchmaking_timeout=20", "swarm.allreduce_timeout=20",
    "swarm.min_link_mbit=100",
]


def join_args(addr: Optional[str], run_dir, *settings: str) -> List[str]:
    args = ["join", "--config", TINY]
    if addr:
        args += ["--initial-peers", addr]
    for s in (*FAST, f"train.run_dir={run_dir}", *settings):
        args += ["--set", s]
    return args


def faults_env(*rules: dict) -> Dict[str, str]:
    return {"P2PDILOCO_FAULTS": json.dumps(list(rules))}


def read_events(run_dir, event: Optional[str] = None) -> List[dict]:
    """metrics.jsonl records (a torn last line from a killed peer is skipped)."""
    path = os.path.join(str(run_dir), "metrics.jsonl")
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event is None or rec.get("event") == event:
                out.append(rec)
    return out


def ok_syncs(run_dir) -> List[dict]:
    return [r for r in read_events(run_dir, "sync") if r["ok"]]


def wait_for(cond: Callable[[], object], timeout: float, what: str, procs=None, names: Sequence[str] = ()) -> object:
    """Poll ``cond`` until truthy; on timeout fail with the tail of the named peers' stderr."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.25)
    tails = "".join(f"\n--- {n} stderr ---\n{procs.err(n)[-2500:]}" for n in names) if procs else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")


def stop(procs, proc, sig=signal.SIGTERM, timeout: float = 60) -> int:
    """Send ``sig`` to one peer (its main process only: what Ctrl-C or `kill` does) and wait."""
    os.kill(proc.pid, sig)
    return procs.wait(proc, timeout)


def digests_by_sync(run_dirs: Iterable) -> Dict[tuple, Dict[str, str]]:
    """{(fragment, step): {run_dir: digest}} over every successful sync of the given peers that had a
    group: a peer's solo outer step (group_size 1: it found nobody, e.g. a straggler waking from a
    freeze mid-matchmaking) is shared with no one, and the lineage rule repairs it later (it adopts
    the larger group's state), so it is not compared."""
    out: Dict[tuple, Dict[str, str]] = {}
    for d in run_dirs:
        for r in ok_syncs(d):
            if r.get("group_size", 2) > 1:
                out.setdefault((r["fragment"], r["step"]), {})[str(d)] = r["digest"]
    return out


def assert_agree(run_dirs: Sequence, min_common: int = 1) -> int:
    """Every sync that several of these peers completed gave them one digest; returns how many
    syncs were shared by all of them (at least ``min_common``)."""
    table = digests_by_sync(run_dirs)
    for key, per_peer in sorted(table.items()):
        assert len(set(per_peer.values())) == 1, f"peers disagree after sync (fragment, step) {key}: {per_peer}"
    shared = sum(1 for per_peer in table.values() if len(per_peer) == len(run_dirs))
    assert shared >= min_common, f"only {shared} syncs shared by all {len(run_dirs)} peers: {sorted(table)}"
    return shared


def ns_cli(*args: str) -> List[str]:
    """argv of the p2pdiloco command, to run inside a network namespace host."""
    return [sys.executable, "-m", "p2pdiloco.cli", *args]


class NsPeers:
    """CLI processes started inside network-namespace hosts (``host.popen``); output in tmp_path."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.procs = {}

    def start(self, host, name, *args, env=None):
        out = open(self.tmp / f"{name}.out", "w")
        err = open(self.tmp / f"{name}.err", "w")
        e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        p = host.popen(ns_cli(*args), stdout=out, stderr=err, cwd=str(self.tmp), env=e)
        p.name = name
        self.procs[name] = p
        return p

    def err(self, name):
        return (self.tmp / f"{name}.err").read_text()

    def wait(self, p, timeout):
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{p.name} did not exit in {timeout} s:\n{self.err(p.name)[-3000:]}")

    def alive(self):
        return [n for n, p in self.procs.items() if p.poll() is None]
