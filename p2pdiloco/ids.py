"""Short peer ids: how logs, messages and tables name a peer.

A libp2p peer id (base58) ends in characters that differ between peers; its last six are what
every log line and error message shows (``node.short_id`` is ours). One function, so every place
names a peer the same way. No imports: any layer may use it.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["short_id", "short_ids"]

#: characters of a peer id shown in logs and messages
SHORT_ID_LEN = 6


def short_id(peer_id: object) -> str:
    """The last :data:`SHORT_ID_LEN` characters of ``peer_id`` (any object: its ``str``)."""
    return str(peer_id)[-SHORT_ID_LEN:]


def short_ids(peer_ids: Iterable[object]) -> str:
    """``{a1b2c3, d4e5f6}``: a set of peers, sorted by short id."""
    return "{" + ", ".join(sorted(short_id(p) for p in peer_ids)) + "}"
