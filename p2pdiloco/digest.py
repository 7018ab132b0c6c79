"""The state digest: one definition for every place that hashes a fragment's global state.

A fragment's digest is ``sha256(outer step count as 8 little-endian bytes ‖ θ bytes ‖ momentum
bytes)``, its first 16 hex digits; a state's digest joins its fragments' digests with ``-``. Peers
compare digests to tell whether they hold the same state, and a joiner checks every downloaded
fragment against its part of the digest the swarm's voters agree on, so everything a donor sends
that decides the joiner's future steps is covered: the parameters, the momentum and the outer step
count (which sets the schedule position of the fragment's next outer step).

:func:`tensors_digest` is the same hash without the step count, for a local worker's model.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence, Union

__all__ = ["fragment_digest", "tensors_digest", "tensor_bytes"]

#: hex digits of a fragment's digest
DIGITS = 16

#: what a digest reads: raw bytes, or tensors (any device and dtype; their bytes in memory order)
Parts = Union[bytes, bytearray, memoryview, Sequence[Any]]


def tensor_bytes(t: Any) -> bytes:
    """A tensor's bytes, contiguous, from the CPU (the same bytes on every device)."""
    return t.detach().cpu().contiguous().numpy().tobytes()


def _feed(h: Any, parts: Parts) -> str:
    if isinstance(parts, (bytes, bytearray, memoryview)):
        h.update(parts)
    else:
        for t in parts:
            h.update(tensor_bytes(t))
    return h.hexdigest()[:DIGITS]


def fragment_digest(parts: Parts, outer_steps: int) -> str:
    """Digest of one fragment after ``outer_steps`` outer steps: ``parts`` are its bytes (θ then
    momentum, fp32), as one blob or as the tensors in that order (both give the same string)."""
    if isinstance(outer_steps, bool) or not isinstance(outer_steps, int) or not 0 <= outer_steps < 2**64:
        raise ValueError(f"outer step count must be an integer in [0, 2**64), got {outer_steps!r}")
    h = hashlib.sha256()
    h.update(struct.pack("<Q", outer_steps))
    return _feed(h, parts)


def tensors_digest(parts: Parts) -> str:
    """Short sha256 of tensors' bytes in order, no step count (a local worker's model or shards)."""
    return _feed(hashlib.sha256(), parts)
