"""Dialing a peer: warm connections before a round, and libp2p's dial backoff.

libp2p (the p2pd daemon under hivemind's P2P) remembers every failed dial per (peer, address) and
refuses new dials to that address for about 5 s ("all dials failed * [/ip4/...] dial backoff",
measured here: 5.0 s after one refused dial; a daemon ``connect`` with the same explicit addresses
is refused the same way, and the daemon offers no call to clear it). A round that dialed its members
only when it started, and retried at 0.3 and 0.6 s, therefore failed on every member whenever one
first dial failed: the retries were refused by the backoff, not by the network.

The first failure itself was mostly TCP simultaneous open (both ends of a pair dialing each other at
once from their listening ports, joined into one TCP connection whose handshake fails both ways):
our daemons run without TCP reuseport (``node.no_tcp_reuseport``). What remains (a link really down
for a while, a DHT dial that failed) is handled here. So:

* :func:`ensure_connected` opens a connection to a peer (a no-op when one is open, in either
  direction: a libp2p connection carries streams both ways) and keeps trying until a deadline:
  every 0.25 s while the address is in backoff (each try costs nothing and notices at once a
  connection the *other* peer opened to us), then a fresh dial once the backoff is over. Matchmaking
  calls it for every member a peer will exchange parts with, before the round starts
  (``Matchmaker`` "warm" step), and both ends of a pair of public peers dial each other, so one
  failed direction is usually rescued by the other within milliseconds.
* :func:`open_stream` opens a stream to a handler, falling back to :func:`ensure_connected` when the
  dial fails, so a round that still meets a cold or backed-off peer waits it out within its own
  timeout instead of failing.
* The cause of the first failure to each peer is logged (INFO) with the daemon's per-address
  reasons (``connection refused``, ``i/o timeout``, ``no addresses``, ``dial backoff``: then an
  earlier dial to that address failed less than ~5 s ago, and we say so), and counted in
  ``stats`` (``dial_failed``, ``dial_backoff``, ``dial_recovered``, ``dial_gave_up``).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Optional, Tuple

from ..ids import short_id
from .relay import open_relayed

__all__ = ["BACKOFF_POLL", "dial_reason", "ensure_connected", "open_stream"]

logger = logging.getLogger(__name__)

#: how often a peer in dial backoff is tried again (seconds): cheap, refused by the daemon at once
BACKOFF_POLL = 0.25
#: pause after a dial that failed for another reason (refused, timed out) before the next try
RETRY_PAUSE = 0.5


def dial_reason(exc: BaseException) -> str:
    """The daemon's reasons for a failed dial, on one line: the per-address list when there is one."""
    text = " ".join(str(exc).split())
    if "all dials failed" in text:
        text = text.split("all dials failed", 1)[1].strip()
    elif not text:
        text = type(exc).__name__
    if "dial backoff" in text:
        text += " (libp2p refuses to dial an address for ~5 s after a dial to it failed)"
    return text[:600]


def _is_dial_error(exc: BaseException) -> bool:
    """A failure to reach the peer (worth waiting out), not an answer from it: a peer that does not serve
    the protocol ("protocols not supported") was reached and said no."""
    text = str(exc).lower()
    if "protocols not supported" in text or "protocol not supported" in text:
        return False
    return "dial" in text or "no addresses" in text or "connect failed" in text


def _stats(node: Any) -> Counter:
    stats = getattr(node, "dial_stats", None)
    if stats is None:
        stats = Counter()
        try:
            node.dial_stats = stats
        except AttributeError:  # pragma: no cover - a node that takes no attributes
            pass
    return stats


async def ensure_connected(node: Any, peer: str, deadline: float, first_error: Optional[BaseException] = None,
                           why: str = "") -> Optional[str]:
    """Make sure a libp2p connection to ``peer`` is open by ``deadline`` (event loop time).

    Returns None once connected, else the last failure's reason (nothing raised). ``first_error``: a
    dial that already failed (the caller's stream open), so its cause is logged as the first. A peer
    reached through a relay (``node.relay_routes``) is reached over our connection to its relay."""
    from hivemind.p2p import PeerID

    relay = getattr(node, "relay_routes", {}).get(peer)
    if relay is not None and relay != node.peer_id_str:
        why = f"{why} (relay of {short_id(peer)})"
        peer = relay

    loop = asyncio.get_running_loop()
    stats = _stats(node)
    pid = PeerID.from_base58(peer)
    failed: Optional[str] = None
    tries = 0
    err: Optional[BaseException] = first_error
    while True:
        if err is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                tries += 1
                await asyncio.wait_for(node.p2p._client.connect(pid, []), timeout=remaining)
                if failed is not None:
                    stats["dial_recovered"] += 1
                    logger.info(f"[{node.short_id}] connected to {short_id(peer)}{why} after {tries} tr"
                                f"{'y' if tries == 1 else 'ies'} (first failure: {failed[:200]})")
                return None
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                err = TimeoutError("no connection within the deadline")
            except Exception as e:  # the daemon's refusal: all dials failed, backoff, no addresses
                err = e
        reason = dial_reason(err)
        if failed is None:
            failed = reason
            stats["dial_failed"] += 1
            logger.info(f"[{node.short_id}] dialing {short_id(peer)}{why} failed: {reason}; retrying until the "
                        f"deadline ({max(0.0, deadline - loop.time()):.1f} s left)")
        backoff = "dial backoff" in reason
        stats["dial_backoff" if backoff else "dial_retries"] += 1
        err = None
        pause = BACKOFF_POLL if backoff else RETRY_PAUSE
        if loop.time() + pause >= deadline:
            break
        await asyncio.sleep(pause)
    stats["dial_gave_up"] += 1
    logger.warning(f"[{node.short_id}] could not connect to {short_id(peer)}{why} before the deadline "
                   f"(first failure: {(failed or 'none')[:300]})")
    return failed or "no connection within the deadline"


async def open_stream(node: Any, peer: str, handler: str, deadline: float,
                      stats: Optional[Counter] = None) -> Tuple[Any, Any, Any]:
    """``node.p2p.call_binary_stream_handler(peer, handler)``, waiting out a failed or backed-off dial
    until ``deadline`` (event loop time; see the module docstring). Errors other than a failed dial
    are raised at once; a dial still failing at the deadline raises ConnectionError with its cause.
    ``stats["dial_retries"]`` (when given) counts the dials that failed and were waited out here. A peer
    that is reached through a relay (``node.relay_routes``) gets the stream through it (swarm/relay.py)."""
    from hivemind.p2p import PeerID  # hivemind costs seconds to import: only when dialing

    pid = PeerID.from_base58(peer)
    loop = asyncio.get_running_loop()
    while True:
        relay = getattr(node, "relay_routes", {}).get(peer)
        punched = getattr(getattr(node, "punches", None), "direct", ())
        if relay is not None and peer in punched:
            if await is_direct(node, peer):  # a hole punch connected us: the relay is not needed
                node.relay_stats["direct_streams"] += 1
                relay = None
            else:
                punched.discard(peer)
        try:
            if relay is not None and relay != node.peer_id_str:
                return await open_relayed(node, relay, peer, handler, timeout=max(1.0, deadline - loop.time()))
            return await node.p2p.call_binary_stream_handler(pid, handler)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not _is_dial_error(e) or loop.time() >= deadline:
                raise
            if stats is not None:
                stats["dial_retries"] += 1
            failure = await ensure_connected(node, peer, deadline, first_error=e)
            if failure is not None:
                raise ConnectionError(f"cannot dial {short_id(peer)}: {failure}") from None


async def is_direct(node: Any, peer: str) -> bool:
    """Whether our daemon holds a connection to ``peer`` that is not through a libp2p relay."""
    try:
        for info in await node.p2p.list_peers():
            if info.peer_id.to_base58() == peer and any("p2p-circuit" not in str(a) for a in info.addrs):
                return True
    except Exception:  # noqa: BLE001 - the daemon is shutting down
        pass
    return False
