"""Partition math of the all-reduce: which slice of the vector each owner reduces, how a part is cut
into chunks on the wire, and the norm both ends check. The same numbers on every peer for the same
inputs (no wire, no state): every member cuts identically.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..compression import Codec
from ..compression.robust import weighted_mean
from ..errors import WireError

__all__ = ["shard_bounds", "chunk_values", "chunk_bounds", "squared_norm", "relayed_mean", "CHUNK_VALUES"]

#: values per chunk of a part or result on the wire (before rounding to whole codec blocks): 4 MB of
#: fp32, 0.56 MB of a 4-bit codec. Small enough that an owner reduces and returns chunk k while
#: chunk k+1 is still arriving, large enough that per-chunk Python work is negligible.
CHUNK_VALUES = 1 << 20


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


def squared_norm(x: torch.Tensor) -> float:
    """‖x‖², or NaN when ``x`` holds a non-finite value: one pass for the finiteness check and the
    norm screen (the fp32 dot overflows only for values near 1e19; those are rescanned exactly)."""
    sq = float(torch.dot(x, x)) if x.numel() else 0.0
    if math.isfinite(sq):
        return sq
    if not bool(torch.isfinite(x).all()):
        return math.nan
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


def relayed_mean(codec: Codec, data: bytes, weights: Sequence[float], out: torch.Tensor, sender: Optional[str]) -> None:
    """Into ``out``: the weighted mean (member order, :func:`weighted_mean`) of the ``len(weights)``
    parts that an owner's reply chunk relays back to back (a ``relays_parts`` codec). Every member
    and the owner run this on the same bytes, so all hold the same bits. Sizes and every relayed
    part's content are checked before anything is written (:class:`WireError` naming ``sender``)."""
    size = codec.encoded_size(out.numel())
    if not weights or len(data) != len(weights) * size:
        raise WireError(f"relayed {codec.name} chunk has {len(data)} bytes, expected {len(weights)} parts of "
                        f"{size}", sender)
    parts = [codec.decode(data[i * size:(i + 1) * size], out.numel(), sender) for i in range(len(weights))]
    out.copy_(weighted_mean(parts, weights))
