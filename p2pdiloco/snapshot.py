"""The snapshot layout: a peer's global state as one flat run of fp32 values.

Fragments in order; within a fragment its parameters θ, then its outer momentum buffers, each
tensor flattened. A fragment of ``numel`` parameter elements therefore holds ``2 · numel`` fp32
values, :data:`BYTES_PER_ELEMENT` bytes per parameter element. A state download's payload, the
digest of a fragment (:mod:`p2pdiloco.digest`) and the global copies a peer's local workers receive
all follow this layout, and every walk over it goes through :func:`walk` (tensors) or
:func:`fragment_bounds` (bytes), so they cannot disagree.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Sequence, Tuple

__all__ = ["BYTES_PER_ELEMENT", "fragment_tensors", "fragment_bounds", "walk", "THETA", "MOMENTUM"]

#: bytes per parameter element in a snapshot: θ and its momentum, fp32 each
BYTES_PER_ELEMENT = 8
THETA, MOMENTUM = "theta", "momentum"


def fragment_tensors(outer: Any) -> List[Any]:
    """A fragment's tensors in snapshot order: its θ (``outer.params``), then its momentum (``outer.buffers``)."""
    return [*outer.params, *outer.buffers]


def fragment_bounds(numels: Sequence[int]) -> List[Tuple[int, int]]:
    """(start, end) byte offsets of each fragment in a snapshot payload."""
    out, off = [], 0
    for n in numels:
        out.append((off, off + BYTES_PER_ELEMENT * n))
        off += BYTES_PER_ELEMENT * n
    return out


def walk(outers: Sequence[Any]) -> Iterator[Tuple[int, str, int, Any, int]]:
    """(fragment, THETA or MOMENTUM, index within that list, tensor, offset in fp32 values) of every
    tensor of the state, in snapshot order."""
    off = 0
    for p, o in enumerate(outers):
        for kind, tensors in ((THETA, o.params), (MOMENTUM, o.buffers)):
            for i, t in enumerate(tensors):
                yield p, kind, i, t, off
                off += t.numel()
