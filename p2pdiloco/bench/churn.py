"""Churn soak: peers killed and started at random for minutes.

    python -m p2pdiloco.bench.churn --minutes 5 --peers 4 --out runs/churn

A bootstrap peer and ``--peers`` volunteers (the real ``p2pdiloco join`` command, each in its own
process group) train on 127.0.0.1. Every few seconds (exponentially distributed, mean
``--every``) one event happens at random, keeping between ``--min-peers`` and ``--max-peers``
alive: ``kill`` (SIGKILL of a peer's whole process group: a crash, possibly mid all-reduce),
``leave`` (SIGTERM: a clean leave), ``join`` (a new peer with a fresh run directory) or
``restart`` (a killed peer comes back on its old run directory: resume from its checkpoint).

The report (printed, and written to ``<out>/churn.json``):

* ``outer_steps``: distinct syncs the swarm completed (fragment, inner step; any peer) during the
  churn, which starts once the swarm's first sync is done (``startup_s`` after launch);
* ``longest_gap_s``: the longest time without a completed sync during the churn (first
  completion of each; the start and the end of the churn window count as boundaries);
* ``digest_agreement``: whether at every completed sync all peers that completed it, or caught up
  to it, hold one state digest; ``disagreements`` lists the exceptions;
* counts of events, catch-ups, failed syncs; every peer's exit status.

Everything is seeded (``--seed``); nothing but 127.0.0.1 is used.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

__all__ = ["main", "analyse"]

_FAST = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=64", "inner.batch_size=4",
         "inner.sync_every=10", "train.eval_batches=1", "train.progress_bar=false", "train.threads=1",
         "swarm.progress_period=1", "swarm.matchmaking_timeout=20", "swarm.allreduce_timeout=20",
         "swarm.min_link_mbit=100", "train.max_outer_steps=100000"]


class _Peer:
    def __init__(self, name: str, run_dir: str, proc: subprocess.Popen):
        self.name, self.run_dir, self.proc = name, run_dir, proc


class Churn:
    def __init__(self, out: str, settings: List[str], seed: int):
        self.out = os.path.abspath(out)
        self.settings = settings
        self.rng = random.Random(seed)
        self.peers: Dict[str, _Peer] = {}
        self.dead: List[str] = []  # run dirs of killed peers, for restarts
        self.procs: List[subprocess.Popen] = []
        self.events: List[dict] = []
        self.addr: Optional[str] = None
        self.count = 0

    def _popen(self, args: List[str], name: str) -> subprocess.Popen:
        out = open(os.path.join(self.out, f"{name}.out"), "a")
        err = open(os.path.join(self.out, f"{name}.err"), "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", *args], stdout=out, stderr=err, cwd=self.out,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def bootstrap(self, timeout: float = 120) -> None:
        self._popen(["bootstrap", "--identity", os.path.join(self.out, "boot.key")], "boot")
        deadline = time.time() + timeout
        while time.time() < deadline:
            lines = [l for l in open(os.path.join(self.out, "boot.out")).read().splitlines() if "/p2p/" in l]
            if lines:
                self.addr = lines[0].strip()
                return
            time.sleep(0.2)
        raise RuntimeError("the bootstrap peer printed no address")

    def start(self, run_dir: Optional[str] = None, kind: str = "join") -> None:
        self.count += 1
        name = f"p{self.count}"
        run_dir = run_dir or os.path.join(self.out, name)
        args = ["join", "--initial-peers", self.addr]
        for s in (*_FAST, *self.settings, f"train.run_dir={run_dir}"):
            args += ["--set", s]
        self.peers[name] = _Peer(name, run_dir, self._popen(args, name))
        self.events.append({"t": time.time(), "event": kind, "peer": name, "run_dir": run_dir})

    def stop(self, name: str, sig: int, kind: str) -> None:
        peer = self.peers.pop(name)
        try:
            if sig == signal.SIGKILL:
                os.killpg(peer.proc.pid, signal.SIGKILL)
                self.dead.append(peer.run_dir)
            else:
                os.kill(peer.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.events.append({"t": time.time(), "event": kind, "peer": name})

    def step(self, min_peers: int, max_peers: int) -> None:
        for name in [n for n, p in self.peers.items() if p.proc.poll() is not None]:
            self.peers.pop(name)  # exited on its own (it should not: counted in the report)
            self.events.append({"t": time.time(), "event": "exited", "peer": name})
        live = len(self.peers)
        allowed = []
        if live > min_peers:
            allowed += ["kill", "leave"]
        if live < max_peers:
            allowed += ["join"] + (["restart"] if self.dead else [])
        # every kind of event gets its turn (kills twice as often), in random order
        done = [e["event"] for e in self.events]
        weight = {"kill": 0.5}
        kind = min(allowed, key=lambda k: (done.count(k) * weight.get(k, 1.0), self.rng.random()))
        if kind in ("kill", "leave"):
            name = self.rng.choice(sorted(self.peers))
            self.stop(name, signal.SIGKILL if kind == "kill" else signal.SIGTERM, kind)
        elif kind == "restart":
            self.start(self.dead.pop(self.rng.randrange(len(self.dead))), "restart")
        else:
            self.start()

    def close(self) -> Dict[str, Optional[int]]:
        """SIGTERM every live peer (a clean leave) and wait; returns their exit statuses."""
        for p in self.peers.values():
            try:
                os.kill(p.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        codes = {}
        for name, p in self.peers.items():
            try:
                codes[name] = p.proc.wait(60)
            except subprocess.TimeoutExpired:
                codes[name] = None
        for p in self.procs:  # then nothing may survive, in any process group we started
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return codes


def _records(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by SIGKILL
                pass
    return out


def analyse(run_dirs: List[str], t_start: float, t_end: float) -> dict:
    """The soak's numbers from the peers' metrics.jsonl (see the module docstring)."""
    first: Dict[tuple, float] = {}
    digests: Dict[tuple, Dict[str, set]] = {}
    failed = catch_ups = 0
    for d in sorted(set(run_dirs)):
        for r in _records(d):
            if r.get("event") == "sync" and r.get("ok"):
                key = (r["fragment"], r["step"])
                first[key] = min(first.get(key, r["time"]), r["time"])
                digests.setdefault(key, {}).setdefault(r["digest"], set()).add(os.path.basename(d))
            elif r.get("event") == "sync":
                failed += 1
            elif r.get("event") == "catch_up":
                catch_ups += 1
                parts = str(r.get("digest", "")).split("-")
                for frag, part in enumerate(parts):  # what it adopted is the state after that sync
                    key = (frag, r["step"])
                    if key in digests:
                        digests[key].setdefault(part, set()).add(os.path.basename(d) + " (catch-up)")
    times = sorted(t for t in first.values() if t >= t_start)  # the churn window
    gaps = [b - a for a, b in zip([t_start] + times, times + [t_end])]
    disagreements = {f"{k[0]}:{k[1]}": {dg: sorted(who) for dg, who in v.items()}
                     for k, v in sorted(digests.items()) if len(v) > 1}
    return {"outer_steps": len(times), "longest_gap_s": round(max(gaps), 1),
            "digest_agreement": not disagreements, "disagreements": disagreements,
            "failed_syncs": failed, "catch_ups": catch_ups}


def run(minutes: float, peers: int, min_peers: int, max_peers: int, every: float, out: str, seed: int,
        settings: List[str]) -> dict:
    os.makedirs(out, exist_ok=True)
    churn = Churn(out, settings, seed)
    codes: Dict[str, Optional[int]] = {}
    t_launch = t_start = t_end = time.time()
    try:
        churn.bootstrap()
        for _ in range(peers):
            churn.start(kind="initial")
        # the churn starts once the swarm is training (its first sync), and lasts `minutes`
        deadline = time.time() + 300
        while time.time() < deadline and not any(
                r.get("event") == "sync" for p in list(churn.peers.values()) for r in _records(p.run_dir)):
            time.sleep(1.0)
        t_start = time.time()
        end = t_start + minutes * 60
        while time.time() < end:
            delay = churn.rng.expovariate(1.0 / every)
            time.sleep(max(0.0, min(end, time.time() + delay) - time.time()))
            if time.time() < end:
                churn.step(min_peers, max_peers)
        t_end = time.time()
    finally:
        codes = churn.close()
    run_dirs = [e["run_dir"] for e in churn.events if "run_dir" in e]
    report = analyse(run_dirs, t_start, t_end)  # from the first sync on
    kinds = [e["event"] for e in churn.events]
    # a peer still importing torch when the soak ends dies of SIGTERM before it can handle it (nothing
    # of it is running yet): only peers that had started training must leave with status 0
    started = {e["peer"] for e in churn.events if "run_dir" in e
               and any(r.get("event") == "start" and r["time"] > e["t"] for r in _records(e["run_dir"]))}
    report.update(seconds=round(t_end - t_start, 1), startup_s=round(t_start - t_launch, 1),
                  events={k: kinds.count(k) for k in sorted(set(kinds)) if k != "initial"},
                  final_exit_codes={k: v for k, v in codes.items() if k in started},
                  still_starting_at_end=sorted(set(codes) - started), seed=seed)
    with open(os.path.join(out, "churn.json"), "w") as f:
        json.dump({"report": report, "events": churn.events}, f, indent=1)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.churn", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--peers", type=int, default=4, help="volunteers at the start")
    p.add_argument("--min-peers", type=int, default=2)
    p.add_argument("--max-peers", type=int, default=5)
    p.add_argument("--every", type=float, default=15.0, help="mean seconds between churn events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/churn")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra peer settings (after the soak's small fast defaults)")
    a = p.parse_args(argv)
    if not 1 <= a.min_peers <= a.peers <= a.max_peers:
        print("error: need 1 <= --min-peers <= --peers <= --max-peers", file=sys.stderr)
        return 2
    report = run(a.minutes, a.peers, a.min_peers, a.max_peers, a.every, a.out, a.seed, a.set)
    print(json.dumps(report, indent=1))
    ok = report["digest_agreement"] and report["outer_steps"] > 0
    print(f"churn: {report['outer_steps']} outer steps in {report['seconds']:.0f} s, longest gap "
          f"{report['longest_gap_s']} s, digest agreement at every step: {report['digest_agreement']}; "
          f"events {report['events']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
