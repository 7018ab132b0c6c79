"""Hole punching: two relayed peers (both behind NAT) open a direct QUIC connection to each other, so
their all-reduce traffic stops crossing the relay.

Why it can work: a home router maps a LAN socket to an outside address when the socket sends, and then
lets in what comes back from the address it sent to. Peers that listen beyond loopback listen on QUIC
(UDP) too (``addresses.listen_maddrs``), and QUIC dials leave from the listening socket; so when each
peer sends to the other's outside address at about the same time, each router sees the other's packets
as replies and lets them in. Most home routers keep a socket's outside port for every destination
(Linux masquerading does, when the port is free), so the address a relay sees a peer at is also the
one the other peer must aim at. A router that picks a new random port per destination defeats this:
the punch fails and the pair stays relayed, which always works.

Who learns what:
* the relay tells a peer, in the reply to its reservation, the outside addresses it sees it at
  (``reserve`` in swarm/relay.py); the peer keeps the QUIC ones in ``node.punches.observed`` (:class:`Punches`);
* a relayed peer that knows another relayed peer (``node.relay_routes``) asks it to punch, through the
  relay: ``{t: "punch", v}``. The relay names the caller *and* the addresses it sees the caller at
  (``seen``), so the callee dials what the relay attests, never addresses a caller made up;
* the callee answers ``{t: "punch", addrs: <its own observed addresses>}`` and both dial each other at
  once, several times over :data:`WINDOW` seconds. libp2p authenticates the connection (each end
  proves its peer id), so a wrong address can waste a dial but never reach an impostor.

After a successful punch both peers hold a direct connection and ``dialing.open_stream`` uses it for
every stream to that peer (``node.punches.direct``); when it is gone, streams go through the relay again and
the pair may punch again after :data:`RETRY_AFTER`. Counted in ``node.relay_stats``: ``punched``,
``punch_failed``, ``direct_streams``.

Wire, on ``p2pdiloco.punch`` (only through our relay):
  ``{t: "punch", v}`` -> ``{t: "punch", addrs}`` | ``{t: "refuse", reason}``
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set

from multiaddr import Multiaddr

from ..addresses import punchable
from ..ids import short_id
from .dialing import is_direct, open_stream
from .protocol import PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header, write_frame

__all__ = ["HANDLER", "Punches", "punch", "serve_punch", "puncher"]

logger = logging.getLogger(__name__)

HANDLER = "p2pdiloco.punch"
#: both sides keep dialing the other for this long (seconds): the other's first packets may arrive before
#: ours left, and are then dropped by our router
WINDOW = 8.0
#: one dial attempt's limit (seconds); a punched QUIC handshake takes a few round trips
ATTEMPT = 3.0
#: a pair whose punch failed tries again after this long (seconds): routers that pick random ports never
#: let it through, and each try costs a few packets and a relayed stream
RETRY_AFTER = 300.0
#: how often a relayed peer looks for relayed peers to punch to (seconds)
PERIOD = 5.0


@dataclass
class Punches:
    """A node's hole punching state (on its network thread)."""

    #: the outside QUIC addresses our relay sees us at (from its reservation reply): where others aim
    observed: List[str] = field(default_factory=list)
    #: relayed peers we hold a direct connection to: ``dialing.open_stream`` bypasses the relay for them
    direct: Set[str] = field(default_factory=set)
    #: peers a punch with is under way (either side asked)
    under_way: Set[str] = field(default_factory=set)
    #: when we last punched with each peer (monotonic seconds), success or not
    tried: Dict[str, float] = field(default_factory=dict)
    #: when we began waiting for a peer with a smaller id to ask first
    waited: Dict[str, float] = field(default_factory=dict)
    #: the background :func:`puncher` (a concurrent future), while we are relayed
    task: Any = None


async def _dial(node: Any, peer: str, addrs: List[str], until: float) -> bool:
    """Dial ``peer`` at ``addrs`` until connected or the loop time ``until``."""
    from hivemind.p2p import PeerID

    pid, maddrs = PeerID.from_base58(peer), [Multiaddr(a) for a in addrs]
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            await asyncio.wait_for(node.p2p._client.connect(pid, maddrs), ATTEMPT)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - dropped by a router (yet), backed off: try again
            if await is_direct(node, peer):  # the other side's dial got through first
                return True
            await asyncio.sleep(0.2)
    return await is_direct(node, peer)


def _done(node: Any, peer: str, ok: bool, addrs: List[str], role: str) -> None:
    node.punches.tried[peer] = time.monotonic()
    if ok:
        node.punches.direct.add(peer)
        node.relay_stats["punched"] += 1
        logger.info(f"[{node.short_id}] hole punched to {short_id(peer)} ({role}): a direct QUIC connection to "
                    f"{', '.join(addrs)}; our streams to it no longer cross the relay")
    else:
        node.relay_stats["punch_failed"] += 1
        logger.info(f"[{node.short_id}] hole punch to {short_id(peer)} failed ({role}, aimed at {', '.join(addrs) or 'nothing'}):"
                    f" its streams stay relayed; trying again in {RETRY_AFTER:.0f} s")


async def punch(node: Any, peer: str) -> bool:
    """Ask relayed ``peer`` (through its relay) to punch with us, and dial it while it dials us."""
    if peer in node.punches.under_way:
        return False
    node.punches.under_way.add(peer)
    loop = asyncio.get_running_loop()
    addrs: List[str] = []
    try:
        _, reader, writer = await open_stream(node, peer, HANDLER, loop.time() + 10)
        try:
            await write_frame(writer, {"t": "punch", "v": PROTOCOL_VERSION}, traffic=node.traffic)
            reply, _ = await asyncio.wait_for(read_frame(reader, 0, node.traffic, peer), 10)
            addrs = punchable(reply.get("addrs")) if reply.get("t") == "punch" else []
            ok = bool(addrs) and await _dial(node, peer, addrs, loop.time() + WINDOW)
        finally:
            writer.close()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the relay or the peer went away: try later
        logger.debug(f"[{node.short_id}] punch to {short_id(peer)}: {type(e).__name__}: {e}")
        ok = False
    finally:
        node.punches.under_way.discard(peer)
    _done(node, peer, ok, addrs, "we asked")
    return ok


async def serve_punch(node: Any, info: Any, reader, writer) -> None:
    """The callee's side: answer with our observed addresses, then dial the caller at the addresses
    its relay saw it at (``info.seen``: set only on streams our relay forwards)."""
    caller = info.peer_id.to_base58()
    header = await read_header(reader, node.traffic, caller)
    refusal = check_version(header)
    seen = punchable(getattr(info, "seen", None))
    if refusal is None and (header.get("t") != "punch" or not seen):
        refusal = "a punch must come through our relay, from a peer it sees at a QUIC address"
    if refusal is None and (caller in node.punches.under_way or caller in node.punches.direct):
        refusal = "a punch with this peer is under way or done"
    if refusal is None and time.monotonic() - node.punches.tried.get(caller, -RETRY_AFTER) < RETRY_AFTER / 10:
        refusal = "punched with this peer moments ago"
    if refusal is None and not node.punches.observed:
        refusal = "our relay did not tell us an outside QUIC address"
    if refusal is not None:
        await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=node.traffic)
        await close_after_reply(reader, writer, timeout=2.0)
        return
    node.punches.under_way.add(caller)
    try:
        await write_frame(writer, {"t": "punch", "addrs": list(node.punches.observed)}, traffic=node.traffic)
        ok = await _dial(node, caller, seen, asyncio.get_running_loop().time() + WINDOW)
    finally:
        node.punches.under_way.discard(caller)
    _done(node, caller, ok, seen, "it asked")
    await close_after_reply(reader, writer, timeout=2.0)


async def puncher(node: Any) -> None:
    """While we are relayed: punch to every relayed peer we know of that we hold no direct connection
    to, once per :data:`RETRY_AFTER` per peer; forget peers whose direct connection is gone."""
    while True:
        await asyncio.sleep(PERIOD)
        if node.reachability != "relayed" or not node.punches.observed:
            continue
        for peer in list(node.punches.direct):
            if not await is_direct(node, peer):
                node.punches.direct.discard(peer)
                logger.info(f"[{node.short_id}] the direct connection to {short_id(peer)} is gone: its streams "
                            "cross the relay again")
        now = time.monotonic()
        for peer, relay in list(node.relay_routes.items()):
            if (peer == node.peer_id_str or peer in node.punches.direct or peer in node.punches.under_way or relay == peer
                    or now - node.punches.tried.get(peer, -RETRY_AFTER) < RETRY_AFTER):
                continue
            # the smaller id asks first; the other asks only if no punch came within a few periods
            if peer < node.peer_id_str and peer not in node.punches.waited:
                node.punches.waited[peer] = now
                continue
            if peer < node.peer_id_str and now - node.punches.waited[peer] < 3 * PERIOD:
                continue
            await punch(node, peer)
