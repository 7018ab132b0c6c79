"""``p2pdiloco demo``: a bootstrap peer plus volunteers on 127.0.0.1, started through the real CLI.

It says which training scheme runs (the default: Streaming DiLoCo with 4-bit pseudo-gradients, config.SCHEMES),
shows a live status line while they train, then a summary (validation loss at start and end, outer
steps, bytes sent and received per peer, whether every peer holds the same state digest, and the
bytes the syncs sent against an fp32 all-reduce of the same syncs) and
writes ``<out>/demo.png`` (validation loss and bytes sent over time).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List

from .errors import UserError
from .metrics import format_bytes, read_metrics

__all__ = ["run_demo"]

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers", "tiny-cpu.toml")


def _cli(*args: str) -> List[str]:
    return [sys.executable, "-m", "p2pdiloco.cli", *args]


def run_demo(args) -> int:
    n = args.peers
    if n < 1 or n > 16:
        raise UserError(f"--peers {n}: choose between 1 and 16 volunteers")
    config = args.config or (_DEFAULT_CONFIG if os.path.isfile(_DEFAULT_CONFIG) else None)
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    run_id = f"demo-{int(time.time())}"
    procs: List[subprocess.Popen] = []

    def stop(signum, frame):
        # SIGTERM (a `timeout`, a service manager, `kill`) or SIGHUP (the terminal closed) reach only this
        # process: the peers run in sessions of their own. Unwind through the `finally` below, which
        # stops them all, instead of dying with them left training.
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}

    def start(argv: List[str], name: str) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=open(os.path.join(out, f"{name}.out"), "w"),
                             stderr=open(os.path.join(out, f"{name}.log"), "w"), start_new_session=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
        procs.append(p)
        return p

    from .config import describe_scheme, load_config

    scheme = describe_scheme(load_config(config, list(args.set)))  # a bad --set is refused here, before anything starts
    try:
        print(f"starting a bootstrap peer and {n} volunteers on 127.0.0.1 (logs in {out})", flush=True)
        print(f"scheme: {scheme}", flush=True)
        boot = start(_cli("bootstrap", "--identity", os.path.join(out, "bootstrap.key")), "bootstrap")
        addr = _wait_for_address(os.path.join(out, "bootstrap.out"), boot)
        print(f"bootstrap peer: {addr}", flush=True)
        volunteers = []
        for i in range(n):
            sets = [f"swarm.run_id={run_id}", f"data.shard={i}", f"train.run_dir={out}/peer{i}",
                    f"train.max_outer_steps={args.outer_steps}", f"swarm.min_peers_to_start={n}",
                    "train.progress_bar=false", *args.set]
            argv = _cli("join", "--initial-peers", addr, *(["--config", config] if config else []),
                        *sum((["--set", s] for s in sets), []))
            volunteers.append(start(argv, f"peer{i}"))
        last = 0.0
        while any(p.poll() is None for p in volunteers):
            time.sleep(0.5)
            if time.time() - last >= 2:
                last = time.time()
                print(_status_line(out, n, args.outer_steps), flush=True)
        failed = [i for i, p in enumerate(volunteers) if p.returncode != 0]
        if failed:
            for i in failed:
                tail = open(os.path.join(out, f"peer{i}.log")).read().strip().splitlines()[-5:]
                print(f"volunteer {i} failed (exit {volunteers[i].returncode}):\n  " + "\n  ".join(tail), file=sys.stderr)
            return 1
        _print_summary(out, n, scheme)
        _plot(out, n)
        return 0
    finally:
        for s in old:  # a second signal must not cut the cleanup short (it is bounded: SIGKILL after 10 s)
            signal.signal(s, signal.SIG_IGN)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for s, h in old.items():
            signal.signal(s, h)


def _wait_for_address(path: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            for line in open(path):
                if "/p2p/" in line:
                    return line.strip()
        if proc.poll() is not None:
            raise UserError("the bootstrap peer exited before printing its address; see its log")
        time.sleep(0.2)
    raise UserError("the bootstrap peer printed no address within 60 s")


def _metrics(out: str, i: int) -> List[Dict]:
    path = os.path.join(out, f"peer{i}", "metrics.jsonl")
    try:
        return read_metrics(path)
    except (OSError, json.JSONDecodeError):
        return []


def _status_line(out: str, n: int, outer_steps: int) -> str:
    parts = []
    for i in range(n):
        syncs = [r for r in _metrics(out, i) if r["event"] == "sync" and r.get("ok")]
        if syncs:
            r = syncs[-1]
            parts.append(f"p{i}: outer {r['outer_step']}/{outer_steps} val {r['val_loss']:.3f} "
                         f"sent {format_bytes(r['bytes_sent'])}")
        elif steps := [r for r in _metrics(out, i) if r["event"] == "progress"]:
            r = steps[-1]
            parts.append(f"p{i}: step {r['step']} loss {r['loss']:.3f} (first sync ahead) "
                         f"sent {format_bytes(r['bytes_sent'])}")
        else:
            parts.append(f"p{i}: starting")
    return " | ".join(parts)


def _print_summary(out: str, n: int, scheme: str = "") -> None:
    print("\nsummary")
    print(f"{'peer':<6} {'id':<8} {'val loss start':>14} {'val loss end':>12} {'outer steps':>11} "
          f"{'bytes sent':>11} {'bytes recv':>11}  digest")
    digests = set()
    for i in range(n):
        recs = _metrics(out, i)
        start = next(r for r in recs if r["event"] == "start")
        summ = next(r for r in recs if r["event"] == "summary")
        digests.add(summ["digest"])
        print(f"peer{i:<2} {summ['short_id']:<8} {start['val_loss']:>14.4f} {summ['val_loss_end']:>12.4f} "
              f"{summ['outer_steps']:>11} {format_bytes(summ['bytes_sent']):>11} "
              f"{format_bytes(summ['bytes_received']):>11}  {summ['digest']}")
    same = "yes" if len(digests) == 1 else f"NO ({len(digests)} different)"
    print(f"all peers hold identical global parameters: {same}")
    print(savings_line(out, n, scheme))


def savings_line(out: str, n: int, scheme: str) -> str:
    """What the syncs sent per peer (all-reduce payload and framing, the sync events' ``sync_bytes_sent``)
    against an fp32 all-reduce of the same syncs (their ``fp32_bytes``), mean over peers."""
    sent = fp32 = 0
    for i in range(n):
        for r in _metrics(out, i):
            if r["event"] == "sync" and r.get("ok"):
                sent += int(r.get("sync_bytes_sent") or 0)
                fp32 += int(r.get("fp32_bytes") or 0)
    if not sent or not fp32:
        return f"scheme: {scheme}; no successful sync to compare with fp32"
    return (f"scheme: {scheme}; syncs sent {format_bytes(sent / n)} per peer, an fp32 all-reduce of the same syncs "
            f"{format_bytes(fp32 / n)}: {fp32 / sent:.1f}x fewer bytes")


def _plot(out: str, n: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(n):
        recs = _metrics(out, i)
        t0 = next(r["time"] for r in recs if r["event"] == "start")
        start = next(r for r in recs if r["event"] == "start")
        syncs = [r for r in recs if r["event"] == "sync" and r.get("ok")]
        ax1.plot([0] + [r["outer_step"] for r in syncs], [start["val_loss"]] + [r["val_loss"] for r in syncs],
                 marker="o", label=f"peer{i}")
        ax2.plot([0] + [r["time"] - t0 for r in syncs], [0] + [r["bytes_sent"] / 1e6 for r in syncs],
                 marker=".", label=f"peer{i}")
    ax1.set_xlabel("outer step")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title("validation loss")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("MB sent")
    ax2.set_title("bytes sent (cumulative)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "demo.png")
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")
