"""Group formation at hundreds and thousands of volunteers, simulated: the real matchmaking code on fake
transports, in virtual time.

    python -m p2pdiloco.bench.scale_sim --peers 100,300,1000 --rounds 2 --churn 0.05 --out runs/scale_sim

Each simulated peer is a real :class:`~p2pdiloco.swarm.matchmaking.Matchmaker` (its leader side and
join protocol included: ``swarm/leading.py``, ``swarm/joining.py``) on a node of this module:

* **DHT**: one dictionary shared by all. A read answers every live record under the key from
  ``--replicas`` nodes (what ``SwarmNode.aget_subkeys`` asks: the nodes holding the key, each answering
  its whole dictionary), a store sends one record to as many; each costs ``--dht-rtts`` round trips.
  A record's bytes are what our nodes put on the wire: the msgpack record, its owner subkey and its
  ed25519 signature (:mod:`p2pdiloco.swarm.signing`), plus a small envelope.
* **Streams** (join requests, the leader's answers, the link check): in-memory pipes delivering each
  write one way (half ``--rtt``) later, in order; opening one costs a round trip on a connection
  already open, two on a new one. A dial to a peer that left fails at its deadline (a crashed peer's
  address times out), as libp2p's does.
* **Background**, as ``Swarm.start_publishing`` does it: every ``progress_period`` each peer stores its
  progress record, and each peer that is not one of the progress key's nearest nodes reads the records
  from one node once per ``network_read_period`` (a progress period per ``READ_SHARE`` live peers it saw
  at its last read), and from a second when the answer lacks a peer of its view.

Time is virtual (an event loop whose clock jumps to the next timer), so the protocol's own timers
(polls, backoffs, join grace, derived waits) decide the formation times, not this machine's CPU.
Each round: every peer trains for ``--train-s`` seconds times a random factor in [1, 1 + ``--spread``]
(its speed, published in its progress record as real peers do), then forms the group of fragment 0
of that round as the training loop would (``expected`` = the live peers it knows, ``sync_step``).
With ``--churn`` that share of the peers leaves during the round at a random moment of its training
window or formation: half of them say goodbye (their record marked gone), half crash (their record
stays until it expires, dials to them fail after the dial wait). With ``--silent K``, K more identities
are hostile: their ids are ground to draw first in round 0 (leadership goes by a per-round draw of
the round's key and the id, :func:`p2pdiloco.swarm.formation.draw`; a peer id is a key's hash, and
anyone can try keys until one draws first in a round it knows in advance; in the later rounds their
draws are as anyone's), their records look like an honest peer's, they store a ready record every round, and
their join handler takes every request and never answers; ``--stalling K`` adds K more that say
``wait`` to every request they hold (as an honest leader still gathering does) and never propose a
group. ``--claiming K`` adds K identities (ids as anyone's) whose progress record claims, all round,
to be one step short of the sync at 0.001 steps/s, and which never get ready (their join handler
holds requests as a silent one's does): each round that waits for them waits to the matchmaking
timeout. The figures are the honest peers'. With ``--cap G`` (``swarm.group_cap``) each member's
warm step connects to the owners its capped all-reduce will talk to (its subgroup's, and its column
when it owns a shard), so the peers talked to are the formation's plus the all-reduce's; and from 2G
peers due, with ``--gather`` (``swarm.gather``), the round's join requests are gathered by bucket heads
(matchmaking item 13). ``--silent-heads K`` adds K identities ground to head a bucket in round 0 (second
in rank, outside the leader's bucket) that take requests and answer none.

Reported per N and round, per peer: DHT messages and bytes of the formation (reads by purpose,
stores), of the background over the round, join-protocol frames sent and bytes (sent and received),
distinct peers talked to (connections), join requests taken (streams opened to its join handler in the
round: the leader's, and the most any peer took), formation time, and how long the group took to close after its
last member was ready (seconds and round trips); the leader's load beside the median peer's;
and the outcome: groups formed, peers that missed the round, split rounds. Not simulated: the
all-reduce itself (its bytes per peer do not grow with N: ``bench.scale``), state downloads, NAT.
Results: ``<out>/results.json``, ``<out>/table.md``, ``<out>/scale_sim.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import selectors
import statistics
import sys
import time as _real_time
from collections import Counter
from types import SimpleNamespace
from typing import Any, Awaitable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import msgpack

from ..errors import MatchmakingFailed, RoundMissed
from ..swarm import formation, joining, leading, matchmaking, standing
from ..swarm.keys import kind_of, progress_key, ready_key
from ..swarm.matchmaking import Matchmaker
from ..swarm.node import READ_BEAM, REPLICAS
from ..swarm.records import wire_data
from ..swarm.swarm import network_read_period, view_lifetime

__all__ = ["main", "simulate", "VirtualLoop", "format_table"]

RUN = "sim"
#: the bytes a record carries beyond its msgpack body: expiration and key framing in the DHT's protobuf
ENVELOPE = 24
#: the bytes of one DHT request and its answer's framing to and from one node, beyond the records
REQUEST = 64


class _VirtualSelector(selectors.DefaultSelector):
    """A selector whose waits advance a virtual clock instead of sleeping (nothing here does real I/O
    but the loop's own wake-up pipe, polled without waiting)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: Optional[float] = None):
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("the simulation deadlocked: every task waits and no timer is set")
        self.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop in virtual time: ``time()`` jumps to the next timer whenever every task waits."""

    def __init__(self) -> None:
        self._vsel = _VirtualSelector()
        super().__init__(self._vsel)

    def time(self) -> float:
        return self._vsel.now

    def call_at(self, when, callback, *args, context=None):
        # asyncio runs a timer up to its clock resolution early; in real time the clock has moved on by
        # then, here it has not, and code waiting for a deadline a picosecond away would spin forever
        # at the same instant: a timer due within the resolution moves the clock to it
        if 0 < when - self._vsel.now <= 2 * self._clock_resolution:
            self._vsel.now = when
        return super().call_at(when, callback, *args, context=context)


class _Clock:
    """``time`` for the swarm modules under simulation: monotonic and wall clocks on the loop's clock."""

    def __init__(self, loop: VirtualLoop, epoch: float = 1.8e9) -> None:
        self.loop, self.epoch = loop, epoch

    def monotonic(self) -> float:
        return self.loop.time()

    perf_counter = monotonic

    def time(self) -> float:
        return self.epoch + self.loop.time()

    def time_ns(self) -> int:
        return int(self.time() * 1e9)


@contextlib.contextmanager
def _patched(clock: _Clock, sim: "Sim") -> Iterator[None]:
    """The swarm modules read the virtual clock, and the join protocol dials through ``sim``."""
    saved = [(m, "time", m.time) for m in (matchmaking, leading, joining, formation, standing)]
    saved += [(joining, "open_stream", joining.open_stream), (joining, "ensure_connected", joining.ensure_connected)]
    for m in (matchmaking, leading, joining, formation, standing):
        m.time = clock
    joining.open_stream, joining.ensure_connected = sim.open_stream, sim.ensure_connected
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def _signed_overhead() -> int:
    """Bytes a signed record carries beyond its body: owner subkey and signature, as our nodes write them."""
    from ..swarm.signing import OwnerSignatures, SigningKey

    key = SigningKey.generate()
    signer = OwnerSignatures(key)
    return len(signer.local_public_key) + len(b"[signature:" + key.sign(b"x" * 200) + b"]")


class SimDHT:
    """Key -> subkey -> (value, expiry, wire bytes); the total bytes per key kept as records change."""

    def __init__(self, loop: VirtualLoop, overhead: int) -> None:
        self.loop, self.overhead = loop, overhead
        self.data: Dict[str, Dict[str, Tuple[Dict[str, Any], float, int]]] = {}
        self.sizes: Dict[str, int] = {}
        self._seq = 0

    def store(self, key: str, subkey: str, value: Dict[str, Any], ttl: float) -> int:
        self._seq += 1
        size = len(msgpack.packb({"k": kind_of(key), "s": self._seq, "d": wire_data(kind_of(key), value)},
                                 use_bin_type=True)) + self.overhead
        sub = self.data.setdefault(key, {})
        old = sub.get(subkey)
        self.sizes[key] = self.sizes.get(key, 0) - (old[2] if old else 0) + size
        sub[subkey] = (value, self.loop.time() + ttl, size)
        return size

    def read(self, key: str) -> Tuple[Dict[str, Dict[str, Any]], int]:
        """The live records under ``key`` and their wire bytes."""
        sub = self.data.get(key)
        if not sub:
            return {}, 0
        now = self.loop.time()
        expired = [s for s, (_, exp, _) in sub.items() if exp <= now]
        for s in expired:
            self.sizes[key] -= sub.pop(s)[2]
        return {s: v for s, (v, _, _) in sub.items()}, self.sizes[key]


class _Pipe:
    """One direction of an in-memory stream: a write reaches the other end's reader one way later, in order."""

    def __init__(self, sim: "Sim", reader: asyncio.StreamReader, src: "SimPeer", dst: "SimPeer") -> None:
        self.sim, self.reader, self.src, self.dst = sim, reader, src, dst
        self._last = 0.0
        self.closed = False

    def _at(self) -> float:
        self._last = max(self.sim.loop.time() + self.sim.rtt / 2, self._last + 1e-6)
        return self._last

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        self.src.count("join_bytes", len(data))  # both ends, as a read counts the request and its answer
        self.dst.count("join_bytes", len(data))
        self.sim.loop.call_at(self._at(), self._deliver, bytes(data))

    def _deliver(self, data: bytes) -> None:
        if not self.reader.at_eof() and not getattr(self.reader, "_eof", False):
            self.reader.feed_data(data)

    async def drain(self) -> None:  # one per frame (write_frame drains once a frame): frames sent
        self.src.count("join_frames")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sim.loop.call_at(self._at(), self._eof)

    def _eof(self) -> None:
        if not getattr(self.reader, "_eof", False):
            self.reader.feed_eof()

    def break_now(self) -> None:  # the peer at one end died: the other end sees EOF at once
        self.closed = True
        self._eof()

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        return None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _hold(reader: asyncio.StreamReader, talk: Optional[Awaitable[None]] = None) -> None:
    """A hostile join handler: reads what comes and answers nothing, until the caller hangs up; ``talk``
    (the honest handler's keep-alive) runs meanwhile, as an honest leader still gathering would."""
    talking = asyncio.ensure_future(talk) if talk is not None else None
    try:
        while await reader.read(1 << 16):
            pass
    finally:
        if talking is not None:
            talking.cancel()


class SimNode:
    """What a Matchmaker uses of :class:`~p2pdiloco.swarm.node.SwarmNode`, on the simulated DHT."""

    def __init__(self, sim: "Sim", peer: "SimPeer", pid: str) -> None:
        self.sim, self.peer = sim, peer
        self.peer_id_str, self.short_id = pid, pid[:8]
        self.traffic = None
        self.reachability = "public"
        self.gate = SimpleNamespace(banned=lambda pid: False, note_bad=lambda *a, **k: None)
        self.handler = None  # the join handler: where the simulated streams to us are dispatched

    def add_handler(self, name: str, handler) -> None:
        self.handler = handler

    async def aget_subkeys(self, key: str, why: str = "other") -> Dict[str, Dict[str, Any]]:
        sim = self.sim
        await asyncio.sleep(sim.dht_rtts * sim.rtt)
        records, size = sim.dht.read(key)
        self.peer.count(f"read:{kind_of(key)}:{why}")
        self.peer.count("dht_msgs", sim.replicas)
        self.peer.count("dht_bytes", sim.replicas * (size + REQUEST))
        return records

    async def astore(self, key: str, value: Dict[str, Any], ttl: float, subkey: str) -> None:
        sim = self.sim
        await asyncio.sleep(sim.dht_rtts * sim.rtt)
        if self.peer.gone:
            return
        size = sim.dht.store(key, subkey, value, ttl)
        self.peer.count(f"store:{kind_of(key)}")
        self.peer.count("dht_msgs", sim.replicas)
        self.peer.count("dht_bytes", sim.replicas * (size + REQUEST))


class SimPeer:
    def __init__(self, sim: "Sim", pid: str, speed: float, hostile: str = "") -> None:
        self.sim, self.pid, self.speed = sim, pid, speed
        #: "silent" or "stalling": publishes records like an honest peer, says it is ready every round,
        #: takes join requests and never answers them ("stalling": saying "wait" meanwhile)
        self.hostile = hostile
        self.node = SimNode(sim, self, pid)
        self.mm = Matchmaker(self.node, RUN, matchmaking_timeout=sim.matchmaking_timeout)
        self.mm._draw = sim.draw
        self.mm.record_lifetime = sim.record_lifetime
        self.mm.group_cap = sim.cap  # the warm step connects to the owners the capped all-reduce will use
        self.mm.gathering = sim.gathering
        self.gone = False
        self.left = asyncio.Event()  # set with gone: a formation in progress stops at once
        self.stats: Counter = Counter()
        self.talked: Set[str] = set()  # peers we opened a stream or a connection to, or that did to us
        self.pipes: List[_Pipe] = []
        self.handlers: Set[asyncio.Task] = set()
        self.progress: Dict[str, Any] = {}
        #: the live peers at our background reader's last network read, and when (virtual seconds)
        self.view: Optional[Dict[str, Dict[str, Any]]] = None
        self.view_at = -float("inf")
        self.mm.fresh_view = self.fresh_view

    def fresh_view(self) -> Optional[Dict[str, Dict[str, Any]]]:
        """As :meth:`Swarm.fresh_view`: one of the key's nearest nodes reads its own storage (free, current);
        any other peer has its background reader's last network read while it is no older than
        :func:`~p2pdiloco.swarm.swarm.view_lifetime`."""
        if self.pid in self.sim.nearest:
            return self.mm.live_of(self.sim.dht.read(progress_key(RUN))[0])
        if self.view is None:
            return None
        fresh = self.sim.clock.time() - self.view_at <= view_lifetime(self.sim.progress_period, len(self.view))
        return self.view if fresh else None

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] += n

    def publish(self) -> None:
        """Store our progress record now, counted as background traffic."""
        if self.gone:
            return
        size = self.sim.dht.store(progress_key(RUN), self.pid, dict(self.progress, t=self.sim.clock.time()),
                                  self.sim.record_lifetime)
        self.count("bg_msgs", self.sim.replicas)
        self.count("bg_bytes", self.sim.replicas * (size + REQUEST))


class Sim:
    """One swarm of simulated peers (see the module docstring)."""

    def __init__(self, n: int, *, seed: int = 0, rtt: float = 0.05, dht_rtts: float = 2.0, replicas: int = REPLICAS,
                 train_s: float = 60.0, sync_s: float = 5.0, spread: float = 0.2, churn: float = 0.0,
                 progress_period: float = 10.0, matchmaking_timeout: float = 30.0, silent: int = 0,
                 stalling: int = 0, claiming: int = 0, rank_by_id: bool = False, cap: int = 0,
                 silent_heads: int = 0, gathering: bool = False) -> None:
        self.loop = VirtualLoop()
        self.cap = cap
        self.gathering = gathering
        self.requests: Counter = Counter()  # join requests (streams to the join handler) each peer took this round
        self.clock = _Clock(self.loop)
        self.rng = random.Random(seed)
        self.rtt, self.dht_rtts, self.replicas = rtt, dht_rtts, replicas
        #: every matchmaker's draw; with rank_by_id, for comparison, none (leadership by the id alone)
        self.draw = (lambda round_key, peer: b"") if rank_by_id else formation.draw
        self.train_s, self.sync_s, self.spread, self.churn = train_s, sync_s, spread, churn
        self.progress_period, self.matchmaking_timeout = progress_period, matchmaking_timeout
        self.record_lifetime = 3 * progress_period + 5
        self.dht = SimDHT(self.loop, _signed_overhead() + ENVELOPE)
        self.connected: Set[frozenset] = set()
        self.peers: Dict[str, SimPeer] = {}
        for _ in range(n):
            pid = self._new_id()
            self.peers[pid] = SimPeer(self, pid, speed=1.0 + self.rng.random() * spread)
        # hostile identities ground to draw first in round 0 (an id is a key's hash: anyone can try keys)
        best = min((self._rank(0, pid) for pid in self.peers), default=(b"\xff" * 8, ""))
        for i in range(silent + stalling):
            pid = self._new_id()
            while self._rank(0, pid) >= best:
                pid = self._new_id()
            self.peers[pid] = SimPeer(self, pid, speed=1.0, hostile="silent" if i < silent else "stalling")
        self._grind_heads(silent_heads, n + silent + stalling + claiming + silent_heads)
        for _ in range(claiming):  # due and slow by their records, never ready
            pid = self._new_id()
            self.peers[pid] = SimPeer(self, pid, speed=1.0, hostile="claiming")
        # the progress key's nearest nodes read it from their own storage; the others over the network
        self.nearest = set(self.rng.sample(sorted(self.peers), min(replicas, n)))

    def _grind_heads(self, k: int, total: int) -> None:
        """K silent identities ground to head a gathering bucket in round 0 (``--silent-heads``, matchmaking item
        13): each ranks second among the honest peers, outside the leader's bucket."""
        honest = sorted((pid for pid, peer in self.peers.items() if not peer.hostile),
                        key=lambda pid: self._rank(0, pid))
        if k <= 0 or len(honest) < 2:
            return
        key, buckets = ready_key(RUN, 0, 0), formation.gather_buckets(total, self.cap)
        first, second = self._rank(0, honest[0]), self._rank(0, honest[1])
        leaders = formation.gather_bucket(key, honest[0], buckets)
        for _ in range(k):
            pid = self._new_id()
            while not first < self._rank(0, pid) < second or (
                    buckets > 1 and formation.gather_bucket(key, pid, buckets) == leaders):
                pid = self._new_id()
            self.peers[pid] = SimPeer(self, pid, speed=1.0, hostile="silent")

    def _rank(self, round_: int, pid: str) -> Tuple[bytes, str]:
        """Leadership order in ``round_`` among public peers, as the matchmakers rank (the draw, then the id)."""
        return self.draw(ready_key(RUN, 0, round_), pid), pid

    def _new_id(self) -> str:
        return "Qm" + "".join(self.rng.choice("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
                              for _ in range(44))

    # ---- the join protocol's transport (patched into swarm/joining.py) ------------------------------
    async def open_stream(self, node: SimNode, peer: str, handler: str, deadline: float, stats=None):
        target = self.peers.get(peer)
        me = node.peer
        if target is None or target.gone:
            await asyncio.sleep(max(0.0, deadline - self.loop.time()))
            raise ConnectionError(f"failed to dial {peer[:8]}")
        pair = frozenset((me.pid, peer))
        await asyncio.sleep(self.rtt if pair in self.connected else 2 * self.rtt)
        if target.gone:
            raise ConnectionError(f"failed to dial {peer[:8]}")
        self.connected.add(pair)
        me.talked.add(peer)
        target.talked.add(me.pid)
        to_target, to_me = asyncio.StreamReader(), asyncio.StreamReader()
        w_me, w_target = _Pipe(self, to_target, me, target), _Pipe(self, to_me, target, me)
        me.pipes.append(w_me)
        target.pipes.append(w_target)
        if handler.endswith("join"):
            self.requests[target.pid] += 1  # join requests this peer took in the round (its formation load)
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda pid=me.pid: pid))
        if target.hostile:
            target.count("held")
        if target.hostile:
            talk = target.mm._say_wait(w_target) if target.hostile == "stalling" else None
            task = asyncio.ensure_future(_hold(to_target, talk))
        else:
            task = asyncio.ensure_future(target.node.handler(info, to_target, w_target))
        target.handlers.add(task)
        task.add_done_callback(target.handlers.discard)
        return None, to_me, w_me

    async def ensure_connected(self, node: SimNode, peer: str, deadline: float, why: str = "") -> Optional[str]:
        target = self.peers.get(peer)
        me = node.peer
        if target is None or target.gone:
            await asyncio.sleep(max(0.0, deadline - self.loop.time()))
            return "unreachable"
        pair = frozenset((me.pid, peer))
        if pair not in self.connected:
            await asyncio.sleep(2 * self.rtt)
            self.connected.add(pair)
        me.talked.add(peer)
        target.talked.add(me.pid)
        return None

    # ---- peers leaving ------------------------------------------------------------------------------
    def leave(self, peer: SimPeer, goodbye: bool) -> None:
        """``peer`` stops: its formation and handlers are cancelled, its streams break; with ``goodbye`` its
        record says so at once, else it stays until it expires (a crash)."""
        peer.gone = True
        peer.left.set()
        if goodbye:
            self.dht.store(progress_key(RUN), peer.pid, {"gone": True, "t": self.clock.time()}, self.record_lifetime)
        for task in list(peer.handlers):
            task.cancel()
        for pipe in peer.pipes:
            pipe.break_now()

    # ---- the background publisher and reader of every peer ------------------------------------------
    async def _background(self, peer: SimPeer) -> None:
        offset = self.rng.random() * self.progress_period
        await asyncio.sleep(offset)
        last_read, live = -float("inf"), 0
        while not peer.gone:
            peer.publish()
            now = self.clock.time()
            if peer.pid not in self.nearest and now - last_read >= network_read_period(self.progress_period, live):
                await asyncio.sleep(self.dht_rtts * self.rtt)
                records, size = self.dht.read(progress_key(RUN))
                # one node's answer; a second node's when it lacks a peer of the view (SwarmNode._read_nodes)
                asked = 1 if set(peer.view or ()) <= set(records) else READ_BEAM
                last_read, live = now, sum(1 for v in records.values() if not v.get("gone"))
                peer.view, peer.view_at = peer.mm.live_of(records), self.clock.time()
                peer.count("bg_msgs", asked)
                peer.count("bg_bytes", asked * (size + REQUEST))
                peer.count("read:progress:background")
            await asyncio.sleep(self.progress_period)

    # ---- one round ------------------------------------------------------------------------------------
    async def _peer_round(self, peer: SimPeer, round_: int, sync_step: int, h: int,
                          leave_at: Optional[float], goodbye: bool, out: Dict[str, Any]) -> None:
        t0 = self.loop.time()
        train = self.train_s * peer.speed
        if peer.hostile == "claiming":  # one step short of the sync at a crawl, all round; never ready
            peer.progress.update(step=sync_step - 1, next_sync=sync_step, sps=0.001, reach="public")
            peer.publish()
            await asyncio.sleep(train + self.matchmaking_timeout + self.sync_s)
            peer.progress.update(next_sync=sync_step + h)
            return
        peer.progress.update(step=sync_step - h, next_sync=sync_step, sps=h / train, reach="public")
        if leave_at is not None:
            self.loop.call_at(t0 + leave_at, self.leave, peer, goodbye)
        # the training phase, publishing our position as the real publisher does (every progress_period)
        end = t0 + train
        while end - self.loop.time() > 1e-6 and not peer.gone:  # (a float step below the clock's resolution ends it)
            await asyncio.sleep(min(self.progress_period, end - self.loop.time()))
            peer.progress["step"] = min(sync_step, sync_step - h + int(h * (self.loop.time() - t0) / train))
        if peer.gone:
            return
        peer.progress["step"] = sync_step
        if peer.hostile:  # ready, as far as anyone can read
            self.dht.store(ready_key(RUN, 0, round_), peer.pid, {"t": self.clock.time(), "reach": "public"},
                           3 * self.matchmaking_timeout)
            await asyncio.sleep(self.matchmaking_timeout + self.sync_s)
            peer.progress.update(next_sync=sync_step + h)
            return
        before = Counter(peer.stats)
        talked_before = set(peer.talked)
        peer.talked.clear()
        t_enter = self.loop.time()
        # whom to wait for, from the background view as Swarm.expected_group takes it (no read of its own)
        expected = 1 + len(formation.expected_peers(self.dht.read(progress_key(RUN))[0], peer.pid, sync_step))
        task = asyncio.ensure_future(peer.mm.form_group(0, round_, expected, sync_step=sync_step))
        watch = asyncio.ensure_future(peer.left.wait())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if peer.gone:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        row: Dict[str, Any] = {"seconds": self.loop.time() - t_enter, "entered": t_enter, "done": self.loop.time()}
        group = None
        try:
            group = task.result()
            slot = peer.mm._slots.get((0, round_))
            row.update(gid=group.gid, size=group.size, members=group.members,
                       led=slot is not None and slot.leading and slot.final is group)
        except (RoundMissed, MatchmakingFailed) as e:
            row.update(error=type(e).__name__, why=str(e)[:200])
        out[peer.pid] = row
        # the all-reduce (or, having missed the round, the catch-up), then our record says so at once, as
        # the training loop publishes it after every sync. A leader's answers to its joiners and its group
        # record go out meanwhile: the round's traffic is counted up to here.
        await asyncio.sleep(self.sync_s)
        row["stats"] = dict(Counter(peer.stats) - before)
        row["talked"] = len(peer.talked)
        peer.talked |= talked_before
        if peer.gone:
            return
        if group is not None:
            peer.mm.add_lineage(group.gid)
            peer.mm.set_companions(group.members)
            peer.progress.update(gid=group.gid)
        peer.progress.update(synced_step=sync_step, digest="d" * 16, next_sync=sync_step + h)
        peer.publish()

    async def _run(self, rounds: int, h: int, progress) -> List[Dict[str, Any]]:
        for peer in self.peers.values():
            peer.progress = {"step": 0, "round": 0, "samples": 0, "sent": 0, "recv": 0, "loss": None,
                             "val_loss": 5.5, "digest": "0" * 16, "last_sync": None, "sps": 0.0,
                             "next_sync": h, "synced_step": 0, "lw": 1, "rate": 0.0, "reach": "public"}
            peer.publish()
            peer.stats.clear()  # the first publication is the start's, not a round's
        self._tasks = [asyncio.ensure_future(self._background(p)) for p in self.peers.values()]  # kept referenced
        results = []
        try:
            for r in range(rounds):
                everyone = [p for p in self.peers.values() if not p.gone]
                live = [p for p in everyone if not p.hostile]  # the honest peers: what is reported
                leavers = set(self.rng.sample(live, int(round(self.churn * len(live)))))
                bg_before = {p.pid: (p.stats["bg_msgs"], p.stats["bg_bytes"]) for p in live}
                out: Dict[str, Any] = {}
                self.requests.clear()
                t0 = self.loop.time()
                window = self.train_s * (1 + self.spread) + 10.0
                await asyncio.gather(*(self._peer_round(
                    p, r, (r + 1) * h, h, self.rng.random() * window if p in leavers else None,
                    self.rng.random() < 0.5, out) for p in everyone))
                for pid, row in out.items():
                    peer = self.peers[pid]
                    row["bg_msgs"] = peer.stats["bg_msgs"] - bg_before[pid][0]
                    row["bg_bytes"] = peer.stats["bg_bytes"] - bg_before[pid][1]
                    row["requests"] = self.requests[pid]
                held = sum(p.stats["held"] for p in everyone if p.hostile)
                # did a hostile identity draw first among every identity live at the round's start
                first = min(everyone, key=lambda p: self._rank(r, p.pid))
                results.append({"round": r, "peers": len(live), "left": len(leavers), "held": held,
                                "hostile_first": bool(first.hostile),
                                "seconds": self.loop.time() - t0, "rows": out})
                progress(r, results[-1])
        finally:  # every task left (background, handlers, stores) ends before the loop closes
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        return results

    def run(self, rounds: int, h: int = 100, progress=lambda r, res: None) -> List[Dict[str, Any]]:
        try:
            with _patched(self.clock, self):
                return self.loop.run_until_complete(self._run(rounds, h, progress))
        finally:
            self.loop.close()


def summarize_round(res: Dict[str, Any], rtt: float) -> Dict[str, Any]:
    """One round's figures: outcome, and per peer (median, the leader's, the largest) message and byte counts."""
    rows = res["rows"]
    ok = {pid: r for pid, r in rows.items() if "gid" in r}
    groups = Counter(r["gid"] for r in ok.values())
    main_gid, main_size = groups.most_common(1)[0] if groups else ("", 0)
    leader = next((pid for pid in ok if ok[pid]["gid"] == main_gid and ok[pid].get("led")), None)

    def per_peer(fn) -> Dict[str, float]:
        values = [fn(r) for r in rows.values()]
        return {"median": statistics.median(values) if values else 0.0, "max": max(values, default=0),
                "leader": fn(rows[leader]) if leader in rows else None}

    def form_msgs(r):
        return r["stats"].get("dht_msgs", 0) + r["stats"].get("join_frames", 0)

    def form_bytes(r):
        return r["stats"].get("dht_bytes", 0) + r["stats"].get("join_bytes", 0)

    reads = Counter()
    for r in rows.values():
        reads.update({k[5:]: v for k, v in r["stats"].items() if k.startswith("read:")})
    seconds = sorted(r["seconds"] for r in ok.values())
    # how long the group took to close once its last member was ready: the protocol's own latency
    main = [r for r in ok.values() if r["gid"] == main_gid]
    last_in = max((r["entered"] for r in main), default=0.0)
    closing = sorted(r["done"] - last_in for r in main)
    return {
        "round": res["round"], "peers": res["peers"], "left": res["left"], "held": res.get("held", 0), "leader": leader,
        "hostile_first": res.get("hostile_first", False),
        "groups": len(groups), "group_sizes": sorted(groups.values(), reverse=True),
        "in_main_group": main_size, "missed": len(rows) - len(ok),
        "split": sum(1 for size in groups.values() if size > 1) > 1,
        "formation_msgs": per_peer(form_msgs), "formation_bytes": per_peer(form_bytes),
        "background_bytes": per_peer(lambda r: r.get("bg_bytes", 0)),
        "peers_talked": per_peer(lambda r: r["talked"]),
        "requests_taken": per_peer(lambda r: r.get("requests", 0)),
        "formation_seconds": {"median": statistics.median(seconds) if seconds else None,
                              "max": seconds[-1] if seconds else None},
        "closing_seconds": {"median": statistics.median(closing) if closing else None,
                            "max": closing[-1] if closing else None},
        "closing_rtts": {"median": statistics.median(closing) / rtt if closing else None,
                         "max": closing[-1] / rtt if closing else None},
        "reads_per_peer": {k: v / max(1, len(rows)) for k, v in sorted(reads.items())},
    }


def simulate(n: int, rounds: int = 2, *, verbose: bool = True, **kwargs) -> Dict[str, Any]:
    """Run one swarm of ``n`` simulated peers for ``rounds`` rounds; the per-round summaries."""
    sim = Sim(n, **kwargs)
    t_wall = _real_time.monotonic()

    def progress(r: int, res: Dict[str, Any]) -> None:
        if verbose:
            s = summarize_round(res, sim.rtt)
            print(f"  N={n} round {r}: {s['in_main_group']} of {s['peers']} peers in one group "
                  f"({s['left']} left, {s['missed']} missed, groups {s['group_sizes'][:5]}), formation "
                  f"{s['formation_seconds']['median']:.2f} s median"
                  f"{' (a hostile identity drew first)' if s['hostile_first'] else ''}; "
                  f"{_real_time.monotonic() - t_wall:.0f} s of this machine's time so far", flush=True)

    results = sim.run(rounds, progress=progress)
    summaries = [summarize_round(res, sim.rtt) for res in results]
    return {"n": n, "settings": {k: v for k, v in kwargs.items()}, "rtt": sim.rtt,
            "rounds": summaries, "over_run": summarize_run(results, summaries),
            "wall_seconds": round(_real_time.monotonic() - t_wall, 1)}


def summarize_run(results: Sequence[Dict[str, Any]], rounds: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The leaders' load over the whole run: who led each round (``rounds``: the rounds' summaries), and
    each peer's formation bytes summed over the rounds (median and heaviest peer): one peer leading every
    round carries the funnel alone."""
    total: Counter = Counter()
    for res in results:
        for pid, r in res["rows"].items():
            total[pid] += r.get("stats", {}).get("dht_bytes", 0) + r.get("stats", {}).get("join_bytes", 0)
    led = Counter(s["leader"] for s in rounds if s["leader"])
    return {"leaders": len(led), "most_rounds_led": max(led.values(), default=0),
            "formation_bytes": {"median": statistics.median(total.values()) if total else 0.0,
                                "max": max(total.values(), default=0)}}


def _kb(v: Optional[float]) -> str:
    return "—" if v is None else f"{v / 1000:,.1f}"


def format_table(runs: Sequence[Dict[str, Any]]) -> str:
    lines = ["| N | round | in one group / live (left, missed) | formation s (median / max) | closing after the last "
             "member, round trips (median / max) | formation KB per peer (median / leader) | msgs per peer "
             "(median / leader) | background KB per peer | peers talked to (median / leader) | join requests "
             "taken (leader / most) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for s in run["rounds"]:
            fs = s["formation_seconds"]
            lines.append(
                f"| {run['n']} | {s['round']} | {s['in_main_group']} / {s['peers']} ({s['left']}, {s['missed']})"
                f"{' SPLIT' if s['split'] else ''} | {fs['median']:.2f} / {fs['max']:.2f} | "
                f"{s['closing_rtts']['median']:.0f} / {s['closing_rtts']['max']:.0f} | "
                f"{_kb(s['formation_bytes']['median'])} / {_kb(s['formation_bytes']['leader'])} | "
                f"{s['formation_msgs']['median']:.0f} / {s['formation_msgs']['leader'] or 0:.0f} | "
                f"{_kb(s['background_bytes']['median'])} | "
                f"{s['peers_talked']['median']:.0f} / {s['peers_talked']['leader'] or 0:.0f} | "
                f"{s['requests_taken']['leader'] or 0:.0f} / {s['requests_taken']['max']:.0f} |")
    return "\n".join(lines)


def _plot(runs: Sequence[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in runs]
    last = [r["rounds"][-1] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("formation_bytes", "formation"), ("background_bytes", "background")):
        ax1.plot(ns, [s[key]["median"] / 1000 for s in last], "o-", label=f"{label}, median peer")
    ax1.plot(ns, [(s["formation_bytes"]["leader"] or 0) / 1000 for s in last], "s--", label="formation, leader")
    ax1.set(xscale="log", yscale="log", xlabel="volunteers N", ylabel="KB per peer per sync",
            title="control traffic per sync (last round)")
    ax1.legend(fontsize=8)
    ax2.plot(ns, [s["peers_talked"]["median"] for s in last], "o-", label="median peer")
    ax2.plot(ns, [s["peers_talked"]["leader"] or 0 for s in last], "s--", label="leader")
    ax2.set(xscale="log", yscale="log", xlabel="volunteers N", ylabel="peers talked to per round",
            title="connections per round")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.scale_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="100,300,1000", help="comma-separated swarm sizes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--churn", type=float, default=0.05, help="share of the peers leaving during each round")
    ap.add_argument("--rtt", type=float, default=0.05, help="round trip between two peers, seconds")
    ap.add_argument("--dht-rtts", type=float, default=2.0, help="round trips of one DHT read or store")
    ap.add_argument("--replicas", type=int, default=REPLICAS, help="nodes a DHT read asks (and a store writes to)")
    ap.add_argument("--train-s", type=float, default=60.0, help="seconds of training between two syncs")
    ap.add_argument("--sync-s", type=float, default=5.0, help="seconds a sync takes once the group formed")
    ap.add_argument("--spread", type=float, default=0.2, help="peers are up to this much slower than the fastest")
    ap.add_argument("--progress-period", type=float, default=10.0, help="swarm.progress_period, seconds")
    ap.add_argument("--matchmaking-timeout", type=float, default=30.0, help="swarm.matchmaking_timeout, seconds")
    ap.add_argument("--silent", type=int, default=0,
                    help="hostile identities ground to draw first in round 0: ready every round, "
                         "answering no join request")
    ap.add_argument("--stalling", type=int, default=0,
                    help="more such identities, which say 'wait' to the requests they hold (as an honest leader does)")
    ap.add_argument("--claiming", type=int, default=0,
                    help="identities whose records claim to be due and slow every round, never ready")
    ap.add_argument("--rank-by-id", action="store_true",
                    help="for comparison: leaders ranked by their id alone (no per-round draw)")
    ap.add_argument("--gather", action="store_true",
                    help="with --cap: bucket heads carry their bucket's join requests (swarm.gather)")
    ap.add_argument("--silent-heads", type=int, default=0,
                    help="K silent identities ground to head a gathering bucket in round 0 (with --cap)")
    ap.add_argument("--cap", type=int, default=0,
                    help="swarm.group_cap: each member's warm step connects to its subgroup's owners and its column")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/scale_sim")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.peers.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        print(f"error: --peers must be comma-separated swarm sizes of at least 2, got {args.peers!r}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for n in sizes:
        print(f"N={n}: {args.rounds} rounds, churn {args.churn:.0%}", flush=True)
        runs.append(simulate(n, args.rounds, seed=args.seed, rtt=args.rtt, dht_rtts=args.dht_rtts,
                             replicas=args.replicas, train_s=args.train_s, sync_s=args.sync_s, spread=args.spread,
                             churn=args.churn, silent=args.silent, stalling=args.stalling, claiming=args.claiming,
                             rank_by_id=args.rank_by_id, cap=args.cap, silent_heads=args.silent_heads,
                             gathering=args.gather,
                             progress_period=args.progress_period,
                             matchmaking_timeout=args.matchmaking_timeout))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": runs}, f, indent=1)
    table = format_table(runs)
    table += "\n\nOver the run (formation KB per peer summed over the rounds; leaders):\n\n" + "\n".join(
        f"- N = {r['n']}: median {_kb(r['over_run']['formation_bytes']['median'])}, heaviest peer "
        f"{_kb(r['over_run']['formation_bytes']['max'])}; {r['over_run']['leaders']} peer(s) led the "
        f"{len(r['rounds'])} rounds, at most {r['over_run']['most_rounds_led']} each" for r in runs)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    _plot(runs, os.path.join(args.out, "scale_sim.png"))
    print(table)
    print(f"results: {args.out}/results.json, table.md, scale_sim.png")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
