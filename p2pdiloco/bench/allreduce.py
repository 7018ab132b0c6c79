"""Our butterfly all-reduce beside hivemind's ``DecentralizedAverager``, same peers, same sizes.

    python -m p2pdiloco.bench.allreduce --peers 2,4 --numel 10M,50M --repeat 3 --json out.json

Every peer is its own process (spawned), on 127.0.0.1, with its own libp2p daemon and DHT, for
both implementations. Per (peers, numel) each peer holds ``base + (rank + 1)`` (``base`` a fixed
Gaussian vector), so the exact mean is known and every result is checked, not only timed.

What is timed, like for like: one all-reduce of an already formed group, from a barrier that all
peers pass to the moment this peer holds the averaged vector. Ours: ``AllReducer.allreduce`` on a
:class:`~p2pdiloco.swarm.allreduce.Group` given to it (matchmaking is a separate step in
p2pdiloco too). hivemind: ``averager.step(wait=False, require_trigger=True)`` runs matchmaking
first (``target_group_size = min_group_size = peers``: without it matchmaking always waits the full
``min_matchmaking_time``, 5 s by default); once every peer's step awaits its trigger, a
barrier, then ``allow_allreduce()`` and the wait for the result are timed. Each repetition starts
from the local values again. Reported per row: the slowest peer's median over ``--repeat`` timed
runs (after one warm-up), the fp32 input throughput that gives (``4 * numel / seconds``), the bytes
our peers sent (payload and framing; hivemind keeps no such counter), the largest error against
the exact mean relative to its largest value, and whether every peer ended with bitwise identical
bytes.

hivemind is run with its own codecs (none, fp16); its 8-bit codecs are broken with numpy >= 2.4
(numpy is pinned below 2.4 here, but they are still not what we compare) and it cannot carry our
4-bit codecs (its receiving side decodes only a fixed set of six compression types). Ours runs fp32,
fp16 and 4-bit codecs. This is a CPU- and serialization-bound measurement on one machine: every peer,
daemon and DHT shares its cores.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["run_ours", "run_hivemind", "collect", "PeerPlace", "PlainJob", "PlainWork", "main"]

_LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _vector(numel: int, rank: int):
    """Peer ``rank``'s input: a fixed Gaussian vector shifted by rank + 1 (the mean is known exactly)."""
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1234)).add_(float(rank + 1))


def _expected(numel: int, peers: int):
    import torch

    base = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    return base.add_(sum(range(1, peers + 1)) / peers)


def _digest(out) -> str:
    """Short hash of a result's bytes: equal digests on every peer = bitwise identical results."""
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]


def _check(out, numel: int, peers: int) -> Dict[str, Any]:
    exp = _expected(numel, peers)
    err = float((out - exp).abs().max() / exp.abs().max())
    return {"rel_err": err, "digest": _digest(out)}


# ---- where a peer runs, what it averages (bench.syncwan puts peers in namespaces, adds low-rank) ----
class PeerPlace:
    """Where a bench peer runs: the multiaddrs its libp2p daemon listens on (loopback here).

    ``enter()`` is called first thing in the peer's process, before any socket, thread or child
    process exists; a subclass (bench.syncwan) moves the process into a network namespace there."""

    host_maddrs: Tuple[str, ...] = tuple(_LOOPBACK)

    def enter(self) -> None:
        pass


class PlainJob:
    """One peer's input for one codec: ``base + (rank + 1)``, averaged by one all-reduce with the codec
    and checked against the exact mean (relative max error, digest of the result's bytes)."""

    def __init__(self, name: str, numel: int, rank: int, peers: int):
        from p2pdiloco.compression import get_codec

        self.codec = get_codec(name)
        self.numel, self.peers = numel, peers
        self.vec = _vector(numel, rank)

    def sync(self, allreduce):
        """The averaged vector; ``allreduce(vec, phase, codec)`` is one all-reduce of the group."""
        return allreduce(self.vec, "bench", self.codec)

    def check(self, out) -> Dict[str, Any]:
        return _check(out, self.numel, self.peers)

    def info(self) -> Dict[str, Any]:
        """Extra fields for the peer's raw result (none here)."""
        return {}


class PlainWork:
    """Makes each peer's job per codec name (picklable: it travels to the spawned peers)."""

    def job(self, name: str, numel: int, rank: int, peers: int) -> PlainJob:
        return PlainJob(name, numel, rank, peers)


def _join_node(rank: int, peers: int, place: PeerPlace, addr_q):
    """Our SwarmNode; rank 0 starts the DHT and hands its address to the others."""
    from p2pdiloco.swarm.node import SwarmNode

    if rank == 0:
        node = SwarmNode([], host_maddrs=list(place.host_maddrs))
        for _ in range(peers - 1):
            addr_q.put(node.visible_maddrs())
        return node
    return SwarmNode(addr_q.get(timeout=120), host_maddrs=list(place.host_maddrs))


# ---- ours --------------------------------------------------------------------------------------
def _ours_peer(rank: int, peers: int, numel: int, codecs: Sequence[str], repeat: int, timeout: float,
               addr_q, id_q, members_q, barrier, result_q, place: Optional[PeerPlace] = None,
               work: Optional[PlainWork] = None) -> None:
    os.setpgrp()  # our DHT process and libp2p daemon join this group; the parent kills it at the end
    try:
        place = place or PeerPlace()
        place.enter()
        work = work or PlainWork()
        from p2pdiloco.swarm.allreduce import AllReducer
        from p2pdiloco.swarm.group import Group, make_group_id

        node = _join_node(rank, peers, place, addr_q)
        ar = AllReducer(node, "bench", timeout=timeout)
        id_q.put((rank, node.peer_id_str))
        members = tuple(members_q[rank].get(timeout=120))
        me = members.index(node.peer_id_str)
        counter = 0
        for name in codecs:
            job = work.job(name, numel, rank, peers)
            times, sent, windows = [], [], []
            out = None
            for rep in range(repeat + 1):
                counter += 1
                group = Group(gid=make_group_id("bench", 0, counter, members), members=members, my_index=me,
                              frag=0, round=counter)

                def allreduce(vec, phase, codec, group=group):
                    return node.call(ar.allreduce(group, phase, vec, 1.0, codec), timeout=timeout * 2)

                barrier.wait(timeout=600)
                s0 = node.traffic.snapshot()[0]
                w0, t0 = time.time(), time.perf_counter()
                out = job.sync(allreduce)
                dt = time.perf_counter() - t0
                if rep:  # the first run warms up (allocations, connections)
                    times.append(dt)
                    sent.append(node.traffic.snapshot()[0] - s0)
                    windows.append((w0, w0 + dt))
            result_q.put({"impl": "p2pdiloco", "codec": name, "rank": rank, "times": times, "windows": windows,
                          "bytes_sent": statistics.median(sent), **job.info(), **job.check(out)})
        barrier.wait(timeout=600)
        node.shutdown()
    except Exception:  # noqa: BLE001 - reported to the parent
        result_q.put({"impl": "p2pdiloco", "rank": rank, "error": traceback.format_exc()[-2000:]})


# ---- hivemind ----------------------------------------------------------------------------------
def _hm_peer(rank: int, peers: int, numel: int, codecs: Sequence[str], repeat: int, timeout: float,
             addr_q, id_q, members_q, barrier, result_q, place: Optional[PeerPlace] = None,
             work: Optional[PlainWork] = None) -> None:
    os.setpgrp()
    try:
        place = place or PeerPlace()
        place.enter()
        mp.set_start_method("fork", force=True)  # hivemind's averager and DHT processes expect fork
        import hivemind
        from hivemind.averaging.control import AveragingStage
        from hivemind.compression import Float16Compression, NoCompression

        if rank == 0:
            dht = hivemind.DHT(start=True, host_maddrs=list(place.host_maddrs))
            for _ in range(peers - 1):
                addr_q.put([str(m) for m in dht.get_visible_maddrs()])
        else:
            dht = hivemind.DHT(initial_peers=addr_q.get(timeout=120), start=True,
                               host_maddrs=list(place.host_maddrs))
        vec = _vector(numel, rank)
        compressions = {"fp32": NoCompression(), "fp16": Float16Compression()}
        for name in codecs:
            tensor = vec.clone()
            averager = hivemind.DecentralizedAverager(
                [tensor], dht, prefix=f"bench_{name}_{peers}_{numel}", start=True, target_group_size=peers,
                min_group_size=peers, min_matchmaking_time=5.0, request_timeout=3.0,
                compression=compressions[name], allreduce_timeout=timeout)
            times, windows = [], []
            for rep in range(repeat + 1):
                with averager.get_tensors() as ts:
                    ts[0].copy_(vec)
                barrier.wait(timeout=600)
                control = averager.step(wait=False, require_trigger=True, timeout=timeout)
                deadline = time.time() + timeout
                while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                    if time.time() > deadline:
                        raise TimeoutError("hivemind matchmaking did not finish")
                    time.sleep(0.002)
                barrier.wait(timeout=600)
                w0, t0 = time.time(), time.perf_counter()
                control.allow_allreduce()
                control.result(timeout=timeout * 2)
                dt = time.perf_counter() - t0
                if rep:
                    times.append(dt)
                    windows.append((w0, w0 + dt))
            with averager.get_tensors() as ts:
                out = ts[0].clone()
            result_q.put({"impl": "hivemind", "codec": name, "rank": rank, "times": times, "windows": windows,
                          "bytes_sent": None, **_check(out, numel, peers)})
            barrier.wait(timeout=600)
            averager.shutdown()
        barrier.wait(timeout=600)
        dht.shutdown()
    except Exception:  # noqa: BLE001 - reported to the parent
        result_q.put({"impl": "hivemind", "rank": rank, "error": traceback.format_exc()[-2000:]})


def _run(target, peers: int, numel: int, codecs: Sequence[str], repeat: int, timeout: float) -> List[Dict[str, Any]]:
    return _summarize(collect(target, peers, numel, codecs, repeat, timeout), peers, numel)


def collect(target, peers: int, numel: int, codecs: Sequence[str], repeat: int, timeout: float,
            places: Optional[Sequence[PeerPlace]] = None, work: Optional[PlainWork] = None) -> List[Dict[str, Any]]:
    """Run ``target`` (``_ours_peer`` or ``_hm_peer``) in one spawned process per peer; return each
    peer's raw result per codec (its times, sync windows in wall-clock seconds, check). ``places[r]``:
    where peer r runs (default loopback); ``work``: what our peers average (default ``PlainWork``)."""
    ctx = mp.get_context("spawn")
    addr_q, id_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    members_q = [ctx.Queue() for _ in range(peers)]
    barrier = ctx.Barrier(peers)
    procs = [ctx.Process(target=target, args=(r, peers, numel, list(codecs), repeat, timeout, addr_q, id_q,
                                              members_q, barrier, result_q, places[r] if places else None, work),
                         daemon=False)
             for r in range(peers)]
    for p in procs:
        p.start()
    rows: List[Dict[str, Any]] = []
    try:
        if target is _ours_peer:
            ids = dict(id_q.get(timeout=300) for _ in range(peers))
            members = sorted(ids.values())
            for q in members_q:
                q.put(members)
        want = peers * len(codecs)
        deadline = time.time() + timeout * (repeat + 2) * len(codecs) + 300
        while len(rows) < want and time.time() < deadline:
            try:
                r = result_q.get(timeout=5)
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if "error" in r:
                raise RuntimeError(f"{r['impl']} peer {r['rank']} failed:\n{r['error']}")
            rows.append(r)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # each peer leads a process group: take its DHT, daemons and shm manager too
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.join(10)
    if len(rows) < peers * len(codecs):
        raise RuntimeError(f"only {len(rows)} of {peers * len(codecs)} results arrived")
    return rows


def _summarize(rows: List[Dict[str, Any]], peers: int, numel: int) -> List[Dict[str, Any]]:
    out = []
    for impl, codec in sorted({(r["impl"], r["codec"]) for r in rows}):
        mine = [r for r in rows if r["impl"] == impl and r["codec"] == codec]
        medians = [statistics.median(r["times"]) for r in mine]
        slowest = max(medians)
        sent = [r["bytes_sent"] for r in mine if r["bytes_sent"] is not None]
        out.append({
            "impl": impl, "codec": codec, "peers": peers, "numel": numel,
            "seconds": round(slowest, 4),                            # slowest peer's median
            "fp32_MBps": round(4 * numel / slowest / 1e6, 1),       # fp32 input averaged per second
            "bytes_sent_per_peer": int(statistics.median(sent)) if sent else None,
            "max_rel_err": max(r["rel_err"] for r in mine),
            "identical": len({r["digest"] for r in mine}) == 1,
            "per_peer_median_s": [round(m, 4) for m in medians],
        })
    return out


def run_ours(peers: int, numel: int, codecs: Sequence[str], repeat: int = 3, timeout: float = 300.0):
    return _run(_ours_peer, peers, numel, codecs, repeat, timeout)


def run_hivemind(peers: int, numel: int, codecs: Sequence[str], repeat: int = 3, timeout: float = 300.0):
    return _run(_hm_peer, peers, numel, codecs, repeat, timeout)


def _parse_sizes(s: str) -> List[int]:
    out = []
    for tok in s.split(","):
        tok = tok.strip().upper()
        mult = 1_000_000 if tok.endswith("M") else 1_000 if tok.endswith("K") else 1
        out.append(int(float(tok.rstrip("MK")) * mult))
    return out


def _table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'impl':<10} {'codec':<5} {'peers':>5} {'numel':>11} {'seconds':>8} {'fp32 MB/s':>9} "
             f"{'sent/peer':>11} {'max rel err':>11} {'identical':>9}"]
    for r in rows:
        sent = f"{r['bytes_sent_per_peer'] / 1e6:.1f} MB" if r["bytes_sent_per_peer"] else "n/a"
        lines.append(f"{r['impl']:<10} {r['codec']:<5} {r['peers']:>5} {r['numel']:>11,} {r['seconds']:>8.3f} "
                     f"{r['fp32_MBps']:>9.1f} {sent:>11} {r['max_rel_err']:>11.2e} {str(r['identical']):>9}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="2,4", help="comma-separated group sizes (default 2,4)")
    ap.add_argument("--numel", default="10M,50M", help="comma-separated fp32 vector sizes, K/M suffixes")
    ap.add_argument("--codecs", default="fp32,fp16,e3m0", help="our codecs (any registered name)")
    ap.add_argument("--hivemind", default="fp32,fp16", help="hivemind compressions: fp32 (none), fp16; '' skips")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per row after one warm-up (median)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one all-reduce may take")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    hm = [c for c in args.hivemind.split(",") if c]
    rows: List[Dict[str, Any]] = []
    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} python={sys.version.split()[0]}", flush=True)
    for peers in [int(p) for p in args.peers.split(",")]:
        for numel in _parse_sizes(args.numel):
            got = run_ours(peers, numel, codecs, args.repeat, args.timeout) if codecs else []
            if hm:
                got += run_hivemind(peers, numel, hm, args.repeat, args.timeout)
            rows += got
            print(_table(got), flush=True)
    print("\n" + _table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv if argv is not None else sys.argv[1:], "rows": rows,
                       "load_at_start": os.getloadavg()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
