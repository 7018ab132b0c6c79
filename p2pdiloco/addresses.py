"""Multiaddr parsing and validation (py-multiaddr), with messages a user can act on."""
from __future__ import annotations

import ipaddress
from typing import Iterable, List

from multiaddr import Multiaddr

from .errors import AddressError

__all__ = ["parse_maddr", "parse_maddrs", "listen_maddrs", "is_loopback"]

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


def is_loopback(maddr: str) -> bool:
    """The address names this machine only (127.0.0.0/8, ::1, localhost)."""
    for proto in Multiaddr(str(maddr)).protocols():
        if proto.name in ("ip4", "ip6"):
            return ipaddress.ip_address(Multiaddr(str(maddr)).value_for_protocol(proto.code)).is_loopback
        if proto.name in ("dns", "dns4", "dns6"):
            return Multiaddr(str(maddr)).value_for_protocol(proto.code) == "localhost"
    return False


def listen_maddrs(host_maddrs: Iterable[str], initial_peers: Iterable[str]) -> List[str]:
    """Where a peer listens: ``host_maddrs`` when given; else loopback when every initial peer is on this
    machine (or there is none), and every interface when an initial peer is elsewhere, so that volunteers
    on other machines (a LAN, two clouds) can dial this one. The p2p daemon authenticates every
    connection (each end proves its peer id) and serves only the swarm's own protocols, so listening
    beyond loopback exposes what any internet peer of the run sees anyway."""
    host = [str(m) for m in host_maddrs]
    if host:
        return host
    remote = [str(m) for m in initial_peers if not is_loopback(m)]
    if not remote:
        return ["/ip4/127.0.0.1/tcp/0"]
    return ["/ip6/::/tcp/0"] if all(str(m).startswith("/ip6/") for m in remote) else ["/ip4/0.0.0.0/tcp/0"]
