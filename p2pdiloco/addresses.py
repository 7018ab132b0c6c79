"""Multiaddr parsing and validation (py-multiaddr), with messages a user can act on."""
from __future__ import annotations

from typing import Iterable, List

from multiaddr import Multiaddr

from .errors import AddressError

__all__ = ["parse_maddr", "parse_maddrs"]

_EXAMPLE = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW..."


def parse_maddr(text: str, what: str = "address", require_peer_id: bool = False) -> Multiaddr:
    """Parse one multiaddr; with ``require_peer_id`` it must end in ``/p2p/<peer id>``."""
    text = str(text).strip()
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # py-multiaddr raises several types (StringParseError, ValueError, ...)
        reason = str(e).split(" (string:")[0]
        raise AddressError(f"{what}: {text!r} is not a valid multiaddr ({reason}); expected e.g. {_EXAMPLE}") from None
    protocols = [p.name for p in maddr.protocols()]
    if require_peer_id and "p2p" not in protocols:
        raise AddressError(
            f"{what}: {text!r} has no /p2p/<peer id> part; copy the full address the bootstrap peer printed, "
            f"e.g. {_EXAMPLE}"
        )
    if not any(p in protocols for p in ("ip4", "ip6", "dns", "dns4", "dns6")) and "p2p-circuit" not in protocols:
        raise AddressError(f"{what}: {text!r} names no host (/ip4/, /ip6/ or /dns/); expected e.g. {_EXAMPLE}")
    return maddr


def parse_maddrs(texts: Iterable[str], what: str = "address", require_peer_id: bool = False) -> List[Multiaddr]:
    return [parse_maddr(t, what, require_peer_id) for t in texts]
