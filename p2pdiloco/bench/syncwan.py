"""Sync at scale on the emulated WAN: one all-reduce of a large pseudo-gradient against the link's limit.

    sudo python -m p2pdiloco.bench.syncwan --peers 4 --numel 100M --rates 100,1000 --delay 50 \\
        --codecs fp32,e3m0,e3m0+lowrank --hivemind fp32 --repeat 2 --out bench_results/syncwan

Per rate an :class:`~p2pdiloco.bench.wan.EmulatedWAN` of ``--peers`` namespaces is built (every
host's link shaped to the rate in both directions, ``--delay`` ms one-way on its uplink). Every peer
is its own process that moves itself into its host's namespace before anything else (``setns``, as
``ip netns exec`` does; its DHT process and libp2p daemon, started afterwards, inherit it), with its
own daemon and DHT, joined through the first peer's address. The peers are
:mod:`p2pdiloco.bench.allreduce`'s, unchanged: ours run ``AllReducer.allreduce`` on a group given to
them after a barrier; hivemind's ``DecentralizedAverager`` runs ``step(wait=False,
require_trigger=True)``, and its all-reduce is timed from the barrier after matchmaking.

What each peer averages (so the exact mean is known and every result is checked: the largest
error relative to the mean's largest value, and whether every peer's result bytes are identical):

* ``fp32``, ``e3m0`` (any registered codec): ``base + (rank + 1)``, ``base`` a fixed Gaussian
  vector of ``--numel`` values, one all-reduce with the codec.
* ``<codec>+lowrank``: DiLoCo's own reducer (``make_reducer`` of a config with
  ``compression.lowrank = true`` and that codec, all other settings default: adaptive rank up to 4,
  a header phase, then factors P and Q) on synthetic matrices of ``~numel`` values in all
  (4096 x 4096 at 100M, see :func:`lowrank_shapes`) plus one 1-D tensor sent whole. Peer r holds
  ``(r + 1) * D``, each matrix of ``D`` of rank 3 with equal singular directions' energy, so the
  agreed rank settles at 3 and the low-rank average is the exact mean (up to the codec's error on the
  factors). The reducer's residuals are reset before every repetition (error feedback is off by
  default anyway), so every repetition averages the same input.

Timed per sync, on each peer: from the barrier to the moment it holds the result; ``--repeat``
timed syncs after one warm-up; reported: the slowest peer's median. Beside it two limits for the
sync's payload, with ``E`` the bytes of one peer's encoded vector (every phase's, for low-rank),
``N`` peers, ``R`` the line rate and ``k`` round trips of ``2 * delay`` (one per all-reduce phase:
a part reaches its owner, the mean comes back; low-rank has up to 3 phases):

* ``limit_a`` (the reduce-scatter alone): ``(N-1)/N * E / R + k * RTT``;
* ``limit_b`` (bandwidth-optimal all-reduce): ``2 (N-1)/N * E / R + k * RTT``: every peer must push
  its parts to the other owners and, as an owner, its mean to the others, all through its own uplink
  (reduce-scatter plus all-gather; the butterfly's means are re-encoded with the same codec). No
  all-reduce in which every peer owns a shard beats it; ``limit_a`` is below it by the all-gather.

Neither counts TCP/IP, Ethernet or libp2p framing (a few %) or TCP slow start.

Where the time goes, per sync window (from the first peer's barrier to the last peer's result),
sampled every 0.2 s: CPU seconds of every process in the peers' namespaces (peers, DHT processes,
libp2p daemons, hivemind's averager) from ``/proc/<pid>/stat``, as a share of all cores; each link
relay's share of one core (the user-space relay that adds the delay, see below); the machine's busy
share from ``/proc/stat`` (other users' work included: the load average is reported beside it); the
bytes each host's ``eth0`` sent, against the line rate. ``bound`` says ``link`` (some peer's uplink
carried >= 80% of the line rate), ``relay`` (a relay used >= 85% of a core: the emulation's limit),
``CPU`` (the machine >= 85% busy) or ``other`` (waits: latency, protocol steps).

The link relay: this kernel has no ``sch_netem``, so the delay is added by one Python process per
host copying every frame (:mod:`p2pdiloco.bench.netns_tools`). Before the syncs of each rate one
TCP stream between two idle hosts is measured (``--probe-seconds``, 0 skips): on the 2-core
development machine it carried 87 Mbit/s of 100 and 188 Mbit/s of 1000 (with 50 ms delay; 897 of
1000 without delay, i.e. without a relay), so at 1 Gbit/s the emulation, not the configured rate, is
the link, and during an all-reduce the relays share the cores with the peers. Read the 1 Gbit/s rows
against the probe's figure and the ``relay`` column.

Writes ``<out>/results.json`` (machine, git commit, load averages, links and probes, one row per
(rate, implementation, codec) with the peers' raw times and windows) and ``<out>/table.md``, and
prints the table. Needs root, ``ip`` and ``tc``.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError, UserError
from .allreduce import (PeerPlace, PlainJob, PlainWork, _digest, _hm_peer, _ours_peer, _parse_sizes, _summarize,
                        collect)
from .hivemind_dp import read_iface_bytes
from .run import _REPO, _git_state, _loadavg, _machine, _Sampler
from .wan import EmulatedWAN, LinkSpec, cleanup_stale, measure_rtt, measure_throughput, require_root

__all__ = ["lowrank_shapes", "limits", "error_bound", "run_syncwan", "format_table", "main"]

_CLONE_NEWNET = 0x40000000
_LOWRANK = "+lowrank"
#: bound verdict thresholds (see the module docstring)
_LINK_BOUND, _RELAY_BOUND, _CPU_BOUND = 0.80, 0.85, 0.85


# ----------------------------------------------------------------------------- peers
class NetnsPlace(PeerPlace):
    """A peer in network namespace ``netns`` (``/var/run/netns/<netns>``), listening on ``address``."""

    def __init__(self, netns: str, address: str):
        self.netns = netns
        self.host_maddrs = (f"/ip4/{address}/tcp/0",)

    def enter(self) -> None:
        """``setns`` this process into the namespace; called before any socket, thread or child exists."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {self.netns}: {os.strerror(err)}")
        finally:
            os.close(fd)


def lowrank_shapes(numel: int) -> List[Tuple[int, ...]]:
    """Square matrices of side ``min(4096, ~sqrt(numel / 4))`` (at least 64), as many as make ~``numel``
    values, plus one 1-D tensor of ``side`` values (a norm's weights: sent whole)."""
    side = max(64, min(4096, int(math.sqrt(max(1, numel) / 4))))
    count = max(1, round(numel / side ** 2))
    return [(side, side)] * count + [(side,)]


class _CheckedJob(PlainJob):
    """The plain job, also reporting what the codec's error bound needs (see :func:`error_bound`)."""

    def __init__(self, name: str, numel: int, rank: int, peers: int):
        super().__init__(name, numel, rank, peers)
        self.rank = rank

    def info(self) -> Dict[str, Any]:
        # the input is base + (rank + 1), the mean base + (N + 1) / 2: the mean's largest magnitude from ours
        shift = (self.peers + 1) / 2 - (self.rank + 1)
        return {"in_absmax": float(self.vec.abs().max()),
                "exact_absmax": max(float(self.vec.max()) + shift, -(float(self.vec.min()) + shift)),
                "phases": [["bench", self.numel, self.codec.name, self.codec.encoded_size(self.numel)]]}


class _LowRankJob:
    """``(rank + 1) * D`` through DiLoCo's low-rank reducer (see the module docstring)."""

    def __init__(self, name: str, numel: int, rank: int, peers: int):
        import torch

        from ..compression import get_codec
        from ..config import load_config
        from ..diloco.reducers import make_reducer

        codec = name[: -len(_LOWRANK)]
        cfg = load_config(None, ["compression.lowrank=true", f"compression.codec={codec}"])
        self.codec = get_codec(codec)
        self.shapes = lowrank_shapes(numel)
        self.reducer = make_reducer(cfg, [SimpleNamespace(shape=torch.Size(s)) for s in self.shapes])
        gen = torch.Generator().manual_seed(4321)
        parts = []
        for shape in self.shapes:
            if len(shape) == 2:  # rank 3, the three directions of about equal energy
                u = torch.randn(shape[0], 3, generator=gen)
                v = torch.randn(shape[1], 3, generator=gen) / math.sqrt(shape[1])
                parts.append((u @ v.T).reshape(-1))
            else:
                parts.append(torch.randn(shape, generator=gen))
        self.delta = torch.cat(parts).mul_(float(rank + 1))
        self.scale = (peers + 1) / 2 / (rank + 1)  # exact mean = delta * scale
        self.phases: List[List[Any]] = []

    def sync(self, allreduce):
        self.reducer.reset()  # every repetition averages the same input
        phases: List[List[Any]] = []

        def recorded(vec, phase, codec=None):
            codec = codec or self.codec
            phases.append([phase, vec.numel(), codec.name, codec.encoded_size(vec.numel())])
            return allreduce(vec, phase, codec)

        out = self.reducer.reduce(self.delta, recorded)
        self.phases = phases
        return out

    def check(self, out) -> Dict[str, Any]:
        exp = self.delta * self.scale
        err = float((out - exp).abs().max() / exp.abs().max())
        return {"rel_err": err, "digest": _digest(out)}

    def info(self) -> Dict[str, Any]:
        got = self.reducer.info()
        return {"phases": self.phases, "numel_actual": int(self.delta.numel()),
                "ranks": sorted(set(got.get("ranks") or [])), "values_sent": got.get("values_sent")}


class SyncWork(PlainWork):
    """Plain codecs through :class:`_CheckedJob`, ``<codec>+lowrank`` through DiLoCo's low-rank reducer."""

    def job(self, name: str, numel: int, rank: int, peers: int):
        if name.endswith(_LOWRANK):
            return _LowRankJob(name, numel, rank, peers)
        return _CheckedJob(name, numel, rank, peers)


# ----------------------------------------------------------------------------- limits and bounds
def limits(encoded_bytes: int, peers: int, rate_mbit: float, delay_ms: float, phases: int = 1) -> Dict[str, float]:
    """Seconds a sync of ``encoded_bytes`` per peer cannot beat (module docstring): ``limit_a``, issue
    17's ``(N-1)/N`` of the encoded vector at line rate, and ``limit_b``, the bandwidth-optimal
    all-reduce's ``2 (N-1)/N``; both plus ``phases`` round trips of ``2 * delay_ms``."""
    line = rate_mbit * 1e6 / 8
    rtts = phases * 2 * delay_ms / 1000
    share = (peers - 1) / peers * encoded_bytes / line
    return {"limit_a": share + rtts, "limit_b": 2 * share + rtts, "round_trips_s": rtts}


def error_bound(codec_name: str, in_absmax: Optional[float], exact_absmax: Optional[float]) -> Optional[float]:
    """Largest error of a butterfly mean relative to the exact mean's largest value, for a plain codec.

    A lossy codec's error is at most ``bound * block absmax`` when a peer's part is encoded and again
    when the owner encodes the mean, so relative to the mean's largest value it is at most
    ``bound * (max input magnitude + max mean magnitude) / max mean magnitude``; a lossless one is
    fp32 rounding (1e-6). None for low-rank (the quantized factors steer the basis: no codec bound)."""
    from ..compression import get_codec

    if codec_name.endswith(_LOWRANK):
        return None
    b = get_codec(codec_name).relative_error_bound
    if not b:
        return 1e-6
    if not in_absmax or not exact_absmax:
        return None
    return b * (in_absmax + exact_absmax) / exact_absmax + 1e-6


# ----------------------------------------------------------------------------- measurement
def _ns_inode(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _cpu_ticks(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rpartition(")")[2].split()
        return int(rest[11]) + int(rest[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _machine_ticks() -> Tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


class _Meter(_Sampler):
    """bench.run's sampler, reading more: per host its eth0 (tx, rx) bytes and the CPU seconds of every
    process in its namespace (a process that exits keeps its last count), each relay's CPU seconds and
    the machine's busy and total ticks. Processes are found by their network namespace, every second."""

    def __init__(self, wan: EmulatedWAN, anchors: Sequence[int], period: float = 0.2):
        super().__init__(anchors, period)
        self.hz = os.sysconf("SC_CLK_TCK")
        self.inodes = {_ns_inode(f"/var/run/netns/{h.netns}"): i for i, h in enumerate(wan.hosts)}
        self.relays = [p.pid for p in wan._relays]
        self.seen: Dict[int, Tuple[int, int]] = {}  # pid -> (host, last ticks)
        self.names: Dict[str, int] = {}  # processes counted, by name (what ran in the hosts' namespaces)
        self._next_scan = 0.0

    def _scan(self) -> None:
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in self.seen:
                host = self.inodes.get(_ns_inode(f"/proc/{name}/ns/net"))
                if host is not None:
                    self.seen[int(name)] = (host, 0)
                    try:
                        with open(f"/proc/{name}/comm") as f:
                            comm = f.read().strip()
                    except OSError:
                        comm = "?"
                    self.names[comm] = self.names.get(comm, 0) + 1

    def read(self):  # (time, {"net": [(tx, rx)], "cpu": [s per host], "relay": [s], "busy": ticks, "total": ticks})
        now = time.time()
        if now >= self._next_scan:
            self._scan()
            self._next_scan = now + 1.0
        cpu = [0.0] * len(self.inodes)
        for pid, (host, last) in list(self.seen.items()):
            ticks = _cpu_ticks(pid)
            if ticks is not None and ticks >= last:
                self.seen[pid] = (host, ticks)
                last = ticks
            cpu[host] += last / self.hz
        busy, total = _machine_ticks()
        return now, {"net": [read_iface_bytes("eth0", f"/proc/{pid}/net/dev") or (0, 0) for pid in self.anchors],
                     "cpu": cpu, "relay": [(_cpu_ticks(p) or 0) / self.hz for p in self.relays],
                     "busy": busy, "total": total}

    def at(self, t: float) -> Optional[Dict[str, Any]]:
        """The counters linearly interpolated at time ``t`` (None outside the samples)."""
        with self._lock:
            samples = list(self.samples)
        for (t0, a), (t1, b) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                mix = lambda x, y: x + w * (y - x)  # noqa: E731
                return {"net": [(mix(p[0], q[0]), mix(p[1], q[1])) for p, q in zip(a["net"], b["net"])],
                        "cpu": [mix(p, q) for p, q in zip(a["cpu"], b["cpu"])],
                        "relay": [mix(p, q) for p, q in zip(a["relay"], b["relay"])],
                        "busy": mix(a["busy"], b["busy"]), "total": mix(a["total"], b["total"])}
        return None

    def usage(self, t0: float, t1: float, rate_mbit: float) -> Optional[Dict[str, Any]]:
        """Where the time went between ``t0`` and ``t1`` (wall-clock seconds)."""
        a, b = self.at(t0), self.at(t1)
        if a is None or b is None or t1 <= t0:
            return None
        dt, cores = t1 - t0, os.cpu_count() or 1
        tx = [q[0] - p[0] for p, q in zip(a["net"], b["net"])]
        relay = [(q - p) / dt for p, q in zip(a["relay"], b["relay"])]
        return {
            "window_s": dt,
            "peers_cpu": sum(q - p for p, q in zip(a["cpu"], b["cpu"])) / dt / cores,  # share of all cores
            "relay_max_core": max(relay) if relay else 0.0,                              # share of one core
            "machine_busy": (b["busy"] - a["busy"]) / max(1e-9, b["total"] - a["total"]),
            "tx_per_peer": statistics.mean(tx),
            "link_util": max(tx) / dt / (rate_mbit * 1e6 / 8),                           # busiest uplink
            "load1": self.mean_load(t0 - 1.0, t1 + 1.0),
        }


def _bound(u: Optional[Dict[str, Any]]) -> str:
    if not u:
        return "n/a"
    if u["link_util"] >= _LINK_BOUND:
        return "link"
    if u["relay_max_core"] >= _RELAY_BOUND:
        return "relay"
    if u["machine_busy"] >= _CPU_BOUND:
        return "CPU"
    return "other"


class _Progress(threading.Thread):
    """A line every ``period`` seconds while peers run: CPU, relays, uplink bytes, load."""

    def __init__(self, meter: _Meter, label: str, rate_mbit: float, period: float = 10.0):
        super().__init__(name="syncwan-progress", daemon=True)
        self.meter, self.label, self.rate, self.period = meter, label, rate_mbit, period
        self.stop = threading.Event()
        self.t0 = time.time()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            now = time.time()
            u = self.meter.usage(now - self.period, now - 0.3, self.rate)
            if u:
                print(f"  {self.label}: {now - self.t0:4.0f} s  peers CPU {u['peers_cpu']:4.0%} of "
                      f"{os.cpu_count()} cores, relay max {u['relay_max_core']:4.0%} of a core, uplink "
                      f"{u['tx_per_peer'] / u['window_s'] / 1e6:6.1f} MB/s per peer, load {_loadavg()}",
                      file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- one rate
def _rows_at_rate(args: argparse.Namespace, rate: float, label: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    link = LinkSpec(rate_mbit=rate, delay_ms=args.delay).validate()
    rows: List[Dict[str, Any]] = []
    with EmulatedWAN(args.peers, link) as wan:
        anchors = [h.popen(["sleep", "infinity"]).pid for h in wan.hosts]
        net: Dict[str, Any] = {"rate_mbit": rate, "delay_ms": args.delay, "backend": wan.backend}
        if args.probe_seconds > 0:
            net["probe_rtt_ms"] = round(measure_rtt(wan.hosts[0], wan.hosts[1]), 2)
            net["probe_mbit"] = round(measure_throughput(wan.hosts[0], wan.hosts[1], args.probe_seconds), 1)
            print(f"{label} link {rate:g} Mbit/s, {args.delay:g} ms ({wan.backend}): one idle TCP stream carried "
                  f"{net['probe_mbit']:.1f} Mbit/s, RTT {net['probe_rtt_ms']:.1f} ms", flush=True)
            if net["probe_mbit"] < 0.8 * rate:
                print(f"{label} note: the emulated link carries {net['probe_mbit']:.0f} of {rate:g} Mbit/s on this machine "
                      f"(the {wan.backend} path): this rate's rows are limited by the emulation, read them against "
                      "the probe and the relay column", flush=True)
        meter = _Meter(wan, anchors)
        meter.start()
        places = [NetnsPlace(h.netns, h.address) for h in wan.hosts]
        try:
            for impl, target, codecs in (("p2pdiloco", _ours_peer, args.codec_list), ("hivemind", _hm_peer, args.hm_list)):
                if not codecs:
                    continue
                progress = _Progress(meter, f"{label} {impl} {','.join(codecs)}", rate)
                progress.start()
                try:
                    raw = collect(target, args.peers, args.numel, codecs, args.repeat, args.timeout, places, SyncWork())
                finally:
                    progress.stop.set()
                got = sorted(_summarize(raw, args.peers, args.numel), key=lambda r: codecs.index(r["codec"]))
                for row in got:
                    _complete(row, [r for r in raw if r["codec"] == row["codec"]], meter, link, args.peers)
                print(format_table(got, header=not rows), flush=True)
                rows += got
        finally:
            meter.stop()
            net["processes_counted"] = dict(sorted(meter.names.items()))
    return rows, net


def _complete(row: Dict[str, Any], raw: List[Dict[str, Any]], meter: _Meter, link: LinkSpec, peers: int) -> None:
    """Add payload, limits, error bound and where the time went to one summarized row."""
    first = raw[0]
    if first.get("phases"):
        phases = first["phases"]
    else:  # hivemind: its fp32 (no compression) or fp16
        phases = [["bench", row["numel"], row["codec"], {"fp32": 4, "fp16": 2}[row["codec"]] * row["numel"]]]
    encoded = sum(p[3] for p in phases)
    row.update(rate_mbit=link.rate_mbit, delay_ms=link.delay_ms, encoded_bytes=encoded, phases=phases,
               numel=first.get("numel_actual", row["numel"]))
    for key in ("ranks", "values_sent"):
        if key in first:
            row[key] = first[key]
    lim = limits(encoded, peers, link.rate_mbit, link.delay_ms, len(phases))
    row.update({k: round(v, 4) for k, v in lim.items()})
    row["x_limit_a"] = round(row["seconds"] / lim["limit_a"], 2)
    row["x_limit_b"] = round(row["seconds"] / lim["limit_b"], 2)
    bound = error_bound(row["codec"], max((r.get("in_absmax") or 0 for r in raw), default=None),
                        min((r.get("exact_absmax") or math.inf for r in raw), default=None))
    row["error_bound"] = bound
    row["within_bound"] = None if bound is None else row["max_rel_err"] <= bound
    usages = []
    for k in range(len(first["windows"])):  # the k-th timed sync: first barrier to last result
        t0 = min(r["windows"][k][0] for r in raw)
        t1 = max(r["windows"][k][1] for r in raw)
        u = meter.usage(t0, t1, link.rate_mbit)
        if u:
            usages.append(u)
    use = {k: round(statistics.mean(u[k] for u in usages), 4) for k in usages[0] if k != "load1"} if usages else {}
    loads = [u["load1"] for u in usages if u.get("load1") is not None]
    if loads:
        use["load1"] = round(statistics.mean(loads), 2)
    row["usage"] = use
    row["bound"] = _bound(use or None)
    row["raw"] = [{k: r.get(k) for k in ("rank", "times", "windows", "bytes_sent", "rel_err", "digest")} for r in raw]


# ----------------------------------------------------------------------------- output
def _mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def format_table(rows: List[Dict[str, Any]], header: bool = True) -> str:
    """One line per (rate, implementation, codec)."""
    head = (f"{'Mbit/s':>6} {'impl':<9} {'codec':<12} {'encoded':>9} {'sent':>9} {'sync s':>7} {'limit a':>7} "
            f"{'x a':>5} {'limit b':>7} {'x b':>5} {'peersCPU':>8} {'relay':>5} {'busy':>5} {'uplink':>6} "
            f"{'load':>5} {'bound':>6} {'rel err':>8} {'ok':>3} {'same':>4}")
    lines = [head] if header else []
    for r in rows:
        u = r.get("usage") or {}
        pct = lambda k: f"{u[k]:.0%}" if k in u else "n/a"  # noqa: E731
        ok = {None: "-", True: "yes", False: "NO"}[r.get("within_bound")]
        lines.append(
            f"{r['rate_mbit']:>6g} {r['impl']:<9} {r['codec']:<12} {_mb(r['encoded_bytes']):>9} "
            f"{_mb(r['bytes_sent_per_peer']):>9} {r['seconds']:>7.2f} {r['limit_a']:>7.2f} {r['x_limit_a']:>5.2f} "
            f"{r['limit_b']:>7.2f} {r['x_limit_b']:>5.2f} {pct('peers_cpu'):>8} {pct('relay_max_core'):>5} "
            f"{pct('machine_busy'):>5} {pct('link_util'):>6} {u.get('load1', 'n/a'):>5} {r['bound']:>6} "
            f"{r['max_rel_err']:>8.1e} {ok:>3} {'yes' if r['identical'] else 'NO':>4}")
    return "\n".join(lines)


_LEGEND = """encoded: one peer's vector encoded (all phases); sent: bytes our peer sent (payload + framing; hivemind: n/a);
sync s: slowest peer's median; limit a = (N-1)/N*encoded/rate + RTTs, limit b = 2(N-1)/N*encoded/rate + RTTs;
peersCPU: peers + DHTs + daemons, share of all cores; relay: busiest link relay, share of one core; busy: whole
machine; uplink: busiest eth0's bytes/s against the rate; load: 1-min load average; ok: error within the codec's
bound (-: none for low-rank); same: every peer's result bitwise identical (hivemind's are not)"""


def run_syncwan(args: argparse.Namespace) -> Dict[str, Any]:
    """Run every rate of parsed ``args``; write ``results.json`` and ``table.md``; return the results."""
    require_root()
    if args.cleanup_stale:
        cleanup_stale()
    os.makedirs(args.out, exist_ok=True)
    results: Dict[str, Any] = {
        "command": " ".join(["python -m p2pdiloco.bench.syncwan", *map(shlex.quote, args.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(), "git": _git_state(), "peers": args.peers, "numel": args.numel,
        "repeat": args.repeat, "links": [], "rows": [],
    }
    print(f"sync at scale: {args.peers} peers x {args.numel:,} values, rates {args.rates} Mbit/s, {args.delay:g} ms "
          f"one-way; ours {','.join(args.codec_list) or '-'}, hivemind {','.join(args.hm_list) or '-'}; "
          f"{os.cpu_count()} cores, load {_loadavg()} -> {args.out}", flush=True)
    try:
        for k, rate in enumerate(args.rate_list):
            rows, net = _rows_at_rate(args, rate, f"[{k + 1}/{len(args.rate_list)}]")
            results["links"].append(net)
            results["rows"] += rows
    finally:
        results["machine"]["loadavg_at_end"] = _loadavg()
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
    table = format_table(results["rows"])
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"```\n{table}\n```\n\n{_LEGEND}\n\nlinks: {json.dumps(results['links'])}\n"
                f"load average at start {results['machine']['loadavg_at_start']}, at end {_loadavg()}\n")
    print(f"\n{table}\n\n{_LEGEND}\nload average at start {results['machine']['loadavg_at_start']}, at end "
          f"{results['machine']['loadavg_at_end']}; results in {args.out}", flush=True)
    return results


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.syncwan", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=4, help="peers, one namespace each (default 4)")
    p.add_argument("--numel", default="100M", help="fp32 values per peer, K/M suffixes (default 100M)")
    p.add_argument("--rates", default="100,1000", help="link rates to run, Mbit/s per direction (default 100,1000)")
    p.add_argument("--delay", type=float, default=50.0, help="one-way delay on every uplink, ms (default 50)")
    p.add_argument("--codecs", default="fp32,e3m0,e3m0+lowrank",
                   help="ours: codec names, '<codec>+lowrank' through DiLoCo's low-rank reducer")
    p.add_argument("--hivemind", default="fp32", help="hivemind's averager: fp32 (none), fp16; '' skips")
    p.add_argument("--repeat", type=int, default=2, help="timed syncs per row after one warm-up (median)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one all-reduce may take")
    p.add_argument("--probe-seconds", type=float, default=3.0,
                   help="measure one idle TCP stream per rate first, seconds (0 skips)")
    p.add_argument("--out", default=None, help="output directory (default bench_results/syncwan-<UTC time>)")
    p.add_argument("--cleanup-stale", action="store_true", help="first remove namespaces of dead runs")
    return p


def _validate(args: argparse.Namespace) -> None:
    from ..compression import get_codec

    if args.peers < 2:
        raise ConfigError(f"--peers must be at least 2, got {args.peers}")
    try:
        args.numel = _parse_sizes(args.numel)[0]
        args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError as e:
        raise ConfigError(f"--numel / --rates: {e}") from None
    if args.numel < 1 or not args.rate_list:
        raise ConfigError("--numel must be >= 1 and --rates name at least one rate")
    for rate in args.rate_list:
        LinkSpec(rate_mbit=rate, delay_ms=args.delay).validate()
    args.codec_list = [c for c in args.codecs.split(",") if c]
    for c in args.codec_list:
        get_codec(c[: -len(_LOWRANK)] if c.endswith(_LOWRANK) else c)
    args.hm_list = [c for c in args.hivemind.split(",") if c]
    bad = [c for c in args.hm_list if c not in ("fp32", "fp16")]
    if bad:
        raise ConfigError(f"--hivemind takes fp32 and fp16, got {', '.join(bad)}")
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    args.argv = argv
    if args.out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        args.out = os.path.join(_REPO, "bench_results", f"syncwan-{stamp}")
    try:
        _validate(args)
        run_syncwan(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: network and processes torn down; partial results in {args.out}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
