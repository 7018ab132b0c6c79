"""The owner's side of the all-reduce: reducing one shard of a group's vector (:mod:`.allreduce` has
the protocol). A state machine per (group, phase), :class:`ShardRound`: the members' parts arrive chunk by
chunk on the ``part`` handler, each checked before it counts; chunk ``j`` of the mean is reduced and
streamed to every member once every kept part's chunk ``j`` is in; screens drop bad parts, never the
round; a missing or cut part aborts the round for everyone.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compression import Codec, codec_by_id, get_codec
from ..compression.robust import aggregate, screen, weighted_mean
from ..errors import SyncFailed, WireError
from ..ids import short_id
from .group import Group, Level
from .partition import chunk_bounds, chunk_values, relayed_mean, squared_norm
from .protocol import (Traffic, check_version, close_after_reply, note_offence, quota_refusal, read_header,
                       read_payload, write_frame)

__all__ = ["ShardOwner", "COLUMN", "MAX_PENDING_ROUNDS", "MAX_PENDING_PER_PEER", "MAX_PENDING_PER_STRANGER",
           "MAX_PENDING_STRANGERS"]

logger = logging.getLogger(__name__)

#: parts for groups this owner has not formed yet wait for it; at most this many such groups at once
#: (each is a few objects and one waiting stream). Shared by protocol.quota_refusal's rule:
MAX_PENDING_ROUNDS = 512
#: ... at most this many opened by one member (a peer of a recent verified round, PeerGate.vouch)
MAX_PENDING_PER_PEER = 16
#: ... by one stranger (anyone else: an honest one waits on one or two groups at a time)
MAX_PENDING_PER_STRANGER = 4
#: ... and by all strangers together; the rest of MAX_PENDING_ROUNDS is the members'
MAX_PENDING_STRANGERS = 256


#: the phase prefix of a column's exchange (capped groups): subgroup totals, averaged without screens
COLUMN = "x:"


@dataclass
class ShardRound:
    """The owner's side of one (gid, phase): the members' parts as they arrive chunk by chunk, parts
    dropped, and the encoded result chunks that every member's reply streams out."""

    created: float = field(default_factory=time.monotonic)
    configured: asyncio.Event = field(default_factory=asyncio.Event)
    opened_by: str = ""                    # sender whose part created this round before we configured it
    group: Optional[Group] = None
    codec: Optional[Codec] = None
    numel: int = 0
    chunks: List[Tuple[int, int]] = field(default_factory=list)
    parts: Dict[int, torch.Tensor] = field(default_factory=dict)   # member index -> its part, filled chunk by chunk
    raw: Dict[int, List[bytes]] = field(default_factory=dict)      # member index -> its chunks as sent (relays_parts)
    weights: Dict[int, float] = field(default_factory=dict)
    got: Dict[int, int] = field(default_factory=dict)              # member index -> chunks received
    sq: Dict[int, float] = field(default_factory=dict)             # member index -> ‖part‖² so far
    dropped: Dict[int, str] = field(default_factory=dict)   # member index -> why its part was dropped
    streaming: Optional[Tuple[int, ...]] = None  # members the result chunks sent so far average (None: not yet)
    out: List[bytes] = field(default_factory=list)                 # encoded result chunks of this epoch
    epoch: int = 0                         # bumped when results already sent are replaced (see _finish)
    covered: Tuple[int, ...] = ()          # member indexes whose parts the result averages
    covered_weight: float = 0.0            # their total weight
    level: Optional[Level] = None          # a capped group's subgroup: the mean goes through a column
    gcovered: Tuple[int, ...] = ()         # with ``level``: whole-group indexes the mean covers
    column: Optional[asyncio.Task] = None  # with ``level``: the column's exchange, once every part is in
    phase: str = ""
    done: asyncio.Future = None  # None once the result is final, or the round's exception
    changed: asyncio.Event = None

    def __post_init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.changed = asyncio.Event()

    def tick(self) -> None:
        """Wake every reply waiting for a new result chunk, a drop or the end of the round."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def live(self) -> List[int]:
        return [i for i in range(self.group.size) if i not in self.dropped]

    def missing(self) -> str:
        """Who the round still waits for, for a timeout's message."""
        n = len(self.chunks)
        late = [f"{short_id(self.group.members[i])} ({self.got.get(i, 0)} of {n} chunks)" for i in self.live()
                if self.got.get(i, 0) < n]
        return ", ".join(late) or "nobody"


class _Rejected(Exception):
    """A member's part failed a check: drop it from the round (the others go on)."""

    def __init__(self, check: str, reason: str):
        self.check = check
        super().__init__(reason)


class ShardOwner:
    """The owner's side of :class:`~p2pdiloco.swarm.allreduce.AllReducer` (a base class of it): serves
    the ``part`` handler and reduces the shards this peer owns. Uses the reducer's ``node``,
    ``timeout``, ``robust``, ``round_samples``, ``stats``, ``dropped_log`` and ``_rounds`` (the open
    rounds by (gid, phase))."""

    def _open_own_shard(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec,
                        bounds: Tuple[int, int], finite: bool, level: Optional[Level] = None) -> ShardRound:
        """Configure the round of the shard we own (``bounds`` of ``vec``) and put our own part in it:
        the parts that arrived before we formed the group start counting now."""
        me = group.my_index
        lo, hi = bounds
        rnd = self._round(group.gid, phase)
        rnd.group, rnd.codec, rnd.numel, rnd.level = group, codec, hi - lo, level
        rnd.chunks = chunk_bounds(hi - lo, chunk_values(codec))
        gate = getattr(self.node, "gate", None)
        for i, peer in enumerate(group.members):  # banned members' parts are dropped up front
            if i != me and gate is not None and gate.banned(peer) and i not in rnd.dropped:
                rnd.dropped[i] = f"peer {peer} is banned here"
                self.stats["dropped:banned"] += 1
        rnd.configured.set()
        # our own part takes the same lossy round trip as everybody else's
        if finite:
            own = codec.roundtrip(vec[lo:hi]) if codec.relative_error_bound else vec[lo:hi].to("cpu")  # read only
            rnd.parts[me], rnd.weights[me], rnd.got[me] = own, float(weight), len(rnd.chunks)
            if codec.relays_parts:
                rnd.raw[me] = [codec.encode(vec[lo + a: lo + b]) for a, b in rnd.chunks]
            rnd.sq[me] = squared_norm(own)
        else:  # our own training diverged: serve the others without our part, then apply nothing
            rnd.dropped[me] = "the owner's own pseudo-gradient is not finite"
            logger.error(f"[{self.node.short_id}] our pseudo-gradient is not finite; leaving it out of "
                         f"group {group.gid} and applying nothing this round")
        self._advance(rnd)
        return rnd

    async def _own_result(self, rnd: ShardRound, out: torch.Tensor) -> Tuple[Tuple[int, ...], float]:
        """Wait for our shard's result and decode it into ``out`` (the same bytes every member decodes);
        returns (covered member indexes, their weight). Incomplete at the timeout: the round fails."""
        try:  # a subgroup's shard waits for its column too (a second exchange, up to 1.5 timeouts)
            await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout * (2.5 if rnd.level else 1))
        except asyncio.TimeoutError:
            missing = rnd.missing()
            self._stalled(rnd)
            self._fail(rnd, SyncFailed(f"the shard of group {rnd.group.gid} owned by this peer was incomplete "
                                       f"after {self.timeout:.0f} s; waiting for {missing}"))
            raise rnd.done.exception() from None
        if rnd.codec.relays_parts:
            weights = [rnd.weights[i] for i in rnd.covered]
            for (s, e), data in zip(rnd.chunks, rnd.out):
                relayed_mean(rnd.codec, data, weights, out[s:e], None)
        else:
            for (s, e), data in zip(rnd.chunks, rnd.out):
                rnd.codec.decode_into(data, out[s:e])
        return (rnd.gcovered if rnd.level else rnd.covered), rnd.covered_weight

    async def _close_own_shard(self, rnd: ShardRound, phase: str, excluded: bool, deadline: float) -> None:
        """We leave the round. When an owner dropped our part (``excluded``) the others' round goes on:
        keep serving our shard until it is decided (up to ``deadline``, loop time), so one rejected
        member never aborts everyone's round; then the round is closed."""
        if excluded and not rnd.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(rnd.done), max(0.0, deadline - asyncio.get_running_loop().time()))
            except BaseException:
                pass
        self._fail(rnd, SyncFailed(f"this peer left the round of group {rnd.group.gid} before its shard "
                                   "was complete"))
        self._rounds.pop((rnd.group.gid, phase), None)

    def _round(self, gid: str, phase: str, sender: str = "") -> ShardRound:
        self._sweep()
        key = (gid, phase)
        if key not in self._rounds:
            if sender:  # a part for a group we have not formed (yet): a quota per sender (protocol.py)
                pending = [r.opened_by for r in self._rounds.values() if not r.configured.is_set()]
                gate = getattr(self.node, "gate", None)
                member = gate.member if gate is not None else (lambda _: False)
                refusal = quota_refusal(pending.count(sender), member(sender), len(pending),
                                        sum(not member(p) for p in pending),
                                        (MAX_PENDING_ROUNDS, MAX_PENDING_PER_PEER, MAX_PENDING_STRANGERS,
                                         MAX_PENDING_PER_STRANGER))
                if refusal is not None:
                    err = WireError(f"too many parts for groups this peer has not formed (gid {gid[:24]}): "
                                    f"{refusal}", sender)
                    err.benign = True
                    raise err
            self._rounds[key] = ShardRound(opened_by=sender, phase=phase)
        return self._rounds[key]

    def _sweep(self) -> None:
        horizon = time.monotonic() - 4 * self.timeout
        for key in [k for k, r in self._rounds.items() if r.created < horizon]:
            del self._rounds[key]

    async def _handle_part(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A member's part of our shard: read it chunk by chunk while its reply streams the result
        chunks out as they are reduced (:meth:`_reply` is the only writer of the stream)."""
        sender = info.peer_id.to_base58()
        traffic = self.node.traffic
        rnd: Optional[ShardRound] = None
        idx: Optional[int] = None
        reply: Optional[asyncio.Future] = None
        try:
            header = await read_header(reader, traffic, sender)
            refusal = check_version(header)
            if refusal is not None:
                await write_frame(writer, {"t": "abort", "reason": refusal}, traffic=traffic)
                return
            gid, phase = header.get("gid"), header.get("phase")
            if not (header.get("t") == "part" and isinstance(gid, str) and isinstance(phase, str)
                    and 0 < len(gid) <= 64 and 0 < len(phase) <= 64):
                raise WireError("malformed part header", sender)
            # The owner may finalize the group (and configure the round) a moment after the sender did.
            rnd = self._round(gid, phase, sender)
            try:
                await asyncio.wait_for(rnd.configured.wait(), timeout=self.timeout)
            except asyncio.TimeoutError:
                if not rnd.configured.is_set():
                    self._rounds.pop((gid, phase), None)
                raise SyncFailed(f"part from {sender} for group {gid}, which this peer never formed") from None
            group = rnd.group
            if sender not in group.members:
                raise WireError(f"part for group {gid} from a peer that is not a member", sender)
            idx = group.members.index(sender)
            self._check_open(rnd, idx, sender)
            weight, codec = self._check_header(header, rnd, idx, sender)
            # our own numbers (the shard's size), never the sender's, size the buffer
            rnd.parts[idx], rnd.weights[idx], rnd.got[idx], rnd.sq[idx] = torch.empty(rnd.numel), weight, 0, 0.0
            if codec.relays_parts:
                rnd.raw[idx] = []
            self._advance(rnd)
            reply = asyncio.ensure_future(self._reply(rnd, idx, writer, traffic))
            try:
                await self._receive(rnd, idx, reader, codec, sender)
            except _Rejected as e:
                if idx not in rnd.dropped and not rnd.done.done():
                    self._drop(rnd, idx, e.check, str(e))
            except asyncio.TimeoutError:
                # a member that stopped sending mid-part (its stream still open): a stall
                self._stalled(rnd, [idx])
                self._fail(rnd, SyncFailed(f"member {sender} sent {rnd.got.get(idx, 0)} of {len(rnd.chunks)} "
                                           f"chunks of its part, then nothing for {self.timeout:.0f} s"))
                return
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                # a member that vanished mid-part (crashed, killed, link cut): never a partial average
                self.stats["parts_cut"] += 1
                self._fail(rnd, SyncFailed(f"member {sender} vanished after {rnd.got.get(idx, 0)} of "
                                           f"{len(rnd.chunks)} chunks of its part ({type(e).__name__})"))
                logger.warning(f"[{self.node.short_id}] connection from {sender} dropped during a part; "
                               f"round of group {gid} aborted")
                return
            await reply
        except _Rejected as e:  # its header failed a check (before any reply started)
            if rnd is not None and idx is not None and idx not in rnd.dropped and not rnd.done.done():
                self._drop(rnd, idx, e.check, str(e))
            await self._reply_abort(writer, f"your part was dropped from this round: {e}")
        except (WireError, SyncFailed) as e:
            if isinstance(e, WireError):
                note_offence(self.node, sender, e)
            logger.warning(f"[{self.node.short_id}] refused part: {e}")
            if reply is None:
                await self._reply_abort(writer, str(e))
            elif rnd is not None:
                self._fail(rnd, e if isinstance(e, SyncFailed) else SyncFailed(str(e)))
                await asyncio.wait([reply], timeout=5.0)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            logger.warning(f"[{self.node.short_id}] connection from {sender} dropped during a part")
        finally:
            if reply is not None and not reply.done():
                reply.cancel()
            await close_after_reply(reader, writer)

    async def _receive(self, rnd: ShardRound, idx: int, reader: asyncio.StreamReader, codec: Codec, sender: str) -> None:
        """Read member ``idx``'s chunks into its part, checking each (exact length, finite values)
        before it counts; stops early when the part was dropped or the round ended."""
        traffic = self.node.traffic
        part = rnd.parts.get(idx)
        for a, b in rnd.chunks if part is not None else ():  # None: dropped already (the weight screen)
            frame = await asyncio.wait_for(read_header(reader, traffic, sender, timeout=None), self.timeout)
            if frame.get("t") != "c":
                raise _Rejected("length", f"expected chunk {rnd.got[idx] + 1} of {len(rnd.chunks)}, got a "
                                          f"{str(frame.get('t'))[:20]!r} message")
            try:
                data = await asyncio.wait_for(
                    read_payload(reader, frame, codec.encoded_size(b - a), traffic, sender), self.timeout)
            except WireError as e:
                raise _Rejected("length", str(e)) from None
            try:  # the length is exact by now: what a codec still refuses is its content (a NaN scale)
                codec.decode_into(data, part[a:b], sender)
            except WireError as e:  # a non-finite value, or a malformed layout (a sparse part's positions)
                raise _Rejected("finite" if "finite" in str(e) else "payload", str(e)) from None
            if codec.relays_parts:  # relayed as it came: every member averages these same bytes
                rnd.raw[idx].append(data)
            del data
            sq = squared_norm(part[a:b])
            if not math.isfinite(sq):
                raise _Rejected("finite", f"{codec.name} part decodes to non-finite values")
            if idx in rnd.dropped or rnd.done.done():
                return
            rnd.sq[idx] += sq
            rnd.got[idx] += 1
            self._advance(rnd)

    async def _reply(self, rnd: ShardRound, idx: int, writer: asyncio.StreamWriter, traffic: Traffic) -> None:
        """Stream the shard's result chunks to member ``idx`` as they are reduced, then the trailer
        naming whose parts they average (``avg``); ``again`` first when the results sent so far were
        replaced (a part dropped after they went out); ``abort`` if its part was dropped or the round
        failed. Every member reads the same chunks and trailer: the same bytes everywhere."""
        sent, epoch = 0, rnd.epoch
        while True:
            changed = rnd.changed
            if idx in rnd.dropped:
                await self._reply_abort(writer, f"your part was dropped from this round: {rnd.dropped[idx]}")
                return
            if rnd.done.done() and rnd.done.exception() is not None:
                await self._reply_abort(writer, str(rnd.done.exception()))
                return
            if rnd.epoch != epoch:
                await write_frame(writer, {"t": "again"}, traffic=traffic)
                sent, epoch = 0, rnd.epoch
            elif sent < len(rnd.out):
                await write_frame(writer, {"t": "c"}, rnd.out[sent], traffic=traffic)
                sent += 1
            elif rnd.done.done():
                trailer = {"t": "avg", "codec": rnd.codec.codec_id, "numel": rnd.numel, "cov": list(rnd.covered),
                           "w": rnd.covered_weight}
                if rnd.codec.relays_parts:  # the relayed parts' weights: each member averages them itself
                    trailer["ws"] = [rnd.weights[i] for i in rnd.covered]
                if rnd.level:  # the whole group's members the column's mean covers
                    trailer["gcov"] = list(rnd.gcovered)
                await write_frame(writer, trailer, traffic=traffic)
                return
            else:
                await changed.wait()

    @staticmethod
    def _check_open(rnd: ShardRound, idx: int, sender: str) -> None:
        """Member ``idx`` may still deliver its part: not dropped, not delivered, round not over."""
        if idx in rnd.dropped:
            raise _Rejected("dropped", rnd.dropped[idx])
        if rnd.done.done():
            if rnd.done.exception() is not None:  # failed (timeout elsewhere): not this sender's fault
                raise SyncFailed(f"the round of group {rnd.group.gid} is already over: {rnd.done.exception()}")
            raise WireError(f"second part from member {idx} for the same round", sender)
        if idx in rnd.parts:
            raise WireError(f"second part from member {idx} for the same round", sender)

    @staticmethod
    def _check_header(header: dict, rnd: ShardRound, idx: int, sender: str) -> Tuple[float, Codec]:
        """(weight, codec) of a member's part header; raises _Rejected naming the failed check."""
        claimed, weight = header.get("idx"), header.get("w")
        if type(claimed) is not int or claimed != idx:
            raise _Rejected("index", f"claims member index {str(claimed)[:20]}, the sender is member {idx}")
        codec_id = header.get("codec")
        codec = codec_by_id(codec_id, sender) if type(codec_id) is int and 0 <= codec_id < 256 else None
        numel, chunk = header.get("numel"), header.get("chunk")
        # by id: a parameterised codec (sparse's k) is the run's own instance; its size check is exact
        if codec is None or codec.codec_id != rnd.codec.codec_id or type(numel) is not int or numel != rnd.numel:
            raise _Rejected("codec", f"codec {str(codec_id)[:20]} with {str(numel)[:20]} values, expected "
                                     f"{rnd.codec.codec_id} ({rnd.codec.name}) with {rnd.numel}")
        if type(chunk) is not int or chunk != chunk_values(rnd.codec):
            raise _Rejected("codec", f"chunks of {str(chunk)[:20]} values, expected {chunk_values(rnd.codec)}")
        if type(weight) not in (int, float) or not (0 < weight < 1e12):
            raise _Rejected("weight", f"weight {str(weight)[:30]} out of range (0, 1e12)")
        return float(weight), rnd.codec

    def _drop(self, rnd: ShardRound, idx: int, check: str, reason: str, reduce: bool = True) -> None:
        """Leave member ``idx``'s part out of this shard; log it with the peer id, count an offence."""
        peer = rnd.group.members[idx]
        rnd.dropped[idx] = reason
        rnd.parts.pop(idx, None)
        rnd.raw.pop(idx, None)
        self.stats["parts_dropped"] += 1
        self.stats["dropped:" + check] += 1
        self.dropped_log.append((peer, rnd.group.gid, rnd.phase, reason))
        logger.warning(f"[{self.node.short_id}] dropped the part of peer {peer} from group {rnd.group.gid} "
                       f"(fragment {rnd.group.frag}, round {rnd.group.round}, {rnd.phase}): {reason}")
        if getattr(self.node, "gate", None) is not None:
            self.node.gate.offence(peer, f"invalid part: {reason}")
        rnd.tick()
        if reduce:
            self._advance(rnd)

    def _stalled(self, rnd: ShardRound, late: Optional[List[int]] = None) -> None:
        """Our shard timed out (or member ``late[0]`` sent no chunk within the timeout): count an
        offence of each member whose part is incomplete, when another member's part did come in full
        (so our own link is not what failed). A member that stalls fails the round of every group it
        joins; counted like a member that sends junk, it is banned after ``ban_after`` rounds and its
        part is then dropped up front (the others' round goes on)."""
        if rnd.done.done() or rnd.group is None:
            return
        me, n = rnd.group.my_index, len(rnd.chunks)
        late = [i for i in (rnd.live() if late is None else late) if rnd.got.get(i, 0) < n]
        if not late or not any(i != me and rnd.got.get(i, 0) == n for i in rnd.live()):
            return
        gate = getattr(self.node, "gate", None)
        for i in late:
            peer = rnd.group.members[i]
            self.stats["members_stalled"] += 1
            reason = (f"stalled: {rnd.got.get(i, 0)} of {n} chunks of its part of group {rnd.group.gid} "
                      f"(fragment {rnd.group.frag}, round {rnd.group.round}, {rnd.phase}) after {self.timeout:.0f} s, "
                      "while other members' parts came")
            if gate is not None:
                gate.offence(peer, reason)  # logged there with the full peer id
            else:
                logger.warning(f"[{self.node.short_id}] peer {peer} {reason}")

    @staticmethod
    async def _reply_abort(writer: asyncio.StreamWriter, reason: str) -> None:
        try:
            await write_frame(writer, {"t": "abort", "reason": reason[:500]})
        except Exception:
            pass

    def _advance(self, rnd: ShardRound) -> None:
        """Reduce what can be reduced. Once every live member's weight is in, the weight screen runs
        and fixes the members the results average (``streaming``); from then on chunk ``j`` is reduced
        (in member order) as soon as every such member's chunk ``j`` is in, and its encoded result
        goes out at once (pipelined: the all-gather of chunk j overlaps the reduce-scatter of j+1).
        When every part is complete the norm screen runs (it needs whole parts): :meth:`_finish`."""
        if rnd.done.done() or rnd.group is None:
            return
        live = rnd.live()
        if rnd.streaming is None:
            if any(i not in rnd.weights for i in live):
                return
            self._screen(rnd, live, weights=True)
            live = rnd.live()
            # CenteredClip needs whole parts, and a subgroup's mean its column: no result leaves before
            # every part is in
            rnd.streaming = () if self._clipping(rnd, live) or rnd.level else tuple(live)
        n = len(rnd.chunks)
        if tuple(live) == rnd.streaming:
            while len(rnd.out) < n and all(rnd.got[i] > len(rnd.out) for i in live):
                j = len(rnd.out)
                a, b = rnd.chunks[j]
                rnd.out.append(self._result_chunk(rnd, live, j, a, b))
                rnd.tick()
        if all(rnd.got.get(i, 0) == n for i in live):
            self._finish(rnd)

    def _finish(self, rnd: ShardRound) -> None:
        """Every live part is complete: screen norms, then make the result final. When the chunks sent
        so far average a member that is now dropped (the norm screen, or a bad chunk after results had
        gone out), the whole result is recomputed and sent again (``epoch``; rare: only a bad part)."""
        live = rnd.live()
        if not live:
            self._fail(rnd, SyncFailed(f"no valid part left in group {rnd.group.gid}"))
            return
        self._screen(rnd, live, weights=False)
        live = rnd.live()
        if rnd.level is not None:  # once: the parts it averages are fixed from here on
            if rnd.column is None:
                rnd.column = asyncio.ensure_future(self._finish_capped(rnd, live))
            return
        if tuple(live) != rnd.streaming or len(rnd.out) < len(rnd.chunks):
            if rnd.out:
                rnd.epoch += 1
                self.stats["rounds_resent"] += 1
            if rnd.codec.relays_parts:
                rnd.out = [self._result_chunk(rnd, live, j, a, b) for j, (a, b) in enumerate(rnd.chunks)]
            else:
                result = self._mean(rnd, live)
                rnd.out = [rnd.codec.encode(result[a:b]) for a, b in rnd.chunks]
        rnd.covered = tuple(live)
        rnd.covered_weight = float(sum(rnd.weights[i] for i in live))  # member order: the same float everywhere
        rnd.done.set_result(None)
        rnd.parts.clear()
        rnd.raw.clear()
        rnd.tick()
        self.stats["rounds"] += 1

    async def _finish_capped(self, rnd: ShardRound, live: List[int]) -> None:
        """A subgroup's shard: its members' mean (screened as any shard's) goes through the shard's column,
        which averages the subgroups' means weighted by their total weights (in the column's member order,
        unscreened: each owner screened its own members) in the group's codec, and, beside it in fp32,
        which of the whole group's members the result covers (a 0/1 mark per member each subgroup kept:
        exact through the weighted mean). Every owner of the column decodes the same bytes; it encodes the
        result once for its subgroup, as any shard's, so every member of every subgroup decodes the same
        result for this shard."""
        level = rnd.level
        try:
            partial = self._mean(rnd, live)
            mask = torch.zeros(level.group.size, dtype=torch.float32)
            mask[[level.whole_index(i) for i in live]] = 1.0
            k = level.plan.owners[level.index].index(level.whole_index(rnd.group.my_index))
            column = level.group.column(level.plan, k)
            total = float(sum(rnd.weights[i] for i in live))  # member order, as a flat round's covered weight
            (out, cov), (marks, marked) = await asyncio.gather(
                self.allreduce_covered(column, COLUMN + rnd.phase, partial, total, rnd.codec, redo=False),
                self.allreduce_covered(column, COLUMN + "cov:" + rnd.phase, mask, total, get_codec("fp32"),
                                       redo=False))
            if not (cov.complete and marked.complete):
                raise SyncFailed(f"the column of shard {k} of group {level.group.gid} covered "
                                 f"{min(len(cov.members), len(marked.members))} of its {column.size} subgroups")
        except SyncFailed as e:
            self._fail(rnd, e)
            return
        except Exception as e:  # noqa: BLE001 - any failure of the column is this round's
            self._fail(rnd, SyncFailed(f"the column of group {level.group.gid} failed: {type(e).__name__}: {e}"))
            return
        if rnd.done.done():  # timed out meanwhile
            return
        rnd.out = [rnd.codec.encode(out[a:b]) for a, b in rnd.chunks]
        rnd.covered, rnd.covered_weight = tuple(live), cov.weight
        rnd.gcovered = tuple(int(i) for i in torch.nonzero(marks > 0).view(-1))
        rnd.done.set_result(None)
        rnd.parts.clear()
        rnd.tick()
        self.stats["rounds"] += 1
        self.stats["rounds_capped"] += 1

    @staticmethod
    def _result_chunk(rnd: ShardRound, live: Sequence[int], j: int, a: int, b: int) -> bytes:
        """Chunk ``j`` of the shard's result: the encoded weighted mean (member order), or, for a codec
        whose mean is not in its own format (``relays_parts``), the live members' chunks as they came,
        concatenated in member order (each member averages them with :func:`relayed_mean`)."""
        if rnd.codec.relays_parts:
            return b"".join(rnd.raw[i][j] for i in live)
        return rnd.codec.encode(weighted_mean([rnd.parts[i][a:b] for i in live], [rnd.weights[i] for i in live]))

    def _clipping(self, rnd: ShardRound, live: Sequence[int]) -> bool:
        return self.robust.aggregator == "centered_clip" and len(live) > 2 and self._screened(rnd)

    def _mean(self, rnd: ShardRound, live: Sequence[int]) -> torch.Tensor:
        """The live parts' aggregate (member order): the robust one, or for a column's parts (subgroup means,
        already screened, including those of a column capped again) the weighted mean as they are."""
        parts, weights = [rnd.parts[i] for i in live], [rnd.weights[i] for i in live]
        return aggregate(parts, weights, self.robust) if self._screened(rnd) else weighted_mean(parts, weights)

    def _screened(self, rnd: ShardRound) -> bool:
        """A column's parts are subgroup means with their total weights: their owners screened them."""
        return not rnd.phase.startswith(COLUMN)

    def _screen(self, rnd: ShardRound, live: List[int], weights: bool) -> None:
        """The robust screen over the live parts (member order): weights (known from the headers) or
        norms (known once the parts are complete). The owner's own part is never dropped."""
        if not self._screened(rnd):
            return
        me = rnd.group.my_index
        own = live.index(me) if me in live else -1
        if weights:
            found = screen([rnd.weights[i] for i in live], [], own, self.robust, rnd.numel, self.round_samples)
        else:
            found = screen([], [math.sqrt(rnd.sq[i]) for i in live], own, self.robust, rnd.numel)
        for k, reason in found.items():
            self._drop(rnd, live[k], reason.split(" ", 1)[0], reason, reduce=False)

    @staticmethod
    def _fail(rnd: ShardRound, exc: Exception) -> None:
        if not rnd.done.done():
            rnd.done.set_exception(exc)
            rnd.done.exception()  # mark retrieved
            rnd.parts.clear()
            rnd.tick()
