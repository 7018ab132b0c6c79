"""Butterfly all-reduce of a flat fp32 vector within a group, on our own wire protocol.

Why not hivemind's ``DecentralizedAverager``: it reports success when part of a tensor was not
averaged, its results differ by an ULP between peers, and it cannot carry a new codec (traps 2, 3
and 5 in hivemind-notes.md). Here:

* The vector is cut into one contiguous shard per *owner*, shard ``k`` owned by ``owners[k]``
  (members are sorted peer ids, so every peer cuts identically). The owners are every member,
  except the members nobody can dial directly (peers behind NAT, ``swarm/reachability.py``; those a
  relay reaches own shards only when no member can be dialed directly, ``swarm/relay.py``): the
  group's leader lists the owners in the group it sends to every member (``Group.owners``), so
  every member cuts the same shards. A private member owns nothing: it dials each owner, sends its
  part and reads the mean back on the same stream (outbound connections work through NAT), and
  its part carries its sample weight like everyone's.
* Every member sends its part of shard ``k`` to its owner (one stream per pair, all concurrently),
  encoded with the group's codec. The owner decodes each part (its own part goes through the same
  encode/decode round trip), aggregates them (sample-weighted mean summed **in fp32 in member
  order**, or CenteredClip: :mod:`p2pdiloco.compression.robust`), encodes the result *once* and
  replies with the same bytes to everyone. Every peer therefore decodes identical bytes: results
  are bitwise identical.
* **Pipelined.** Parts and results travel in chunks of :data:`CHUNK_VALUES` values (whole codec
  blocks; each chunk encoded on its own, which for blockwise codecs is the same bytes as encoding
  the part at once). Once every member's weight is in (headers) the weight screen runs; then the
  owner reduces chunk ``j`` as soon as every member's chunk ``j`` is in and streams its encoded mean
  to every member at once, while chunk ``j+1`` is still arriving; a member sends its chunks and reads
  the result chunks on the same stream concurrently, decoding each into place. The mean is
  element-wise, so a chunk's result is bitwise the whole shard's. The norm screen and CenteredClip
  need whole parts: CenteredClip sends nothing before every part is in, and if the norm screen (or a
  chunk that fails its checks after results went out) drops a part whose chunks were already
  averaged, the owner recomputes the shard without it and sends it again, preceded by ``again``
  (members discard what they had; only a bad part costs this). A reply ends with a trailer (``avg``)
  naming the members the mean covers: nothing counts before it.
* If a part is missing when the timeout expires (a peer died or stalls) or a member's stream breaks
  mid-part (killed after half its chunks), the owner replies ``abort`` to everyone and every member
  raises :class:`SyncFailed` for the whole vector: a partial average is never returned. A member
  whose part is incomplete at the timeout while another member's part came in full is counted as
  an offender (``stats["members_stalled"]``): one that stalls every round it joins gets banned.
* **Memory** (besides the input): a member holds the result (one vector) and, as an owner, the
  other members' parts of its shard ((M-1)/M of a vector; its own part is read in place, or its
  codec round trip for lossy codecs), the shard's encoded result, and a few chunks in flight: about
  two vectors of fp32 for the lossless codec, less for 4-bit ones (tests/test_allreduce_chunks.py
  measures it at 100M values). The owner keeps the parts until the round ends because a late drop
  recomputes the shard from them.

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
from ..compression.robust import NORM_SCREEN_MIN_NUMEL, RobustConfig, aggregate, screen, weighted_mean
from ..errors import SyncFailed, WireError
from .dialing import open_stream
from .protocol import (PROTOCOL_VERSION, Traffic, check_version, close_after_reply, note_offence, quota_refusal,
                       read_frame, read_header, read_payload, write_frame)

__all__ = ["Group", "Coverage", "AllReducer", "make_group_id", "restricted_group", "shard_bounds", "chunk_values",
           "chunk_bounds", "CHUNK_VALUES"]

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
#: values per chunk of a part or result on the wire (before rounding to whole codec blocks): 4 MB of
#: fp32, 0.56 MB of a 4-bit codec. Small enough that an owner reduces and returns chunk k while
#: chunk k+1 is still arriving, large enough that per-chunk Python work is negligible.
CHUNK_VALUES = 1 << 20


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


def chunk_values(codec: Codec) -> int:
    """Values per chunk of a part or result on the wire for ``codec``: ``CHUNK_VALUES`` rounded down to
    whole codec blocks (a blockwise codec encodes every chunk on its own, so chunks must not split a
    block). Every member and owner derives it from the codec alone; a part header states it."""
    block = max(1, codec.block_size)
    return max(block, CHUNK_VALUES // block * block)


def chunk_bounds(numel: int, chunk: int) -> List[Tuple[int, int]]:
    """The chunks of a shard of ``numel`` values: at least one (an empty shard is one empty chunk)."""
    return [(s, min(numel, s + chunk)) for s in range(0, numel, chunk)] or [(0, 0)]


def _squared_norm(x: torch.Tensor) -> float:
    """‖x‖², or NaN when ``x`` holds a non-finite value: one pass for the finiteness check and the
    norm screen (the fp32 dot overflows only for values near 1e19; those are rescanned exactly)."""
    sq = float(torch.dot(x, x)) if x.numel() else 0.0
    if math.isfinite(sq):
        return sq
    if not bool(torch.isfinite(x).all()):
        return math.nan
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


@dataclass
class _Round:
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
    weights: Dict[int, float] = field(default_factory=dict)
    got: Dict[int, int] = field(default_factory=dict)              # member index -> chunks received
    sq: Dict[int, float] = field(default_factory=dict)             # member index -> ‖part‖² so far
    dropped: Dict[int, str] = field(default_factory=dict)   # member index -> why its part was dropped
    streaming: Optional[Tuple[int, ...]] = None  # members the result chunks sent so far average (None: not yet)
    out: List[bytes] = field(default_factory=list)                 # encoded result chunks of this epoch
    epoch: int = 0                         # bumped when results already sent are replaced (see _finish)
    covered: Tuple[int, ...] = ()          # member indexes whose parts the result averages
    covered_weight: float = 0.0            # their total weight
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
        late = [f"{self.group.members[i][-6:]} ({self.got.get(i, 0)} of {n} chunks)" for i in self.live()
                if self.got.get(i, 0) < n]
        return ", ".join(late) or "nobody"


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
    ``replies_rejected``, ``rounds``, ``rounds_resent`` (results sent again after a late drop),
    ``members_stalled`` (members counted as offenders for a part incomplete at the timeout),
    ``parts_cut`` (a member's stream broke mid-part: its round aborted),
    ``dial_retries``: streams to an owner whose dial failed first and was waited out, see
    :mod:`.dialing`) and ``dropped_log`` (the last 256 ``(peer, gid, phase, reason)``).
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
            self._rounds[key] = _Round(opened_by=sender, phase=phase)
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
        rnd: Optional[_Round] = None
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

    async def _receive(self, rnd: _Round, idx: int, reader: asyncio.StreamReader, codec: Codec, sender: str) -> None:
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
            except WireError as e:
                raise _Rejected("finite", str(e)) from None
            del data
            sq = _squared_norm(part[a:b])
            if not math.isfinite(sq):
                raise _Rejected("finite", f"{codec.name} part decodes to non-finite values")
            if idx in rnd.dropped or rnd.done.done():
                return
            rnd.sq[idx] += sq
            rnd.got[idx] += 1
            self._advance(rnd)

    async def _reply(self, rnd: _Round, idx: int, writer: asyncio.StreamWriter, traffic: Traffic) -> None:
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
                await write_frame(writer, {"t": "avg", "codec": rnd.codec.codec_id, "numel": rnd.numel,
                                           "cov": list(rnd.covered), "w": rnd.covered_weight}, traffic=traffic)
                return
            else:
                await changed.wait()

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
        numel, chunk = header.get("numel"), header.get("chunk")
        if codec is not rnd.codec or type(numel) is not int or numel != rnd.numel:
            raise _Rejected("codec", f"codec {str(codec_id)[:20]} with {str(numel)[:20]} values, expected "
                                     f"{rnd.codec.codec_id} ({rnd.codec.name}) with {rnd.numel}")
        if type(chunk) is not int or chunk != chunk_values(codec):
            raise _Rejected("codec", f"chunks of {str(chunk)[:20]} values, expected {chunk_values(codec)}")
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
        rnd.tick()
        if reduce:
            self._advance(rnd)

    def _stalled(self, rnd: _Round, late: Optional[List[int]] = None) -> None:
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

    def _advance(self, rnd: _Round) -> None:
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
            # CenteredClip needs whole parts: no result leaves before every part is in
            rnd.streaming = () if self._clipping(live) else tuple(live)
        n = len(rnd.chunks)
        if tuple(live) == rnd.streaming:
            while len(rnd.out) < n and all(rnd.got[i] > len(rnd.out) for i in live):
                a, b = rnd.chunks[len(rnd.out)]
                rnd.out.append(rnd.codec.encode(weighted_mean([rnd.parts[i][a:b] for i in live],
                                                              [rnd.weights[i] for i in live])))
                rnd.tick()
        if all(rnd.got.get(i, 0) == n for i in live):
            self._finish(rnd)

    def _finish(self, rnd: _Round) -> None:
        """Every live part is complete: screen norms, then make the result final. When the chunks sent
        so far average a member that is now dropped (the norm screen, or a bad chunk after results had
        gone out), the whole result is recomputed and sent again (``epoch``; rare: only a bad part)."""
        live = rnd.live()
        if not live:
            self._fail(rnd, SyncFailed(f"no valid part left in group {rnd.group.gid}"))
            return
        self._screen(rnd, live, weights=False)
        live = rnd.live()
        if tuple(live) != rnd.streaming or len(rnd.out) < len(rnd.chunks):
            if rnd.out:
                rnd.epoch += 1
                self.stats["rounds_resent"] += 1
            parts, weights = [rnd.parts[i] for i in live], [rnd.weights[i] for i in live]
            result = aggregate(parts, weights, self.robust)
            rnd.out = [rnd.codec.encode(result[a:b]) for a, b in rnd.chunks]
        rnd.covered = tuple(live)
        rnd.covered_weight = float(sum(rnd.weights[i] for i in live))  # member order: the same float everywhere
        rnd.done.set_result(None)
        rnd.parts.clear()
        rnd.tick()
        self.stats["rounds"] += 1

    def _clipping(self, live: Sequence[int]) -> bool:
        return self.robust.aggregator == "centered_clip" and len(live) > 2

    def _screen(self, rnd: _Round, live: List[int], weights: bool) -> None:
        """The robust screen over the live parts (member order): weights (known from the headers) or
        norms (known once the parts are complete). The owner's own part is never dropped."""
        me = rnd.group.my_index
        own = live.index(me) if me in live else -1
        if weights:
            found = screen([rnd.weights[i] for i in live], [], own, self.robust, rnd.numel, self.round_samples)
        else:
            found = screen([], [math.sqrt(rnd.sq[i]) for i in live], own, self.robust, rnd.numel)
        for k, reason in found.items():
            self._drop(rnd, live[k], reason.split(" ", 1)[0], reason, reduce=False)

    @staticmethod
    def _fail(rnd: _Round, exc: Exception) -> None:
        if not rnd.done.done():
            rnd.done.set_exception(exc)
            rnd.done.exception()  # mark retrieved
            rnd.parts.clear()
            rnd.tick()

    # ---- member side ----------------------------------------------------------------------------
    async def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec) -> torch.Tensor:
        """Weighted mean of ``vec`` over the group; identical bytes on every member, or SyncFailed."""
        return (await self.allreduce_covered(group, phase, vec, weight, codec))[0]

    async def allreduce_covered(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec,
                                redo: bool = True) -> Tuple[torch.Tensor, Coverage]:
        """(weighted mean, whose parts it covers): the same member set on every shard (see module
        docstring: a round whose shards differ is re-done over the common members once, when ``redo``)."""
        # stays on its device: a GPU encodes its parts there (the codecs are torch ops); what comes
        # off the wire is decoded and reduced on CPU, and the mean is returned on CPU
        vec = vec.detach().to(dtype=torch.float32).contiguous().view(-1)
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
            gate = getattr(self.node, "gate", None)
            if gate is not None:  # every shard averaged their parts: members here (quotas, protocol.py)
                gate.vouch(members)
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
        finite = math.isfinite(_squared_norm(vec))  # a dot product: ~10x faster than isfinite().all()
        out = torch.empty(vec.numel(), dtype=torch.float32)      # every shard's mean lands here
        rnd: Optional[_Round] = None
        if mine is not None:
            lo, hi = bounds[mine]
            rnd = self._round(group.gid, phase)
            rnd.group, rnd.codec, rnd.numel = group, codec, hi - lo
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
                rnd.sq[me] = _squared_norm(own)
            else:  # our own training diverged: serve the others without our part, then apply nothing
                rnd.dropped[me] = "the owner's own pseudo-gradient is not finite"
                logger.error(f"[{self.node.short_id}] our pseudo-gradient is not finite; leaving it out of "
                             f"group {group.gid} and applying nothing this round")
            self._advance(rnd)
        if self.before_send is not None:
            self.before_send(group, phase)

        async def exchange(k: int) -> Tuple[Tuple[int, ...], float]:
            a, b = bounds[k]
            if k == mine:
                try:
                    await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout)
                except asyncio.TimeoutError:
                    missing = rnd.missing()
                    self._stalled(rnd)
                    self._fail(rnd, SyncFailed(f"the shard of group {group.gid} owned by this peer was incomplete "
                                               f"after {self.timeout:.0f} s; waiting for {missing}"))
                    raise rnd.done.exception() from None
                for (s, e), data in zip(rnd.chunks, rnd.out):  # the same bytes every member decodes
                    codec.decode_into(data, out[a + s:a + e])
                return rnd.covered, rnd.covered_weight
            return await self._send_part(group, phase, owner_idx[k], vec[a:b], weight, codec, out[a:b])

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
            if excluded:
                # One owner dropped our part; the others may still be reading theirs. Finish sending
                # them (a stream cut mid-part aborts that owner's round for everyone), then go.
                pending = [t for t in tasks if not t.done()]
                if pending:
                    await asyncio.wait(pending, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
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
                self._fail(rnd, SyncFailed(f"this peer left the round of group {group.gid} before its shard "
                                           "was complete"))
                self._rounds.pop((group.gid, phase), None)
        if not finite:
            raise SyncFailed("our own pseudo-gradient is not finite; this round is not applied here")
        return out, list(results)

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
                         codec: Codec, out: torch.Tensor) -> Tuple[Tuple[int, ...], float]:
        """Our part of owner ``j``'s shard, chunk by chunk, while its result chunks come back on the
        same stream into ``out``; returns (covered member indexes, their weight) from the trailer."""
        owner = group.members[j]
        traffic: Traffic = self.node.traffic
        sent_part, sent_weight = self._outgoing(group, phase, j, part, weight)
        chunk = chunk_values(codec)
        _, reader, writer = await self._connect(owner)
        tasks: List[asyncio.Future] = []
        try:
            header = {"t": "part", "v": PROTOCOL_VERSION, "gid": group.gid, "phase": phase, "idx": group.my_index,
                      "w": float(sent_weight), "codec": codec.codec_id, "numel": sent_part.numel(), "chunk": chunk}
            await write_frame(writer, header, traffic=traffic)
            tasks = [asyncio.ensure_future(self._send_chunks(group, writer, sent_part, codec, chunk)),
                     asyncio.ensure_future(self._read_result(reader, owner, codec, chunk, out))]
            reply, sq = (await asyncio.gather(*tasks))[1]
            covered = self._check_coverage(group, reply, j, owner)
            self._check_result(group, owner, part, math.sqrt(sq))
            return covered, float(reply["w"])
        except WireError as e:
            self.stats["replies_rejected"] += 1
            note_offence(self.node, owner, e)
            raise
        finally:
            for t in tasks:
                t.cancel()
            writer.close()

    async def _send_chunks(self, group: Group, writer: asyncio.StreamWriter, part: torch.Tensor, codec: Codec,
                           chunk: int) -> None:
        chunks = chunk_bounds(part.numel(), chunk)
        for n, (a, b) in enumerate(chunks, 1):
            await write_frame(writer, {"t": "c"}, codec.encode_view(part[a:b]), traffic=self.node.traffic)
            if 2 * n >= len(chunks) > 2 * (n - 1):  # fault-injection hook: half of this part is out
                faults.fire("allreduce.half_sent", frag=group.frag, round=group.round)
        faults.fire("allreduce.part_sent", frag=group.frag, round=group.round)  # fault-injection hook

    async def _read_result(self, reader: asyncio.StreamReader, owner: str, codec: Codec, chunk: int,
                           out: torch.Tensor) -> dict:
        """The owner's reply: result chunks into ``out`` (exact sizes), ``again`` restarting them, then
        the ``avg`` trailer once every chunk is in, returned with ``out``'s squared norm; ``abort``/``refuse``
        raise."""
        chunks = chunk_bounds(out.numel(), chunk)
        got = 0
        while True:
            reply, payload = await read_frame(reader, codec.encoded_size(chunk), self.node.traffic, owner)
            kind = reply.get("t")
            if kind in ("abort", "refuse"):
                reason = str(reply.get("reason"))[:500]
                excluded = reason.startswith("your part was dropped") or "is banned here" in reason
                raise (_Excluded if excluded else SyncFailed)(f"owner {owner[-6:]} aborted the round: {reason}")
            if kind == "c" and got < len(chunks):
                a, b = chunks[got]
                codec.decode_into(payload, out[a:b], owner)
                got += 1
            elif kind == "again":
                got = 0
            elif kind == "avg" and got == len(chunks):
                if reply.get("codec") != codec.codec_id or reply.get("numel") != out.numel():
                    raise WireError(f"reply for codec {str(reply.get('codec'))[:20]} with "
                                    f"{str(reply.get('numel'))[:20]} values", owner)
                sq = _squared_norm(out)
                if not math.isfinite(sq):
                    raise WireError("averaged shard decodes to non-finite values", owner)
                return reply, sq
            else:
                raise WireError(f"unexpected reply {str(kind)[:20]!r} after {got} of {len(chunks)} chunks", owner)

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

    def _check_result(self, group: Group, owner: str, mine: torch.Tensor, got: float) -> None:
        """A result (of norm ``got``) far larger than our own part is implausible: every part the owner
        may keep is within norm_bound of the median, and any aggregate of them within √M of that."""
        bound = self.robust.norm_bound
        if not bound or mine.numel() < NORM_SCREEN_MIN_NUMEL:
            return
        own = float(mine.norm())
        if own > 0 and got > bound * math.sqrt(group.size) * own:
            raise WireError(f"averaged shard has norm {got:.4g}, implausible next to our part's {own:.4g} "
                            f"(limit {bound:g}·√{group.size} times it)", owner)
