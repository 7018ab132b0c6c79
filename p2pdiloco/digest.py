"""The state digest: one definition for every place that hashes a fragment's global state.

A fragment's digest is ``sha256(outer step count as 8 little-endian bytes ‖ θ bytes ‖ momentum
bytes)``, its first 16 hex digits; a state's digest joins its fragments' digests with ``-``. Peers
compare digests to tell whether they hold the same state, and a joiner checks every downloaded
fragment against its part of the digest the swarm's voters agree on, so everything a donor sends
that decides the joiner's future steps is covered: the parameters, the momentum and the outer step
count (which sets the schedule position of the fragment's next outer step).
"""
from __future__ import annotations

import hashlib
import struct

__all__ = ["fragment_hasher", "finish", "fragment_digest"]

#: hex digits of a fragment's digest
DIGITS = 16


def fragment_hasher(outer_steps: int):
    """A sha256 already fed the fragment's outer step count; feed θ's bytes, then the momentum's."""
    if isinstance(outer_steps, bool) or not isinstance(outer_steps, int) or not 0 <= outer_steps < 2**64:
        raise ValueError(f"outer step count must be an integer in [0, 2**64), got {outer_steps!r}")
    h = hashlib.sha256()
    h.update(struct.pack("<Q", outer_steps))
    return h


def finish(h) -> str:
    return h.hexdigest()[:DIGITS]


def fragment_digest(blob: bytes, outer_steps: int) -> str:
    """Digest of one fragment from its bytes (θ then momentum, fp32) and its outer step count."""
    h = fragment_hasher(outer_steps)
    h.update(blob)
    return finish(h)
