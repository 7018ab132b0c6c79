"""The join protocol, both ends (:mod:`.matchmaking` has the rules): a member's request to a leader
(:meth:`JoinRequests._join`: ask, answer the link check, read the group or the refusal), and the
``join`` handler that serves such requests (it counts a request as the sender's ready record and
answers once this peer's slot for the round decided: the group, or a refusal naming whom we follow).

Messages (msgpack headers, :mod:`.protocol`): ``join`` {frag, round, reach[, via]} → ``wait`` {} ←
every ``WAIT_S`` while the request is held → zero or one ``warm`` {members[, owners]} ← answered by
``warmed`` {unreachable} → then ``group`` {gid, members, base[, owners]} (after a ``warm``, when the
group is the one proposed: {gid, base, as: proposed}) or ``refuse`` {reason[, hint | size, base | why]} ←.
A bucket's head carrying others' requests (matchmaking item 13) sends ``join`` with ``riders`` [{id, reach[,
via]}], then ``ride`` {riders} / ``unride`` {ids} → as riders come and hang up, answers a ``warm`` with
``warmed`` {unreachable, riders: {id: unreachable | None}} →, and gets ``batch`` {replies: {id: reply}, size}
← (a refusal or hint before any proposal is one reply for all). To its riders it is a leader: the same
frames as above.

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
from .leading import AS_JOINER, LeftOut, Proposal, Rider, RoundSlot
from .signing import plain_text
from .protocol import (PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header,
                       refuse_bad_request, write_frame)

__all__ = ["JoinRequests", "JoinWatch", "JOIN_DIAL_WAIT", "WAIT_S", "SILENT_S", "MAX_RIDERS"]

logger = logging.getLogger(__name__)

#: how long a join request waits out a failed first dial to a leader that is live by its records
#: (seconds): a cold address or libp2p's dial backoff (dialing.py) must not split a round in two
JOIN_DIAL_WAIT = 3.0
#: how often a peer holding a join request says so (seconds): its ``wait`` frames
WAIT_S = 2.0
#: how long a joiner waits for the next frame from a peer that took its request (seconds): three missed
#: ``wait`` frames; then the request ends unanswered and the holder counts as silent
SILENT_S = 3 * WAIT_S
#: the most join requests one carrier may bring (matchmaking item 13): a bucket holds up to twice the
#: group cap, and views differ; past this the carrier's request is malformed
MAX_RIDERS = 1024


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


def _pending(slot: RoundSlot) -> list:
    """The riders we carry that have no answer yet, in joiner order."""
    return [slot.riders[r] for r in sorted(slot.riders) if not slot.riders[r].final.done()]


async def _stopped(task: Optional[asyncio.Future]) -> None:
    """Cancel ``task`` and let it unwind (None: nothing to stop); returns None."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return None


class JoinRequests:
    """The join protocol of :class:`~p2pdiloco.swarm.matchmaking.Matchmaker` (a base class of it)."""

    @property
    def _request_timeout(self) -> float:
        """How long a join request waits for the leader's first answer: past the longest an honest leader
        waits for ready peers (``matchmaking_timeout``) and admits joiners (``join_grace``)."""
        return self.matchmaking_timeout + self.join_grace + 10

    def _request_limit(self, slot: Optional[RoundSlot]) -> float:
        """How long a join request with no timeout of its own waits for its first answer. With gathering on
        (matchmaking item 13) a leader admits the peers behind a silent head longer than the join grace."""
        limit = self._request_timeout
        if slot is not None and slot.carry:
            limit += self._gather_grace - self.join_grace
        return limit

    async def _join(self, leader: str, frag: int, round_: int, due: Optional[int] = None, timeout: Optional[float] = None,
                    watch: Optional[JoinWatch] = None) -> Tuple[Optional[Group], Optional[str]]:
        """Ask ``leader`` to admit us. (group, None) when admitted, (None, hint) when refused; (None, None)
        when unreachable, silent for SILENT_S, or no answer within ``timeout`` (default: the request
        timeout). ``watch`` follows the request: taken by the leader's handler, a group proposed with us
        (the link check runs: from then on hanging up leaves us out of it, and its own timeouts bound
        the wait), the holder silent."""
        watch = watch if watch is not None else JoinWatch()
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
        slot = self._current_slot(frag, round_)
        via_head = slot is not None and slot.via == leader  # it carries our request (matchmaking item 13)
        carried: Optional[Set[str]] = set() if slot is not None and slot.carry and not via_head else None
        syncing: Optional[asyncio.Future] = None
        try:
            request = {"t": "join", "v": PROTOCOL_VERSION, "frag": frag, "round": round_, **self._my_reach_fields()}
            if carried is not None:  # we carry the requests of our bucket (matchmaking item 13)
                request["riders"] = [r.entry for r in _pending(slot)]
                carried |= {e["id"] for e in request["riders"]}
            await write_frame(writer, request, traffic=traffic)
            watch.taken.set()
            if carried is not None:
                syncing = asyncio.ensure_future(self._sync_riders(writer, slot, carried))
            reply = await self._first_reply(reader, leader, timeout or self._request_limit(slot), watch)
            syncing = await _stopped(syncing)  # from here on only the link check writes to the leader
            if reply.get("t") == "warm":  # the group is closing: warm our links first (matchmaking item 10)
                proposed = True
                watch.proposed.set()
                reply = await self._answer_warm(reader, writer, reply, leader, via_head, carried, slot)
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
            await _stopped(syncing)
            writer.close()
        return self._answer_of(reply, leader, via_head, frag, round_, due)

    def _answer_of(self, reply: Dict[str, Any], leader: str, via_head: bool, frag: int, round_: int,
                   due: Optional[int]) -> Tuple[Optional[Group], Optional[str]]:
        """What the last word of ``leader`` (``via_head``: the head that carried our request) means for
        :meth:`_join`: (group, None), (None, hint), (None, None); RoundMissed when we missed the round."""
        me = self.node.peer_id_str
        if reply.get("t") == "group":
            parsed = self._parse_members(reply, leader, via_head)
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

    async def _sync_riders(self, writer: asyncio.StreamWriter, slot: RoundSlot, carried: Set[str]) -> None:
        """While our request waits for the leader's first answer, tell it of the requests we carry as they
        come and go (``ride`` / ``unride``): a joiner that hung up on us must not be admitted."""
        while True:
            await slot.riders_changed.wait()
            slot.riders_changed.clear()
            now = {r.entry["id"]: r for r in _pending(slot)}
            added, gone = sorted(set(now) - carried), sorted(carried - set(now))
            if added:
                carried |= set(added)
                await write_frame(writer, {"t": "ride", "riders": [now[r].entry for r in added]},
                                  traffic=self.node.traffic)
            if gone:
                carried -= set(gone)
                await write_frame(writer, {"t": "unride", "ids": gone}, traffic=self.node.traffic)

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
            self.join_stats["carriers" if "riders" in header else "requests"] += 1
            if "riders" in header:  # a carrier (matchmaking item 13)
                reply = await self._carrier_admission(sender, frag, round_, reader, writer, header["riders"])
            else:
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
            slot = await self._entered_slot(frag, round_, hung_up)
            if hung_up.done():
                if slot is not None:
                    slot.arrivals.discard(sender)
                return None
            if slot is None:
                return {"t": "refuse", "reason": "not ready"}
            # it is ready for this round, whoever leads it: our poll counts the request as its ready record
            slot.arrivals.add(sender)
            slot.arrived.set()
            await self._until_decided(slot, hung_up)
            if hung_up.done():
                slot.arrivals.discard(sender)
                return None
            refusal, rider = self._refusal(slot), None
            if refusal is not None and self._may_carry(slot):
                rider = await self._ride(slot, sender, hung_up)
                if rider is None:
                    return None  # it hung up before the leader proposed anything
                if rider.final.done() and rider.final.result() == AS_JOINER:
                    rider, refusal = None, self._refusal(slot)  # we lead after all: it joins us
            if rider is None:
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
        if rider is not None:
            return await self._carried_reply(reader, writer, sender, rider)
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

    async def _carrier_admission(self, sender: str, frag: int, round_: int, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter, entries: Any) -> Optional[Dict[str, Any]]:
        """Our answer to a carrier's request (matchmaking item 13): it and the joiners it carries are
        admitted, refused or hinted together; a group closing gets one proposal and one link report for
        all of them, and its last word names each one's reply (``batch``). The carrier may add riders
        (``ride``) or withdraw those that hung up on it (``unride``) until we propose."""
        carrier = _Carrier(self, sender)
        carrier.take(entries)
        listener = asyncio.ensure_future(carrier.listen(reader))  # the carrier's frames; done: it hung up
        try:
            fut = await self._hold_carrier(carrier, frag, round_, listener, writer)
            if not isinstance(fut, asyncio.Future):
                return fut  # a refusal, or None: it hung up
            if not fut.done():
                carrier.leave(hung_up=True)
                logger.info(f"[{self.node.short_id}] carrier {short_id(sender)} stopped waiting for fragment {frag} "
                            f"round {round_} before the group closed; not admitted with its riders")
                return None
            proposal = fut.result()
            if not isinstance(proposal, Proposal):
                return self._final_reply(proposal, carrier.slot)  # the same for the carrier and its riders
            return await carrier.link_check(writer, proposal)
        finally:
            await _stopped(listener)

    async def _hold_carrier(self, carrier: "_Carrier", frag: int, round_: int, listener: asyncio.Future,
                            writer: asyncio.StreamWriter) -> Union[asyncio.Future, Dict[str, Any], None]:
        """Hold a carrier's request as :meth:`_admission` holds a joiner's: until our slot for the round
        decided; then its refusal, or, admitted, its future once the group's answer came or it hung up."""
        keepalive = asyncio.ensure_future(self._say_wait(writer))
        try:
            slot = await self._entered_slot(frag, round_, listener)
            if listener.done():
                return None
            if slot is None:
                return {"t": "refuse", "reason": "not ready"}
            carrier.slot = slot
            carrier.arrive()
            await self._until_decided(slot, listener)
            if listener.done():
                carrier.leave(hung_up=True)
                return None
            refusal = self._refusal(slot)
            return refusal if refusal is not None else await carrier.admitted(listener)
        finally:
            keepalive.cancel()  # every frame from here on is an answer, written by one task
            await asyncio.gather(keepalive, return_exceptions=True)

    async def _entered_slot(self, frag: int, round_: int, gone: asyncio.Future) -> Optional[RoundSlot]:
        """Our slot for (frag, round_) once we enter that round (a request can come just before we do); None
        when ``gone`` (the requester hung up) comes first or matchmaking_timeout passes."""
        slot = self._current_slot(frag, round_)
        deadline = time.monotonic() + self.matchmaking_timeout
        while slot is None and not gone.done() and time.monotonic() < deadline:
            await asyncio.wait({gone}, timeout=0.05)  # we may be about to enter this round
            slot = self._current_slot(frag, round_)
        return slot

    async def _until_decided(self, slot: RoundSlot, gone: asyncio.Future) -> None:
        """Wait until our slot decided (whom we follow, or that we lead) or ``gone`` (the requester hung up),
        at most matchmaking_timeout + 5 s."""
        decided = asyncio.ensure_future(slot.decided.wait())
        try:
            await asyncio.wait({decided, gone}, timeout=self.matchmaking_timeout + 5,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            decided.cancel()

    @staticmethod
    def _may_carry(slot: RoundSlot) -> bool:
        """Do we carry a join request instead of refusing it with a hint (matchmaking item 13): gathering
        is on, and we follow a leader we asked directly, still open."""
        return (slot.carry and slot.via is None and slot.decided.is_set() and not slot.leading
                and not slot.closed and slot.final is None)

    async def _ride(self, slot: RoundSlot, sender: str, hung_up: asyncio.Future) -> Optional[Rider]:
        """Carry ``sender``'s request with ours until the leader proposes a group, answers, or we lead
        (:data:`AS_JOINER`); None: it hung up first (the leader is told, it must not admit it)."""
        routes = getattr(self.node, "relay_routes", None) or {}
        entry = {"id": sender, "reach": self._reach.get(sender, "public")}
        if isinstance(routes.get(sender), str):
            entry["via"] = routes[sender]
        rider = slot.riders[sender] = Rider(entry)
        slot.riders_changed.set()
        self.join_stats["carried"] += 1
        await asyncio.wait({rider.warm, rider.final, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        if hung_up.done() and not rider.warm.done() and not rider.final.done():
            if slot.riders.get(sender) is rider:
                del slot.riders[sender]
                slot.riders_changed.set()
            rider.settle(None)
            slot.arrivals.discard(sender)
            return None
        return rider

    async def _carried_reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sender: str,
                             rider: Rider) -> Optional[Dict[str, Any]]:
        """A carried joiner's answer: the leader's proposal passed on and its link report brought back,
        then the leader's last word for it (None: break the stream unanswered)."""
        traffic = self.node.traffic
        if rider.warm.done():
            try:
                await write_frame(writer, rider.warm.result(), traffic=traffic)
                answer, _ = await asyncio.wait_for(read_frame(reader, 0, traffic, sender), self.warm_timeout + 1)
                bad = answer.get("unreachable")
                if (answer.get("t") != "warmed" or not isinstance(bad, list) or len(bad) > MAX_RIDERS * 4
                        or not all(isinstance(p, str) for p in bad)):
                    raise WireError("malformed link report", sender)
                if not rider.report.done():
                    rider.report.set_result({p for p in bad if p != sender})
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
                logger.info(f"[{self.node.short_id}] {short_id(sender)} sent no link report ({type(e).__name__})")
            finally:
                if not rider.report.done():
                    rider.report.set_result(None)
        try:
            final = await asyncio.wait_for(asyncio.shield(rider.final), timeout=self.warm_timeout + 14)
        except asyncio.TimeoutError:
            return None
        return final if isinstance(final, dict) else None

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
                           leader: str, via_head: bool = False, carried: Optional[Set[str]] = None,
                           slot: Optional[RoundSlot] = None) -> Dict[str, Any]:
        """Joiner side of the link check: warm our links to the proposed owners, report the ones we
        could not reach, and return the leader's final reply ({} when the proposal is malformed). A
        carrier (``carried``: the requests it brought) passes the proposal on to those riders, reports
        for them too, and hands each its part of the leader's answer (matchmaking item 13)."""
        parsed = self._parse_members(reply, leader, via_head)
        if parsed is None:
            return {}
        riders = {r: slot.riders[r] for r in sorted(carried or ()) if r in slot.riders and r in parsed[0]
                  and not slot.riders[r].final.done() and not slot.riders[r].warm.done()}
        for rider in riders.values():
            rider.warm.set_result({k: reply[k] for k in ("t", "members", "owners") if k in reply})
        own = asyncio.ensure_future(self._warm_links(*parsed))
        if riders:
            await asyncio.wait([r.report for r in riders.values()], timeout=self.warm_timeout + 1)
        unreachable = await own
        warmed: Dict[str, Any] = {"t": "warmed", "unreachable": sorted(unreachable)}
        if carried is not None:
            warmed["riders"] = {r: (sorted(x.report.result()) if x.report.done() and x.report.result() is not None
                                    else None) for r, x in riders.items()}
        await write_frame(writer, warmed, traffic=self.node.traffic)
        final, _ = await asyncio.wait_for(read_frame(reader, 0, self.node.traffic, leader), self.warm_timeout + 12)
        if final.get("t") == "batch" and carried is not None:
            final = self._hand_out(final, slot, riders)
        if final.get("t") == "group" and final.get("as") == "proposed" and "members" not in final:
            members, owners = parsed  # the group as proposed: the caller checks its id against these lists
            final = dict(final, members=list(members), **({"owners": list(owners)} if owners is not None else {}))
        return final

    def _hand_out(self, batch: Dict[str, Any], slot: RoundSlot, proposed: Dict[str, Rider]) -> Dict[str, Any]:
        """A carrier's share of the leader's ``batch`` answer: each rider gets its reply (one proposed the
        group and not answered: its stream breaks, as the leader's would; one not proposed: the group
        closed without it); returns ours ({} when there is none)."""
        replies = batch.get("replies")
        replies = replies if isinstance(replies, dict) else {}
        mine = replies.get(self.node.peer_id_str)
        mine = mine if isinstance(mine, dict) else {}
        for pid, rider in list(slot.riders.items()):
            reply = replies.get(pid)
            if isinstance(reply, dict) and pid in proposed:
                rider.settle(reply)
            elif pid in proposed:
                rider.settle(None)
            else:
                rider.settle({"t": "refuse", "reason": "closed", "size": batch.get("size"),
                              "base": mine.get("base", "")})
        return mine

    def _parse_members(self, reply: Dict[str, Any], leader: str,
                       via_head: bool = False) -> Optional[Tuple[Tuple[str, ...], Optional[Tuple[str, ...]]]]:
        """(members, owners) of a ``warm`` or ``group`` reply, checked; None when malformed or unacceptable.
        ``via_head``: ``leader`` is the head that carried our request (matchmaking item 13), a member that
        need not own a shard."""
        me = self.node.peer_id_str
        members = reply.get("members")
        if (not isinstance(members, list) or me not in members or leader not in members
                or not all(isinstance(m, str) for m in members) or members != sorted(set(members))):
            return None
        owners = reply.get("owners")
        if owners is not None:  # a subset of the members, in member order, with the leader, without us if private
            if (not isinstance(owners, list) or not owners or not set(owners) <= set(members)
                    or owners != sorted(set(owners)) or (leader not in owners and not via_head)):
                return None
            owners = tuple(owners)
        if self._private(me) and me in (owners if owners is not None else members) and len(members) > 1:
            logger.warning(f"[{self.node.short_id}] leader {short_id(leader)} made this private peer a shard owner; "
                           "not joining that group")
            return None
        return tuple(members), owners


class _Carrier:
    """The leader's side of one carrier's request (:meth:`JoinRequests._carrier_admission`): the riders it
    brings, kept in step with its ``ride`` / ``unride`` frames, registered as joiners while we admit."""

    def __init__(self, mm: JoinRequests, sender: str) -> None:
        self.mm, self.sender = mm, sender
        self.riders: Dict[str, None] = {}           # joiners it carries, in arrival order
        self.slot: Optional[RoundSlot] = None
        self.mine: Dict[str, asyncio.Future] = {}   # joiners registered by this request -> their future
        self.changed = asyncio.Event()
        self.warmed: asyncio.Future = asyncio.get_running_loop().create_future()

    def take(self, entries: Any) -> None:
        """Riders named by the carrier, checked (:class:`~p2pdiloco.errors.WireError` when malformed)."""
        if not isinstance(entries, list) or len(self.riders) + len(entries) > MAX_RIDERS:
            raise WireError("malformed riders", self.sender)
        for entry in entries:
            pid = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(pid, str) or not 20 <= len(pid) <= 128:
                raise WireError("malformed rider", self.sender)
            if pid in (self.sender, self.mm.node.peer_id_str) or self.mm.node.gate.banned(pid):
                continue
            self.mm._learn_reach(pid, entry.get("reach"), entry.get("via"))
            self.riders[pid] = None
        self.changed.set()
        if self.slot is not None:
            self.arrive()

    async def listen(self, reader: asyncio.StreamReader) -> None:
        """Read the carrier's frames until it hangs up: riders coming and going, then its link report."""
        traffic = self.mm.node.traffic
        try:
            while True:
                frame, _ = await read_frame(reader, 0, traffic, self.sender)
                kind = frame.get("t")
                if kind == "ride" and not self.warmed.done():
                    self.take(frame.get("riders"))
                elif kind == "unride" and isinstance(frame.get("ids"), list):
                    for pid in frame["ids"]:
                        self.riders.pop(pid, None) if isinstance(pid, str) else None
                    self.changed.set()
                elif kind == "warmed" and not self.warmed.done():
                    self.warmed.set_result(frame)
                else:
                    raise WireError(f"unexpected {str(kind)[:20]!r} frame from a carrier", self.sender)
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                logger.info(f"[{self.mm.node.short_id}] carrier {short_id(self.sender)}: {e}")

    def arrive(self) -> None:
        """The carrier and its riders are ready for the round, whoever leads it (item 9)."""
        self.slot.arrivals.update({self.sender, *self.riders})
        self.slot.arrived.set()

    def _register(self) -> None:
        """Our joiners from this request are the carrier and its current riders."""
        slot, loop = self.slot, asyncio.get_running_loop()
        for pid in (self.sender, *self.riders):
            if pid not in self.mine:
                fut = slot.joiners.get(pid)
                if fut is None:
                    fut = slot.joiners[pid] = loop.create_future()
                    self.mine[pid] = fut
                else:
                    self.mine[pid] = None  # another request of its own holds it: not ours to withdraw
        for pid in [p for p in self.mine if p != self.sender and p not in self.riders]:
            fut = self.mine.pop(pid)
            if fut is not None and not fut.done() and slot.joiners.get(pid) is fut:
                del slot.joiners[pid]
                slot.arrivals.discard(pid)
        slot.arrivals.update({self.sender, *self.riders})
        slot.joined_event.set()
        slot.arrived.set()

    async def admitted(self, listener: asyncio.Future) -> asyncio.Future:
        """Keep our joiners in step with the carrier until the group's answer (the carrier's future done)
        or the carrier hangs up; returns the carrier's future."""
        self._register()
        fut = self.slot.joiners[self.sender]
        while not fut.done() and not listener.done():
            self.changed.clear()
            changed = asyncio.ensure_future(self.changed.wait())
            try:
                await asyncio.wait({fut, listener, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            if not fut.done():
                self._register()
        return fut

    def leave(self, hung_up: bool) -> None:
        """The carrier went away before our answer: none of its joiners is admitted through it, and
        (``hung_up``) none counts as ready by this request any more."""
        slot = self.slot
        if slot is None:
            return
        for pid, fut in self.mine.items():
            if fut is not None and not fut.done() and slot.joiners.get(pid) is fut:
                del slot.joiners[pid]
        if hung_up:
            slot.arrivals.difference_update({self.sender, *self.riders} - set(slot.joiners))

    async def link_check(self, writer: asyncio.StreamWriter, proposal: Proposal) -> Optional[Dict[str, Any]]:
        """Send the proposal once, read the carrier's report for itself and its riders, wait for the final
        group and answer each of them (``batch``)."""
        mm, traffic = self.mm, self.mm.node.traffic
        ours = [p for p in (self.sender, *self.riders) if p in proposal.reports]
        try:
            msg: Dict[str, Any] = {"t": "warm", "members": list(proposal.members)}
            if proposal.owners is not None:
                msg["owners"] = list(proposal.owners)
            await write_frame(writer, msg, traffic=traffic)
            report = await asyncio.wait_for(asyncio.shield(self.warmed), mm.warm_timeout + 2)
            self._reports(report, proposal, ours)
        except (asyncio.TimeoutError, ConnectionError, WireError) as e:
            logger.info(f"[{mm.node.short_id}] carrier {short_id(self.sender)} sent no link report "
                        f"({type(e).__name__})")
        finally:
            for pid in ours:
                if not proposal.reports[pid].done():
                    proposal.reports[pid].set_result(None)
        try:
            group = await asyncio.wait_for(asyncio.shield(proposal.final), timeout=mm.warm_timeout + 10)
        except asyncio.TimeoutError:
            return None
        replies = {}
        for pid in (self.sender, *self.riders):
            answer: Any = group
            if pid not in proposal.members:
                answer = RoundMissed("closed")  # registered after we proposed: the group closed without it
            elif pid in proposal.left:
                answer = LeftOut(proposal.left[pid])
            replies[pid] = mm._final_reply(answer, self.slot, proposal)
        return {"t": "batch", "replies": replies, "size": len(group.members) if group is not None else 0}

    def _reports(self, report: Dict[str, Any], proposal: Proposal, ours: list) -> None:
        """The carrier's ``warmed`` frame: its own unreachable owners and each rider's (None: no report)."""
        members = set(proposal.members)
        riders = report.get("riders")
        riders = riders if isinstance(riders, dict) else {}
        for pid in ours:
            bad = report.get("unreachable") if pid == self.sender else riders.get(pid)
            if isinstance(bad, list) and len(bad) <= len(members) and all(isinstance(p, str) for p in bad):
                proposal.reports[pid].set_result({p for p in bad if p in members and p != pid})
