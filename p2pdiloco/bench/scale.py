"""Control traffic and connections against the swarm's size: N volunteers on one machine.

    python -m p2pdiloco.bench.scale --peers 4,8,24 --outer-steps 3 --out runs/scale

For each N: a bootstrap peer and N volunteers of ``--config`` (the real ``p2pdiloco join`` command,
each in its own process group, one torch thread each) train on 127.0.0.1 for ``--outer-steps``
outer steps, each keeping a ledger of its DHT calls (``P2PDILOCO_DHT_LEDGER=1``,
:mod:`p2pdiloco.swarm.ledger`). Per peer and successful fragment sync, means over peers:

* DHT bytes by record kind (``progress``, ``history``, ``ready``, ``group``, ``fingerprint``, ``node``
  for lookups), requests and responses together, protobuf sizes (without stream framing and TCP/IP);
  over the whole run, and after each peer's first sync (the ledger it wrote then subtracted: joining,
  waiting for ``min_peers_to_start`` peers and the first formation left out, so what a running swarm
  costs per sync), and the same per second (bytes after the first sync over the seconds from it to the
  peer's end) with the seconds between two syncs: the background records go by the clock, so a peer's
  bytes per sync grow with the time between its syncs, which on one machine grows with N (the peers
  share its cores). ``--slow F`` makes every volunteer's inner steps F times slower (the fault hook's
  ``slow``), to run a small swarm at a larger one's sync interval;
* after the first sync, the network reads of records per sync by kind and purpose (``progress:formation``,
  ``progress:background``, ``progress:catch-up``, ``ready:ready poll``, ...: the callers' tags,
  :attr:`~p2pdiloco.swarm.node.SwarmNode.read_counts`);
* all-reduce bytes sent (payload and framing: the sync events' ``sync_bytes_sent``);
* group formation (``group_wait_seconds``) and sync seconds, medians;
* the group sizes seen, and how many syncs failed or split (one (fragment, round) synced by groups
  that ended on different digests);
* TCP connections held by each peer's p2p daemon, the largest count sampled every 2 s.

Seconds are on N processes sharing this machine's cores: read them against each other, not as a
network's. Results go to ``<out>/results.json``, ``<out>/table.md`` and ``<out>/scale.png`` (DHT bytes
per sync by kind, and connections, against N). Only 127.0.0.1 is used.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from ..errors import ConfigError, UserError
from ..faults import ENV_VAR as FAULTS_ENV
from .procs import LocalProcs
from .run import _read_jsonl

__all__ = ["main", "summarize", "format_table"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: what every volunteer runs beside --config: one thread each (N of them share the cores), one shard each
_PEER_SETS = ["train.threads=1", "train.progress_bar=false", "train.eval_batches=1"]
KINDS = ("progress", "history", "ready", "group", "fingerprint", "node", "generic")


def _kind(row: str) -> str:
    """``find:ready`` -> ``ready``; a call that touched several kinds counts under the first."""
    kind = row.split(":", 1)[1] if ":" in row else row
    kind = kind.split("+", 1)[0]
    return kind if kind in KINDS else ("node" if kind in ("-", "") else "generic")


def _by_kind(ledger: Dict[str, Any]) -> Dict[str, float]:
    """A ledger's request and response bytes by record kind."""
    per_kind = {k: 0.0 for k in KINDS}
    for row, (_, req, resp) in ledger.items():
        per_kind[_kind(row)] += req + resp
    return per_kind


def summarize(n: int, runs: List[List[Dict[str, Any]]], connections: Dict[int, int]) -> Dict[str, Any]:
    """One row of the table from the N peers' metrics (``runs``: each peer's events)."""
    dht_kind: Dict[str, List[float]] = {k: [] for k in KINDS}
    steady_kind: Dict[str, List[float]] = {k: [] for k in KINDS}
    steady_reads: Dict[str, List[float]] = {}
    dht_total, steady_total, ar_bytes, waits, secs, sizes = [], [], [], [], [], []
    steady_rate, steady_interval = [], []
    ok = failed = 0
    digests: Dict[tuple, set] = {}
    for recs in runs:
        syncs = [r for r in recs if r.get("event") == "sync"]
        good = [r for r in syncs if r.get("ok")]
        ok += len(good)
        failed += len(syncs) - len(good)
        for r in good:
            digests.setdefault((r["fragment"], r["outer_step"]), set()).add(r.get("digest"))
            sizes.append(r.get("group_size"))
            if isinstance(r.get("sync_bytes_sent"), (int, float)):
                ar_bytes.append(r["sync_bytes_sent"])
            if isinstance(r.get("group_wait_seconds"), (int, float)):
                waits.append(r["group_wait_seconds"])
            if isinstance(r.get("sync_seconds"), (int, float)):
                secs.append(r["sync_seconds"])
        summary = next((r for r in recs if r.get("event") == "summary"), None)
        ledger = (summary or {}).get("dht_ledger")
        if good and isinstance(ledger, dict):
            per_kind = _by_kind(ledger)
            for k in KINDS:
                dht_kind[k].append(per_kind[k] / len(good))
            dht_total.append(sum(per_kind.values()) / len(good))
            # after the first sync: the summary's ledger less the one the peer wrote at its first sync
            first = next((r for r in recs if r.get("event") == "dht_ledger"), None)
            if first is not None and isinstance(first.get("dht_ledger"), dict) and len(good) > 1:
                at_first = _by_kind(first["dht_ledger"])
                later = {k: per_kind[k] - at_first[k] for k in KINDS}
                for k in KINDS:
                    steady_kind[k].append(later[k] / (len(good) - 1))
                steady_total.append(sum(later.values()) / (len(good) - 1))
                span = (summary or {}).get("time", 0.0) - first.get("time", 0.0)
                if span > 0:
                    steady_rate.append(sum(later.values()) / span)
                    steady_interval.append(span / (len(good) - 1))
                reads_end, reads_first = (summary or {}).get("dht_reads") or {}, first.get("dht_reads") or {}
                for why in set(reads_end) | set(reads_first):
                    steady_reads.setdefault(why, []).append(
                        (reads_end.get(why, 0) - reads_first.get(why, 0)) / (len(good) - 1))
    mean = lambda xs: round(statistics.fmean(xs), 1) if xs else None  # noqa: E731
    median = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {
        "peers": n, "peers_reporting": sum(1 for recs in runs if any(r.get("event") == "summary" for r in recs)),
        "ok_syncs": ok, "failed_syncs": failed, "split_rounds": sum(1 for d in digests.values() if len(d) > 1),
        "group_sizes": sorted({s for s in sizes if isinstance(s, int)}),
        "dht_bytes_per_sync": mean(dht_total), "dht_bytes_per_sync_by_kind": {k: mean(v) for k, v in dht_kind.items()},
        # the same after each peer's first sync (its start left out), and the network reads per sync by
        # record kind and purpose ("progress:formation", ...), means over the peers that reported both
        "dht_bytes_per_sync_after_first": mean(steady_total),
        "dht_bytes_per_sync_after_first_by_kind": {k: mean(v) for k, v in steady_kind.items()},
        "dht_bytes_per_s_after_first": mean(steady_rate), "seconds_per_sync_after_first": mean(steady_interval),
        "reads_per_sync_after_first": {why: round(statistics.fmean(v + [0.0] * (len(steady_total) - len(v))), 2)
                                       for why, v in sorted(steady_reads.items())},
        "allreduce_bytes_per_sync": mean(ar_bytes),
        "group_formation_s_median": median(waits), "sync_s_median": median(secs),
        "connections_max": max(connections.values()) if connections else None,
        "connections_mean": mean(list(connections.values())),
    }


class _Connections(threading.Thread):
    """The largest number of established TCP connections of each peer's p2p daemon, sampled every 2 s."""

    def __init__(self, pids: Dict[int, int]):
        super().__init__(daemon=True)
        self.pids, self.peak = pids, {}  # peer index -> pid of its `join` process; peer index -> connections
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            import psutil
        except ImportError:  # a hivemind dependency: absent only in unusual installs
            return
        while not self.stop.wait(2.0):
            for i, pid in self.pids.items():
                try:
                    daemons = [c for c in psutil.Process(pid).children(recursive=True) if "p2pd" in c.name()]
                    n = sum(1 for d in daemons for c in d.net_connections(kind="tcp") if c.status == "ESTABLISHED")
                except (psutil.Error, OSError):
                    continue
                self.peak[i] = max(self.peak.get(i, 0), n)


def run_one(n: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train N volunteers to the outer-step budget (or ``--timeout``) and summarize them."""
    work = os.path.join(args.out, f"n{n}")
    os.makedirs(work, exist_ok=True)
    procs = LocalProcs(work)
    t0 = time.time()
    conns = None
    try:
        addr = procs.bootstrap(timeout=120)
        for i in range(n):
            sets = [*_PEER_SETS, *args.set, f"swarm.run_id=scale-{n}-{os.getpid()}", f"swarm.min_peers_to_start={n}",
                    f"data.num_shards={n}", f"data.shard={i}", f"train.max_outer_steps={args.outer_steps}",
                    f"train.run_dir={os.path.join(work, f'p{i}')}"]
            procs.start(f"p{i}", "join", "--initial-peers", addr, "--config", args.config,
                        *sum((["--set", s] for s in sets), []), env=_peer_env(args.slow))
        peers = procs.procs[1:]
        conns = _Connections({i: p.pid for i, p in enumerate(peers)})
        conns.start()
        deadline, last = t0 + args.timeout, 0.0
        while time.time() < deadline and any(p.poll() is None for p in peers):
            if time.time() - last >= 15:
                last = time.time()
                syncs = sum(1 for i in range(n) for r in _read_jsonl(os.path.join(work, f"p{i}", "metrics.jsonl"))
                            if r.get("event") == "sync")
                running = sum(1 for p in peers if p.poll() is None)
                print(f"[scale] N={n}: {running}/{n} peers running, {syncs} syncs logged, {time.time() - t0:.0f} s",
                      file=sys.stderr, flush=True)
            time.sleep(1.0)
    finally:
        if conns is not None:
            conns.stop.set()
        procs.close()
    runs = [_read_jsonl(os.path.join(work, f"p{i}", "metrics.jsonl")) for i in range(n)]
    row = summarize(n, runs, conns.peak if conns is not None else {})
    row["seconds"] = round(time.time() - t0, 1)
    row["exit_codes"] = [p.returncode for p in procs.procs[1:]]
    failed = [i for i, p in enumerate(procs.procs[1:]) if p.returncode not in (0, -signal.SIGKILL)]
    if failed:
        tail = procs.tail(f"p{failed[0]}", 100_000).strip().splitlines()[-1:] or ["(nothing)"]
        row["errors"] = f"{len(failed)} peer(s) exited with an error; p{failed[0]}: {tail[0][:500]}"
        print(f"[scale] N={n}: {row['errors']}", file=sys.stderr, flush=True)
        if row["ok_syncs"] == 0:
            raise UserError(f"no volunteer of N={n} synced: {row['errors']} (logs in {work})")
    return row


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _peer_env(slow: float) -> Dict[str, str]:
    env = {"P2PDILOCO_DHT_LEDGER": "1"}
    if slow > 1.0:
        env[FAULTS_ENV] = json.dumps({"phase": "step", "action": "slow", "factor": slow, "times": 0})
    return env


def _kb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 1000:.1f} KB"


def format_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| peers | ok / failed / split syncs | group sizes | DHT per peer per sync | of which progress / history / "
             "ready / group / node | after the first sync | of which progress / history / ready / group / node | "
             "s between syncs | DHT per peer per s | "
             "all-reduce sent per sync | formation s (median) | sync s (median) | connections per peer (max) |",
             "|---" * 13 + "|"]
    kinds = ("progress", "history", "ready", "group", "node")
    for r in rows:
        k, later = r["dht_bytes_per_sync_by_kind"], r.get("dht_bytes_per_sync_after_first_by_kind") or {}
        lines.append(f"| {r['peers']} | {r['ok_syncs']} / {r['failed_syncs']} / {r['split_rounds']} | "
                     f"{', '.join(map(str, r['group_sizes'])) or '-'} | {_kb(r['dht_bytes_per_sync'])} | "
                     f"{' / '.join(_kb(k.get(x)) for x in kinds)} | {_kb(r.get('dht_bytes_per_sync_after_first'))} | "
                     f"{' / '.join(_kb(later.get(x)) for x in kinds)} | {r.get('seconds_per_sync_after_first', 'n/a')} | "
                     f"{_kb(r.get('dht_bytes_per_s_after_first'))} | "
                     f"{_kb(r['allreduce_bytes_per_sync'])} | {r['group_formation_s_median']} | {r['sync_s_median']} | "
                     f"{r['connections_max'] if r['connections_max'] is not None else 'n/a'} |")
    purposes = sorted({why for r in rows for why in r.get("reads_per_sync_after_first") or {}})
    if purposes:
        lines += ["", "Network reads of records per peer per sync after the first sync, by kind and purpose:", "",
                  "| peers | " + " | ".join(purposes) + " |", "|---" * (len(purposes) + 1) + "|"]
        for r in rows:
            reads = r.get("reads_per_sync_after_first") or {}
            lines.append(f"| {r['peers']} | " + " | ".join(f"{reads.get(w, 0.0):.2f}" for w in purposes) + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: List[Dict[str, Any]], out: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ns = [r["peers"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(rows)
    # the running swarm's traffic (each peer's start left out) where every row has it
    after = all(r.get("dht_bytes_per_sync_after_first") is not None for r in rows)
    field = "dht_bytes_per_sync_after_first_by_kind" if after else "dht_bytes_per_sync_by_kind"
    for kind in KINDS:
        vals = [(r[field].get(kind) or 0) / 1000 for r in rows]
        if any(vals):
            a.bar([str(n) for n in ns], vals, bottom=bottom, label=kind)
            bottom = [x + y for x, y in zip(bottom, vals)]
    a.plot([str(n) for n in ns], [(r["allreduce_bytes_per_sync"] or 0) / 1000 for r in rows], "k.-",
           label="all-reduce sent")
    a.set_xlabel("peers")
    a.set_ylabel("KB per peer per fragment sync")
    a.set_title("DHT bytes by record kind" + (", after each peer's first sync" if after else ""))
    a.legend(fontsize=8)
    b.plot(ns, [r["connections_max"] or 0 for r in rows], "o-", label="max")
    b.plot(ns, [r["connections_mean"] or 0 for r in rows], "s-", label="mean")
    b.set_xlabel("peers")
    b.set_ylabel("TCP connections of a peer's p2p daemon")
    b.legend()
    fig.tight_layout()
    path = os.path.join(out, "scale.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="4,8,24", help="comma-separated swarm sizes (default 4,8,24)")
    ap.add_argument("--outer-steps", type=int, default=3)
    ap.add_argument("--config", default=os.path.join(_REPO, "peers", "tiny-cpu.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="settings of every volunteer (e.g. inner.sync_every=60)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per swarm size before it is cut off")
    ap.add_argument("--slow", type=float, default=1.0, metavar="F",
                    help="every volunteer's inner steps F times slower (a small swarm at a larger one's sync interval)")
    ap.add_argument("--out", default="runs/scale")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.peers.split(",") if x.strip()]
        if not sizes or any(n < 2 for n in sizes):
            raise ValueError
    except ValueError:
        print(f"error: --peers takes swarm sizes of at least 2, comma-separated; got {args.peers!r}", file=sys.stderr)
        return 2
    if args.outer_steps < 1:
        print("error: --outer-steps must be at least 1", file=sys.stderr)
        return 2
    if not args.slow >= 1.0:
        print(f"error: --slow takes a factor of at least 1; got {args.slow}", file=sys.stderr)
        return 2
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    load = os.getloadavg()
    # Ctrl-C, and a kill, end the run through run_one's cleanup: every volunteer runs in its own session
    # (nothing signals it with us), and a shell starts a background job with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for n in sizes:
            print(f"[scale] N={n}: starting a bootstrap and {n} volunteers", file=sys.stderr, flush=True)
            rows.append(run_one(n, args))
            result = {"command": " ".join(["python -m p2pdiloco.bench.scale", *(argv if argv is not None else sys.argv[1:])]),
                      "load_at_start": [round(x, 2) for x in load], "rows": rows}
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(result, f, indent=1)
            with open(os.path.join(args.out, "table.md"), "w") as f:
                f.write(format_table(rows))
    except (ConfigError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the volunteers are stopped; finished sizes in {args.out}", file=sys.stderr)
        return 130
    _plot(rows, args.out)
    print(format_table(rows))
    return 0 if all(r["ok_syncs"] > 0 for r in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
