"""Swarm: what a training peer needs from the network, behind one small interface.

Records in the DHT (values are msgpack maps, keys prefixed with the run id):

    <run>:fingerprint            {fp, fields}      the configuration every peer must share
    <run>:progress  [peer id]    {step, round, next_sync, sps, samples, sent, recv, loss, val_loss,
                                  digest, last_sync, t, reach,
                                  vr, vl, fr, ff, ft, fw}        refreshed every progress_period
                                  (the last six: a short history for the dashboard, records.py)
    <run>:mm:<frag>:<round> [peer id]                            matchmaking (see matchmaking.py)
    <run>:group:<frag>:<round> [leader id]  {members, base}      the one group of that round

``form_group()`` forms the one group for (fragment, round); ``allreduce()`` averages a vector in it
(a compressor may call it several times per sync, one *phase* each).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch

from ..compression import Codec
from ..compression.robust import RobustConfig
from ..errors import FingerprintMismatch
from .allreduce import AllReducer
from .group import Coverage, Group
from .keys import fingerprint_key, history_key, progress_key
from .matchmaking import Matchmaker
from .node import SwarmNode
from .timeouts import Timeouts, allreduce_bytes
from . import records
from .records import run_fingerprint
from .signing import plain_text

__all__ = ["Swarm", "network_read_period", "view_lifetime"]

logger = logging.getLogger(__name__)

FINGERPRINT_TTL = 3600.0
#: seconds between two node lookups next to the progress key (node.lookup_near): keeps the routing table's
#: view of the key's nearest nodes current, where our direct stores and local reads go
LOOKUP_PERIOD = 120.0
#: seconds between two reads of the progress records from our own DHT storage (no network: see
#: SwarmNode.read_near), so records published at a sync show within this, whatever the progress period
LOCAL_READ_PERIOD = 2.0
#: live peers per network read of the background reader per progress_period: such a read carries every live
#: peer's record, so in a larger swarm the reads are spaced out (network_read_period) and a peer's background
#: bytes per second stay flat as the swarm grows; matchmaking reads for itself as a formation starts
READ_SHARE = 8
#: progress-record stores allowed in flight at once (each can take seconds: see Swarm.publish_progress)
MAX_STORES_IN_FLIGHT = 4
#: a history record lives this many progress records' lifetimes (Swarm.history_lifetime)
HISTORY_LIFETIMES = 10
#: a new validation loss alone waits for this many progress periods after our last history store (a failed
#: round goes out at the next period): a peer validates every outer step, and a history store per step
#: was a twentieth of a peer's DHT bytes at 24 peers, for a plot that moves by a point a minute
HISTORY_PERIODS = 6


def network_read_period(progress_period: float, live: int) -> float:
    """Seconds between two network reads of the progress records by the background reader of a peer that
    does not hold the key, with ``live`` peers in its view: one progress period per READ_SHARE of them."""
    return progress_period * max(1, math.ceil(live / READ_SHARE))


def view_lifetime(progress_period: float, live: int, read_s: float = 0.0) -> float:
    """How old (seconds) the background reader's view of ``live`` peers may be and still stand in for a
    network read as a follower enters a round: the reader's own period, plus LOCAL_READ_PERIOD (its
    tick), plus twice its last network read's duration ``read_s`` (the next read takes about as long
    before the view is new again; at most one more period). A reader that keeps to its period never
    leaves an older view; one stuck on a slow read, or a paused process, does."""
    period = network_read_period(progress_period, live)
    return period + LOCAL_READ_PERIOD + min(2.0 * read_s, period)


class Swarm:
    def __init__(self, node: SwarmNode, run_id: str, *, matchmaking_timeout: float, allreduce_timeout: float,
                 min_group_size: int = 1, progress_period: float = 10.0, robust: Optional[RobustConfig] = None,
                 group_cap: int = 0, gather: bool = False):
        self.node = node
        robust = robust or RobustConfig()
        node.gate.configure(ban_after=robust.ban_after, ban_seconds=robust.ban_seconds)
        self.run_id = run_id
        self.progress_period = progress_period
        self.matchmaker = Matchmaker(node, run_id, matchmaking_timeout=matchmaking_timeout,
                                     min_group_size=min_group_size)
        # the progress records' ttl: three periods, plus room for a DHT store that waits on an unreachable
        # node (hivemind's wait_timeout, 3 s) before the next publish gets through
        self.matchmaker.record_lifetime = 3 * progress_period + 5
        self.matchmaker.group_cap = group_cap
        self.matchmaker.gathering = gather  # matchmaking item 13 (with a cap)
        self.allreducer = AllReducer(node, run_id, timeout=allreduce_timeout, robust=robust, cap=group_cap)
        #: derives the all-reduce / state-download timeouts from measured speed (swarm/timeouts.py)
        self.timeouts = Timeouts(allreduce_timeout)
        self._progress: Dict[str, Any] = {"reach": getattr(node, "reachability", "public")}
        if getattr(node, "via", ""):  # relayed: the relay others reach us through (swarm/relay.py)
            self._progress["via"] = node.via
        self._progress_lock = threading.Lock()
        self._view: Optional[Dict[str, Dict[str, Any]]] = None
        self._view_at = -float("inf")  # monotonic time of the read that gave _view
        self._read_s = 0.0  # how long the background reader's last network read took (view_lifetime)
        self.matchmaker.fresh_view = self.fresh_view
        self._fingerprint: Optional[Dict[str, Any]] = None
        self._fingerprint_stored = 0.0  # monotonic time of our last fingerprint store
        self._in_flight: Set[concurrent.futures.Future] = set()  # progress stores not finished yet
        self._reached: List[Tuple[float, int]] = []  # (when, how many nodes took it) of recent progress stores
        self._dirty = False  # a publish was put off because too many stores were in flight
        self._published_at = -float("inf")  # monotonic time of our last progress store (started)
        #: our history record (records.HistoryRecord), kept apart from the progress record that every
        #: peer reads at every matchmaking poll; stored by the publisher when it changed or ages
        self._history: Dict[str, Any] = {}
        self._history_changed = False  # a validation loss or a failure since the last store
        self._history_failed = False  # a failure since the last store
        self._history_stored = -float("inf")  # monotonic time of our last history store
        #: other peers' fingerprint records were found when we joined: the run exists (or did, within FINGERPRINT_TTL)
        self.run_existed = False
        self._claimed_since: List[Any] = []  # when each of those claims was first made (their ``since``)
        self._stop = threading.Event()
        self._publisher: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        #: per fragment, the members of the group of our last successful sync of it (since our last adoption)
        self._last_members: Dict[int, FrozenSet[str]] = {}

    @property
    def peer_id(self) -> str:
        return self.node.peer_id_str

    def configure(self, *, round_samples: int, min_link_mbit: float, adaptive_timeouts: bool) -> None:
        """The run's settings for our rounds: ``round_samples`` (inner.round_samples: the all-reduce's
        weight screen budgets by it, as weights differ as speeds do), the slowest link the timeouts
        allow for, and whether the timeouts follow measured speeds (all-reduce, state download and
        matchmaking's waits)."""
        self.allreducer.round_samples = round_samples
        self.timeouts.configure(min_link_mbit=min_link_mbit, adaptive=adaptive_timeouts)
        self.matchmaker.adaptive = adaptive_timeouts

    @property
    def record_lifetime(self) -> float:
        """Seconds a progress record lives in the DHT (three progress periods and a margin)."""
        return self.matchmaker.record_lifetime

    # ---- our side of the run's history (the training loop's recovery reads and feeds it) ------------
    def set_give_way(self, give_way: Optional[Callable[[Dict[str, Dict[str, Any]]], Optional[str]]]) -> None:
        """Given the live peers' records, a reason to stop matchmaking and adopt a rival history's state
        instead, or None (asked on the network thread before a round: it must not wait)."""
        self.matchmaker.give_way = give_way

    def voters(self, peers: Dict[str, Dict[str, Any]]) -> Set[str]:
        """Whose claims count among the live ``peers`` (:func:`~p2pdiloco.swarm.standing.voters`)."""
        return self.matchmaker.voters(peers)

    @property
    def companions(self) -> Set[str]:
        """The other members of our last successful group (or our donors) that are still seen."""
        return self.matchmaker.companions

    def partners(self) -> Set[str]:
        """Peers we synced with lately: their claims count (:mod:`.standing`)."""
        return self.matchmaker.partners.current()

    def lineage(self, last: Optional[int] = None) -> Set[str]:
        """Our history's group ids (the ``last`` few), plus the groups we formed lately."""
        return self.matchmaker.lineage(last)

    def follow_group(self, frag: int, round_: int) -> None:
        """Our sync of (frag, round_) succeeded: its group joins our history (peers that trained in other
        groups are a rival lineage), goes into our progress record, and its members are our companions.
        Nothing when we did not see the group formed (its record is what others compare with)."""
        group = self.matchmaker.groups.get((frag, round_))
        if group is None:
            return
        self.matchmaker.add_lineage(group.gid)
        self.update_progress(gid=group.gid)
        self.matchmaker.set_companions(group.members)
        self._last_members[frag] = frozenset(group.members)

    def last_members(self, frag: int) -> FrozenSet[str]:
        """The members of the group of our last successful sync of ``frag`` (empty: none since we started
        or last adopted another state)."""
        return self._last_members.get(frag, frozenset())

    def adopt_history(self, gids: List[str], donors: List[str]) -> None:
        """We adopted the donors' state: their last groups are our lineage now (else the lineage rule
        would see them as rivals again and again), and they are our companions."""
        self.matchmaker.adopt_lineage(gids)
        self.matchmaker.set_companions(donors)
        self._last_members.clear()

    # ---- fingerprint ------------------------------------------------------------------------------
    def check_fingerprint(self, fp: str, fields: Dict[str, Any]) -> None:
        """Refuse to join a run configured differently; then publish our fingerprint (signed, one
        record per peer). The run's fingerprint is the one most peers that trained in the run claim; ours
        wins ties, and identities that never trained cannot outvote peers that did
        (records.run_fingerprint)."""
        key = fingerprint_key(self.run_id)
        mine = {"fp": fp, "fields": fields, "since": time.time()}
        try:  # before our first direct store (SwarmNode.store_near): meet the progress key's nearest nodes
            self.node.lookup_near(progress_key(self.run_id)).result(timeout=10)
        except Exception as e:
            logger.debug(f"lookup near the progress key failed: {e}")
        claims = self.node.get_subkeys(key, why="start")
        if not claims:
            self.node.store(key, mine, ttl=FINGERPRINT_TTL, subkey=self.peer_id)
            time.sleep(0.2)  # two first peers racing: read back what the other one published
            claims = self.node.get_subkeys(key, why="start")
        claims.pop(self.peer_id, None)
        self.run_existed = bool(claims)
        self._claimed_since = [v.get("since") for v in claims.values()]
        # whose claims count: peers that trained in the run first (records.run_fingerprint)
        progress = self.node.get_subkeys(progress_key(self.run_id), why="start") if claims else {}
        existing = run_fingerprint(claims, mine, progress)
        if existing.get("fp") != fp:
            theirs = existing.get("fields") if isinstance(existing.get("fields"), dict) else {}
            diff = sorted(k for k in set(theirs) | set(fields) if theirs.get(k) != fields.get(k))
            details = "; ".join(f"{k}: run has {theirs.get(k)!r}, you have {fields.get(k)!r}" for k in diff[:12])
            advice = ("Use the run's configuration (same --config and --set values) or choose another "
                      "swarm.run_id")
            if "protocol.version" in diff:  # not a setting: the peers run p2pdiloco versions that cannot talk
                advice = (f"The run's peers speak protocol version {theirs.get('protocol.version')!r} and this "
                          f"p2pdiloco speaks {fields.get('protocol.version')!r}: install the p2pdiloco version the "
                          "run uses (all peers must run versions with the same protocol), or choose another "
                          "swarm.run_id")
            raise FingerprintMismatch(
                f"this peer's configuration differs from run {self.run_id!r} in {len(diff)} field(s): {details}. "
                + advice
            )
        self._fingerprint = mine
        self.node.store(key, mine, ttl=FINGERPRINT_TTL, subkey=self.peer_id)
        self._fingerprint_stored = time.monotonic()

    def only_recent_claims(self, window: float) -> bool:
        """Every other peer's fingerprint claim found when we joined was first made less than ``window``
        seconds ago (by its ``since``; a claim without one counts as old): they are peers starting
        together with us, not a run in progress (``join_run``)."""
        now = time.time()
        return bool(self._claimed_since) and all(
            isinstance(t, (int, float)) and math.isfinite(t) and now - t < window for t in self._claimed_since)

    # ---- progress -----------------------------------------------------------------------------------
    def update_progress(self, **fields: Any) -> None:
        with self._progress_lock:
            self._progress.update(fields)

    # the dashboard's history: the last validation losses and failed rounds, in our history record
    def note_val_loss(self, outer_step: int, val_loss: float) -> None:
        with self._progress_lock:
            records.note_val_loss(self._history, outer_step, val_loss)
            self._history_changed = True

    def note_failure(self, outer_step: int, fragment: int, reason: str) -> None:
        # the reason often quotes another peer (an owner's abort reason): no record syntax of theirs
        # may reach our own record, whose signature every node checks
        reason = plain_text(reason, records.FAIL_REASON_CHARS)
        with self._progress_lock:
            records.note_failure(self._history, outer_step, fragment, reason)
            self._history_changed = self._history_failed = True

    @property
    def history_lifetime(self) -> float:
        """Seconds a history record lives: HISTORY_LIFETIMES progress records' lifetimes. A dashboard
        shows a peer's history only beside its live progress record, so an old one outliving its peer
        shows nothing; living long, it is re-stored rarely when nothing changes (an idle peer)."""
        return HISTORY_LIFETIMES * self.record_lifetime

    def publish_history(self) -> bool:
        """Store our history record when a round failed since the last store, when a new validation
        loss came and the last store is HISTORY_PERIODS progress periods old, or when that store is
        half its lifetime old (a dashboard started later still finds it); in the background, by the
        periodic publisher (at most once per progress period). True when a store was started."""
        now = time.monotonic()
        with self._progress_lock:
            age = now - self._history_stored
            due = (self._history_failed or age >= self.history_lifetime / 2
                   or (self._history_changed and age >= HISTORY_PERIODS * self.progress_period))
            if not self._history or not due:
                return False
            value = dict(self._history, t=time.time())
            self._history_changed = self._history_failed = False
            self._history_stored = now
        self.node.submit(self.node.astore_near(history_key(self.run_id), value, ttl=self.history_lifetime))
        return True

    def own_progress(self) -> Dict[str, Any]:
        """A copy of our progress record as last updated (not necessarily published yet)."""
        with self._progress_lock:
            return dict(self._progress)

    def publish_progress(self, wait: bool = False) -> None:
        """Publish our progress record as it is now; without ``wait``, in the background.

        A DHT store waits on every unresponsive node among the key's nearest: 6 s per store while one
        peer of four is frozen (hivemind's 3 s RPC timeout, once to find the nodes and once to store;
        ``python -m p2pdiloco.bench.dht_stall``). Neither the training loop nor the periodic publisher
        may wait that long: the loop would stall at every sync, and the publisher would fall behind the
        records' lifetime, so live peers would vanish from each other's views. So stores run on the
        network thread, several at once; when too many are still in flight, the newest values are
        published as soon as one finishes (a record with a later expiration replaces an older one, so
        the order in which they land does not matter)."""
        with self._progress_lock:
            self._in_flight = {f for f in self._in_flight if not f.done()}
            if not wait and len(self._in_flight) >= MAX_STORES_IN_FLIGHT:
                self._dirty = True
                return
            self._dirty = False
            self._published_at = time.monotonic()
            value = dict(self._progress, t=time.time())
            relayed = getattr(self.node, "relay_stats", {}).get("bytes", 0)
            if relayed:  # bytes we sent on relayed streams (status, dashboard)
                value["rb"] = int(relayed)
            fut = self.node.submit(self.node.astore_near(progress_key(self.run_id), value,
                                                         ttl=self.matchmaker.record_lifetime))
            self._in_flight.add(fut)
        fut.add_done_callback(self._store_done)
        if wait:
            try:
                fut.result(timeout=30)
            except Exception as e:
                logger.debug(f"progress publish failed: {e}")

    def published_lately(self) -> bool:
        """Our progress record was stored less than half a progress period ago (a sync publishes it twice:
        as its formation starts and when its result lands). The periodic publisher then leaves its store
        out: the record lives 3 periods + 5 s, and the next tick is at most 1.5 periods after that store."""
        with self._progress_lock:
            return time.monotonic() - self._published_at < self.progress_period / 2

    def _store_done(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            logger.debug(f"progress publish failed: {fut.exception()}")
        elif not fut.cancelled():
            now = time.monotonic()
            with self._progress_lock:
                self._reached = [(t, n) for t, n in self._reached if now - t < LOOKUP_PERIOD] + [(now, fut.result())]
        if self._dirty and not self._stop.is_set():
            self.publish_progress()

    def _fewer_reached(self) -> bool:
        """Our last progress store reached fewer nodes than one within the last LOOKUP_PERIOD: nodes left
        our routing table (hivemind drops one that does not answer). Then a lookup every period finds
        them again as soon as they can be reached (a healed partition), as hivemind's own store did with
        the lookup it starts every store with."""
        with self._progress_lock:
            return bool(self._reached) and self._reached[-1][1] < max(n for _, n in self._reached)

    def _refresh_fingerprint(self) -> None:
        """Re-publish our fingerprint record well before it expires (in the background)."""
        if self._fingerprint is None or time.monotonic() - self._fingerprint_stored < FINGERPRINT_TTL / 4:
            return
        self._fingerprint_stored = time.monotonic()
        self.node.submit(self.node.astore_near(fingerprint_key(self.run_id), self._fingerprint, ttl=FINGERPRINT_TTL))

    def start_publishing(self) -> None:
        """Publish our progress record every progress_period, and read everyone's (:meth:`peers_view`),
        in a background thread: a DHT call can wait seconds on an unreachable node, and the training
        loop must not."""
        def publish() -> None:
            next_lookup, lookup = time.monotonic() + LOOKUP_PERIOD, None
            while not self._stop.wait(self.progress_period):
                try:
                    if (lookup is None or lookup.done()) and (time.monotonic() >= next_lookup or self._fewer_reached()):
                        logger.debug(f"[{self.node.short_id}] node lookup next to the progress key (stores reached "
                                     f"{[n for _, n in self._reached]} nodes lately)")
                        next_lookup = time.monotonic() + LOOKUP_PERIOD
                        lookup = self.node.lookup_near(progress_key(self.run_id))
                        self.node.lookup_near(history_key(self.run_id))  # where publish_history stores
                    if not self.published_lately():
                        self.publish_progress()
                    self.publish_history()
                    self._refresh_fingerprint()
                except Exception as e:  # the DHT may be shutting down
                    logger.debug(f"progress publish failed: {e}")

        def read() -> None:  # its own thread: a slow read must not delay our record (and vice versa)
            last_network = -float("inf")
            while not self._stop.wait(min(self.progress_period, LOCAL_READ_PERIOD)):
                try:
                    last_network = self.read_view(last_network)
                except Exception as e:
                    logger.debug(f"progress read failed: {e}")

        self._publisher = threading.Thread(target=publish, name="p2pdiloco-progress", daemon=True)
        self._publisher.start()
        self._reader = threading.Thread(target=read, name="p2pdiloco-peers", daemon=True)
        self._reader.start()

    def read_view(self, last_network: float) -> float:
        """One pass of the background reader: refresh :meth:`peers_view` from our own DHT storage when we
        hold the progress key (free), else over the network once per :func:`network_read_period` (one
        progress_period per READ_SHARE live peers; one node's copy, a second node's when the first lacks a
        record of a peer in our view: :meth:`SwarmNode.read_near`). A network read of the records that matchmaking made
        counts as that period's read: its records become the view, and no second read follows within the
        period. Returns the monotonic time of the last network read."""
        formed, live = self.matchmaker.last_read
        if formed > last_network:
            last_network = formed
            with self._progress_lock:
                self._view, self._view_at = live, formed
        with self._progress_lock:
            known = set(self._view or ())
        start = time.monotonic()
        due = start - last_network >= network_read_period(self.progress_period, len(known))
        records = self.node.read_near(progress_key(self.run_id), network=due, expect=known)
        if records is None:
            return last_network
        view, now = self.matchmaker.live_of(records), time.monotonic()
        with self._progress_lock:
            self._view, self._view_at = view, now
            if due:
                self._read_s = now - start
        return now if due else last_network

    def fresh_view(self) -> Optional[Dict[str, Dict[str, Any]]]:
        """:meth:`peers_view` while the background reader keeps it current (:func:`view_lifetime`); None
        when it is older (the reader is stuck on a slow read, or the process was paused)."""
        with self._progress_lock:
            view, at, read_s = self._view, self._view_at, self._read_s
        if view is None:
            return None
        return view if time.monotonic() - at <= view_lifetime(self.progress_period, len(view), read_s) else None

    def peers_view(self) -> Optional[Dict[str, Dict[str, Any]]]:
        """The live peers as of the background reader's last read (None before its first), without waiting."""
        with self._progress_lock:
            return self._view

    def live_peers(self, why: str = "other") -> Dict[str, Dict[str, Any]]:
        """The live peers' progress records, read over the network now (``why``: the caller's purpose,
        counted by :attr:`SwarmNode.read_counts`)."""
        return self.matchmaker.live_of(self.node.get_subkeys(progress_key(self.run_id), why=why))

    def wait_for_peers(self, n: int, timeout: float) -> int:
        """Block until ``n`` peers (this one included) are live or ``timeout`` passes; returns the count.
        The polls back off from 0.5 s to LOCAL_READ_PERIOD: each reads every live peer's record from every
        node holding the key, and every peer of a swarm that starts together polls at once."""
        deadline = time.monotonic() + timeout
        pause = 0.5
        while True:
            count = len(self.live_peers(why="start") | {self.peer_id: {}})
            now = time.monotonic()
            if count >= n or now >= deadline:
                return count
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, LOCAL_READ_PERIOD)

    def expected_group(self, sync_step: int) -> int:
        """Live peers (ourselves included) that will take part in the sync at inner step ``sync_step``:
        those whose next sync is at this step or earlier (they are on their way). Counting the ones
        behind us makes the group wait for slower peers rather than close without them. (The
        background reader's view when there is one: matchmaking re-reads the records itself.)"""
        peers = self.peers_view()
        if peers is None:
            peers = self.live_peers(why="formation")
        others = sum(1 for pid, v in peers.items()
                     if pid != self.peer_id and isinstance(v.get("next_sync"), int) and v["next_sync"] <= sync_step)
        return 1 + others

    # ---- sync -----------------------------------------------------------------------------------------
    def form_group(self, frag: int, round_: int, sync_step: int) -> Group:
        """The one group for (frag, round_): waits for the live peers due at ``sync_step``. Raises SyncFailed."""
        self.update_progress(next_sync=sync_step)
        self.publish_progress()
        expected = self.expected_group(sync_step)
        return self.node.call(self.matchmaker.form_group(frag, round_, expected, sync_step=sync_step))

    def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec,
                  on_coverage: Optional[Callable[[Coverage], None]] = None) -> torch.Tensor:
        """Weighted mean of ``vec`` over ``group`` (bitwise identical on every member). Raises SyncFailed.

        ``on_coverage`` gets whose parts the mean covers (the same on every member that applies it;
        fewer than the group when a part was dropped: see :mod:`.allreduce`)."""
        if group.size == 1:
            if on_coverage is not None:
                on_coverage(Coverage(members=group.members, weight=float(weight)))
            return codec.roundtrip(vec.detach().to("cpu", torch.float32)) if codec.relative_error_bound \
                else vec.detach().to("cpu", torch.float32).clone()
        n = vec.numel()  # a relaying codec's replies carry every member's part: the mean of out and back
        nbytes = allreduce_bytes((codec.encoded_size(n) + codec.reply_size(n, group.size)) // 2, group.size)
        self.allreducer.timeout = self.timeouts.transfer(nbytes)
        t0 = time.perf_counter()
        out, coverage = self.node.call(self.allreducer.allreduce_covered(group, phase, vec, weight, codec))
        self.timeouts.observe(nbytes, time.perf_counter() - t0)
        if on_coverage is not None:
            on_coverage(coverage)
        return out

    def shutdown(self) -> None:
        self._stop.set()
        for thread in (self._publisher, self._reader):
            if thread is not None:
                thread.join(timeout=2)
        try:  # say goodbye: drop our progress record so nobody waits for us
            # a record only replaces one that expires earlier, so the goodbye gets the usual lifetime
            self.node.store_near(progress_key(self.run_id), {"gone": True, "t": time.time()},
                                 ttl=self.matchmaker.record_lifetime + 1)
        except Exception:
            pass
