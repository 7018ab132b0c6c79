"""Reachability: can other peers dial this one? Detected by a dial-back, not assumed.

A peer behind NAT (a home router, a cloud instance without a public port) can dial out, but nobody
can dial in. libp2p reuses an open connection in both directions, so a peer that *has* talked to us
can often still reach us; anyone else cannot. p2pdiloco therefore never relies on dialing a
private peer (matchmaking.py: a private peer never leads; allreduce.py: it owns no shard;
state_sync.py: it donates state only when no public donor has it), and a private peer runs its DHT
node as a client (hivemind ``client_mode``): it reads and stores records through the public nodes
and is never put into their routing tables, so nobody's DHT read waits on a node it cannot reach.

Detection (``swarm.reachability = "auto"``, the default), an AutoNAT-style dial-back: the peer
asks its initial peers (usually the bootstrap peers, which are public by nature) over the
``p2pdiloco.reach`` handler to open a plain TCP connection to *the address they see the request
coming from* at the port(s) we listen on (or announce). A NAT rewrites our source address to its
own, where nothing forwards the port, so the dial-back fails: private. A helper dials only the
requester's own observed IP, never an address the requester names, so nobody can use it to probe
third parties. Outcome:

* ``public``: at least one helper connected;
* ``private``: helpers answered and none could connect, or no helper answered at all (the safe
  side: a private peer treated as public would make rounds fail; a public peer treated as
  private still trains as a full member and only does less of the reducing);
* a peer with no initial peers (the first peer of a swarm) is public: others dial it to get in.

``relayed`` (reachable only through a libp2p circuit relay) is a value records and ``status``
accept for peers that announce ``/p2p-circuit`` addresses; p2pdiloco does not set up relays itself.

``swarm.reachability = "public"`` / ``"private"`` skip the detection (a port forward the helpers
cannot see, or a network you know). A peer lying about being public only breaks rounds it takes
part in (its group's members cannot send it their parts and the round fails over to the next one),
as any unresponsive member does.

Wire (protocol.py): request ``{t: "reach", v, ports: [int, ...]}`` (at most 4), reply
``{t: "reach", ok: bool, addr: "ip:port" | ""}``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Iterable, List, Optional, Sequence, Tuple

from ..errors import WireError
from .protocol import (PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header,
                       refuse_bad_request, write_frame)

__all__ = ["REACHABILITY", "SETTINGS", "HANDLER", "is_private", "serve_reach", "detect", "listen_ports"]

logger = logging.getLogger(__name__)

#: what a peer publishes in its progress record (``reach``)
REACHABILITY = ("public", "private", "relayed")
#: what ``swarm.reachability`` accepts
SETTINGS = ("auto", "public", "private")
#: the dial-back handler; one per node, shared by every run on it
HANDLER = "p2pdiloco.reach"
#: a helper's TCP connect attempt (seconds)
DIAL_TIMEOUT = 3.0
MAX_PORTS = 4


def is_private(reach: Optional[str]) -> bool:
    """Nobody can dial a peer with this reachability directly (unknown counts as public: a peer of
    before reachability existed, as every peer was then)."""
    return reach in ("private", "relayed")


def listen_ports(maddrs: Iterable[object]) -> List[int]:
    """The TCP ports of ``maddrs`` (multiaddrs or strings), in order, without repeats."""
    ports: List[int] = []
    for m in maddrs:
        parts = str(m).split("/")
        for i, proto in enumerate(parts[:-1]):
            if proto == "tcp" and parts[i + 1].isdigit():
                port = int(parts[i + 1])
                if 0 < port < 65536 and port not in ports:
                    ports.append(port)
    return ports[:MAX_PORTS]


def _observed_ip(addr: object) -> Tuple[Optional[str], bool]:
    """(IP the request came from, whether it came through a circuit relay)."""
    parts = str(addr).split("/")
    relayed = "p2p-circuit" in parts
    for i, proto in enumerate(parts[:-1]):
        if proto in ("ip4", "ip6"):
            return parts[i + 1], relayed
    return None, relayed


async def _dial(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


def serve_reach(node) -> None:
    """Serve the dial-back on ``node`` (every p2pdiloco node does, bootstrap peers included)."""

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()
        traffic = node.traffic
        try:
            header = await read_header(reader, traffic, sender)
            refusal = check_version(header)
            ports = header.get("ports")
            if refusal is None and not (header.get("t") == "reach" and isinstance(ports, list)
                                        and 0 < len(ports) <= MAX_PORTS
                                        and all(type(p) is int and 0 < p < 65536 for p in ports)):
                raise WireError("malformed reach request", sender)
            if refusal is not None:
                await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=traffic)
                return
            ip, relayed = _observed_ip(info.addr)
            ok, where = False, ""
            if ip is not None and not relayed:
                results = await asyncio.gather(*(_dial(ip, p) for p in ports))
                hits = [p for p, r in zip(ports, results) if r]
                ok = bool(hits)
                where = f"{ip}:{hits[0] if hits else ports[0]}"
            await write_frame(writer, {"t": "reach", "ok": ok, "addr": where, "relayed": relayed}, traffic=traffic)
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            await refuse_bad_request(node, sender, e, writer)
        finally:
            await close_after_reply(reader, writer)

    node.add_handler(HANDLER, handle)


async def _ask(node, helper: str, ports: Sequence[int], timeout: float) -> Optional[dict]:
    from hivemind.p2p import PeerID

    async def go() -> dict:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(helper), HANDLER)
        try:
            await write_frame(writer, {"t": "reach", "v": PROTOCOL_VERSION, "ports": list(ports)},
                              traffic=node.traffic)
            reply, _ = await read_frame(reader, 0, node.traffic, helper)
            return reply
        finally:
            writer.close()

    try:
        reply = await asyncio.wait_for(go(), timeout)
    except Exception as e:  # unreachable helper, an older peer without the handler, a timeout
        logger.info(f"[{node.short_id}] reachability helper {helper[-6:]} did not answer ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]})")
        return None
    return reply if reply.get("t") == "reach" and isinstance(reply.get("ok"), bool) else None


async def detect(node, helpers: Sequence[str], ports: Sequence[int], timeout: float = 10.0) -> Tuple[str, str]:
    """(``public`` | ``private``, why) from asking ``helpers`` (peer ids) to dial us back on ``ports``."""
    helpers = [h for h in dict.fromkeys(helpers) if h != node.peer_id_str][:3]
    if not helpers:
        return "public", "no other peer to ask (the first peer of a swarm is dialed by everyone else)"
    if not ports:
        return "private", "this peer listens on no TCP port"
    replies = await asyncio.gather(*(_ask(node, h, ports, timeout) for h in helpers))
    answered = [(h, r) for h, r in zip(helpers, replies) if r is not None]
    hits = [(h, r) for h, r in answered if r["ok"]]
    if hits:
        h, r = hits[0]
        return "public", f"{h[-6:]} dialed us back at {r.get('addr')}"
    if answered:
        seen = ", ".join(f"{h[-6:]} could not dial {r.get('addr') or 'us'}" for h, r in answered)
        return "private", f"{seen} (behind NAT or a firewall)"
    return "private", "no helper answered the reachability check; assuming private (safe side)"
