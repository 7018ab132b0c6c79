"""Butterfly all-reduce of a flat fp32 vector within a group, on our own wire protocol.

Why not hivemind's ``DecentralizedAverager``: it reports success when part of a tensor was not
averaged, its results differ by an ULP between peers, and it cannot carry a new codec (traps 2, 3
and 5 in hivemind-notes.md). Here:

* The vector is cut into one contiguous shard per *owner*, shard ``k`` owned by ``owners[k]``
  (members are sorted peer ids, so every peer cuts identically). The owners are every member,
  except the members nobody can dial (private peers behind NAT, ``swarm/reachability.py``): the
  group's leader lists the owners in the group it sends to every member (``Group.owners``), so
  every member cuts the same shards. A private member owns nothing: it dials each owner, sends its
  part and reads the mean back on the same stream (outbound connections work through NAT), and
  its part carries its sample weight like everyone's.
* Every member sends its part of shard ``k`` to its owner (one stream per pair, all concurrently),
  encoded with the group's codec. The owner decodes each part (its own part goes through the same
  encode/decode round trip), aggregates them once every part is in or dropped (sample-weighted mean
  summed **in fp32 in member order**, or CenteredClip: :mod:`p2pdiloco.compression.robust`),
  encodes the result *once* and replies with the same bytes to everyone. Every peer therefore
  decodes identical bytes: results are bitwise identical.
* If a part is missing when the timeout expires (a peer died or stalls), the owner replies ``abort``
  to everyone and every member raises :class:`SyncFailed` for the whole vector: a partial average
  is never returned.

Hostile parts (reliability.md rows 6–7). The owner checks every part before using it, in this
order, each before anything is allocated from the sender's numbers: header types; the sender is the
group member at the index it claims; codec id and number of values equal what the owner expects
for this shard; weight finite in (0, 1e12); payload byte length exactly ``codec.encoded_size``;
decoded values finite. Once all parts are in, :func:`~p2pdiloco.compression.robust.screen` drops
parts whose weight or norm is far above the group's median. **A part that fails is dropped, not
the round**: the owner aggregates the parts that passed and sends that result to every member, so
the round still ends identically on every honest peer (each shard's result is decided by its owner
alone and sent as one set of bytes). The offender gets ``abort`` with the reason (it applies
nothing and will re-sync from the swarm), is logged with its full peer id and counted as an
offence (:class:`~p2pdiloco.swarm.protocol.PeerGate`; repeat offenders are banned, and a banned
member's part is dropped up front). The owner's own part is never dropped.

No silent partial average. Every owner's reply names the members its mean covers and their total
weight (``cov``, ``w``), so every member learns, for every shard, whose parts are in it
(:class:`Coverage`). Then, identically on every member (they all read the same replies):

* every shard covers the whole group: the round is complete;
* every shard covers the same subset ``S`` (a member's own part was not finite, so it left itself
  out and every owner dropped it): the round is applied over ``S`` and reported as **degraded**,
  naming who was left out (``Coverage.left_out``; a warning on every member, ``coverage`` and
  ``left_out`` in the sync event);
* shards cover different subsets (an owner dropped a member that other owners kept: a peer that
  sent a bad part to some owners only, a norm screen that fired in one shard, different ban lists):
  the round is **re-done** at once over ``S`` = the members every shard covers, as a group of its
  own (id derived from the first group's and ``S``), so every shard of the applied result averages
  the same members. If the re-done round's shards differ again, the round fails everywhere.

A multi-phase reducer (low-rank) keeps the member set of its first phase for the later ones
(:class:`~p2pdiloco.diloco.core.DiLoCo` runs them on the restricted group), and fails the round if
a later phase covers fewer members.

Members check the owner's reply too: exact size, finite values, and a norm plausible next to their
own part (at most ``norm_bound·√M`` times it); an implausible result is an offence of the owner and
fails the round for that member (a Byzantine *owner* can still hand different members different
bytes; divergence repair by majority digest, state_sync.in_minority, is the backstop).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .. import faults
from ..compression import Codec, codec_by_id
from ..compression.robust import NORM_SCREEN_MIN_NUMEL, RobustConfig, aggregate, screen
from ..errors import SyncFailed, WireError
from .dialing import open_stream
from .protocol import (PROTOCOL_VERSION, Traffic, check_version, close_after_reply, note_offence, read_frame,
                       read_header, read_payload, write_frame)

__all__ = ["Group", "Coverage", "AllReducer", "make_group_id", "restricted_group", "shard_bounds"]

logger = logging.getLogger(__name__)

#: parts for groups this owner has not formed yet wait for it; at most this many such groups at once
MAX_PENDING_ROUNDS = 256
#: ... and at most this many opened by one sender
MAX_PENDING_PER_PEER = 16


def make_group_id(run_id: str, frag: int, round_: int, members: Sequence[str], base: str = "",
                  owners: Optional[Sequence[str]] = None) -> str:
    """The group's id. ``base`` is the id of the group the leader's state came from (its last successful
    sync): chaining ids keeps two histories that reuse a round number and members (a peer alone on each
    side of a partition) apart. ``owners`` (when not every member owns a shard) is part of it too, so
    members that were told different owners cannot meet in one round."""
    extra = [f"base:{base}"] if base else []
    if owners is not None and tuple(owners) != tuple(members):
        extra += [f"owner:{o}" for o in owners]
    blob = "\n".join([run_id, str(frag), str(round_), *members, *extra]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@dataclass(frozen=True)
class Group:
    """A finalized group: the same ``gid``, ``members`` and ``owners`` on every member.

    ``owners``: the members that own a shard, in member order (None: every member). Private
    members (nobody can dial them) are left out of it by the leader; see the module docstring.
    """

    gid: str
    members: Tuple[str, ...]
    my_index: int
    frag: int
    round: int
    owners: Optional[Tuple[str, ...]] = None

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def shard_owners(self) -> Tuple[str, ...]:
        return self.members if self.owners is None else self.owners


@dataclass(frozen=True)
class Coverage:
    """Whose parts a finished all-reduce averaged, the same on every member that applies it.

    ``members``: peer ids every shard's mean covers (sorted, as in the group); ``left_out``: the
    group's other members; ``weight``: their total sample weight (Σ w_i over ``members``);
    ``redone``: the first exchange's shards covered different members and the round was re-done
    over ``members``. Complete when ``left_out`` is empty, else degraded.
    """

    members: Tuple[str, ...]
    left_out: Tuple[str, ...] = ()
    weight: float = 0.0
    redone: bool = False

    @property
    def complete(self) -> bool:
        return not self.left_out

    @property
    def kind(self) -> str:
        """``full``, ``degraded`` (applied over fewer members) or ``redone`` (re-done over fewer)."""
        return "full" if self.complete else ("redone" if self.redone else "degraded")


def restricted_group(group: "Group", members: Sequence[str]) -> "Group":
    """The group of ``group``'s round restricted to ``members`` (which must include us): what a round
    whose shards covered different members is re-done with. Its id derives from the first group's,
    so every member that computes the same ``members`` forms the same group without matchmaking."""
    members = tuple(m for m in group.members if m in set(members))
    me = group.members[group.my_index]
    gid = hashlib.sha256("\n".join([group.gid, "redo", *members]).encode()).hexdigest()[:24]
    owners = None if group.owners is None else tuple(o for o in group.owners if o in members)
    return Group(gid=gid, members=members, my_index=members.index(me), frag=group.frag, round=group.round,
                 owners=owners)


def shard_bounds(numel: int, parts: int, align: int = 1) -> List[Tuple[int, int]]:
    """Contiguous near-equal shards, identical on every peer for the same (numel, parts, align).

    Every shard starts at a multiple of ``align`` (the codec's ``block_size``), so a blockwise codec's
    blocks never straddle two shards and ``codec.roundtrip(vec)`` is exactly what the owners decode.
    """
    units = -(-numel // align)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        bounds.append((min(start * align, numel), min(end * align, numel)))
        start = end
    return bounds


@dataclass
class _Round:
    """The owner's side of one (gid, phase): parts received so far, parts dropped, the result."""

    created: float = field(default_factory=time.monotonic)
    configured: asyncio.Event = field(default_factory=asyncio.Event)
    opened_by: str = ""                    # sender whose part created this round before we configured it
    group: Optional[Group] = None
    codec: Optional[Codec] = None
    numel: int = 0
    parts: Dict[int, Tuple[float, torch.Tensor]] = field(default_factory=dict)
    dropped: Dict[int, str] = field(default_factory=dict)   # member index -> why its part was dropped
    covered: Tuple[int, ...] = ()          # member indexes whose parts the result averages
    covered_weight: float = 0.0            # their total weight
    phase: str = ""
    done: asyncio.Future = None  # bytes of the encoded result, or exception

    def __post_init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()


class _Excluded(SyncFailed):
    """An owner left *our* part out (or refuses us): the others' round goes on without us."""


class _Rejected(Exception):
    """A member's part failed a check: drop it from the round (the others go on)."""

    def __init__(self, check: str, reason: str):
        self.check = check
        super().__init__(reason)


class AllReducer:
    """Serves the ``part`` handler and runs all-reduce rounds. Lives on the node's event loop.

    Counters for tests and operators: ``stats`` (``parts_dropped``, ``dropped:<check>``,
    ``replies_rejected``, ``rounds``, ``dial_retries``: streams to an owner whose dial failed
    first and was waited out, see :mod:`.dialing`) and ``dropped_log`` (the last 256 ``(peer, gid, phase, reason)``).
    """

    def __init__(self, node, run_id: str, timeout: float, robust: Optional[RobustConfig] = None):
        self.node = node
        self.run_id = run_id
        self.timeout = timeout
        self.robust = robust or RobustConfig()
        #: inner.round_samples of the run (rounds by the swarm's samples): the weight screen's budget
        self.round_samples = 0
        self.handler_name = f"p2pdiloco.{run_id}.part"
        self._rounds: Dict[Tuple[str, str], _Round] = {}
        self.stats: Counter = Counter()
        self.dropped_log: Deque[Tuple[str, str, str, str]] = deque(maxlen=256)
        #: fault-injection hook: called with (group, phase) before parts are sent; tests use it
        self.before_send = None
        node.add_handler(self.handler_name, self._handle_part)

    # ---- owner side -----------------------------------------------------------------------------
    def _round(self, gid: str, phase: str, sender: str = "") -> _Round:
        self._sweep()
        key = (gid, phase)
        if key not in self._rounds:
            if sender:  # a part for a group we have not formed (yet): bounded, per sender and in all
                pending = [r for r in self._rounds.values() if not r.configured.is_set()]
                if (len(pending) >= MAX_PENDING_ROUNDS
                        or sum(r.opened_by == sender for r in pending) >= MAX_PENDING_PER_PEER):
                    err = WireError(f"too many parts for groups this peer has not formed (gid {gid})", sender)
                    err.benign = True
                    raise err
            self._rounds[key] = _Round(opened_by=sender, phase=phase)
        return self._rounds[key]

    def _sweep(self) -> None:
        horizon = time.monotonic() - 4 * self.timeout
        for key in [k for k, r in self._rounds.items() if r.created < horizon]:
            del self._rounds[key]

    async def _handle_part(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        traffic = self.node.traffic
        rnd: Optional[_Round] = None
        idx: Optional[int] = None
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
            try:
                payload = await asyncio.wait_for(
                    read_payload(reader, header, codec.encoded_size(rnd.numel), traffic, sender), self.timeout)
            except WireError as e:
                raise _Rejected("length", str(e)) from None
            try:
                part = codec.decode(payload, rnd.numel, sender)
            except WireError as e:
                raise _Rejected("finite", str(e)) from None
            del payload
            self._check_open(rnd, idx, sender)  # the round may have moved on while we read
            rnd.parts[idx] = (weight, part)
            self._maybe_reduce(rnd)
            try:
                result = await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout)
            except asyncio.TimeoutError:
                self._fail(rnd, SyncFailed(f"shard of group {gid} incomplete after {self.timeout:.0f} s"))
                raise rnd.done.exception()
            if idx in rnd.dropped:  # the screen at reduce time dropped this part
                raise _Rejected("screen", rnd.dropped[idx])
            await write_frame(writer, {"t": "avg", "codec": codec.codec_id, "numel": rnd.numel,
                                       "cov": list(rnd.covered), "w": rnd.covered_weight}, result, traffic=traffic)
        except _Rejected as e:
            reason = str(e)
            if rnd is not None and idx is not None and idx not in rnd.dropped:
                self._drop(rnd, idx, e.check, reason)
            await self._reply_abort(writer, f"your part was dropped from this round: {reason}")
        except (WireError, SyncFailed) as e:
            if isinstance(e, WireError):
                note_offence(self.node, sender, e)
            logger.warning(f"[{self.node.short_id}] refused part: {e}")
            await self._reply_abort(writer, str(e))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            logger.warning(f"[{self.node.short_id}] connection from {sender} dropped during a part")
        finally:
            await close_after_reply(reader, writer)

    @staticmethod
    def _check_open(rnd: _Round, idx: int, sender: str) -> None:
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
    def _check_header(header: dict, rnd: _Round, idx: int, sender: str) -> Tuple[float, Codec]:
        """(weight, codec) of a member's part header; raises _Rejected naming the failed check."""
        claimed, weight = header.get("idx"), header.get("w")
        if type(claimed) is not int or claimed != idx:
            raise _Rejected("index", f"claims member index {str(claimed)[:20]}, the sender is member {idx}")
        codec_id = header.get("codec")
        codec = codec_by_id(codec_id, sender) if type(codec_id) is int and 0 <= codec_id < 256 else None
        numel = header.get("numel")
        if codec is not rnd.codec or type(numel) is not int or numel != rnd.numel:
            raise _Rejected("codec", f"codec {str(codec_id)[:20]} with {str(numel)[:20]} values, expected "
                                     f"{rnd.codec.codec_id} ({rnd.codec.name}) with {rnd.numel}")
        if type(weight) not in (int, float) or not (0 < weight < 1e12):
            raise _Rejected("weight", f"weight {str(weight)[:30]} out of range (0, 1e12)")
        return float(weight), codec

    def _drop(self, rnd: _Round, idx: int, check: str, reason: str, reduce: bool = True) -> None:
        """Leave member ``idx``'s part out of this shard; log it with the peer id, count an offence."""
        peer = rnd.group.members[idx]
        rnd.dropped[idx] = reason
        rnd.parts.pop(idx, None)
        self.stats["parts_dropped"] += 1
        self.stats["dropped:" + check] += 1
        self.dropped_log.append((peer, rnd.group.gid, rnd.phase, reason))
        logger.warning(f"[{self.node.short_id}] dropped the part of peer {peer} from group {rnd.group.gid} "
                       f"(fragment {rnd.group.frag}, round {rnd.group.round}, {rnd.phase}): {reason}")
        if getattr(self.node, "gate", None) is not None:
            self.node.gate.offence(peer, f"invalid part: {reason}")
        if reduce:
            self._maybe_reduce(rnd)

    @staticmethod
    async def _reply_abort(writer: asyncio.StreamWriter, reason: str) -> None:
        try:
            await write_frame(writer, {"t": "abort", "reason": reason[:500]})
        except Exception:
            pass

    def _maybe_reduce(self, rnd: _Round) -> None:
        if rnd.done.done() or rnd.group is None or len(rnd.parts) + len(rnd.dropped) < rnd.group.size:
            return
        me = rnd.group.my_index
        order = sorted(rnd.parts)                       # member order: bitwise-reproducible result
        if not order:
            self._fail(rnd, SyncFailed(f"no valid part left in group {rnd.group.gid}"))
            return
        weights = [rnd.parts[i][0] for i in order]
        norms = [float(rnd.parts[i][1].norm()) for i in order]
        own = order.index(me) if me in rnd.parts else -1
        for k, reason in screen(weights, norms, own, self.robust, rnd.numel, self.round_samples).items():
            self._drop(rnd, order[k], reason.split(" ", 1)[0], reason, reduce=False)
        order = sorted(rnd.parts)
        result = aggregate([rnd.parts[i][1] for i in order], [rnd.parts[i][0] for i in order], self.robust)
        rnd.covered = tuple(order)
        rnd.covered_weight = float(sum(rnd.parts[i][0] for i in order))  # member order: the same float everywhere
        rnd.done.set_result(rnd.codec.encode(result))
        rnd.parts.clear()
        self.stats["rounds"] += 1

    @staticmethod
    def _fail(rnd: _Round, exc: Exception) -> None:
        if not rnd.done.done():
            rnd.done.set_exception(exc)
            rnd.done.exception()  # mark retrieved

    # ---- member side ----------------------------------------------------------------------------
    async def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec) -> torch.Tensor:
        """Weighted mean of ``vec`` over the group; identical bytes on every member, or SyncFailed."""
        return (await self.allreduce_covered(group, phase, vec, weight, codec))[0]

    async def allreduce_covered(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec,
                                redo: bool = True) -> Tuple[torch.Tensor, Coverage]:
        """(weighted mean, whose parts it covers): the same member set on every shard (see module
        docstring: a round whose shards differ is re-done over the common members once, when ``redo``)."""
        vec = vec.detach().to("cpu", torch.float32).contiguous().view(-1)
        out, covers = await self._exchange(group, phase, vec, weight, codec)
        sets = {cov for cov, _ in covers}
        common = sorted(set.intersection(*(set(c) for c in sets)))
        members = tuple(group.members[i] for i in common)
        left = tuple(m for m in group.members if m not in members)
        if len(sets) == 1:
            if left:
                self.stats["rounds_degraded"] += 1
                logger.warning(f"[{self.node.short_id}] group {group.gid} (fragment {group.frag}, round {group.round}, "
                               f"{phase}) is degraded: its means cover {len(members)} of {group.size} members; "
                               f"left out: {', '.join(left)}")
            return out, Coverage(members=members, left_out=left, weight=covers[0][1])
        if not redo:
            raise SyncFailed(f"the shards of group {group.gid} cover different members "
                             f"({sorted(sets)}); not applied")
        self.stats["rounds_redone"] += 1
        logger.warning(f"[{self.node.short_id}] the shards of group {group.gid} (fragment {group.frag}, round "
                       f"{group.round}, {phase}) covered different members; re-doing it without {', '.join(left)}")
        sub = restricted_group(group, members)
        out, cov = await self.allreduce_covered(sub, phase, vec, weight, codec, redo=False)
        left_out = tuple(m for m in group.members if m not in cov.members)
        return out, Coverage(members=cov.members, left_out=left_out, weight=cov.weight, redone=True)

    async def _exchange(self, group: Group, phase: str, vec: torch.Tensor, weight: float,
                        codec: Codec) -> Tuple[torch.Tensor, List[Tuple[Tuple[int, ...], float]]]:
        """One butterfly exchange: (the concatenated means, each shard's (covered indexes, weight))."""
        owners = group.shard_owners
        if not owners:
            raise SyncFailed(f"no member of group {group.gid} can own a shard: every member is private (behind "
                             "NAT), so none can accept the others' parts; a group needs a public peer")
        owner_idx = [group.members.index(o) for o in owners]   # shard k -> member index of its owner
        bounds = shard_bounds(vec.numel(), len(owners), codec.block_size)
        me = group.my_index
        mine = owner_idx.index(me) if me in owner_idx else None  # our shard, None: we own none (private)
        finite = bool(torch.isfinite(vec).all())
        rnd: Optional[_Round] = None
        if mine is not None:
            lo, hi = bounds[mine]
            rnd = self._round(group.gid, phase)
            rnd.group, rnd.codec, rnd.numel = group, codec, hi - lo
            gate = getattr(self.node, "gate", None)
            for i, peer in enumerate(group.members):  # banned members' parts are dropped up front
                if i != me and gate is not None and gate.banned(peer) and i not in rnd.dropped:
                    rnd.dropped[i] = f"peer {peer} is banned here"
                    rnd.parts.pop(i, None)
                    self.stats["dropped:banned"] += 1
            rnd.configured.set()
            # our own part takes the same lossy round trip as everybody else's
            if finite:
                rnd.parts[me] = (float(weight), codec.roundtrip(vec[lo:hi]) if codec.relative_error_bound
                                 else vec[lo:hi].clone())
            else:  # our own training diverged: serve the others without our part, then apply nothing
                rnd.dropped[me] = "the owner's own pseudo-gradient is not finite"
                logger.error(f"[{self.node.short_id}] our pseudo-gradient is not finite; leaving it out of "
                             f"group {group.gid} and applying nothing this round")
            self._maybe_reduce(rnd)
        if self.before_send is not None:
            self.before_send(group, phase)

        async def exchange(k: int) -> Tuple[torch.Tensor, Tuple[int, ...], float]:
            a, b = bounds[k]
            if k == mine:
                mean_bytes = await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout)
                return codec.decode(mean_bytes, b - a), rnd.covered, rnd.covered_weight
            return await self._send_part(group, phase, owner_idx[k], vec[a:b], weight, codec)

        tasks = [asyncio.ensure_future(exchange(k)) for k in range(len(owners))]
        deadline = asyncio.get_running_loop().time() + self.timeout * 1.5
        excluded = False
        try:
            faults.fire("allreduce.send", frag=group.frag, round=group.round)  # fault-injection hook
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=self.timeout * 1.5)
        except _Excluded:
            excluded = True
            raise
        except asyncio.TimeoutError:
            raise SyncFailed(f"all-reduce of group {group.gid} timed out after {self.timeout:.0f} s") from None
        except SyncFailed:
            raise
        except (WireError, ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            raise SyncFailed(f"all-reduce of group {group.gid} failed: {e}") from None
        except Exception as e:  # P2P daemon errors (peer unreachable) and the like
            raise SyncFailed(f"all-reduce of group {group.gid} failed: {type(e).__name__}: {e}") from None
        finally:
            for t in tasks:
                t.cancel()
            if excluded and rnd is not None and not rnd.done.done():
                # An owner dropped our part, but the others' round goes on: keep serving our shard
                # until it is decided, so one rejected member never aborts everyone's round.
                try:
                    await asyncio.wait_for(asyncio.shield(rnd.done), max(0.0, deadline - asyncio.get_running_loop().time()))
                except BaseException:
                    pass
            if rnd is not None:
                self._fail(rnd, SyncFailed("round finished"))
                self._rounds.pop((group.gid, phase), None)
        if not finite:
            raise SyncFailed("our own pseudo-gradient is not finite; this round is not applied here")
        return torch.cat([r[0] for r in results]), [(r[1], r[2]) for r in results]

    def _outgoing(self, group: Group, phase: str, j: int, part: torch.Tensor,
                  weight: float) -> Tuple[torch.Tensor, float]:
        """What we send to owner ``j``: our part and weight, unchanged. (The one seam a test's
        misbehaving peer overrides; everything else it runs is the real code.)"""
        return part, weight

    async def _connect(self, peer: str):
        """Open a stream to ``peer``'s part handler. Matchmaking connected the group's members already
        (its warm step); a dial that still fails (a cold peer, an address in libp2p's dial backoff) is
        waited out within the round's timeout rather than failing the round for the whole group
        (:mod:`.dialing`)."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        return await open_stream(self.node, peer, self.handler_name, deadline, stats=self.stats)

    async def _send_part(self, group: Group, phase: str, j: int, part: torch.Tensor, weight: float,
                         codec: Codec) -> Tuple[torch.Tensor, Tuple[int, ...], float]:
        owner = group.members[j]
        traffic: Traffic = self.node.traffic
        sent_part, sent_weight = self._outgoing(group, phase, j, part, weight)
        _, reader, writer = await self._connect(owner)
        try:
            header = {"t": "part", "v": PROTOCOL_VERSION, "gid": group.gid, "phase": phase, "idx": group.my_index,
                      "w": float(sent_weight), "codec": codec.codec_id, "numel": sent_part.numel()}
            await write_frame(writer, header, codec.encode(sent_part), traffic=traffic)
            faults.fire("allreduce.part_sent", frag=group.frag, round=group.round)  # fault-injection hook
            reply, payload = await read_frame(reader, codec.encoded_size(part.numel()), traffic, owner)
            if reply.get("t") in ("abort", "refuse"):
                reason = str(reply.get("reason"))[:500]
                excluded = reason.startswith("your part was dropped") or "is banned here" in reason
                raise (_Excluded if excluded else SyncFailed)(f"owner {owner[-6:]} aborted the round: {reason}")
            if reply.get("t") != "avg" or reply.get("codec") != codec.codec_id or reply.get("numel") != part.numel():
                raise WireError(f"unexpected reply {str(reply.get('t'))[:20]!r}", owner)
            if len(payload) != codec.encoded_size(part.numel()):
                raise WireError("averaged shard has the wrong size", owner)
            covered = self._check_coverage(group, reply, j, owner)
            result = codec.decode(payload, part.numel(), owner)
            self._check_result(group, owner, part, result)
            return result, covered, float(reply["w"])
        except WireError as e:
            self.stats["replies_rejected"] += 1
            note_offence(self.node, owner, e)
            raise
        finally:
            writer.close()

    @staticmethod
    def _check_coverage(group: Group, reply: dict, j: int, owner: str) -> Tuple[int, ...]:
        """The member indexes an owner's reply says its mean covers: sorted, distinct, in range, with us
        among them (it replied with a mean, so it kept our part), weight positive. (The owner itself
        may be missing: its own pseudo-gradient was not finite.)"""
        cov, w = reply.get("cov"), reply.get("w")
        if (not isinstance(cov, list) or not all(type(i) is int for i in cov) or cov != sorted(set(cov))
                or not cov or cov[0] < 0 or cov[-1] >= group.size or group.my_index not in cov
                or type(w) not in (int, float) or not 0 < w < 1e12 * group.size):
            raise WireError(f"reply names an invalid member set {str(cov)[:60]} or weight {str(w)[:20]}", owner)
        return tuple(cov)

    def _check_result(self, group: Group, owner: str, mine: torch.Tensor, result: torch.Tensor) -> None:
        """A result far larger than our own part is implausible: every part the owner may keep is
        within norm_bound of the median, and any aggregate of them within √M of that."""
        bound = self.robust.norm_bound
        if not bound or mine.numel() < NORM_SCREEN_MIN_NUMEL:
            return
        own = float(mine.norm())
        got = float(result.norm())
        if own > 0 and got > bound * math.sqrt(group.size) * own:
            raise WireError(f"averaged shard has norm {got:.4g}, implausible next to our part's {own:.4g} "
                            f"(limit {bound:g}·√{group.size} times it)", owner)
