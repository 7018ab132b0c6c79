"""The join protocol, both ends (:mod:`.matchmaking` has the rules): a member's request to a leader
(:meth:`JoinRequests._join`: ask, answer the link check, read the group or the refusal), and the
``join`` handler that serves such requests (it counts a request as the sender's ready record and
answers once this peer's slot for the round decided: the group, or a refusal naming whom we follow).

Messages (msgpack headers, :mod:`.protocol`): ``join`` {frag, round, reach[, via]} → ``wait`` {} ←
every ``WAIT_S`` while the request is held → zero or one ``warm`` {members[, owners]} ← answered by
``warmed`` {unreachable} → then ``group`` {gid, members, base[, owners]} (after a ``warm``, when the
group is the one proposed: {gid, base, as: proposed}) or ``refuse`` {reason[, hint | size, base | why]} ←.

A peer that takes a request and then says nothing for ``SILENT_S`` is gone or hostile: an identity with
the best rank that takes every request and answers none would otherwise hold every honest peer of the
round until its own timeout, and they would give up on it at different moments and split the round.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

from ..errors import MatchmakingFailed, RoundMissed, WireError
from ..ids import short_id
from .dialing import dial_reason, ensure_connected, open_stream
from .group import Group, capped_plan, make_group_id
from .leading import LeftOut, Proposal, RoundSlot
from .signing import plain_text
from .protocol import (PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header,
                       refuse_bad_request, write_frame)

__all__ = ["JoinRequests", "JoinWatch", "JOIN_DIAL_WAIT", "WAIT_S", "SILENT_S"]

logger = logging.getLogger(__name__)

#: how long a join request waits out a failed first dial to a leader that is live by its records
#: (seconds): a cold address or libp2p's dial backoff (dialing.py) must not split a round in two
JOIN_DIAL_WAIT = 3.0
#: how often a peer holding a join request says so (seconds): its ``wait`` frames
WAIT_S = 2.0
#: how long a joiner waits for the next frame from a peer that took its request (seconds): three missed
#: ``wait`` frames; then the request ends unanswered and the holder counts as silent
SILENT_S = 3 * WAIT_S


@dataclass
class JoinWatch:
    """What a joiner learns of its request while it is out (:meth:`JoinRequests._join`)."""

    taken: asyncio.Event = field(default_factory=asyncio.Event)     # on a stream the leader's handler opened
    proposed: asyncio.Event = field(default_factory=asyncio.Event)  # the leader proposed a group with us
    silent: bool = False  # the holder said nothing for SILENT_S: the request ended unanswered
    broken: bool = False  # the holder's stream broke before it answered (it left, crashed, or hung up on us)
    unreached: bool = False  # the dial failed for JOIN_DIAL_WAIT: the request never reached it
    #: the holder kept the request for its whole timeout and answered nothing (when not silent: it said 'wait',
    #: as a stalling identity does, or an honest leader that entered the round after us and still waits)
    expired: bool = False

    @property
    def unanswered(self) -> bool:
        """The leader took the request and will not answer it: not asked again this round."""
        return self.silent or self.broken


class JoinRequests:
    """The join protocol of :class:`~p2pdiloco.swarm.matchmaking.Matchmaker` (a base class of it)."""

    @property
    def _request_timeout(self) -> float:
        """How long a join request waits for the leader's first answer: past the longest an honest leader
        waits for ready peers (``matchmaking_timeout``) and admits joiners (``join_grace``)."""
        return self.matchmaking_timeout + self.join_grace + 10

    async def _join(self, leader: str, frag: int, round_: int, due: Optional[int] = None, timeout: Optional[float] = None,
                    watch: Optional[JoinWatch] = None) -> Tuple[Optional[Group], Optional[str]]:
        """Ask ``leader`` to admit us. (group, None) when admitted, (None, hint) when refused; (None, None)
        when unreachable, silent for SILENT_S, or no answer within ``timeout`` (default: the request
        timeout). ``watch`` follows the request: taken by the leader's handler, a group proposed with us
        (the link check runs: from then on hanging up leaves us out of it, and its own timeouts bound
        the wait), the holder silent."""
        watch = watch if watch is not None else JoinWatch()
        me = self.node.peer_id_str
        traffic = self.node.traffic
        try:
            # a first dial can fail while the leader is alive (its addresses not yet known to us, a dial
            # backoff left by a DHT call): wait it out briefly instead of leading a split group alone
            deadline = asyncio.get_running_loop().time() + JOIN_DIAL_WAIT
            _, reader, writer = await asyncio.wait_for(
                open_stream(self.node, leader, self.handler_name, deadline), timeout=JOIN_DIAL_WAIT + 10)
        except Exception as e:
            watch.unreached = True
            logger.info(f"[{self.node.short_id}] leader {short_id(leader)} unreachable ({type(e).__name__}: "
                        f"{dial_reason(e)[:200]}); trying the next")
            return None, None
        proposed = False  # the leader proposed a group with us in it (a 'warm')
        try:
            await write_frame(writer, {"t": "join", "v": PROTOCOL_VERSION, "frag": frag, "round": round_,
                                       **self._my_reach_fields()}, traffic=traffic)
            watch.taken.set()
            reply = await self._first_reply(reader, leader, timeout or self._request_timeout, watch)
            if reply.get("t") == "warm":  # the group is closing: warm our links first (matchmaking item 10)
                proposed = True
                watch.proposed.set()
                reply = await self._answer_warm(reader, writer, reply, leader)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, WireError) as e:
            if proposed:
                # The leader may have closed the group with us in it before it vanished (its other
                # members got the final answer, ours was lost): leading or joining another group now
                # would split the round into two results. The round fails here, as it does for them.
                raise MatchmakingFailed(f"leader {short_id(leader)} of fragment {frag} round {round_} vanished after "
                                        f"proposing a group with us ({type(e).__name__}); the round may have "
                                        "closed with us in it, so it fails here") from None
            watch.broken = watch.taken.is_set() and isinstance(e, (asyncio.IncompleteReadError, ConnectionError))
            watch.expired = timeout is None and watch.taken.is_set() and isinstance(e, asyncio.TimeoutError)
            if watch.silent:
                logger.info(f"[{self.node.short_id}] {short_id(leader)} took our join request for fragment {frag} "
                            f"round {round_} and said nothing for {SILENT_S:.0f}s; trying the next")
            else:
                logger.info(f"[{self.node.short_id}] join with {short_id(leader)} failed ({type(e).__name__}); "
                            "trying the next")
            return None, None
        finally:
            writer.close()
        if reply.get("t") == "group":
            parsed = self._parse_members(reply, leader)
            base = reply.get("base", "")
            if parsed is None or not isinstance(base, str) or len(base) > 64:
                return None, None
            members, owners = parsed
            gid = make_group_id(self.run_id, frag, round_, members, base, owners)
            if reply.get("gid") != gid:
                return None, None
            return Group(gid=gid, members=members, my_index=members.index(me), frag=frag, round=round_,
                         owners=owners), None
        reason = reply.get("reason")
        if reason == "left out":
            raise RoundMissed(f"left out of the group for fragment {frag}, round {round_} before it started: "
                              f"{plain_text(reply.get('why'), 300)} (leader {short_id(leader)})")
        size = reply.get("size")
        if reason == "closed" and isinstance(size, int) and not self._authoritative([leader] * size, due,
                                                                                    reply.get("base")):
            logger.info(f"[{self.node.short_id}] leader {short_id(leader)} closed a group of {size} outside our history "
                        f"for fragment {frag} round {round_}; forming one with the others")
            return None, None
        if reason == "closed":
            raise RoundMissed(f"missed the group for fragment {frag}, round {round_} (it closed before we joined)")
        hint = reply.get("hint")
        if not isinstance(hint, str):
            # the caller drops this candidate for the round (and never steps down for it when leading)
            logger.info(f"[{self.node.short_id}] {short_id(leader)} refused our join request for fragment {frag} "
                        f"round {round_} ({plain_text(reason, 40)}); trying the next")
            return None, None
        return None, hint

    async def _first_reply(self, reader: asyncio.StreamReader, leader: str, timeout: float,
                           watch: JoinWatch) -> Dict[str, Any]:
        """The leader's first frame other than ``wait``, within ``timeout`` seconds; a gap of SILENT_S
        between two frames marks the holder silent (asyncio.TimeoutError either way)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            left = end - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                reply, _ = await asyncio.wait_for(read_frame(reader, 0, self.node.traffic, leader), min(left, SILENT_S))
            except asyncio.TimeoutError:
                watch.silent = left > SILENT_S
                raise
            if reply.get("t") != "wait":
                return reply

    async def _handle_join(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer asks us to admit it to the group of (fragment, round): the ``join`` handler."""
        sender = info.peer_id.to_base58()
        traffic = self.node.traffic
        try:
            header = await read_header(reader, traffic, sender)
            refusal = check_version(header)
            frag, round_ = header.get("frag"), header.get("round")
            if refusal is None and not (header.get("t") == "join" and isinstance(frag, int) and isinstance(round_, int)):
                refusal = "malformed join request"
            if refusal is not None:
                await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=traffic)
                return
            # its own word: whether we may dial it, and through which relay (matchmaking item 8)
            self._learn_reach(sender, header.get("reach"), header.get("via"))
            reply = await self._admission(sender, frag, round_, reader, writer)
            if reply is not None:
                await write_frame(writer, reply, traffic=traffic)
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info(f"[{self.node.short_id}] bad join request from {short_id(sender)}: {e}")
            await refuse_bad_request(self.node, sender, e, writer)  # says why; counts toward a ban
        finally:
            await close_after_reply(reader, writer)

    async def _admission(self, sender: str, frag: int, round_: int, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> Optional[Dict[str, Any]]:
        """Our answer to ``sender``'s join request (None: it hung up, nothing to send). The joiner sends
        nothing more until our reply, so its end closing means it stopped waiting (its join timeout
        passed, or it chose another leader): such a peer is never admitted, as the group would wait on
        a peer that is not in it."""
        hung_up = asyncio.ensure_future(reader.read(1))
        keepalive = asyncio.ensure_future(self._say_wait(writer))  # until we answer: we hold the request
        try:
            slot = self._current_slot(frag, round_)
            deadline = time.monotonic() + self.matchmaking_timeout
            while slot is None and not hung_up.done() and time.monotonic() < deadline:
                await asyncio.wait({hung_up}, timeout=0.05)  # we may be about to enter this round
                slot = self._current_slot(frag, round_)
            if hung_up.done():
                if slot is not None:
                    slot.arrivals.discard(sender)
                return None
            if slot is None:
                return {"t": "refuse", "reason": "not ready"}
            # it is ready for this round, whoever leads it: our poll counts the request as its ready record
            slot.arrivals.add(sender)
            slot.arrived.set()
            decided = asyncio.ensure_future(slot.decided.wait())
            try:
                await asyncio.wait({decided, hung_up}, timeout=self.matchmaking_timeout + 5,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                decided.cancel()
            if hung_up.done():
                slot.arrivals.discard(sender)
                return None
            refusal = self._refusal(slot)
            if refusal is not None:
                return refusal
            fut = slot.joiners.get(sender) or asyncio.get_running_loop().create_future()
            slot.joiners[sender] = fut
            slot.joined_event.set()
            await asyncio.wait({fut, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung_up.cancel()
            # The cancelled read must unwind before this stream is read again (the link check below): a
            # StreamReader serves one waiter at a time, and Python >= 3.12's wait_for reads in the calling
            # task at once, without the scheduling step that used to let the cancellation land first.
            await asyncio.gather(hung_up, return_exceptions=True)
            keepalive.cancel()  # every frame from here on is an answer, written by one task
            await asyncio.gather(keepalive, return_exceptions=True)
        if not fut.done():
            if slot.joiners.get(sender) is fut:
                del slot.joiners[sender]
            slot.arrivals.discard(sender)
            logger.info(f"[{self.node.short_id}] {short_id(sender)} stopped waiting to join fragment {frag} "
                        f"round {round_} before the group closed; not admitted")
            return None
        answer = proposal = fut.result()
        if isinstance(proposal, Proposal):  # closing: the link check first (matchmaking item 10)
            answer = await self._warm_exchange(reader, writer, sender, proposal)
        return self._final_reply(answer, slot, proposal if isinstance(proposal, Proposal) else None)

    async def _say_wait(self, writer: asyncio.StreamWriter) -> None:
        """Tell a joiner every WAIT_S that we still hold its request (it takes silence for a peer gone)."""
        try:
            while True:
                await asyncio.sleep(WAIT_S)
                await write_frame(writer, {"t": "wait"}, traffic=self.node.traffic)
        except (OSError, RuntimeError):
            return  # the joiner hung up: the admission sees it

    @staticmethod
    def _refusal(slot: RoundSlot) -> Optional[Dict[str, Any]]:
        """The refusal for a joiner once our slot decided (None: we lead and admit it)."""
        if not slot.decided.is_set():
            return {"t": "refuse", "reason": "undecided"}
        if not slot.leading:
            return {"t": "refuse", "reason": "not leader", "hint": slot.leader}
        if slot.closed:
            size = len(slot.final.members) if slot.final is not None else None
            return {"t": "refuse", "reason": "closed", "size": size, "base": slot.base}
        return None

    @staticmethod
    def _final_reply(answer: Union[Group, LeftOut, RoundMissed, str, None], slot: RoundSlot,
                     proposal: Optional[Proposal] = None) -> Dict[str, Any]:
        """The leader's last word to an admitted joiner: the group, or why there is none for it. A group
        as ``proposal`` proposed it is named by its id alone (``as``: proposed): the joiner has its member
        and owner lists from the proposal, and at hundreds of members the lists were most of the bytes a
        round's leader sent."""
        if isinstance(answer, RoundMissed):  # the round went on without us: the joiner tries the next candidate
            return {"t": "refuse", "reason": "round missed"}
        if isinstance(answer, LeftOut):
            return {"t": "refuse", "reason": "left out", "why": str(answer)[:300]}
        if isinstance(answer, str):  # we stepped down: a better-ranked peer leads this round
            return {"t": "refuse", "reason": "not leader", "hint": answer}
        if answer is None:
            return {"t": "refuse", "reason": "group too small"}
        if proposal is not None and (answer.members, answer.owners) == (proposal.members, proposal.owners):
            return {"t": "group", "gid": answer.gid, "base": slot.base, "as": "proposed"}
        reply = {"t": "group", "gid": answer.gid, "members": list(answer.members), "base": slot.base}
        if answer.owners is not None:
            reply["owners"] = list(answer.owners)
        return reply

    async def _warm_links(self, members: Sequence[str], owners: Optional[Sequence[str]]) -> Set[str]:
        """Connect to every owner we will send parts to (in a group larger than ``group_cap``: our
        subgroup's owners, and our column when we own a shard; :func:`.group.capped_plan`); returns those
        still unreachable after ``warm_timeout`` seconds."""
        me = self.node.peer_id_str
        owners = owners if owners is not None else members
        plan = capped_plan(members, owners, self.group_cap)
        if plan is not None and me in members:
            targets = sorted(members[j] for j in plan.peers_of(members.index(me)))
        else:
            targets = [o for o in owners if o != me]
        if not targets:
            return set()
        deadline = asyncio.get_running_loop().time() + self.warm_timeout
        results = await asyncio.gather(*(ensure_connected(self.node, t, deadline, why=" (warming the group's links)")
                                         for t in targets))
        return {t for t, failure in zip(targets, results) if failure is not None}

    async def _warm_exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: str,
                             proposal: Proposal) -> Union[Group, LeftOut, None]:
        """Handler side of the link check with one joiner: send the proposal, read its report, wait for
        the final group. Returns the group, the reason it was left out, or None (no group)."""
        traffic = self.node.traffic
        report = proposal.reports[sender]
        try:
            msg: Dict[str, Any] = {"t": "warm", "members": list(proposal.members)}
            if proposal.owners is not None:
                msg["owners"] = list(proposal.owners)
            await write_frame(writer, msg, traffic=traffic)
            answer, _ = await asyncio.wait_for(read_frame(reader, 0, traffic, sender), self.warm_timeout + 2)
            bad = answer.get("unreachable")
            if (answer.get("t") != "warmed" or not isinstance(bad, list) or len(bad) > len(proposal.members)
                    or not all(isinstance(p, str) for p in bad)):
                raise WireError("malformed link report", sender)
            if not report.done():
                report.set_result({p for p in bad if p in proposal.members and p != sender})
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info(f"[{self.node.short_id}] {short_id(sender)} sent no link report ({type(e).__name__})")
        finally:
            if not report.done():
                report.set_result(None)
        try:
            group = await asyncio.wait_for(asyncio.shield(proposal.final), timeout=self.warm_timeout + 10)
        except asyncio.TimeoutError:
            return None
        if sender in proposal.left:
            return LeftOut(proposal.left[sender])
        return group

    async def _answer_warm(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: Dict[str, Any],
                           leader: str) -> Dict[str, Any]:
        """Joiner side of the link check: warm our links to the proposed owners, report the ones we
        could not reach, and return the leader's final reply ({} when the proposal is malformed)."""
        parsed = self._parse_members(reply, leader)
        if parsed is None:
            return {}
        unreachable = await self._warm_links(*parsed)
        await write_frame(writer, {"t": "warmed", "unreachable": sorted(unreachable)}, traffic=self.node.traffic)
        final, _ = await asyncio.wait_for(read_frame(reader, 0, self.node.traffic, leader), self.warm_timeout + 12)
        if final.get("t") == "group" and final.get("as") == "proposed" and "members" not in final:
            members, owners = parsed  # the group as proposed: the caller checks its id against these lists
            final = dict(final, members=list(members), **({"owners": list(owners)} if owners is not None else {}))
        return final

    def _parse_members(self, reply: Dict[str, Any], leader: str) -> Optional[Tuple[Tuple[str, ...], Optional[Tuple[str, ...]]]]:
        """(members, owners) of a ``warm`` or ``group`` reply, checked; None when malformed or unacceptable."""
        me = self.node.peer_id_str
        members = reply.get("members")
        if (not isinstance(members, list) or me not in members or leader not in members
                or not all(isinstance(m, str) for m in members) or members != sorted(set(members))):
            return None
        owners = reply.get("owners")
        if owners is not None:  # a subset of the members, in member order, with the leader, without us if private
            if (not isinstance(owners, list) or not owners or not set(owners) <= set(members)
                    or owners != sorted(set(owners)) or leader not in owners):
                return None
            owners = tuple(owners)
        if self._private(me) and me in (owners if owners is not None else members) and len(members) > 1:
            logger.warning(f"[{self.node.short_id}] leader {short_id(leader)} made this private peer a shard owner; "
                           "not joining that group")
            return None
        return tuple(members), owners
