"""Relays: how peers that nobody can dial (behind NAT) are reached, through a public peer they trust.

A private peer (``swarm/reachability.py``) can dial out but cannot be dialed. It *reserves* a slot on
a relay, one of its initial peers (the bootstrap the user typed, or public volunteers listed in
``swarm.relays``), keeps that connection open and publishes ``reach = "relayed"`` and ``via = <the
relay's peer id>`` in its records. A peer that must open a stream to it (to its group leader, its
shard owner, a state donor) asks the relay to *forward*: the relay opens a stream to the private peer
over the connection the private peer holds to it (libp2p carries streams both ways over one
connection), tells it who is calling and for which handler, and then copies bytes both ways until
either end closes. Every protocol runs unchanged over such a stream.

Why our own forwarding and not libp2p's circuit relay: in the p2p daemon hivemind ships, a circuit is
cut after 128 KiB unless the relay's own AutoNAT already found it public (which takes another public
peer on another IP: not the case when the bootstrap is the swarm's only public machine), reservations
made before that are lost, and auto-relay waits minutes for relay candidates; a pseudo-gradient part
is megabytes. libp2p's hole punching (DCUtR) needs TCP reuseport, which our daemons run without
(simultaneous dials of two public peers failed with it); two relayed peers punch with our own
protocol instead (swarm/punch.py), over QUIC, and talk directly when it succeeds. For that the relay
tells a reserving peer the outside addresses it sees it at (``seen``), and names the addresses it sees
a caller at when it forwards its stream.

Trust: a private peer trusts its relay as it trusts its bootstrap: the relay names each caller (the
handlers' quotas, offences and group checks use that name), sees the bytes and could drop or alter
them. A relay accepts forwards only to peers holding a reservation with it, and only to p2pdiloco
handlers. Bounds (:class:`RelayLimits`, set on the bootstrap with ``--relay-*`` options or
``relay_*`` keys): reservations, circuits open at once, bytes per circuit, bytes per hour; relaying
can be turned off. What it carries is counted (:attr:`RelayServer.stats`): the bootstrap logs it, a
private peer publishes the bytes its relayed streams carried (``rb``) for ``status`` and the
dashboard.

Wire (protocol.py framing), on ``p2pdiloco.relay`` (the relay's handler):
  ``{t: "reserve", v}``                 -> ``{t: "ok", ttl, seen}`` | ``{t: "refuse", reason}``
  ``{t: "fwd", v, to, h}``              -> ``{t: "ok"}`` then raw bytes both ways | ``{t: "refuse", reason}``
and on ``p2pdiloco.relayed`` (a private peer's, called by its relay only):
  ``{t: "in", v, from, h, seen}`` then raw bytes both ways: the stream of handler ``h`` from caller
  ``from``, whom the relay sees at ``seen``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ..addresses import punchable
from ..errors import WireError
from ..ids import short_id
from .protocol import PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header, write_frame

__all__ = ["HANDLER", "INBOUND", "RelayLimits", "RelayServer", "reserve", "open_relayed", "serve_inbound",
           "RESERVATION_TTL"]

logger = logging.getLogger(__name__)

HANDLER = "p2pdiloco.relay"
INBOUND = "p2pdiloco.relayed"
#: a reservation lasts this long (seconds); the private peer renews it every third of it
RESERVATION_TTL = 60.0
#: bytes copied per read while forwarding
CHUNK = 1 << 16
#: how long a relay waits for the private peer to take a forwarded stream (seconds)
OPEN_TIMEOUT = 10.0
#: a forwarded stream that carries no byte either way for this long is closed (seconds): longer than an
#: owner waits for the other members' parts before it answers
IDLE_TIMEOUT = 300.0


@dataclass
class RelayLimits:
    """What one relay carries at most (0: no limit)."""

    enabled: bool = True
    max_reservations: int = 128
    max_circuits: int = 64
    #: streams one caller may have forwarded at once (a member sends to each relayed owner at once)
    max_circuits_per_caller: int = 16
    #: bytes of one forwarded stream, both directions together (a pseudo-gradient part and its result
    #: for models of a few hundred million parameters fit in the default)
    max_circuit_bytes: int = 4 << 30
    #: bytes all circuits together may carry per hour (0: no limit)
    max_bytes_per_hour: int = 0


class RelayServer:
    """Serves reservations and forwards on a public peer (the bootstrap, or a volunteer that relays)."""

    def __init__(self, node, limits: Optional[RelayLimits] = None):
        self.node = node
        self.limits = limits or RelayLimits()
        self._reserved: Dict[str, float] = {}  # peer -> reservation end (monotonic)
        self._circuits = 0
        self._by_caller: Counter = Counter()  # caller -> circuits open
        self._hour: Tuple[float, int] = (time.monotonic(), 0)  # (window start, bytes in it)
        self._lock = threading.Lock()
        #: reservations, circuits, bytes forwarded, refusals by reason
        self.stats: Counter = Counter()
        # Not behind the node's gate: to a relay every caller is a stranger (it shares no rounds), and the
        # gate's stranger quota would refuse a member that sends to several relayed owners at once. The
        # relay has limits of its own (per caller and in all), honours the gate's bans, and never lets an
        # exception escape.
        node.call(node.p2p.add_binary_stream_handler(HANDLER, self._handle), timeout=30)

    def reserved(self) -> Set[str]:
        now = time.monotonic()
        with self._lock:
            return {p for p, until in self._reserved.items() if until > now}

    def _refusal(self, kind: str, peer: str, target: str = "") -> Optional[str]:
        lim, now = self.limits, time.monotonic()
        if not lim.enabled:
            return "this peer does not relay"
        gate = getattr(self.node, "gate", None)
        if gate is not None and gate.banned(peer):
            return "banned"
        with self._lock:
            self._reserved = {p: t for p, t in self._reserved.items() if t > now}
            if kind == "reserve":
                if peer not in self._reserved and lim.max_reservations and len(self._reserved) >= lim.max_reservations:
                    return f"relay full ({lim.max_reservations} reservations)"
                return None
            if target not in self._reserved:
                return "no reservation for that peer here"
            if lim.max_circuits and self._circuits >= lim.max_circuits:
                return f"relay busy ({lim.max_circuits} circuits open)"
            if lim.max_circuits_per_caller and self._by_caller[peer] >= lim.max_circuits_per_caller:
                return f"relay busy for this caller ({lim.max_circuits_per_caller} circuits open)"
            start, used = self._hour
            if now - start >= 3600:
                self._hour = (now, 0)
            elif lim.max_bytes_per_hour and used >= lim.max_bytes_per_hour:
                return f"relay over its hourly budget ({lim.max_bytes_per_hour} bytes)"
            return None

    async def _handle(self, info, reader, writer) -> None:
        sender = info.peer_id.to_base58()
        forwarded = False
        try:
            header = await read_header(reader, self.node.traffic, sender)
            refusal = check_version(header)
            kind = header.get("t")
            if refusal is None and kind not in ("reserve", "fwd"):
                refusal = "expected reserve or fwd"
            target, handler = header.get("to"), header.get("h")
            if refusal is None and kind == "fwd" and (
                    not isinstance(target, str) or not 20 <= len(target) <= 128 or not isinstance(handler, str)
                    or not handler.startswith("p2pdiloco.") or len(handler) > 256):
                refusal = "malformed forward"
            refusal = refusal or self._refusal(kind, sender, target or "")
            if refusal is not None:
                self.stats[f"refused: {refusal.split(' (')[0]}"] += 1
                await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=self.node.traffic)
                return
            if kind == "reserve":
                with self._lock:
                    self._reserved[sender] = time.monotonic() + RESERVATION_TTL
                self.stats["reservations"] += 1
                await write_frame(writer, {"t": "ok", "ttl": RESERVATION_TTL, "seen": await self._seen(sender)},
                                  traffic=self.node.traffic)
                return
            await self._forward(sender, target, handler, reader, writer)
            forwarded = True
        except (WireError, asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as e:
            logger.info(f"[{self.node.short_id}] relay request from {short_id(sender)} failed: {e}")
        except asyncio.CancelledError:  # the relay shuts down
            pass
        except Exception as e:  # noqa: BLE001 - a bug must not take the relay down; say who triggered it
            logger.error(f"[{self.node.short_id}] relay request from {short_id(sender)} failed: {type(e).__name__}: {e}")
        finally:
            if forwarded:
                writer.close()
            else:  # a reply (a reservation, a refusal) must reach the caller before we close: it closes first
                await close_after_reply(reader, writer, timeout=10.0)

    async def _seen(self, peer: str) -> list:
        """The outside QUIC addresses our daemon sees ``peer`` at (where a hole punch must aim)."""
        try:
            return punchable([str(a) for info in await self.node.p2p.list_peers()
                              if info.peer_id.to_base58() == peer for a in info.addrs])
        except Exception:  # noqa: BLE001 - the daemon is shutting down
            return []

    async def _forward(self, caller: str, target: str, handler: str, reader, writer) -> None:
        from hivemind.p2p import PeerID

        try:
            _, t_reader, t_writer = await asyncio.wait_for(
                self.node.p2p.call_binary_stream_handler(PeerID.from_base58(target), INBOUND), OPEN_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the private peer is gone, or its connection to us is
            self.stats["refused: target unreachable"] += 1
            await write_frame(writer, {"t": "refuse", "reason": f"cannot reach {short_id(target)} from the relay: "
                                                                 f"{type(e).__name__}"}, traffic=self.node.traffic)
            return
        with self._lock:
            self._circuits += 1
            self._by_caller[caller] += 1
        self.stats["circuits"] += 1
        try:
            await write_frame(t_writer, {"t": "in", "v": PROTOCOL_VERSION, "from": caller, "h": handler,
                                         "seen": await self._seen(caller)})
            await write_frame(writer, {"t": "ok"}, traffic=self.node.traffic)
            budget = self.limits.max_circuit_bytes or (1 << 62)
            moved = await pipe(reader, writer, t_reader, t_writer, budget, self._count)
            if moved >= budget:
                self.stats["refused: circuit over its byte limit"] += 1
        finally:
            with self._lock:
                self._circuits -= 1
                self._by_caller[caller] -= 1
                if self._by_caller[caller] <= 0:
                    del self._by_caller[caller]
            t_writer.close()

    def _count(self, n: int) -> None:
        self.stats["bytes"] += n
        with self._lock:
            start, used = self._hour
            self._hour = (start, used + n)


async def pipe(a_reader, a_writer, b_reader, b_writer, budget: int, count: Callable[[int], None]) -> int:
    """Copy bytes a -> b and b -> a until either side ends, ``budget`` bytes were copied in all, or
    nothing moved either way for IDLE_TIMEOUT seconds; returns the bytes copied. Our protocols never
    half-close a stream, so the first end ends both."""
    moved = 0
    loop = asyncio.get_running_loop()
    last = loop.time()  # the last byte either way: a stream idle both ways for IDLE_TIMEOUT is closed

    async def one(src, dst):
        nonlocal moved, last
        while moved < budget:
            try:
                data = await asyncio.wait_for(src.read(CHUNK), IDLE_TIMEOUT / 4)
            except asyncio.TimeoutError:
                if loop.time() - last >= IDLE_TIMEOUT:
                    return
                continue
            if not data:
                return
            last = loop.time()
            moved += len(data)
            count(len(data))  # before the write: whoever receives these bytes finds them counted
            dst.write(data)
            await dst.drain()

    tasks = [asyncio.ensure_future(one(a_reader, b_writer)), asyncio.ensure_future(one(b_reader, a_writer))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return moved


# ---- the private peer's side --------------------------------------------------------------------------
async def reserve(node, relay: str, timeout: float = 10.0) -> Optional[str]:
    """Ask ``relay`` for a slot; None when granted, else why not."""
    from hivemind.p2p import PeerID

    try:
        _, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(PeerID.from_base58(relay), HANDLER), timeout)
    except Exception as e:  # noqa: BLE001 - an old bootstrap without the handler, or unreachable
        return f"{type(e).__name__}: {str(e)[:160]}"
    try:
        await write_frame(writer, {"t": "reserve", "v": PROTOCOL_VERSION}, traffic=node.traffic)
        reply, _ = await asyncio.wait_for(read_frame(reader, 0, node.traffic, relay), timeout)
        if reply.get("t") != "ok":
            return str(reply.get("reason", "refused"))[:200]
        node.punches.observed = punchable(reply.get("seen"))  # where the relay sees us: a hole punch aims there
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        writer.close()


async def serve_inbound(node, trusted: Callable[[], Set[str]], handlers: Dict[str, Callable], info, reader,
                        writer) -> None:
    """``p2pdiloco.relayed``: a stream our relay forwards. Only a relay we reserved with may call it; the
    stream then runs the named handler as if the caller had dialed us (its quotas, offences and checks
    apply to the caller the relay names)."""
    from hivemind.p2p import PeerID

    relay = info.peer_id.to_base58()
    if relay not in trusted():
        await write_frame(writer, {"t": "refuse", "reason": "not our relay"})
        await close_after_reply(reader, writer, timeout=2.0)  # the refusal reaches the caller before we close
        return
    header = await read_header(reader, node.traffic, relay)
    caller, name = header.get("from"), header.get("h")
    handler = handlers.get(name) if isinstance(name, str) else None
    if header.get("t") != "in" or not isinstance(caller, str) or handler is None:
        writer.close()
        return
    try:
        pid = PeerID.from_base58(caller)
    except Exception:  # noqa: BLE001 - a malformed id from our relay
        writer.close()
        return
    node.relay_stats["inbound"] += 1
    await handler(_Info(pid, punchable(header.get("seen"))), reader, _Counted(writer, node.relay_stats))


class _Info:
    """What a handler reads of its stream's origin: the caller the relay names, and the outside
    addresses the relay sees it at (swarm/punch.py)."""

    def __init__(self, peer_id, seen=()):
        self.peer_id = peer_id
        self.seen = list(seen)


class _Counted:
    """A stream writer that counts what it writes (the bytes our relayed streams carried)."""

    def __init__(self, writer, stats: Counter):
        self._w, self._stats = writer, stats

    def write(self, data) -> None:
        self._stats["bytes"] += len(data)
        self._w.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._w, name)


async def open_relayed(node, relay: str, peer: str, handler: str, timeout: float):
    """A stream to ``handler`` of the private ``peer`` through ``relay``: (info, reader, writer), as
    ``call_binary_stream_handler`` returns them. Raises ConnectionError naming the relay's refusal."""
    from hivemind.p2p import PeerID

    info, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(relay), HANDLER)
    try:
        await write_frame(writer, {"t": "fwd", "v": PROTOCOL_VERSION, "to": peer, "h": handler},
                          traffic=node.traffic)
        reply, _ = await asyncio.wait_for(read_frame(reader, 0, node.traffic, relay), timeout)
    except BaseException:
        writer.close()
        raise
    if reply.get("t") != "ok":
        writer.close()
        raise ConnectionError(f"relay {short_id(relay)} did not forward to {short_id(peer)}: "
                              f"{str(reply.get('reason', 'refused'))[:200]}")
    node.relay_stats["outbound"] += 1
    return info, reader, _Counted(writer, node.relay_stats)
