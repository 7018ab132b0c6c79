"""Butterfly all-reduce of a flat fp32 vector within a group, on our own wire protocol.

Why not hivemind's ``DecentralizedAverager``: it reports success when part of a tensor was not
averaged, its results differ by an ULP between peers, and it cannot carry a new codec (traps 2, 3
and 5 in hivemind-notes.md). Here:

* The vector is cut into ``M`` contiguous shards, shard ``j`` owned by member ``j`` (members are
  sorted peer ids, so every peer cuts identically).
* Every member sends its part of shard ``j`` to owner ``j`` (one stream per pair, all concurrently),
  encoded with the group's codec. The owner decodes each part (its own part goes through the same
  encode/decode round trip), sums ``w_i * part_i`` **in fp32 in member order** once all ``M`` parts
  are in, divides by ``sum(w_i)``, encodes the mean *once* and replies with the same bytes to
  everyone. Every peer therefore decodes identical bytes: results are bitwise identical.
* If any part is missing when the timeout expires, invalid, or from a peer that is not the member it
  claims to be, the owner replies ``abort`` to everyone and every member raises :class:`SyncFailed`
  for the whole vector: a partial average is never returned.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compression import Codec, codec_by_id
from ..errors import SyncFailed, WireError
from .protocol import PROTOCOL_VERSION, close_after_reply, Traffic, check_version, read_frame, read_header, read_payload, write_frame

__all__ = ["Group", "AllReducer", "make_group_id", "shard_bounds"]

logger = logging.getLogger(__name__)


def make_group_id(run_id: str, frag: int, round_: int, members: Sequence[str]) -> str:
    blob = "\n".join([run_id, str(frag), str(round_), *members]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@dataclass(frozen=True)
class Group:
    """A finalized group: the same ``gid`` and ``members`` on every member."""

    gid: str
    members: Tuple[str, ...]
    my_index: int
    frag: int
    round: int

    @property
    def size(self) -> int:
        return len(self.members)


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
    """The owner's side of one (gid, phase): parts received so far and the encoded mean."""

    created: float = field(default_factory=time.monotonic)
    configured: asyncio.Event = field(default_factory=asyncio.Event)
    group: Optional[Group] = None
    codec: Optional[Codec] = None
    numel: int = 0
    parts: Dict[int, Tuple[float, torch.Tensor]] = field(default_factory=dict)
    done: asyncio.Future = None  # bytes of the encoded mean, or exception

    def __post_init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()


class AllReducer:
    """Serves the ``part`` handler and runs all-reduce rounds. Lives on the node's event loop."""

    def __init__(self, node, run_id: str, timeout: float):
        self.node = node
        self.run_id = run_id
        self.timeout = timeout
        self.handler_name = f"p2pdiloco.{run_id}.part"
        self._rounds: Dict[Tuple[str, str], _Round] = {}
        #: fault-injection hook: called with (group, phase) before parts are sent; tests use it
        self.before_send = None
        node.add_handler(self.handler_name, self._handle_part)

    # ---- owner side -----------------------------------------------------------------------------
    def _round(self, gid: str, phase: str) -> _Round:
        self._sweep()
        key = (gid, phase)
        if key not in self._rounds:
            self._rounds[key] = _Round()
        return self._rounds[key]

    def _sweep(self) -> None:
        horizon = time.monotonic() - 4 * self.timeout
        for key in [k for k, r in self._rounds.items() if r.created < horizon]:
            del self._rounds[key]

    async def _handle_part(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        traffic = self.node.traffic
        try:
            header = await read_header(reader, traffic, sender)
            refusal = check_version(header)
            if refusal is not None:
                await write_frame(writer, {"t": "abort", "reason": refusal}, traffic=traffic)
                return
            gid, phase, idx = header.get("gid"), header.get("phase"), header.get("idx")
            weight = header.get("w")
            if not (isinstance(gid, str) and isinstance(phase, str) and isinstance(idx, int)
                    and isinstance(weight, (int, float)) and len(gid) <= 64 and len(phase) <= 32):
                raise WireError("malformed part header", sender)
            # The owner may finalize the group (and configure the round) a moment after the sender did.
            rnd = self._round(gid, phase)
            try:
                await asyncio.wait_for(rnd.configured.wait(), timeout=self.timeout)
            except asyncio.TimeoutError:
                self._rounds.pop((gid, phase), None)
                raise WireError(f"part for unknown group {gid}", sender) from None
            group = rnd.group
            if not 0 <= idx < group.size or group.members[idx] != sender:
                raise WireError(f"part claims member index {idx} of group {gid}", sender)
            codec = codec_by_id(header.get("codec", -1), sender)
            if codec is not rnd.codec or header.get("numel") != rnd.numel:
                raise WireError(f"part has codec {codec.name}/{header.get('numel')} values, expected "
                                f"{rnd.codec.name}/{rnd.numel}", sender)
            if not (weight > 0 and weight < 1e12):
                raise WireError(f"part weight {weight!r} out of range", sender)
            payload = await read_payload(reader, header, codec.encoded_size(rnd.numel), traffic, sender)
            if idx in rnd.parts:
                raise WireError(f"duplicate part from member {idx}", sender)
            rnd.parts[idx] = (float(weight), codec.decode(payload, rnd.numel, sender))
            self._maybe_reduce(rnd)
            try:
                mean_bytes = await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout)
            except asyncio.TimeoutError:
                self._fail(rnd, SyncFailed(f"shard of group {gid} incomplete after {self.timeout:.0f} s"))
                raise rnd.done.exception()
            await write_frame(writer, {"t": "avg", "codec": codec.codec_id, "numel": rnd.numel}, mean_bytes,
                              traffic=traffic)
        except (WireError, SyncFailed) as e:
            logger.warning(f"[{self.node.short_id}] refused part: {e}")
            try:
                await write_frame(writer, {"t": "abort", "reason": str(e)[:500]}, traffic=traffic)
            except Exception:
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            logger.warning(f"[{self.node.short_id}] connection from {sender[-6:]} dropped during a part")
        finally:
            await close_after_reply(reader, writer)

    def _maybe_reduce(self, rnd: _Round) -> None:
        if rnd.done.done() or len(rnd.parts) < rnd.group.size:
            return
        acc = torch.zeros(rnd.numel, dtype=torch.float32)
        total = 0.0
        for idx in range(rnd.group.size):  # fixed order: bitwise-reproducible sum
            w, part = rnd.parts[idx]
            acc.add_(part, alpha=w)
            total += w
        acc.div_(total)
        rnd.done.set_result(rnd.codec.encode(acc))
        rnd.parts.clear()

    @staticmethod
    def _fail(rnd: _Round, exc: Exception) -> None:
        if not rnd.done.done():
            rnd.done.set_exception(exc)
            rnd.done.exception()  # mark retrieved

    # ---- member side ----------------------------------------------------------------------------
    async def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec) -> torch.Tensor:
        """Weighted mean of ``vec`` over the group; identical bytes on every member, or SyncFailed."""
        vec = vec.detach().to("cpu", torch.float32).contiguous().view(-1)
        bounds = shard_bounds(vec.numel(), group.size, codec.block_size)
        me = group.my_index
        lo, hi = bounds[me]
        rnd = self._round(group.gid, phase)
        rnd.group, rnd.codec, rnd.numel = group, codec, hi - lo
        rnd.configured.set()
        # our own part takes the same lossy round trip as everybody else's
        rnd.parts[me] = (float(weight), codec.roundtrip(vec[lo:hi]) if codec.relative_error_bound else vec[lo:hi].clone())
        self._maybe_reduce(rnd)
        if self.before_send is not None:
            self.before_send(group, phase)

        async def exchange(j: int) -> torch.Tensor:
            if j == me:
                mean_bytes = await asyncio.wait_for(asyncio.shield(rnd.done), timeout=self.timeout)
                return codec.decode(mean_bytes, hi - lo)
            a, b = bounds[j]
            return await self._send_part(group, phase, j, vec[a:b], weight, codec)

        tasks = [asyncio.ensure_future(exchange(j)) for j in range(group.size)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=self.timeout * 1.5)
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
            self._fail(rnd, SyncFailed("round finished"))
            self._rounds.pop((group.gid, phase), None)
        return torch.cat(results)

    async def _send_part(self, group: Group, phase: str, j: int, part: torch.Tensor, weight: float,
                         codec: Codec) -> torch.Tensor:
        from hivemind.p2p import PeerID

        owner = group.members[j]
        traffic: Traffic = self.node.traffic
        _, reader, writer = await self.node.p2p.call_binary_stream_handler(PeerID.from_base58(owner),
                                                                           self.handler_name)
        try:
            header = {"t": "part", "v": PROTOCOL_VERSION, "gid": group.gid, "phase": phase, "idx": group.my_index,
                      "w": float(weight), "codec": codec.codec_id, "numel": part.numel()}
            await write_frame(writer, header, codec.encode(part), traffic=traffic)
            reply, payload = await read_frame(reader, codec.encoded_size(part.numel()), traffic, owner)
            if reply.get("t") == "abort":
                raise SyncFailed(f"owner {owner[-6:]} aborted the round: {reply.get('reason')}")
            if reply.get("t") != "avg" or reply.get("codec") != codec.codec_id or reply.get("numel") != part.numel():
                raise WireError(f"unexpected reply {reply.get('t')!r}", owner)
            if len(payload) != codec.encoded_size(part.numel()):
                raise WireError("averaged shard has the wrong size", owner)
            return codec.decode(payload, part.numel(), owner)
        finally:
            writer.close()
