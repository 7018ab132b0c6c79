"""The member's side of the all-reduce (:mod:`.allreduce` has the protocol): send our part of each
owner's shard chunk by chunk and read that owner's result chunks back on the same stream, checking
the reply (exact sizes, finite values, a plausible norm, whose parts the mean covers).
"""
from __future__ import annotations

import asyncio
import math
from typing import List, Optional, Tuple

import torch

from .. import faults
from ..compression import Codec
from ..compression.robust import NORM_SCREEN_MIN_NUMEL
from ..errors import SyncFailed, WireError
from ..ids import short_id
from .dialing import open_stream
from .group import Group, Level
from .partition import chunk_bounds, chunk_values, relayed_mean, squared_norm
from .protocol import PROTOCOL_VERSION, Traffic, note_offence, read_frame, write_frame

__all__ = ["PartSender"]


class OwnerExcludedUs(SyncFailed):
    """An owner left *our* part out (or refuses us): the others' round goes on without us."""


class PartSender:
    """The member's side of :class:`~p2pdiloco.swarm.allreduce.AllReducer` (a base class of it): one
    exchange with one owner per call. Uses the reducer's ``node``, ``timeout``, ``robust``,
    ``handler_name`` and ``stats``."""

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
                         codec: Codec, out: torch.Tensor,
                         level: Optional[Level] = None) -> Tuple[Tuple[int, ...], float]:
        """Our part of owner ``j``'s shard, chunk by chunk, while its result chunks come back on the
        same stream into ``out``; returns (covered member indexes, their weight) from the trailer
        (with ``level``, ``group`` is our subgroup and the indexes are the whole group's)."""
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
                     asyncio.ensure_future(self._read_result(reader, owner, codec, chunk, out, group.size))]
            reply, sq = (await asyncio.gather(*tasks))[1]
            covered = self._check_coverage(group, reply, j, owner, level)
            if level is not None:
                covered = self._check_whole_coverage(level, covered, reply, owner)
            self._check_result(group if level is None else level.group, owner, part, math.sqrt(sq))
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
                           out: torch.Tensor, members: int = 1) -> dict:
        """The owner's reply: result chunks into ``out`` (exact sizes), ``again`` restarting them, then
        the ``avg`` trailer once every chunk is in, returned with ``out``'s squared norm; ``abort``/``refuse``
        raise. With a ``relays_parts`` codec the chunks are the covered members' parts back to back
        (up to ``members`` of them), averaged here once the trailer names them and their weights."""
        chunks = chunk_bounds(out.numel(), chunk)
        relayed: List[bytes] = []
        got = 0
        while True:
            reply, payload = await read_frame(reader, codec.reply_size(chunk, members), self.node.traffic, owner)
            kind = reply.get("t")
            if kind in ("abort", "refuse"):
                reason = str(reply.get("reason"))[:500]
                excluded = reason.startswith("your part was dropped") or "is banned here" in reason
                raise (OwnerExcludedUs if excluded else SyncFailed)(f"owner {short_id(owner)} aborted the round: {reason}")
            if kind == "c" and got < len(chunks):
                a, b = chunks[got]
                if codec.relays_parts:
                    del relayed[got:]
                    relayed.append(payload)
                else:
                    codec.decode_into(payload, out[a:b], owner)
                got += 1
            elif kind == "again":
                got = 0
            elif kind == "avg" and got == len(chunks):
                if reply.get("codec") != codec.codec_id or reply.get("numel") != out.numel():
                    raise WireError(f"reply for codec {str(reply.get('codec'))[:20]} with "
                                    f"{str(reply.get('numel'))[:20]} values", owner)
                if codec.relays_parts:
                    weights = self._relayed_weights(reply, owner)
                    for (a, b), data in zip(chunks, relayed):
                        relayed_mean(codec, data, weights, out[a:b], owner)
                sq = squared_norm(out)
                if not math.isfinite(sq):
                    raise WireError("averaged shard decodes to non-finite values", owner)
                return reply, sq
            else:
                raise WireError(f"unexpected reply {str(kind)[:20]!r} after {got} of {len(chunks)} chunks", owner)

    @staticmethod
    def _relayed_weights(reply: dict, owner: str) -> List[float]:
        """The weights of the parts a relaying owner's reply carries: one per covered member, each in
        (0, 1e12), adding up (in member order, as the owner added them) to the trailer's total."""
        ws, cov = reply.get("ws"), reply.get("cov")
        if (not isinstance(ws, list) or not isinstance(cov, list) or len(ws) != len(cov)
                or not all(type(w) in (int, float) and 0 < w < 1e12 for w in ws)
                or float(sum(float(w) for w in ws)) != reply.get("w")):
            raise WireError(f"relayed reply names invalid weights {str(ws)[:60]}", owner)
        return [float(w) for w in ws]

    @staticmethod
    def _check_coverage(group: Group, reply: dict, j: int, owner: str,
                        level: Optional[Level] = None) -> Tuple[int, ...]:
        """The member indexes an owner's reply says its mean covers: sorted, distinct, in range, with us
        among them (it replied with a mean, so it kept our part), weight positive (up to the whole group's
        with ``level``). (The owner itself may be missing: its own pseudo-gradient was not finite.)"""
        cov, w = reply.get("cov"), reply.get("w")
        size = group.size if level is None else level.group.size
        if (not isinstance(cov, list) or not all(type(i) is int for i in cov) or cov != sorted(set(cov))
                or not cov or cov[0] < 0 or cov[-1] >= group.size or group.my_index not in cov
                or type(w) not in (int, float) or not 0 < w < 1e12 * size):
            raise WireError(f"reply names an invalid member set {str(cov)[:60]} or weight {str(w)[:20]}", owner)
        return tuple(cov)

    @staticmethod
    def _check_whole_coverage(level: Level, covered: Tuple[int, ...], reply: dict, owner: str) -> Tuple[int, ...]:
        """A capped group's reply also names the whole group's members its column's mean covers
        (``gcov``): sorted, distinct, in range, and within our subgroup exactly the members the owner says
        it kept. Returned: the shard's coverage in the whole group."""
        gcov, whole = reply.get("gcov"), level.group
        ours = set(level.plan.subgroups[level.index])
        if (not isinstance(gcov, list) or not all(type(i) is int for i in gcov) or gcov != sorted(set(gcov))
                or not gcov or gcov[0] < 0 or gcov[-1] >= whole.size
                or {i for i in gcov if i in ours} != {level.whole_index(i) for i in covered}):
            raise WireError(f"reply names an invalid member set {str(gcov)[:60]} of the whole group", owner)
        return tuple(gcov)

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
