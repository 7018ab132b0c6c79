"""Group formation for one (fragment, round): the DHT says who is ready, a leader makes it final.

1. A peer ready to sync fragment ``f`` of round ``r`` stores a *ready* record under
   ``<run>:mm:<f>:<r>`` (subkey: its peer id; a follower whose request a leader holds does not, item 9)
   and polls that key until as many peers are ready as
   the caller expects (the live peers at this round) or ``matchmaking_timeout`` passes. The polls
   back off (``POLL_MIN_S`` doubling to ``POLL_MAX_S``) while they find nobody new: a join request
   (item 9) or the leader's answer ends the pause at once.
2. The ready peer of the best *rank* (item 8: reachability, then a draw that changes every round)
   is the *leader*. Every other peer sends it a ``join``
   request. The leader admits joiners until everyone it saw ready has joined (or a short grace
   period ends), then finalizes: ``members`` = itself + admitted peers, sorted, and replies to every
   joiner with the same ``(gid, members)``. A group is therefore decided by exactly one peer and
   every member gets the same answer.
3. A peer that is asked to lead but follows someone else refuses with a *hint* (its leader); a
   peer whose leader is unreachable drops it and tries the next best-ranked one. "Unreachable" means a
   dial that still fails after ``JOIN_DIAL_WAIT`` seconds: a first dial to a live leader can be
   refused by libp2p's dial backoff left by an earlier failed dial, which is waited out: a follower
   that gave up on a live leader would lead a group of its own and split the round.
4. There is one group per (fragment, round), because all peers share one global state. The leader
   records the final members under ``<run>:group:<f>:<r>``. A peer that finds a closed group
   without itself (or is refused with ``closed``) raises :class:`MatchmakingFailed`: it missed
   the round and must catch up (download state), never sync alone.
5. Elastic membership (when the caller passes ``sync_step``): while waiting, the live peers'
   progress records are re-read, ``reevaluate_period`` seconds after a read that changed whom we
   wait for, twice the last pause (up to ``REEVAL_MAX_S``) after one that did not. A peer that said goodbye
   (clean leave) or whose record expired (crashed, stopped) stops being waited for; a peer that
   just announced itself (a joiner) starts being waited for. How long to wait is *derived* from
   the peers' measured speed: a missing peer at inner step ``s`` running ``sps`` steps/s is
   given ``eta_slack * (sync_step - s) / sps + eta_margin`` seconds from when we first see that
   record; ``matchmaking_timeout`` is only the upper bound. A peer that finds a verified sync of
   the swarm (claimed by enough peers, see ``standing.pick_target``) at or beyond its own
   ``sync_step`` is *behind* (a straggler that woke up): it raises :class:`RoundMissed` before it
   announces anything, so it never contributes to a round that is already over.
6. A group that formed without us makes us miss the round only if it is *our* round: it went on
   from our history. Every group names its *base*, the group its leader's state came from (the
   leader's last successful sync; the group id chains it), and we know our *lineage* (the groups
   we synced in or adopted when catching up, and the groups we formed). A base in our lineage: our
   history went on without us. Another base: another history (the other side of a partition, an
   isolated peer that ran ahead alone; also a record left from before a heal, which reuses the
   round numbers): we form our own group for that round, and the minority history gives way
   (``standing.rival_lineage``). Without a base or a lineage (a fresh run, a peer that just
   joined from scratch) the group counts if it holds one of our latest group's peers or, when we
   have none, at least half of the live peers. The ``closed`` refusal carries size and base.
   While waiting for a group, a peer that sees a rival history outnumbering its own (the caller's
   :attr:`Matchmaker.give_way` hook) stops at once: it is to adopt that state, not sync this round.
   A peer that adopted another history enters round numbers it already ran: what it decided for those
   rounds (closed groups of the history it left) no longer answers join requests; they wait for it to
   enter the round again. Its ready records of those rounds are withdrawn (a withdrawn record outlives
   the one it replaces and counts as not ready), so the others do not wait on it, or ask it to lead,
   as ready for a round it has not entered yet.
7. DHT views differ (a record not yet replicated, a node that just died). So a leader also waits
   (``join_grace``) for the peers due now whose ready record it did not see, a peer first asks
   such unseen peers of a better rank (briefly) before it leads itself, and a peer about to
   sync alone while others are live re-reads the DHT once more before it does: a missed record
   must not split a round into two groups.
8. Peers behind NAT (``swarm/reachability.py``) are *relayed* when a relay took them (others reach
   them through it, ``swarm/relay.py``) and *private* when none did (nobody can reach them).
   Leadership goes by *rank*: public peers first, then relayed ones, then private ones, then the
   smallest draw: a hash of the round's key and the peer id (:func:`.formation.draw`), another
   order every round, the same on every peer. A private peer therefore never leads a group with
   others (it can dial the leader, the leader could not dial it; the join reply comes back on the
   stream it opened), and the leader
   names the group's shard *owners* (``Group.owners``): its public members, or its relayed members
   when none is public (a relayed owner's traffic all crosses its relay), never a private one. Who
   is what is learned from the progress and ready records (``reach``, ``via``) and from the join
   request itself (the leader's source for its joiners). A private peer whose round has other ready
   peers but no reachable one fails that round with one clear :class:`MatchmakingFailed`, at once
   rather than after a timeout; alone, it syncs alone like anyone.
9. Group formation is on the critical path of every sync, and each DHT read or store costs round
   trips. So a peer also asks the presumable leader (the best rank among itself and the live
   peers due at this sync) to admit it as soon as it is ready, while it polls, and a leader counts
   such a request as that peer's ready record: usually the group closes without any peer waiting
   for another's record to reach the DHT. The request decides nothing: when the poll picks another
   leader (or us), the peer hangs up first, and a joiner that hung up is never admitted. Once the
   presumable leader holds the request (the stream open, the request written), the peer reads nothing
   more (a peer asking it to lead meanwhile is sent to that leader: "not leader", hint): the leader
   polls the round for everyone who asked it and answers when its group closes, and
   each read would carry every ready or progress record of the round (per follower and poll: the
   control traffic that grows with the swarm). While the dial is still tried, the peer polls: a
   presumable leader that left or crashed after our read fails the dial only after ``JOIN_DIAL_WAIT``,
   and another peer may lead meanwhile. A refusal, or no answer by the peer's own deadline, sends it
   back to polling; a presumable leader that cannot be reached, breaks the stream or falls silent
   (item 11) is replaced at once by the next one (the best rank among the others due).
   For the same reason a peer enters a round with a network read of the live peers and the round's
   group record only when it may lead it: one whose background view (``Swarm.fresh_view``: no older than
   the background reader's own period allows) makes another peer the presumable leader takes that view and
   asks that leader, and stores its ready record only if it polls or that leader holds it for half the
   join grace (a store costs a node lookup and a store on each of the key's nearest nodes, and the
   leader counts the request instead; a longer wait is one where the others' reads must see us ready, item
   11). A refusal with a hint sends the request to the hinted peer at once (up to ``HINTS_FOLLOWED``
   times a round: the peers deferring to it stored no ready record, so a poll would not show them
   ready); a refusal without one makes the next poll re-read the live peers. The view never decides
   a group: the presumable leader reads for itself, a view that missed a better-ranked peer costs a
   hint or a refusal, and a round closed without us is refused as ``closed`` (or found by a poll's
   read of the group record).
10. Links are warmed before the round. When the leader closes a group it first sends
   every joiner the *proposed* members and owners (``warm``); each member, the leader too, opens a
   connection to every owner it will send parts to (:func:`~p2pdiloco.swarm.dialing.ensure_connected`:
   waits out libp2p's dial backoff, and both ends of a public pair dial each other, so one failed
   direction is rescued by the other) for up to ``warm_timeout`` seconds, and answers with the
   owners it could not reach (``warmed``). The all-reduce then starts on open connections, usually
   while the pseudo-gradient is still being computed. A member really unreachable is left out
   *before* the round, not discovered by every member after it started: the leader takes the
   pairs (reporter, owner) that stayed unconnected and, while any is left, removes the member in
   the most of them (ties: the worse rank, so public peers stay; never the leader);
   a joiner that sends no answer in time is removed too. The final group (``group``) has the
   others; a removed joiner gets ``refuse`` with reason ``left out`` and raises
   :class:`RoundMissed` (it catches up like any peer that missed a round). A joiner that lies
   about its links can get itself, or one peer it names, left out of that round: no worse than a
   member that stalls.
11. Leaders that take requests and answer none. A hostile identity with honest-looking records, ready
   every round, is the presumable leader of the rounds where it draws first: about its share of them (a
   peer id is the hash of a key anyone can grind, which is why the rank is a per-round draw and not the
   id: a ground id would lead every round). A peer holding a join request therefore says so (``wait``,
   every ``WAIT_S``) until it answers; a holder silent for ``SILENT_S`` (or whose stream breaks) is
   *dropped* for the round: not presumed, not asked again. A holder that keeps talking and proposes
   nothing is dropped when every peer due is ready and ``_patience`` (twice the join grace, the longest
   an honest leader admits joiners) has passed since our own wait ended (*stalled*), unless a live peer
   due by its record is one we skip as overdue (item 12): strikes are each peer's own, and a holder that
   did not see that peer miss a round waits for it, up to its matchmaking timeout; it then gets as long
   as our request allows: followers that drop an honest leader lead groups of their own, and a round
   that outlasts a group record's lifetime can then close twice. A holder that says 'wait' for the
   request's whole timeout (longer than an honest leader waits and admits; its drop cannot depend on
   every peer due being ready: one that claims to be due and never comes holds that off in the rounds
   before it is overdue) is dropped as stalled too, with the same exception. Every honest peer
   drops a silent or stalled identity, at different moments (a broken stream breaks for all at once):
   so a peer that leads in place of a better-ranked one admits joiners longer (``_fallback_grace``), a
   candidate that answers "I follow <such a peer>" is asked again (``HINT_RETRY_S``) for as long as it
   takes that candidate to drop it too, rather than bounced past, and a leader's re-reads never add
   dropped peers to the joiners it waits for. The round takes SILENT_S longer per silent identity ahead
   of the first honest peer, in one group.
12. Peers that claim to be due and never come. A progress record's step and speed are the writer's
   claims: an identity that claims to be just short of every sync step at a crawl would be waited for
   up to ``matchmaking_timeout`` every round. A peer we waited for (due, by its ETA) that was still
   not ready when a round we completed closed, and not in its group, is *overdue*: after k such
   rounds in a row, the next 2^(k-1) rounds do not wait for it (no ETA, not counted in ``expected``,
   not among the unseen peers a leader waits for, not presumed as leader); then it is waited for
   again. Being a member of one of our groups ends it. When it is ready it counts as anyone ready
   does. So an identity whose claims never come true is waited for in about log2 of the rounds,
   and an honest peer that missed a round (a pause, a catch-up) and is slower than the others is
   waited for again one round later. ``OVERDUE_S`` without news forgets it.
13. Gathering: the leader's work bounded by the group cap (``swarm.gather``, off by default). With
   ``swarm.group_cap`` = G and at least 2G peers due (by our view), the peers fall into 2^floor(log2(N/G))
   *buckets* by a hash of the round's key and their id (:func:`.formation.gather_buckets`, a power of two
   so that views a few peers apart agree); a bucket's *head* is its best-ranked dialable peer
   (:func:`.formation.gather_head`), and the round's leader heads its own bucket. A peer that does not
   head its bucket sends its early request to its head instead of the presumable leader; the head asks
   the leader itself and *carries* the requests it holds in its own (``riders``, then ``ride`` /
   ``unride`` frames as joiners come and hang up): the leader admits, refuses or hints them with the
   head, proposes the group once to the head, which passes the proposal on and brings back one link
   report for all, and answers with one ``batch`` naming each one's reply. So the leader holds about
   N/G + 2G requests instead of N, each head up to 2G. A peer carries only while it follows a leader it
   asked directly (one whose request a head carries refuses with the usual hint), and a peer carrying
   requests never sends its own through a head. A head that leads after all admits its riders as
   joiners; one whose formation ends otherwise answers the riders it still holds (closed, or round
   missed: they look again), and breaks the stream of one it passed a proposal to and could not answer
   (the proposal's leader vanished: the round fails for it as for its head).
   Item 11's rules apply to a head as to a leader, with three changes. A rider drops a head that falls
   silent or whose stream breaks and asks the bucket's next head (or the leader); but one whose wait is
   over while its head still holds its request waits for the head's answer, whoever it would ask
   itself, for the request's whole timeout: the head applies item 11 to the leader as any direct
   follower does and carries its riders on to whom it asks next, so a bucket follows its head rather
   than each rider's own timing (riders that dropped a leader at their own moments, while their heads
   still waited on it, split rounds). A head that holds the request that long stalls, or waits on a
   leader that does (and drops it about then): the rider drops both and asks the next candidate. A leader admits the ready peers whose head (by its view) did not
   join it for SILENT_S longer than the join grace (a silent head's riders come late), and so join
   requests wait that much longer for their first answer. A hostile head can also name riders that
   never asked: they are left out by the link check when they do not answer it, or, when the head
   answers for them, fail the round as a member that stalls does. Not yet good enough: in simulation,
   stalling identities beside one that claims to be due and never comes make many more peers miss
   gathered rounds than ungathered ones, which is why it is off by default.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Set, Tuple, Union

from ..errors import MatchmakingFailed, RoundMissed
from ..ids import short_id, short_ids
from . import formation
from .formation import expected_peers
from .group import Group, tier_of
from .joining import SILENT_S, JoinRequests, JoinWatch
from .keys import group_key, handler_name, progress_key, ready_key
from .leading import Leading, RoundSlot, consume_outcome
from .reachability import REACHABILITY
from .standing import Lineage, Partners, pick_target, voters

__all__ = ["Matchmaker", "expected_peers"]

#: the pause between two polls of a round's records (seconds): POLL_MIN_S after a poll that found a new
#: ready peer, doubling with each poll that found none, up to POLL_MAX_S (a poll reads two keys from
#: several nodes, each answer carrying every signed record of the round: ~100 KB per sync and peer
#: at a steady 0.1 s with 4 peers)
POLL_MIN_S, POLL_MAX_S = 0.1, 0.8
#: the longest pause between two re-reads of the live peers while a formation polls (seconds): the
#: re-reads start every reevaluate_period and double while one brings no change in whom we wait for.
#: Each re-read carries every live peer's progress record from several nodes (the control traffic that
#: grows with the swarm), and those records change only when their peer syncs or re-publishes, which
#: a reader sees within LOCAL_READ_PERIOD (2 s) anyway
REEVAL_MAX_S = 2.0
#: how long a follower waits for its early request to reach the presumable leader before it polls the
#: round itself (seconds): a dial to a live peer takes a few round trips, and once the leader holds the
#: request the follower reads nothing (item 9); a dial still tried after this (the leader left or
#: crashed since our read, or its address is cold) must not keep us from seeing who leads instead
EARLY_DIAL_S = 0.5
#: how soon a candidate that still waits on a leader we dropped is asked again (seconds): well within
#: its join grace once it leads
HINT_RETRY_S = 0.3
#: how many refusing leaders' hints a follower's early request follows in one round (item 9); then it polls
HINTS_FOLLOWED = 3
#: how long a peer stays overdue (item 12) without missing a round we waited for it in (seconds)
OVERDUE_S = 3600.0


@dataclass
class _Overdue:
    """A peer's record of rounds it was waited for and missed (item 12)."""

    strikes: int       # such rounds in a row
    skip: int          # rounds left that do not wait for it
    since: float       # monotonic time of the last strike

logger = logging.getLogger(__name__)


@dataclass
class _Attempt:
    """One peer's formation of one (fragment, round)'s group, carried through the steps of
    :meth:`Matchmaker.form_group`."""

    me: str
    frag: int
    round: int
    sync_step: Optional[int]
    expected: int                          # ready peers to wait for, us included
    slot: RoundSlot
    key: str                               # the round's ready-record key
    t_enter: float
    start: float
    hard_deadline: float
    deadline: float = 0.0
    first_seen: Dict[Tuple[str, Any], float] = field(default_factory=dict)
    ready: Set[str] = field(default_factory=set)
    waiting_for: Set[str] = field(default_factory=set)
    peers: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    absent: Set[str] = field(default_factory=set)
    last_eval: float = -1e9
    reeval_gap: float = 0.0                 # the pause to the next re-read of the live peers (the backoff)
    presumed: str = ""
    early: Optional[asyncio.Future] = None  # our request to the presumable leader, while it is open
    watch: JoinWatch = field(default_factory=JoinWatch)  # the early request: taken, proposed, silent
    quiet_polls: int = 0                    # polls in a row that found no new ready peer (the backoff)
    dial_waited: bool = False               # we gave the early request EARLY_DIAL_S to reach the leader
    silent: Set[str] = field(default_factory=set)   # took our request, then said nothing for SILENT_S
    stalled: Set[str] = field(default_factory=set)  # held it, every peer due ready, proposed nothing in time
    gone: Set[str] = field(default_factory=set)     # took it, then its stream broke (it left or crashed)
    unreached: Set[str] = field(default_factory=set)  # presumable leaders our early request could not reach
    ready_stored: bool = False              # our ready record went out (Matchmaker._store_ready)
    hints: int = 0                          # early requests sent to a refusing leader's hint
    group: Optional[Group] = None           # the group we end in

    @property
    def dropped(self) -> Set[str]:
        """The peers not asked again this round: they took our request and left it unanswered."""
        return self.silent | self.stalled | self.gone

    @property
    def holding_out(self) -> Set[str]:
        """Dropped peers that others may still wait on (silent or stalled: each peer drops them after its
        own wait; a broken stream breaks for everyone at once)."""
        return self.silent | self.stalled

    def __post_init__(self) -> None:
        self.ready.add(self.me)

    def hang_up(self) -> None:
        """Withdraw the early request (the presumable leader must not admit us any more)."""
        if self.early is not None:
            self.early.cancel()
            self.early = None


async def _nothing() -> None:
    return None


class Matchmaker(Leading, JoinRequests):
    """Forms groups (see the module docstring): the steps of one formation here, the leader's side in
    :class:`~.leading.Leading`, the join protocol in :class:`~.joining.JoinRequests`, the rules in
    :mod:`.formation`.

    :param matchmaking_timeout: upper bound of the wait for ready peers, seconds.
    :param join_grace: how long a leader waits for the ready peers to send their join request.
    :param eta_slack: multiplier on a missing peer's expected time to reach the sync (>= 1).
    :param eta_margin: seconds added to it (DHT latency, a progress period of staleness).
    :param warm_timeout: how long the members of a closing group try to connect to each other before
        a member they cannot reach is left out (item 10); covers one libp2p dial backoff (~5 s).
    """

    def __init__(self, node, run_id: str, *, matchmaking_timeout: float, min_group_size: int = 1,
                 join_grace: float = 3.0, eta_slack: float = 2.0, eta_margin: float = 3.0,
                 reevaluate_period: float = 0.5, warm_timeout: float = 8.0):
        self.node = node
        self.warm_timeout = warm_timeout
        #: the all-reduce's cap (swarm.group_cap): which owners a member warms its links to; with ``gathering``
        #: (swarm.gather), a round of at least twice as many peers due is gathered by bucket heads (item 13)
        self.group_cap = 0
        self.gathering = False
        #: join requests taken ("requests", "carriers": those carrying others) and carried ("carried", item 13)
        self.join_stats: Counter = Counter()
        #: (monotonic time, live peers) of our last network read of the progress records: the background
        #: reader takes it as its own read of that period (Swarm.start_publishing)
        self.last_read: Tuple[float, Dict[str, Dict[str, Any]]] = (-float("inf"), {})
        self.run_id = run_id
        self.matchmaking_timeout = matchmaking_timeout
        self.min_group_size = min_group_size
        self.join_grace = join_grace
        self.eta_slack = eta_slack
        self.eta_margin = eta_margin
        self.reevaluate_period = reevaluate_period
        #: False: wait up to matchmaking_timeout for every expected peer (nothing derived)
        self.adaptive = True
        self.handler_name = handler_name(run_id, "join")
        self._slots: Dict[Tuple[int, int], RoundSlot] = {}
        self._live_count = 1  # live peers (us included) at the last read of the progress records
        #: recently finalized groups by (fragment, round): the training loop reads a sync's group id here
        self.groups: Dict[Tuple[int, int], Group] = {}
        #: how long a peer's progress record lives (the swarm sets it): see :attr:`companions`
        self.record_lifetime = 8.0
        self._companions: Set[str] = set()
        #: who we completed verified rounds with: whose claims count (swarm/standing.py)
        self.partners = Partners()
        self._seen: Dict[str, float] = {}  # peer -> when its record was last in a read (monotonic)
        self._lineage = Lineage()  # our history: the groups we synced in, adopted or formed
        #: how many times we adopted another history (caught up): round numbers restart from the adopted
        #: state, so a slot opened before that belongs to a round of the history we left
        self._histories = 0
        #: our ready records that may still live: key -> when they expire (monotonic); withdrawn when we
        #: adopt another history (they would say we are ready for rounds of the history we left)
        self._ready_stored: Dict[str, float] = {}
        self._tasks: Set[asyncio.Task] = set()  # DHT stores running in the background
        self._reach: Dict[str, str] = {}  # peer -> reachability, from its records and join requests
        #: overdue peers (item 12): waited for in a round we completed, not ready when it closed
        self._overdue: Dict[str, _Overdue] = {}
        #: each peer's draw for a round (formation.draw): a function so rules tests can rank by id alone
        self._draw: Callable[[str, str], bytes] = formation.draw
        #: set by the swarm: the live peers as its background reader last read them, while that read is no
        #: older than the reader's own period allows (else None): what a follower enters a round with (item 9)
        self.fresh_view: Optional[Callable[[], Optional[Dict[str, Dict[str, Any]]]]] = None
        #: set by the training loop: given the live peers' records, a reason to stop matchmaking and adopt
        #: a rival history's state instead (see the module docstring, item 6), or None
        self.give_way: Optional[Callable[[Dict[str, Dict[str, Any]]], Optional[str]]] = None
        node.add_handler(self.handler_name, self._handle_join)

    # ---- lineage (module docstring, item 6) and standing --------------------------------------------
    def add_lineage(self, gid: str) -> None:
        """A sync in group ``gid`` succeeded: it is now the base of the groups we lead."""
        self._lineage.add(gid)

    def adopt_lineage(self, gids: Iterable[str]) -> None:
        """We caught up with other peers' state: their groups are our history now. Our ready records of
        the rounds we entered in the history we left are withdrawn: round numbers restart from the adopted
        state, and until they expire those records would tell the others we are ready for the rounds we
        are about to enter again (they would ask us to lead, or wait on us, before we are there)."""
        self._lineage.adopt(gids)
        self._histories += 1  # called from the training thread: the loop reads it, nobody else writes it
        stale, self._ready_stored = self._ready_stored, {}
        if stale:
            self.node.submit(self._withdraw_ready(stale))

    async def _withdraw_ready(self, stale: Dict[str, float]) -> None:
        """Replace our ready records in ``stale`` (key -> expiry) by withdrawn ones that outlive them (a
        DHT node keeps the later expiration); entering such a round again stores a fresh record, later
        still."""
        now = time.monotonic()
        for key, expiry in stale.items():
            if expiry > now:
                self._background(self.node.astore(key, {"t": time.time(), "withdrawn": True}, ttl=expiry - now + 2.0,
                                                  subkey=self.node.peer_id_str), "withdrawn ready record")

    def lineage(self, last: Optional[int] = None) -> Set[str]:
        """Our history's group ids (:meth:`.standing.Lineage.ids`)."""
        return self._lineage.ids(last)

    @property
    def base(self) -> str:
        """The group our state came from (our last successful sync), "" before the first."""
        return self._lineage.base

    def set_companions(self, members) -> None:
        """The members of our last successful group, or the donors of a verified state (the training loop
        calls this after each): our companions, and partners whose claims count from now on."""
        now = time.monotonic()
        self._companions = set(members) - {self.node.peer_id_str}
        self._seen.update((pid, now) for pid in self._companions)
        for pid in self._companions:
            self._overdue.pop(pid, None)
        self.partners.add(self._companions)

    def voters(self, peers: Dict[str, Dict[str, Any]]) -> Set[str]:
        """Whose claims count among the live ``peers`` (:func:`~p2pdiloco.swarm.standing.voters`)."""
        return voters(peers, self.node.peer_id_str, self.partners.current())

    # ---- reachability (module docstring, item 8) ---------------------------------------------------

    def _note_reach(self, records: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        for pid, v in records.items():
            self._learn_reach(pid, v.get("reach"), v.get("via"))
        return records

    def _learn_reach(self, pid: str, reach: Any, via: Any) -> None:
        """A peer's reachability (and, relayed, its relay: where ``open_stream`` sends our streams to it)."""
        if pid == self.node.peer_id_str or reach not in REACHABILITY:
            return
        self._reach[pid] = reach
        routes = getattr(self.node, "relay_routes", None)
        if routes is None:
            return
        if reach == "relayed" and isinstance(via, str) and 20 <= len(via) <= 128 and via != pid:
            routes[pid] = via
        else:
            routes.pop(pid, None)

    def _tier(self, peer: str) -> int:
        """How others reach ``peer`` (:func:`.group.tier_of`): public, relayed or private."""
        reach = getattr(self.node, "reachability", "public") if peer == self.node.peer_id_str else self._reach.get(peer)
        return tier_of(reach)

    def _private(self, peer: str) -> bool:
        """Nobody can open a stream to it: it can neither lead nor own a shard."""
        return self._tier(peer) == 2

    def _ranking(self, round_key: str) -> Callable[[str], formation.Rank]:
        """Who leads the round under ``round_key``: public peers, then relayed ones, then private ones;
        then the smallest draw for this round (:func:`.formation.draw`)."""
        draw = self._draw
        return lambda peer: (self._tier(peer), draw(round_key, peer), peer)

    async def _ready_read(self, key: str) -> Set[str]:
        """The (unbanned) peers with a ready record under ``key`` (not a withdrawn one); notes their reachability."""
        records = await self.node.aget_subkeys(key, why="ready poll")
        return self._unbanned(self._note_reach({p: v for p, v in records.items()
                                                if not (isinstance(v, dict) and v.get("withdrawn"))}))

    def live_of(self, records: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """The live peers among a read of the progress records (no goodbye, not banned); every read
        goes through here, so it also keeps :attr:`companions` up to date."""
        self._note_reach(records)
        live = {pid: v for pid, v in records.items() if not v.get("gone") and not self.node.gate.banned(pid)}
        now = time.monotonic()
        self._seen.update((pid, now) for pid in live)
        self._companions -= set(records) - set(live)  # said goodbye (or banned): no longer on our side
        return live

    @property
    def companions(self) -> Set[str]:
        """The other members of our last successful group whose record we read within one record
        lifetime. A DHT read can miss a record: such a peer still counts as with us
        (:func:`~p2pdiloco.swarm.standing.pick_target`, ``rival_lineage``); one unseen for longer
        is gone or cut off and counts for nobody."""
        now = time.monotonic()
        return {pid for pid in self._companions if now - self._seen.get(pid, 0.0) <= self.record_lifetime}

    def _background(self, coro, what: str) -> None:
        """Run a DHT store without waiting for it (kept referenced until done; a failure is logged)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.debug(f"[{self.node.short_id}] storing the {what} failed: {t.exception()}")

        task.add_done_callback(done)

    def _my_reach(self) -> str:
        reach = getattr(self.node, "reachability", "public")
        return reach if reach in REACHABILITY else "public"

    def _my_reach_fields(self) -> Dict[str, str]:
        """What our ready records and join requests say of how to reach us."""
        reach = self._my_reach()
        via = getattr(self.node, "via", "")
        return {"reach": reach, "via": via} if reach == "relayed" and via else {"reach": reach}

    def _unbanned(self, peers: Iterable[str]) -> Set[str]:
        return {p for p in peers if not self.node.gate.banned(p)}

    def _key(self, frag: int, round_: int) -> str:
        return ready_key(self.run_id, frag, round_)

    def _group_key(self, frag: int, round_: int) -> str:
        return group_key(self.run_id, frag, round_)

    def _slot(self, frag: int, round_: int) -> RoundSlot:
        """Our slot for (frag, round_) as we enter that round: a fresh one unless this history opened it."""
        for key in [k for k in self._slots if k[1] < round_ - 2]:
            del self._slots[key]  # forget rounds long gone
        slot = self._current_slot(frag, round_)
        if slot is None:
            slot = self._slots[(frag, round_)] = RoundSlot(history=self._histories)
        return slot

    def _current_slot(self, frag: int, round_: int) -> Optional[RoundSlot]:
        """Our slot for (frag, round_) in our current history, None before we enter that round. A peer
        that ran ahead alone and then adopted the swarm's state enters the same round numbers again: the
        slots of the rounds it ran alone hold groups of the history it left (closed, another base), and a
        joiner refused with those would form a group without us while we lead one without it."""
        slot = self._slots.get((frag, round_))
        return slot if slot is not None and slot.history == self._histories else None

    # ---- one formation: form_group and its steps ---------------------------------------------------

    async def form_group(self, frag: int, round_: int, expected: int, sync_step: Optional[int] = None) -> Group:
        """Return the final group for (frag, round_), or raise MatchmakingFailed (RoundMissed: the round
        is over without us; catch up).

        ``expected``: how many ready peers (this one included) to wait for. With ``sync_step`` (the
        schedule position this sync belongs to) the wait is elastic and derived (module docstring,
        item 5). Four named steps, each one method: :meth:`_enter` (read, check, announce, ask the
        presumable leader), :meth:`_poll` (until enough peers are ready or the wait ends),
        :meth:`_last_look` (before syncing alone) and :meth:`_choose_leader` (ask candidates in rank
        order, or lead). The rules, as ``tests/test_matchmaking_rules.py`` checks them row by row:

        ========================================================  ===========================================
        situation                                                 rule
        ========================================================  ===========================================
        a verified sync of the swarm at or past our sync step     behind: RoundMissed, nothing announced
        the round's group closed without us, based on our         RoundMissed (the round went on without us)
        history (or, without a history, holding a partner of
        our last group / half the live peers)
        the round's group closed without us, another history      not ours: form our own group
        as many ready peers as expected (records or requests)     stop polling
        a live peer due now is not ready yet                      wait for it until its derived ETA, never
                                                                  past ``matchmaking_timeout``
        we enter, and our fresh background view makes another     take that view (no network read of the
        peer the presumable leader                                live peers or the group record); store
                                                                  our ready record only if we poll, or
                                                                  defer for half the join grace
        the presumable leader refuses our request with a hint     ask the hinted peer at once (at most
                                                                  HINTS_FOLLOWED times a round)
        the presumable leader (best rank of us and the peers      ask it to admit us at once; once it took
        due now) is another peer                                  the request read nothing more until it
                                                                  answers (peers asking us meanwhile get
                                                                  its id as hint): its group is ours;
                                                                  refused, or no answer by our deadline:
                                                                  poll
        the dial to the presumable leader is still tried          poll (after <= EARLY_DIAL_S): it may have
        after EARLY_DIAL_S                                        left, and another peer lead
        alone while others are live, or partners of our last      look once more (after <= 1 s): behind?
        group cannot be seen at all                               missed? more ready records?
        candidates                                                ready peers, plus unseen due peers and
                                                                  absent partners of better rank, in rank
                                                                  order: public before private, then id
        we are private and so is every other ready peer           MatchmakingFailed: nobody can lead us
        the best candidate is us                                  lead: admit joiners, waiting the join
                                                                  grace for the unseen ones
        a candidate answers "not leader" with a hint              ask the hinted peer first (re-read the
                                                                  ready records when we have not seen it);
                                                                  a candidate bounces at most 3 times
        a candidate refuses without a hint, or is unreachable     the next candidate
        the presumable leader breaks the stream or says nothing   dropped for the round (never presumed or
        for SILENT_S after taking our request                     asked again); ask the next presumable one
        the presumable leader cannot be reached                   ask the next presumable one (it stays a
                                                                  candidate)
        every peer due is ready, our wait is over, and the        dropped (stalled) after _patience; the
        presumable leader holding our request proposed nothing    next candidate (no drop while we skip a
                                                                  due peer as overdue: it may wait for it)
        a candidate holds our request for the request's whole     dropped (stalled), the next candidate (no
        timeout, saying 'wait', and answers nothing               drop while we skip a due peer as overdue)
        a candidate's hint names a peer we dropped as silent or   ask it again shortly, however often, for
        stalled                                                   as long as that peer takes to drop it too
        we lead in place of a better-ranked silent or stalled     admit for _fallback_grace, not the join
        peer                                                      grace; never wait for dropped peers
        a join request for a round we ran before we adopted       held until we enter that round again; our
        another history                                           formation then answers it
        a peer we waited for, not ready when k rounds we          overdue: the next 2^(k-1) rounds do not
        completed closed (in a row), not a member since           wait for it or presume it; counted when
                                                                  seen ready
        a group cap G, 2G peers due, and another peer heads our   our early request goes to that head (item
        gathering bucket (we carry no requests ourselves)         13); its answer is the leader's
        a peer asks us to admit it while we follow a leader we    carry its request in ours (item 13) and
        asked directly, gathering on                              pass it the leader's answer; lead: admit
        our wait is over while our head holds our request         its answer, as long as the request allows
                                                                  (silent, broken, expired: ask directly)
        ========================================================  ===========================================
        """
        a = await self._enter(frag, round_, expected, sync_step)
        try:
            a.group = await self._form(a)
            return a.group
        finally:
            self._release_riders(a.slot, a.group)

    async def _form(self, a: "_Attempt") -> Group:
        """:meth:`form_group` after :meth:`_enter`: poll, look once more, choose a leader."""
        try:
            group = await self._poll(a)
            if group is None:
                await self._last_look(a)
        except BaseException:  # behind, missed, or stopped: the presumable leader must not admit us
            a.hang_up()
            raise
        if group is None:
            group = await self._choose_leader(a)
        self._note_overdue(a, group)
        return group

    def _release_riders(self, slot: RoundSlot, group: Optional[Group]) -> None:
        """Our formation is over: the requests we carried and nobody answered get theirs (item 13). One
        that was proposed a group breaks unanswered (the leader's answer was lost with ours); the others
        were not in the group we joined (closed), or there was none (round missed: they look again)."""
        for rider in slot.riders.values():
            if rider.warm.done():
                rider.settle(None)
            elif group is not None:
                rider.settle({"t": "refuse", "reason": "closed", "size": group.size, "base": self.base})
            else:
                rider.settle({"t": "refuse", "reason": "round missed"})
        slot.riders.clear()
        slot.carry = False

    def _note_overdue(self, a: "_Attempt", group: Group) -> None:
        """Item 12, after a round we completed: the peers we waited for that were not ready when it closed
        and are not in its group get a strike (and 2^(strikes-1) rounds without a wait); a round that
        did not wait for an overdue peer counts down its skip; members are not overdue."""
        now = time.monotonic()
        members = set(group.members)
        missing = (a.waiting_for - a.ready - members) if a.sync_step is not None else set()
        for pid in list(self._overdue):
            entry = self._overdue[pid]
            if pid in members or now - entry.since > OVERDUE_S:
                del self._overdue[pid]
            elif pid not in missing and entry.skip > 0:
                entry.skip -= 1
        for pid in missing:
            entry = self._overdue.setdefault(pid, _Overdue(0, 0, now))
            entry.strikes += 1
            entry.skip, entry.since = 2 ** min(entry.strikes - 1, 16), now
        if missing:
            logger.info(f"[{self.node.short_id}] waited for {short_ids(missing)} at fragment {a.frag} round "
                        f"{a.round}, not ready when it closed: not waited for in the next round(s)")

    def _skipping(self) -> Set[str]:
        """The overdue peers whose rounds without a wait are not over (item 12)."""
        return {pid for pid, entry in self._overdue.items() if entry.skip > 0}

    def _skipped_due(self, a: "_Attempt") -> Set[str]:
        """The live peers due now by their records that we do not wait for as overdue (item 12). Another peer
        counts its own strikes, from the rounds it waited in: a leader that did not see them miss a round
        waits for them, which is no stall."""
        if a.sync_step is None:
            return set()
        return expected_peers(a.peers, a.me, a.sync_step) & self._not_waited(a)

    def _not_waited(self, a: "_Attempt") -> Set[str]:
        """The overdue peers whose rounds without a wait are not over, not seen ready in this round (item 12)."""
        return self._skipping() - a.ready

    async def _enter(self, frag: int, round_: int, expected: int, sync_step: Optional[int]) -> "_Attempt":
        """Read the live peers and the round's group record (a follower with a fresh view: neither, item 9);
        refuse a round we are behind on or that is over without us; ask the presumable leader to admit us
        (item 9), or store our ready record (in the background: a store can wait seconds on an
        unresponsive node) when we are that leader."""
        me = self.node.peer_id_str
        t_enter = time.monotonic()
        key = self._key(frag, round_)
        live = self._entry_view(key, sync_step) if sync_step is not None else None
        viewed = live is not None
        if viewed:
            groups: Dict[str, Dict[str, Any]] = {}
        else:
            live, groups = await asyncio.gather(
                self._live_peers(check=True) if sync_step is not None else _nothing(),
                self.node.aget_subkeys(self._group_key(frag, round_), why="formation"))
        if sync_step is not None:
            self._check_not_behind(live, frag, round_, sync_step)
        self._raise_if_missed(groups, frag, round_, expected)
        start = time.monotonic()
        a = _Attempt(me=me, frag=frag, round=round_, sync_step=sync_step, expected=expected,
                     slot=self._slot(frag, round_), key=key, t_enter=t_enter, start=start,
                     hard_deadline=start + self.matchmaking_timeout)
        a.deadline = a.hard_deadline
        if sync_step is not None:
            self._evaluate(a, live)  # read just now, or the background reader's fresh view
            self._ask_presumed(a)
        if a.early is None:
            self._store_ready(a)
        return a

    def _store_ready(self, a: "_Attempt") -> None:
        """Store our ready record for the round (once; in the background). A follower whose request the
        presumable leader takes never does: the leader counts the request as its ready record (item 9),
        and the store would fetch the round's whole dictionary from every node its lookup asks."""
        if a.ready_stored:
            return
        a.ready_stored = True
        ttl = self.matchmaking_timeout * 3
        now = time.monotonic()
        self._ready_stored = {k: e for k, e in self._ready_stored.items() if e > now}
        self._ready_stored[a.key] = now + ttl
        self._background(self.node.astore(a.key, {"t": time.time(), **self._my_reach_fields()}, ttl=ttl,
                                          subkey=a.me), "ready record")

    def _entry_view(self, key: str, sync_step: int) -> Optional[Dict[str, Dict[str, Any]]]:
        """The live peers as we enter the round under ``key`` from the background reader's view, when
        there is a fresh one (:attr:`fresh_view`) and it makes another peer the presumable leader (item
        9); else None: the peer the view presumes (us), or a peer without a fresh view, reads over the
        network, as each peer of the round once did, every read carrying every live peer's record."""
        me = self.node.peer_id_str
        view = self.fresh_view() if self.fresh_view is not None else None
        if view is None:
            return None
        live = {pid: v for pid, v in view.items() if not self.node.gate.banned(pid)}
        if self._presumable(live, key, sync_step, self._skipping()) == me:
            return None
        self._live_count = len(set(live) | {me})
        if self.give_way is not None and (why := self.give_way(live)):
            raise RoundMissed(why)
        return live

    def _presumable(self, peers: Dict[str, Dict[str, Any]], key: str, sync_step: int, skip: Set[str]) -> str:
        """The presumable leader of the round under ``key``: the best rank among us and the live ``peers``
        due at ``sync_step``, ``skip`` left out; us when that peer is private (nobody can dial it)."""
        me = self.node.peer_id_str
        due = self._unbanned(expected_peers(peers, me, sync_step)) - skip
        best = min(due | {me}, key=self._ranking(key))
        return me if self._private(best) else best

    def _ask_presumed(self, a: "_Attempt", delay: float = 0.0) -> None:
        """Ask the presumable leader to admit us (item 9): the best rank among us and the live peers due
        now (the last read), not counting peers that fell silent on our request this round. Nothing is
        decided by this early request: when the poll picks another leader, we hang up and the presumable
        one does not admit us. ``delay``: seconds before the request goes out."""
        exclude = a.dropped | a.unreached | self._not_waited(a)
        a.presumed = self._presumable(a.peers, a.key, a.sync_step, exclude)
        head = self._head_of(a, exclude)
        if a.presumed != a.me:
            leader = a.presumed
            if head is not None and head != leader:
                self._send_early(a, head, delay, via_head=True)  # it carries our request to the leader (item 13)
            else:
                self._send_early(a, leader, delay)

    def _head_of(self, a: "_Attempt", exclude: Set[str]) -> Optional[str]:
        """Our bucket's head (:func:`.formation.gather_head`, item 13), or None (ask the leader ourselves);
        turns the round's carrying on when gathering applies (``swarm.group_cap``, 2 caps of peers due)."""
        due = self._unbanned(expected_peers(a.peers, a.me, a.sync_step)) - self._not_waited(a)
        cap = self.group_cap if self.gathering else 0
        buckets, heads = a.slot.heads = formation.gather_heads(due | {a.me}, a.key, cap, self._ranking(a.key),
                                                               self._tier, exclude)
        a.slot.carry = buckets > 1
        if not a.slot.carry or a.slot.riders:  # a peer carrying requests asks the leader itself
            return None
        head = heads.get(formation.gather_bucket(a.key, a.me, buckets))
        return None if head == a.me else head

    def _send_early(self, a: "_Attempt", leader: str, delay: float = 0.0, via_head: bool = False) -> None:
        """Our early request to ``leader`` (item 9), ``delay`` seconds from now, watched afresh; ``via_head``:
        ``leader`` is our bucket's head, which carries it (item 13)."""
        a.presumed, a.watch, a.dial_waited = leader, JoinWatch(), False
        a.slot.via = leader if via_head else None
        a.early = asyncio.ensure_future(self._join_after(delay, leader, a.frag, a.round, a.expected, a.watch))

    async def _join_after(self, delay: float, leader: str, frag: int, round_: int, due: Optional[int],
                          watch: JoinWatch) -> Tuple[Optional[Group], Optional[str]]:
        if delay > 0:
            await asyncio.sleep(delay)
        return await self._join(leader, frag, round_, due, watch=watch)

    def _evaluate(self, a: "_Attempt", read: Dict[str, Dict[str, Any]]) -> None:
        """A fresh read of the live peers: whom we wait for, how many, and until when (item 5). The next
        re-read is reevaluate_period away after a read that changed whom we wait for (or the first),
        twice the last pause (up to REEVAL_MAX_S) after one that did not."""
        before = (set(a.peers), a.waiting_for, a.expected)
        a.last_eval = time.monotonic()
        a.peers = read
        a.waiting_for = expected_peers(read, a.me, a.sync_step) - self._not_waited(a)
        a.expected = 1 + len(a.waiting_for | (a.ready - {a.me}))
        a.deadline = self._derived_deadline(read, a.waiting_for - a.ready, a.sync_step, a.first_seen, a.start,
                                            a.hard_deadline)
        changed = not a.reeval_gap or before != (set(a.peers), a.waiting_for, a.expected)
        a.reeval_gap = (self.reevaluate_period if changed
                        else min(max(REEVAL_MAX_S, self.reevaluate_period), 2 * a.reeval_gap))

    async def _poll(self, a: "_Attempt") -> Optional[Group]:
        """Poll the ready records and the group record (and, at the re-read pauses of :meth:`_evaluate`,
        the live peers) until as many peers are ready as expected or the deadline; join requests count as
        ready records; while the presumable leader holds our request, wait for its answer instead (item
        9). Returns the group when the presumable leader answered with one, else None."""
        slot = a.slot
        while True:
            at_deadline = False  # this read ends a deferral at our deadline: it re-reads the live peers too
            if a.early is not None and not a.early.done() and a.watch.taken.is_set():
                step = await self._defer(a)
                if step == "ready":
                    return None
                if step == "answered":
                    group = self._early_group(a)
                    if group is not None:
                        return group
                if step != "deadline":
                    continue
                at_deadline = True  # one read of the round (below), the live peers too, before we choose
            if a.early is not None and not a.early.done() and not a.dial_waited:
                a.dial_waited = True  # once: then we poll while the dial is tried
                taken = asyncio.ensure_future(a.watch.taken.wait())
                try:
                    await self._wait_for_news(min(EARLY_DIAL_S, max(0.0, a.deadline - time.monotonic())),
                                              slot, a.early, taken)
                finally:
                    taken.cancel()
                continue
            self._store_ready(a)  # we poll: the peers that poll too must see us ready
            # the three reads of one poll run side by side: each waits a round trip or more on a WAN
            reeval = a.sync_step is not None and (at_deadline or time.monotonic() - a.last_eval >= a.reeval_gap)
            reads = asyncio.ensure_future(asyncio.gather(
                self._ready_read(a.key), self._live_peers(check=True) if reeval else _nothing(),
                self.node.aget_subkeys(self._group_key(a.frag, a.round), why="formation")))
            try:
                while not reads.done() and not (a.early is not None and a.early.done()):
                    a.ready |= self._unbanned(slot.arrivals)
                    if len(a.ready) >= a.expected:
                        break  # the peers we wait for asked us to lead: no need for the DHT to say so
                    await self._wait_for_news(None, slot, reads, a.early)
            except BaseException:  # cancelled (the peer stops): nobody awaits the reads any more
                reads.cancel()
                reads.add_done_callback(consume_outcome)
                raise
            if not reads.done():
                reads.cancel()
                reads.add_done_callback(consume_outcome)
            if a.early is not None and a.early.done():
                group = self._early_group(a)
                if group is not None:
                    return group
                continue  # refused (it follows another peer, or is not the leader): poll on
            if not reads.done():
                return None  # enough peers asked us to lead
            got_ready, got_live, got_groups = reads.result()
            before = (len(a.ready), a.expected)
            a.ready |= got_ready | self._unbanned(slot.arrivals)
            if reeval:
                self._evaluate(a, got_live)
            self._raise_if_missed(got_groups, a.frag, a.round, a.expected)
            now = time.monotonic()
            if len(a.ready) >= a.expected or now >= a.deadline:
                return None
            # back off while the reads bring nothing new: join requests and the early answer wake us at
            # once anyway, and each read asks several nodes for every signed record of the round
            a.quiet_polls = 0 if (len(a.ready), a.expected) != before else a.quiet_polls + 1
            await self._wait_for_news(min(POLL_MAX_S, POLL_MIN_S * 2 ** min(a.quiet_polls, 8),
                                          max(0.02, a.deadline - now)), slot, a.early)

    async def _defer(self, a: "_Attempt") -> str:
        """Wait while the presumable leader holds our request (item 9): "ready" (as many peers ready as
        expected: the poll is over), "answered" (the request is done), "news" (look again) or
        "deadline" (our deadline came with the request still held).

        The leader polls the round for all of us and answers when its group closes (or refuses, and we
        poll on). Reading the round ourselves meanwhile would only end in waiting for that answer too,
        at the cost of every ready and progress record per read: the control traffic that grows with
        the swarm. Only a request the leader took counts: while the dial is still tried (a leader that
        left or crashed since our read fails only after JOIN_DIAL_WAIT) we poll, and see whoever leads
        instead. A leader that goes away after taking it breaks the stream, which answers at once; one
        silent for SILENT_S ends the request (joining.py), and is not asked again (_choose_leader).
        Meanwhile we follow it: a peer that asks us to admit it is sent there ("not leader", hint), not
        held until that leader's group has closed. At our deadline the caller reads the round once: a
        fresher progress record can move the deadline (the leader reads it too), and the read says
        whether every peer due is ready: then an honest leader closes within its join grace, and one
        that does not is given up on (_ask). That read needs the ready records of the peers deferring
        with us, so a deferral that lasts half the join grace stores ours (an honest leader that holds
        every request closes sooner; one that stalls is seen to by the time our wait ends)."""
        slot = a.slot
        if not slot.decided.is_set():
            slot.leader = a.presumed
            slot.decided.set()
        now = time.monotonic()
        a.ready |= self._unbanned(slot.arrivals)
        if len(a.ready) >= a.expected:
            return "ready"
        if now >= a.deadline:
            return "deadline"
        store_at = a.start + self.join_grace / 2
        if not a.ready_stored and now >= store_at:
            self._store_ready(a)
        wait = a.deadline - now if a.ready_stored else min(a.deadline, store_at) - now
        await self._wait_for_news(wait, slot, a.early)
        return "answered" if a.early.done() else "news"

    def _early_group(self, a: "_Attempt") -> Optional[Group]:
        """The presumable leader's answer to our early request: its group (ours now), or None when it
        refused (it follows another peer, or is not the leader). A RoundMissed (closed without us) ends
        matchmaking here."""
        group, hint = a.early.result()
        a.early = None
        if group is None and not a.slot.leading:
            a.slot.leader = None  # we no longer follow it (the deferral in _poll did)
            a.slot.decided.clear()
        if group is None:
            a.last_eval = -float("inf")  # our presumption was wrong: the next poll re-reads the live peers
        if a.watch.unanswered or a.watch.unreached:  # it fell silent, went away or was never reached:
            self._note_unanswered(a, a.presumed, a.watch)  # ask the next one
            self._ask_presumed(a)
        elif group is None and hint in a.holding_out and time.monotonic() < a.deadline:
            # it still follows a peer we dropped: it drops that one too, within its own SILENT_S, and then
            # leads or follows the next; ask it again shortly rather than poll the round meanwhile
            self._ask_presumed(a, delay=HINT_RETRY_S)
        elif group is None and self._may_follow_hint(a, hint):
            # it follows that peer: so do we, at once (the peers that defer to it store no ready record, so
            # a poll would not show them ready, and we would wait for them until our deadline)
            a.hints += 1
            self._send_early(a, hint)
        if group is None:
            return None
        a.slot.leader, a.slot.final = a.presumed, group
        a.slot.decided.set()
        return self._remember(group, a.t_enter)

    def _may_follow_hint(self, a: "_Attempt", hint: Any) -> bool:
        """Is ``hint``, the peer our refusing presumable leader follows, worth an early request of its own:
        another peer, not dropped or found unreachable this round, dialable, within HINTS_FOLLOWED, before
        our deadline."""
        return (isinstance(hint, str) and hint not in a.dropped | a.unreached | {a.me, a.presumed}
                and not self.node.gate.banned(hint) and not self._private(hint) and a.hints < HINTS_FOLLOWED
                and time.monotonic() < a.deadline)

    async def _last_look(self, a: "_Attempt") -> None:
        """The partners of our last group whose record we cannot see at all count as unseen: crashed, or
        hidden by the DHT (a frozen node can hold every read and store for longer than a record lives,
        and two peers that each see an empty swarm must not each close a group of one). About to sync alone while others are live: give the DHT a moment, then make sure they are
        not past this round already (their group record or progress may not have reached us yet)."""
        if a.sync_step is None:
            return
        a.absent = self._unbanned(self._companions) - set(a.peers) - a.ready - {a.me}
        if a.ready == {a.me} and (len(a.peers) > 1 or a.absent):
            await asyncio.sleep(min(1.0, self.join_grace))
            a.ready |= await self._ready_read(a.key)
            self._check_not_behind(await self._live_peers(), a.frag, a.round, a.sync_step)
            await self._check_not_missed(a.frag, a.round, a.expected)

    async def _choose_leader(self, a: "_Attempt") -> Group:
        """Ask the candidates in rank order (live peers due now that we did not see ready and whose rank
        is better than ours may be leading already: DHT views differ), or lead when our turn comes."""
        me, slot, frag, round_ = a.me, a.slot, a.frag, a.round
        self._store_ready(a)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[{self.node.short_id}] frag {frag} round {round_}: poll done after "
                         f"{time.monotonic() - a.start:.2f}s (first reads {a.start - a.t_enter:.2f}s); ready "
                         f"{short_ids(a.ready)}, waiting for {short_ids(a.waiting_for)}, live {short_ids(a.peers)}, "
                         f"absent partners {short_ids(a.absent)}, expected {a.expected}")
        unseen = (a.waiting_for | a.absent) - a.ready
        # a peer that took our request and left it unanswered is not asked again this round
        candidates = [c for c in formation.candidates(a.ready, unseen, me, self._ranking(a.key), self._tier)
                      if c not in a.dropped]
        tried: Set[str] = set(a.dropped)
        retry_until: Dict[str, float] = {}  # dropped peer -> until when a candidate that follows it is asked again
        bounced: Dict[str, int] = {}  # candidate -> how often it answered "not leader" (with a hint)
        try:
            while candidates:
                leader = candidates[0]
                if leader == me:
                    a.hang_up()  # the presumable leader must not admit us while we lead
                    led = await self._lead_turn(a, candidates, unseen, tried)
                    if isinstance(led, Group):
                        return led
                    a.ready.add(led)  # stepped down for a better-ranked ready peer: join it
                    candidates = sorted(set(candidates) | {led}, key=self._ranking(a.key))
                    tried.discard(led)
                    continue
                tried.add(leader)
                group, hint = await self._ask(a, leader)
                if group is not None:
                    slot.final = group
                    return self._remember(group, a.t_enter)
                slot.leader = None
                slot.decided.clear()
                if not hint:
                    candidates.remove(leader)
                    continue
                until = retry_until.setdefault(hint, self._retry_until(a, hint)) if hint in a.holding_out else 0.0
                if time.monotonic() < until:
                    # It still waits on a leader we dropped. Its wait is bounded as ours was, and then it
                    # leads or asks the next candidate, as we do: ask it again shortly, however often it
                    # takes (not a bounce). Peers drop a silent leader at different moments, and those that
                    # drop it first must not lead groups of their own meanwhile: that splits the round.
                    await asyncio.sleep(HINT_RETRY_S)
                    continue
                if bounced.get(leader, 0) >= 3:
                    candidates.remove(leader)
                    continue
                # It follows another peer for now. It stays a candidate: when that peer does not answer
                # (crashed), it leads itself, and we must be there, not leading a split group of our own.
                bounced[leader] = bounced.get(leader, 0) + 1
                if hint not in tried and hint not in a.ready and hint not in unseen and hint != me:
                    # A hinted leader we have not seen ready (it arrived after our poll ended): re-read
                    # the ready records before choosing whom to ask, so that we ask the leader the
                    # others follow before it closes its group without us.
                    a.ready |= await self._ready_read(a.key)
                if hint not in tried and (hint in a.ready or hint in unseen) and len(tried) < 8:
                    candidates.remove(hint) if hint in candidates else None
                    candidates.insert(0, hint)  # ask its leader first
                else:  # it still follows a peer we could not reach: it will find out too; ask again shortly
                    await asyncio.sleep(0.5 * bounced[leader])
        finally:
            a.hang_up()
        raise MatchmakingFailed(f"no group could be formed for fragment {frag}, round {round_}")  # pragma: no cover

    async def _lead_turn(self, a: "_Attempt", candidates: Sequence[str], unseen: Set[str],
                         tried: Set[str]) -> Union[Group, str]:
        """Our turn to lead: refused when we are private and the others are too; else lead (the group,
        or the better-ranked ready peer we stepped down for). In place of better-ranked peers that left
        our request unanswered, the ready peers we saw are waited for longer (:meth:`_fallback_grace`)."""
        me, frag, round_ = a.me, a.frag, a.round
        if self._private(me) and len(a.ready | set(candidates)) > 1:
            others = sorted(short_id(p) for p in (a.ready | set(candidates)) - {me})
            a.slot.closed = True
            raise MatchmakingFailed(
                f"no public peer is ready for fragment {frag} round {round_}: this peer is private (behind NAT, "
                f"nobody can dial it, and no relay took it) and so are the other ready peers "
                f"({', '.join(others)}); a group needs a peer others can reach to lead it and reduce its shards. "
                "Use a bootstrap that relays (the default) or run at least one peer with an open port "
                "(see bootstrap/README.md)")
        grace = self._fallback_grace(a)
        led = await self._lead(a.slot, frag, round_, (set(candidates) & a.ready) - {me},
                               set() if self._private(me) else unseen, a.expected, skip=tried, grace=grace)
        return self._remember(led, a.t_enter) if isinstance(led, Group) else led

    def _fallback_grace(self, a: "_Attempt") -> Optional[float]:
        """How long we admit joiners when we lead in place of better-ranked peers that left our request
        unanswered (None: the join grace). The others drop such a peer too, each after its own wait:
        closing after the join grace would leave them out, and they would form a second group. A silent
        one is dropped SILENT_S after the request reached it (they were ready before we led: within one
        early dial and SILENT_S, and then they ask us at once); a stalled one only after each peer's own
        deadline and patience (never past its hard deadline: within matchmaking_timeout + patience), or
        when our request's whole timeout passed (:meth:`_note_unanswered`), within as long."""
        rank = self._ranking(a.key)
        better = {p for p in a.holding_out if rank(p) < rank(a.me)}
        if better & a.stalled:
            return self.matchmaking_timeout + self._patience
        if better:
            return self.join_grace + EARLY_DIAL_S + SILENT_S
        return None

    def _retry_until(self, a: "_Attempt", dropped: str) -> float:
        """Until when a candidate that still follows ``dropped`` is asked again (from now). The candidate
        was ready before now, so it entered the round before now: it drops a silent peer within one
        early dial and SILENT_S and then leads within its join grace; a stalled one by its own hard
        deadline (within matchmaking_timeout from now) and patience."""
        if dropped in a.stalled:
            return time.monotonic() + self.matchmaking_timeout + self._patience
        return time.monotonic() + EARLY_DIAL_S + SILENT_S + self.join_grace

    def _note_unanswered(self, a: "_Attempt", peer: str, watch: JoinWatch) -> None:
        """``peer`` took our request and will not answer it (``watch``): dropped for the round. One that held
        it for the request's whole timeout, saying 'wait', is dropped as stalled (an honest leader closes
        sooner), unless it may be waiting for a peer due by its records that we skip as overdue (item 12:
        its strikes are its own, and an honest leader waits for such a peer to its own deadline): then it
        stays a candidate."""
        if watch.silent:
            a.silent.add(peer)
        elif watch.expired:
            skipped = self._skipped_due(a)
            if not skipped:
                a.stalled.add(peer)
            logger.info(f"[{self.node.short_id}] {short_id(peer)} held our join request for fragment {a.frag} round "
                        f"{a.round} for its whole timeout and answered nothing: "
                        + (f"it may wait for {short_ids(skipped)}, whom we skip as overdue" if skipped
                           else "dropped as stalled"))
        elif watch.broken:
            a.gone.add(peer)
        elif watch.unreached:
            a.unreached.add(peer)

    async def _ask(self, a: "_Attempt", leader: str) -> Tuple[Optional[Group], Optional[str]]:
        """Ask ``leader`` to admit us: (its group, None) or (None, its hint). An unseen candidate gets a
        bounded wait (twice the join grace); the presumable leader's early answer is used when pending."""
        slot = a.slot
        slot.leader = leader
        slot.decided.set()
        # An unseen candidate gets twice the join grace. The presumable leader, once every peer due is
        # ready, gets _patience to propose (a proposal ends it: the link check has its own timeouts): an
        # honest one closes within its join grace of the last request. Not after we dropped a better-ranked
        # peer: the one we ask then may lead in its place, admitting for longer (_fallback_grace). Any
        # other ready candidate gets as long as the request allows: it may wait for peers we gave up on
        # (its view of their progress is its own)
        # A head carrying our request (item 13) takes it to whichever leader it follows by its own rules: we
        # wait for its answer as long as the request allows (its silence or broken stream ends it sooner),
        # whoever we would ask, so that a bucket follows its head and not each rider's own timing
        via_head = a.early is not None and a.slot.via is not None and a.slot.via == a.presumed
        early = a.early is not None and (leader == a.presumed or via_head)
        if via_head:
            bound: Optional[float] = None
        elif leader not in a.ready:
            bound = 2 * self.join_grace
        else:
            bound = self._patience if early and len(a.ready) >= a.expected and not a.dropped else None
            if bound is not None and self._skipped_due(a):
                bound = None  # it may still wait for a peer we skip as overdue: its strikes are its own
        try:
            group, hint, direct = None, None, not early
            if early:  # we asked it already (or our head carries that request to it): wait for that answer
                holder = a.presumed
                answer = await self._answer(a.early, bound, a.watch.proposed)
                if answer is None:
                    a.stalled.add(holder)
                    logger.info(f"[{self.node.short_id}] {short_id(holder)} holds our request for fragment "
                                f"{a.frag} round {a.round} and proposed no group {bound:.1f}s after our wait ended; "
                                "trying the next candidate")
                group, hint = answer or (None, None)
                self._note_unanswered(a, holder, a.watch)
                direct = holder != leader and group is None and hint is None  # our head failed us: ask it ourselves
                if via_head and a.watch.expired and holder in a.stalled:
                    # held for a whole request timeout: the head stalls, or the leader it waits on does (an
                    # honest head drops that one about now): both dropped, the next candidate asked
                    a.stalled.add(leader)
                    direct = False
            if direct:
                a.hang_up()  # it must not admit us while we join another leader
                slot.via = None
                watch = JoinWatch()
                group, hint = await self._join(leader, a.frag, a.round, a.expected, timeout=bound, watch=watch)
                if watch.unanswered or watch.expired:  # (unreachable: the next candidate, as before)
                    self._note_unanswered(a, leader, watch)
            a.early = None
        except MatchmakingFailed:
            slot.closed = True
            raise
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[{self.node.short_id}] frag {a.frag} round {a.round}: asked {short_id(leader)}: "
                         f"{'group ' + short_ids(group.members) if group is not None else 'hint ' + short_id(hint)}")
        return group, hint

    @staticmethod
    async def _wait_for_news(timeout: Optional[float], slot: RoundSlot, *futures: Optional[asyncio.Future]) -> None:
        """Wait until a peer asks us to admit it, one of ``futures`` is done, or ``timeout`` passes."""
        slot.arrived.clear()
        arrived = asyncio.ensure_future(slot.arrived.wait())
        try:
            await asyncio.wait({arrived, *(f for f in futures if f is not None)}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()

    @property
    def _gather_grace(self) -> float:
        """How long a leader admits the joiners it saw ready when gathering is on (item 13): the join grace,
        plus the time a silent head can hold a request before its rider asks the bucket's next head."""
        return self.join_grace + EARLY_DIAL_S + SILENT_S

    @property
    def _patience(self) -> float:
        """How long a leader may take to propose a group once our own wait is over and it should close
        (module docstring, item 11): twice the join grace, the longest an honest leader admits joiners."""
        return 2 * self.join_grace

    @staticmethod
    async def _answer(early: asyncio.Future, timeout: Optional[float],
                      proposed: asyncio.Event) -> Optional[Tuple[Optional[Group], Optional[str]]]:
        """The answer to a join request already on its way, waited for at most ``timeout`` seconds more
        unless the leader proposed a group with us meanwhile (``timeout`` None: as long as the request
        allows). None: no answer in time (we hung up)."""
        if timeout is None:
            return await early
        await asyncio.wait({early}, timeout=timeout)
        if early.done() or proposed.is_set():  # closing with us in it: the link check's timeouts bound it
            return await early
        early.cancel()  # we hang up: the leader does not admit us any more
        return None

    def _remember(self, group: Group, t_enter: float) -> Group:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[{self.node.short_id}] frag {group.frag} round {group.round}: group of {group.size} "
                         f"formed in {time.monotonic() - t_enter:.2f}s")
        self._lineage.formed(group.gid)
        self.groups[(group.frag, group.round)] = group
        while len(self.groups) > 64:
            del self.groups[next(iter(self.groups))]
        return group

    # ---- reading the swarm: live peers, behind, missed ------------------------------------------------

    async def _live_peers(self, check: bool = False) -> Dict[str, Dict[str, Any]]:
        """The live peers' progress records; with ``check``, raise RoundMissed when the caller's
        :attr:`give_way` hook says a rival history outnumbers ours (we are to adopt its state).
        Over the network: right after a partition heals, our own storage can still lack the records
        of peers whose stores skipped us while we were cut off (their routing tables dropped us), and
        a view without them would stop us waiting for them."""
        live = self.live_of(await self.node.aget_subkeys(progress_key(self.run_id), why="formation"))
        self.last_read = (time.monotonic(), live)
        self._live_count = len(set(live) | {self.node.peer_id_str})
        if check and self.give_way is not None and (why := self.give_way(live)):
            raise RoundMissed(why)
        return live

    def _check_not_behind(self, peers: Dict[str, Dict[str, Any]], frag: int, round_: int, sync_step: int) -> None:
        """Raise RoundMissed when the swarm verifiably synced at or beyond ``sync_step`` already."""
        target = pick_target(peers, self.node.peer_id_str, min_step=sync_step - 1, companions=self.companions,
                             trusted=self.voters(peers))
        if target is not None:
            raise RoundMissed(f"behind: the swarm already synced step {target[0]} (claimed by {len(target[2])} "
                              f"peer(s)); not contributing to fragment {frag} round {round_} of step {sync_step}")

    def _derived_deadline(self, peers: Dict[str, Dict[str, Any]], missing: Set[str], sync_step: int,
                          first_seen: Dict[Tuple[str, Any], float], start: float, hard_deadline: float) -> float:
        """When to stop waiting for the ``missing`` peers (:func:`.formation.derived_deadline`; without
        :attr:`adaptive`, the hard deadline)."""
        if not self.adaptive:
            return hard_deadline
        return formation.derived_deadline(peers, missing, sync_step, first_seen, start, hard_deadline,
                                          self.eta_slack, self.eta_margin)

    def _partners(self) -> Set[str]:
        """The peers of our latest group of each fragment: our current history (lineage)."""
        return formation.latest_partners(self.groups.values(), self.node.peer_id_str)

    def _authoritative(self, members: Sequence[str], due: Optional[int], base: Any = None) -> bool:
        """Does a group that formed without us mean we missed the round (:func:`.formation.authoritative`)?"""
        lineage = self.lineage() if isinstance(base, str) and base else set()
        return formation.authoritative(members, due, base, lineage, self._partners(), self._live_count)

    async def _check_not_missed(self, frag: int, round_: int, due: Optional[int] = None) -> None:
        """Raise RoundMissed when a group for this round already closed without us and counts as our
        round (:meth:`_authoritative`)."""
        records = await self.node.aget_subkeys(self._group_key(frag, round_), why="formation")
        self._raise_if_missed(records, frag, round_, due)

    def _raise_if_missed(self, records: Dict[str, Dict[str, Any]], frag: int, round_: int,
                         due: Optional[int] = None) -> None:
        """:meth:`_check_not_missed` on group records already read."""
        me = self.node.peer_id_str
        for leader, value in records.items():
            members = value.get("members")
            if (isinstance(members, list) and me not in members
                    and self._authoritative(members, due, value.get("base"))):
                raise RoundMissed(f"missed the group for fragment {frag}, round {round_}: "
                                        f"{len(members)} peer(s) synced it without us")
