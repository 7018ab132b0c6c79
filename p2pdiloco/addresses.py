"""Multiaddr parsing and validation (py-multiaddr), with messages a user can act on."""
from __future__ import annotations

import ipaddress
from typing import Any, Iterable, List

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
    # QUIC beside TCP: a QUIC dial leaves from the listening UDP socket, which is what lets two peers
    # behind NAT punch a hole to each other (swarm/punch.py); TCP stays for peers that cannot use UDP
    if all(str(m).startswith("/ip6/") for m in remote):
        return ["/ip6/::/tcp/0", "/ip6/::/udp/0/quic-v1"]
    return ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]


def with_quic(maddrs: Iterable[str]) -> List[str]:
    """``maddrs`` plus, for each TCP address beyond loopback, its QUIC twin: the same IP, the same port
    number over UDP (``/ip4/X/tcp/P[/p2p/ID]`` -> ``/ip4/X/udp/P/quic-v1[/p2p/ID]``), unless a UDP address
    on that IP is listed already. A bootstrap listens on both (one port number to open, TCP and UDP), and a
    peer dials both, so that its connection to the bootstrap is QUIC where UDP passes: the outside
    address the bootstrap sees on it is where a hole punch aims (swarm/punch.py); TCP serves where UDP is
    blocked."""
    out = [str(m) for m in maddrs]
    for m in list(out):
        parts = m.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or is_loopback(m):
            continue
        if any(o.startswith(f"/{parts[1]}/{parts[2]}/udp/") for o in out):
            continue
        out.append("/".join(parts[:3] + ["udp", parts[4], "quic-v1"] + parts[5:]))
    return out


#: at most this many outside addresses are taken from a relay or a peer (swarm/punch.py)
MAX_PUNCH_ADDRS = 4


def punchable(addrs: Iterable[Any]) -> List[str]:
    """The addresses a punch can aim at: QUIC over IPv4/IPv6, without a relay hop, at most
    :data:`MAX_PUNCH_ADDRS`; anything else (or malformed) is dropped."""
    out: List[str] = []
    for a in addrs if isinstance(addrs, (list, tuple)) else ():
        if not isinstance(a, str) or len(a) > 200:
            continue
        try:
            m = Multiaddr(a)
        except Exception:  # noqa: BLE001 - whatever a peer sent
            continue
        names = [p.name for p in m.protocols()]
        if names[:1] in (["ip4"], ["ip6"]) and "udp" in names and "quic-v1" in names and "p2p-circuit" not in names:
            text = str(m).split("/p2p/", 1)[0]
            if text not in out:
                out.append(text)
        if len(out) >= MAX_PUNCH_ADDRS:
            break
    return out
