"""Background traffic between syncs: bytes/s per peer on the emulated WAN while no sync is due.

    sudo python -m p2pdiloco.bench.idle --peers 4 --seconds 60

starts a bootstrap peer and ``--peers`` real ``p2pdiloco join`` processes (tiny preset, default
settings otherwise), each in its own namespace of an :class:`~p2pdiloco.bench.wan.EmulatedWAN`
(``--rate`` Mbit/s, ``--delay`` ms one way). ``inner.sync_every`` is set far beyond the run, so no
sync is ever due: what crosses the wire is the background (progress records, fingerprint, liveness,
DHT and libp2p maintenance). The peers' steps are slowed down (the fault hook's ``slow``) so that four
peers barely load two cores. ``--warmup`` seconds after the last peer started training (its
``start`` event: joined, first record published) it counts each host's ``eth0`` bytes (everything: payload, framing, TCP/IP and Ethernet headers) over
``--seconds`` seconds, from ``/proc/<pid>/net/dev`` of an idle process in each namespace, and prints
bytes/s sent and received per peer, the bootstrap peer's, the quietest and busiest 10 s windows and
the load average (others' work on the machine).

``--repo DIR`` runs the peers from another checkout (e.g. ``git worktree add /tmp/before <commit>``),
so a before/after comparison uses one harness. ``--set section.key=value`` passes settings to every
peer (e.g. ``swarm.progress_period=2``). Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .hivemind_dp import read_iface_bytes
from .run import _DEFAULT_CONFIG, _REPO, _child_env, _loadavg, _start_bootstrap
from .wan import EmulatedWAN, LinkSpec, _kill_group, require_root

__all__ = ["measure", "main"]

#: the sampling period of the interface counters (s) and the short window reported beside the mean
SAMPLE_S = 1.0
WINDOW_S = 10.0


def _peer_argv(repo: str, config: str, maddr: str, i: int, n: int, host: Any, run_id: str, run_dir: str,
               seconds: float, sets: Sequence[str]) -> List[str]:
    overrides = [f"data.num_shards={n}", f"data.shard={i}", f"train.run_dir={run_dir}", "train.threads=1",
                 "train.progress_bar=false", f"swarm.run_id={run_id}", f"swarm.host_maddrs=/ip4/{host.address}/tcp/0",
                 "inner.sync_every=100000", f"train.max_seconds={seconds:g}", *sets]
    argv = [sys.executable, "-m", "p2pdiloco.cli", "join", "--initial-peers", maddr, "--config", config]
    for s in overrides:
        argv += ["--set", s]
    return argv


def _rates(samples: List[Tuple[float, List[Tuple[int, int]]]], i: int) -> Tuple[float, float]:
    (t0, v0), (t1, v1) = samples[0], samples[-1]
    dt = max(t1 - t0, 1e-9)
    return (v1[i][0] - v0[i][0]) / dt, (v1[i][1] - v0[i][1]) / dt


def _windows(samples: List[Tuple[float, List[Tuple[int, int]]]], peers: int) -> Tuple[float, float]:
    """The quietest and the busiest WINDOW_S window of the peers' mean send rate (bytes/s)."""
    rates = []
    for a in range(len(samples)):
        b = next((k for k in range(a, len(samples)) if samples[k][0] - samples[a][0] >= WINDOW_S), None)
        if b is None:
            break
        dt = samples[b][0] - samples[a][0]
        rates.append(sum(samples[b][1][i][0] - samples[a][1][i][0] for i in range(peers)) / peers / dt)
    return (min(rates), max(rates)) if rates else (float("nan"), float("nan"))


def _wait_for_starts(paths: List[str], procs: List[subprocess.Popen], timeout: float) -> None:
    """Until every peer wrote its ``start`` event (joined, data loaded, first record published)."""
    deadline = time.monotonic() + timeout
    while True:
        started = 0
        for path in paths:
            try:
                with open(path) as f:
                    started += any('"event": "start"' in line for line in f)
            except OSError:
                pass
        if started == len(paths):
            return
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"only {started} of {len(paths)} peers started training (see their logs)")
        time.sleep(0.5)


def measure(peers: int = 4, seconds: float = 60.0, warmup: float = 20.0, rate_mbit: float = 10.0,
            delay_ms: float = 50.0, sets: Sequence[str] = (), repo: str = _REPO, config: str = _DEFAULT_CONFIG,
            out: str = "", slow: float = 5.0, start_timeout: float = 180.0) -> Dict[str, Any]:
    """Run the measurement (see the module docstring); returns the results as a dict."""
    require_root()
    out = out or tempfile.mkdtemp(prefix="p2pdiloco-idle-")
    os.makedirs(out, exist_ok=True)
    run_id = f"idle-{os.getpid()}-{int(time.time())}"
    env = dict(_child_env(), PYTHONPATH=repo,
               P2PDILOCO_FAULTS=json.dumps({"phase": "step", "action": "slow", "factor": slow, "times": 0}))
    files: List[Any] = []
    procs: List[subprocess.Popen] = []
    load_start = _loadavg()
    with EmulatedWAN(peers + 1, LinkSpec(rate_mbit=rate_mbit, delay_ms=delay_ms)) as wan:
        try:
            boot, maddr = _start_bootstrap(wan.hosts[peers], out, files)
            procs.append(boot)
            anchors = [h.popen(["sleep", str(int(start_timeout + warmup + seconds + 600))]) for h in wan.hosts]
            procs += anchors
            for i in range(peers):
                log = open(os.path.join(out, f"peer{i}.log"), "w")
                files.append(log)
                argv = _peer_argv(repo, config, maddr, i, peers, wan.hosts[i], run_id, os.path.join(out, f"peer{i}"),
                                  start_timeout + warmup + seconds + 60, sets)
                procs.append(wan.hosts[i].popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo))
            _wait_for_starts([os.path.join(out, f"peer{i}", "metrics.jsonl") for i in range(peers)], procs, start_timeout)
            time.sleep(warmup)
            samples: List[Tuple[float, List[Tuple[int, int]]]] = []
            t_end = time.time() + seconds
            while True:
                now = time.time()
                samples.append((now, [read_iface_bytes("eth0", f"/proc/{a.pid}/net/dev") or (0, 0) for a in anchors]))
                if now >= t_end:
                    break
                time.sleep(min(SAMPLE_S, max(0.0, t_end - now)))
            alive = [p.poll() is None for p in procs[len(anchors) + 1:]]
        finally:
            for p in procs:
                _kill_group(p, grace=5)
            for f in files:
                f.close()
    per_peer = [_rates(samples, i) for i in range(peers)]
    quiet, busy = _windows(samples, peers)
    syncs = 0
    for i in range(peers):
        try:
            with open(os.path.join(out, f"peer{i}", "metrics.jsonl")) as f:
                syncs += sum(1 for line in f if '"event": "sync"' in line)
        except OSError:
            pass
    return {"peers": peers, "seconds": round(samples[-1][0] - samples[0][0], 1), "warmup_s": warmup,
            "link": {"rate_mbit": rate_mbit, "delay_ms": delay_ms}, "sets": list(sets), "repo": repo,
            "sent_per_peer_Bps": round(sum(s for s, _ in per_peer) / peers),
            "recv_per_peer_Bps": round(sum(r for _, r in per_peer) / peers),
            "sent_max_peer_Bps": round(max(s for s, _ in per_peer)),
            "per_peer_Bps": [[round(s), round(r)] for s, r in per_peer],
            "bootstrap_Bps": [round(v) for v in _rates(samples, peers)],
            "sent_per_peer_quietest_10s_Bps": round(quiet), "sent_per_peer_busiest_10s_Bps": round(busy),
            "peers_alive": all(alive), "syncs": syncs, "loadavg_start": load_start, "loadavg_end": _loadavg(),
            "out": out}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.idle", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0, help="the measured window (default 60)")
    p.add_argument("--warmup", type=float, default=20.0,
                   help="seconds between the last peer's start of training and the window (default 20)")
    p.add_argument("--rate", type=float, default=10.0, help="link rate, Mbit/s (default 10)")
    p.add_argument("--delay", type=float, default=50.0, help="one-way delay, ms (default 50)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--repo", default=_REPO, help="run the peers from this checkout (default: this one)")
    p.add_argument("--out", default="", help="peer logs and metrics here (default: a temporary folder)")
    p.add_argument("--json", default="", help="also write the results to this file")
    args = p.parse_args(argv)
    r = measure(args.peers, args.seconds, args.warmup, args.rate, args.delay, args.sets, os.path.abspath(args.repo),
                out=args.out)
    print(json.dumps(r), flush=True)
    print(f"background per peer over {r['seconds']:.0f} s ({r['peers']} peers, {r['link']['rate_mbit']:g} Mbit/s, "
          f"{r['link']['delay_ms']:g} ms): sent {r['sent_per_peer_Bps'] / 1000:.2f} KB/s, received "
          f"{r['recv_per_peer_Bps'] / 1000:.2f} KB/s (10 s windows: {r['sent_per_peer_quietest_10s_Bps'] / 1000:.2f}"
          f"-{r['sent_per_peer_busiest_10s_Bps'] / 1000:.2f} KB/s sent); bootstrap sent/received "
          f"{r['bootstrap_Bps'][0] / 1000:.2f}/{r['bootstrap_Bps'][1] / 1000:.2f} KB/s; syncs {r['syncs']}; "
          f"peers alive {r['peers_alive']}; load average {r['loadavg_start']} -> {r['loadavg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["peers_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
