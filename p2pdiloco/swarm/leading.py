"""The leader's side of group formation (:mod:`.matchmaking` has the protocol, items 2, 7 and 10):
admit joiners for the join grace, step down when a better-ranked ready peer shows up, propose the
group and warm its links, leave out members nobody can reach, close the group and announce it.
The per-round state both sides of the join protocol share is :class:`RoundSlot`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

from ..errors import MatchmakingFailed, RoundMissed
from ..ids import short_id, short_ids
from . import formation
from .group import Group, make_group_id
from .keys import group_key

__all__ = ["Leading"]

logger = logging.getLogger(__name__)


@dataclass
class RoundSlot:
    """This peer's matchmaking state for one (fragment, round)."""

    decided: asyncio.Event = field(default_factory=asyncio.Event)
    leader: Optional[str] = None           # whom we follow (None while undecided or when leading)
    leading: bool = False
    joiners: Dict[str, asyncio.Future] = field(default_factory=dict)
    joined_event: asyncio.Event = field(default_factory=asyncio.Event)
    final: Optional[Group] = None
    base: str = ""                         # the base of the group we led (matchmaking item 6)
    closed: bool = False
    arrivals: Set[str] = field(default_factory=set)  # peers that asked us to admit them: ready, they say
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    history: int = 0                       # the Matchmaker's history count when this slot was opened
    #: gathering (matchmaking item 13) is on for this round: we carry the join requests of peers
    #: that ask us while we follow a leader directly, instead of refusing them with a hint
    carry: bool = False
    via: Optional[str] = None              # the head our own request went to (None: to a leader directly)
    riders: Dict[str, "Rider"] = field(default_factory=dict)  # requests we carry, by joiner
    riders_changed: asyncio.Event = field(default_factory=asyncio.Event)
    heads: Tuple[int, Dict[int, str]] = (1, {})  # the round's gathering buckets and their heads, by our view


#: a carried request's outcome when we lead after all: it joins our group like any joiner
AS_JOINER = "joiner"


@dataclass
class Rider:
    """A join request we carry to the leader (matchmaking item 13): what the joiner said of its
    reachability, and what the leader answers for it."""

    entry: Dict[str, str]                  # {id, reach[, via]}: what our join frames say of it
    warm: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    report: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    #: the leader's last word for it (a reply frame), AS_JOINER, or None: break its stream unanswered
    final: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def settle(self, outcome: Any) -> None:
        """Give the joiner ``outcome`` unless it has one."""
        if not self.final.done():
            self.final.set_result(outcome)


@dataclass
class Proposal:
    """The group a leader is about to close, sent to its joiners to warm their links (matchmaking item 10)."""

    members: Tuple[str, ...]
    owners: Optional[Tuple[str, ...]]
    reports: Dict[str, asyncio.Future]   # joiner -> the owners it could not reach (None: no answer)
    final: asyncio.Future                # -> the final Group, or None (no group after all)
    left: Dict[str, str] = field(default_factory=dict)  # members left out -> why


class LeftOut(str):
    """A joiner's answer: it was left out of the group (the reason)."""


def consume_outcome(fut: asyncio.Future) -> None:
    """Done-callback of a future nobody awaits any more: retrieve its outcome (no 'never retrieved' log)."""
    if not fut.cancelled():
        fut.exception()


def _answer_joiners(slot: RoundSlot, answer: object) -> None:
    """Give every joiner still waiting for our answer ``answer``: a group, a proposal, the id of the
    peer we stepped down for (their hint), the RoundMissed that stopped us (the round went on without
    us), or None (too few peers for a group)."""
    for fut in slot.joiners.values():
        if not fut.done():
            fut.set_result(answer)


class Leading:
    """The leader's side of :class:`~p2pdiloco.swarm.matchmaking.Matchmaker` (a base class of it)."""

    async def _lead(self, slot: RoundSlot, frag: int, round_: int, expected_joiners: Set[str],
                    unseen: Set[str] = frozenset(), due: Optional[int] = None,
                    skip: Set[str] = frozenset(), grace: Optional[float] = None) -> Union[Group, str]:
        """Lead the round: admit joiners (:meth:`_admit`, for up to ``grace`` seconds, the join grace by
        default), then close the group (:meth:`_close`). Returns the group, or the id of a better-ranked
        ready peer we stepped down for (our joiners are sent there)."""
        slot.leading = True
        slot.decided.set()
        for rider in slot.riders.values():  # the requests we carried join us (matchmaking item 13)
            rider.settle(AS_JOINER)
        slot.riders.clear()
        better = await self._admit(slot, frag, round_, expected_joiners, unseen, skip,
                                   self.join_grace if grace is None else grace)
        if better is not None:
            slot.leading, slot.leader = False, better
            _answer_joiners(slot, better)  # -> "not leader", hint: the real leader
            slot.joiners.clear()
            logger.info(f"[{self.node.short_id}] {short_id(better)} is ready too and ranks before us: it leads "
                        f"fragment {frag} round {round_}")
            return better
        return await self._close(slot, frag, round_, expected_joiners, unseen, due)

    async def _admit(self, slot: RoundSlot, frag: int, round_: int, expected_joiners: Set[str], unseen: Set[str],
                     skip: Set[str], grace: float) -> Optional[str]:
        """Admit joiners for up to ``grace`` seconds: everyone we saw ready, plus the live peers due
        at this sync whose ready record we did not see (DHT views differ: a record we missed must not
        split the round into two groups). Ready records are re-read during the first ``join_grace``
        seconds (``expected_joiners`` grows with them); a ready peer of better rank than ours not in
        ``skip`` means we are not the leader after all: its id is returned before anything is closed.
        None: close now."""
        me = self.node.peer_id_str
        grace_end = time.monotonic() + grace
        reads_end = time.monotonic() + self.join_grace
        # with gathering (item 13) a peer we saw ready can be held by a silent head for SILENT_S before it asks
        # its bucket's next head: one whose head did not join us is waited for that much longer
        ready_end = time.monotonic() + max(grace, self._gather_grace if slot.carry else 0.0)
        key = self._key(frag, round_)
        buckets, heads = slot.heads

        def waiting() -> bool:
            joined, now = set(slot.joiners), time.monotonic()
            late = expected_joiners - joined
            held = {p for p in late if buckets > 1 and heads.get(formation.gather_bucket(key, p, buckets), p)
                    not in joined | {p, me}}
            return bool((held and now < ready_end) or ((late or not unseen <= joined) and now < grace_end))

        while waiting():
            slot.joined_event.clear()
            try:
                await asyncio.wait_for(slot.joined_event.wait(),
                                       timeout=max(0.01, min(0.3, ready_end - time.monotonic())))
            except asyncio.TimeoutError:
                pass
            if (expected_joiners | unseen) <= set(slot.joiners):
                break  # everyone we wait for is here: close now, the check below is for peers we did not see
            if time.monotonic() >= reads_end:
                continue  # a longer grace only waits for the peers we know of (see Matchmaker._lead_turn)
            seen = await self._ready_read(key) - {me}
            rank = self._ranking(key)
            better = sorted((p for p in seen - expected_joiners
                             if rank(p) < rank(me) and p not in slot.joiners and p not in skip), key=rank)
            # a longer grace (a fallback after a silent leader) waits only for peers that may still come
            expected_joiners |= seen - skip if grace > self.join_grace else seen
            if better:
                return better[0]
        if logger.isEnabledFor(logging.DEBUG):
            joined = set(slot.joiners)
            logger.debug(f"[{self.node.short_id}] frag {frag} round {round_}: admitted; late "
                         f"{short_ids(expected_joiners - joined)}, unseen {short_ids(unseen - joined)}, heads "
                         f"{short_ids(heads.values())}")
        return None

    async def _close(self, slot: RoundSlot, frag: int, round_: int, expected_joiners: Set[str], unseen: Set[str],
                     due: Optional[int]) -> Group:
        """Close the group: refuse latecomers, check that the round did not go on without us, warm the
        links (members nobody can reach are left out), answer every joiner and announce the group."""
        me = self.node.peer_id_str
        slot.closed = True
        try:
            await self._check_not_missed(frag, round_, due)
        except RoundMissed as missed:
            _answer_joiners(slot, missed)
            raise
        members = tuple(sorted({me, *slot.joiners}))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[{self.node.short_id}] frag {frag} round {round_}: leading, closing with "
                         f"{short_ids(members)}; expected {short_ids(expected_joiners)}, unseen {short_ids(unseen)}")
        if len(members) < self.min_group_size:
            _answer_joiners(slot, None)
            raise MatchmakingFailed(f"only {len(members)} peer(s) ready, swarm.min_group_size is {self.min_group_size}")
        base = self.base
        proposal = None
        if len(members) > 1:
            members, proposal = await self._warm_group(slot, frag, round_, members)
        if len(members) < self.min_group_size:
            if proposal is not None:
                proposal.final.set_result(None)
            raise MatchmakingFailed(f"only {len(members)} peer(s) left after the link check, swarm.min_group_size "
                                    f"is {self.min_group_size}")
        owners = self._owners(members)
        gid = make_group_id(self.run_id, frag, round_, members, base, owners)
        group = Group(gid=gid, members=members, my_index=members.index(me), frag=frag, round=round_, owners=owners)
        slot.final, slot.base = group, base
        if proposal is not None:
            proposal.final.set_result(group)  # the members first: the all-reduce can start
        # One group per (fragment, round): announce it so a late peer knows it missed the round (until
        # the record is out, a late peer asking us to admit it gets the "closed" refusal instead)
        self._background(self.node.astore(group_key(self.run_id, frag, round_), {"members": list(members), "base": base},
                                          ttl=self.matchmaking_timeout * 10, subkey=me), "group record")
        missing = expected_joiners - set(slot.joiners)
        if missing:
            logger.info(f"[{self.node.short_id}] group for fragment {frag} round {round_} formed without "
                        f"{len(missing)} ready peer(s) that did not join in time")
        return group

    def _owners(self, members: Tuple[str, ...]) -> Optional[Tuple[str, ...]]:
        """The shard owners of ``members`` (:func:`.formation.shard_owners`)."""
        return formation.shard_owners(members, self._tier)

    async def _warm_group(self, slot: RoundSlot, frag: int, round_: int,
                          members: Tuple[str, ...]) -> Tuple[Tuple[str, ...], Proposal]:
        """Leader: propose ``members`` to the joiners, warm our own links meanwhile, collect their
        reports; returns the members that stay (and the proposal, whose ``final`` the caller sets)."""
        loop = asyncio.get_running_loop()
        me = self.node.peer_id_str
        owners = self._owners(members)
        joiners = {j: f for j, f in slot.joiners.items() if j in members}
        proposal = Proposal(members, owners, {j: loop.create_future() for j in joiners}, loop.create_future())
        for fut in joiners.values():
            if not fut.done():
                fut.set_result(proposal)
        own = asyncio.ensure_future(self._warm_links(members, owners))
        await asyncio.wait([own, *proposal.reports.values()], timeout=self.warm_timeout + 2)
        reports = {j: (f.result() if f.done() else None) for j, f in proposal.reports.items()}
        if not own.done():
            own.cancel()
            own.add_done_callback(consume_outcome)
        reports[me] = own.result() if own.done() and not own.cancelled() else set()
        proposal.left = self._left_out(members, reports, self._key(frag, round_))
        if proposal.left:
            logger.warning(f"[{self.node.short_id}] leaving {len(proposal.left)} member(s) out of the group for "
                           f"fragment {frag} round {round_} before the round: "
                           + "; ".join(f"{short_id(p)}: {why}" for p, why in sorted(proposal.left.items())))
        return tuple(m for m in members if m not in proposal.left), proposal

    def _left_out(self, members: Sequence[str], reports: Dict[str, Optional[Set[str]]],
                  round_key: str) -> Dict[str, str]:
        """Who leaves the group of the round under ``round_key`` before it starts
        (:func:`.formation.left_out`; never us, the leader)."""
        return formation.left_out(members, reports, self.node.peer_id_str, self._ranking(round_key))
