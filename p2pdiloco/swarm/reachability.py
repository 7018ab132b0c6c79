"""Reachability: can other peers dial this one? Detected by a dial-back, not assumed.

A peer behind NAT (a home router, a cloud instance without a public port) can dial out, but nobody
can dial in. libp2p reuses an open connection in both directions, so a peer that *has* talked to us
can often still reach us; anyone else cannot. p2pdiloco therefore never dials a private peer
directly (it is reached through its relay, or not at all: matchmaking.py ranks and owners;
state_sync.py: it donates state only when no public donor has it), and a private peer runs its DHT
node as a client (hivemind ``client_mode``): it reads and stores records through the public nodes
and is never put into their routing tables, so nobody's DHT read waits on a node it cannot reach.

Detection (``swarm.reachability = "auto"``, the default), an AutoNAT-style dial-back. The peer asks
up to :data:`MAX_HELPERS` *helpers* over the ``p2pdiloco.reach`` handler: its initial peers first,
then the DHT servers in its routing table (public peers: private ones are never in a routing
table). A helper dials the asker back at *the IP it sees the request coming from* and the TCP
port(s) the asker listens on (or announces), from a fresh libp2p host of its own (a throwaway p2p
daemon with a new identity, no listener, no earlier connection to reuse), asking for the asker's
peer id: the secure handshake only completes when the remote end holds that peer id's key. A NAT
rewrites our source address to its own, where nothing forwards the port, so the dial-back fails;
so does an open port served by anything else (another program, another peer's daemon: wrong or no
libp2p identity). A helper dials only the requester's own observed IP and never an address the
requester names, so nobody can use it to probe third parties.

The verdict (:func:`verdict`), over the helpers asked (*candidates*), those that answered, and
those that proved the dial-back (*yes*):

* no candidate at all (the first peer of a swarm): ``public``, others dial it to get in;
* ``public`` when at least two helpers said yes and they are a strict majority of the answers
  (2 of 2, 2 of 3, 3 of 5; 2 of 4 is not enough);
* one helper's yes is enough only when it is our only candidate (a swarm of that peer and us: a
  lie then only breaks rounds between the two of us);
* everything else is ``private``, including nobody answering (the safe side: a private peer taken
  for public would make every round it owns a shard of fail; a public peer taken for private still
  trains as a full member and only does less of the reducing).

So one lying helper cannot make a private peer public: its yes alone never counts when we know
another peer, and the honest answers outvote it. It can make a public peer private (say no, or not
answer, when only one other helper answers): the safe direction. Making a private peer public takes
at least two colluding helpers that outnumber the honest answers among the ones asked. A helper
that cannot check (busy, its dialer did not start) refuses instead of answering no; it counts as
not answered.

A private peer then takes a slot on a relay (its initial peers, swarm/relay.py) and is ``relayed``:
others reach it through that relay, so it can lead a group and own shards when no public member can.

``swarm.reachability = "public"`` / ``"private"`` skip the detection (a port forward the helpers
cannot see, or a network you know). A peer lying about being public only breaks rounds it takes
part in (its group's members cannot send it their parts and the round fails over to the next one),
as any unresponsive member does.

Wire (protocol.py): request ``{t: "reach", v, ports: [int, ...]}`` (at most 4), reply
``{t: "reach", ok: bool, addr: "ip:port" | "", relayed: bool}`` or ``{t: "refuse", reason}``.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Iterable, List, Optional, Sequence, Tuple

from multiaddr import Multiaddr

from ..errors import WireError
from ..ids import short_id
from .protocol import (PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header,
                       refuse_bad_request, write_frame)

__all__ = ["REACHABILITY", "SETTINGS", "HANDLER", "is_private", "serve_reach", "detect", "verdict",
           "helper_candidates", "listen_ports"]

logger = logging.getLogger(__name__)

#: what a peer publishes in its progress record (``reach``)
REACHABILITY = ("public", "private", "relayed")
#: what ``swarm.reachability`` accepts
SETTINGS = ("auto", "public", "private")
#: the dial-back handler; one per node, shared by every run on it
HANDLER = "p2pdiloco.reach"
#: a helper's libp2p dial-back: connect and secure handshake (seconds; the dialer's start comes on top)
DIAL_TIMEOUT = 4.0
#: a helper's throwaway dialer daemon must start within this (seconds)
DIALER_START_TIMEOUT = 10.0
MAX_PORTS = 4
#: helpers asked at once
MAX_HELPERS = 5
#: dial-back requests a helper holds waiting for its dialer (one dials at a time); more are refused
MAX_WAITING = 8
#: when no helper answered (busy with a swarm that starts at once, or too slow to answer in time), the
#: helpers are asked once more after a pause drawn from this range (seconds): a check that did not run
#: says nothing of our reachability, and a peer taken for private is relayed for its whole run
RETRY_PAUSE_S = (1.0, 5.0)


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


def _observed_ip(addr: object) -> Tuple[Optional[str], Optional[str], bool]:
    """(``ip4`` | ``ip6``, IP the request came from, whether it came through a circuit relay)."""
    parts = str(addr).split("/")
    relayed = "p2p-circuit" in parts
    for i, proto in enumerate(parts[:-1]):
        if proto in ("ip4", "ip6"):
            return proto, parts[i + 1], relayed
    return None, None, relayed


class _DialerUnavailable(Exception):
    """The helper could not start its dialer: it cannot check, so it must not answer no."""


async def dial_back(peer_id: str, maddrs: Sequence[str], timeout: float = DIAL_TIMEOUT) -> Optional[str]:
    """The address among ``maddrs`` (``/ip4/.../tcp/...``, without ``/p2p/``) at which a fresh libp2p
    host completed a secure handshake with ``peer_id``, or None.

    The dialer is a p2p daemon of its own, started for this one dial with a new random identity and no
    listener, and shut down after it: it has no connection to ``peer_id`` that could be reused (ours
    has, the asker's request came on it) and knows no address of it but ``maddrs``, so a connection
    proves that whoever listens at one of them holds ``peer_id``'s key (libp2p's security handshake
    refuses a remote key of another peer id). An idle daemon exits by itself (``idle_timeout``), so
    one left behind by a killed process goes away."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    try:
        dialer = await P2P.create(no_listen=True, auto_nat=False, nat_port_map=False, use_relay=False,
                                  conn_manager=False, dht_mode="client", idle_timeout=timeout + 10,
                                  startup_timeout=DIALER_START_TIMEOUT)
    except (P2PDaemonError, OSError, asyncio.TimeoutError) as e:
        raise _DialerUnavailable(f"{type(e).__name__}: {e}") from None
    try:
        target = PeerID.from_base58(peer_id)
        try:
            await asyncio.wait_for(dialer._client.connect(target, [Multiaddr(m) for m in maddrs]), timeout)
            peers = await asyncio.wait_for(dialer._client.list_peers(), timeout)
        except Exception as e:  # refused, timed out, wrong peer id ("peer id mismatch"), not libp2p at all
            logger.debug(f"dial-back to {short_id(peer_id)} at {', '.join(maddrs)} failed: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}")
            return None
        for info in peers:
            if info.peer_id == target:
                return str(info.addrs[0]) if info.addrs else maddrs[0]
        return None
    finally:
        await dialer.shutdown()


def _hostport(maddr: str) -> str:
    parts = maddr.split("/")
    return f"{parts[2]}:{parts[4]}" if len(parts) > 4 else maddr


def serve_reach(node) -> None:
    """Serve the dial-back on ``node`` (every p2pdiloco node does, bootstrap peers included)."""
    one_at_a_time = asyncio.Lock()  # one throwaway dialer at a time, whoever asks
    waiting = [0]

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
            if refusal is None and waiting[0] >= MAX_WAITING:
                refusal = "busy: too many reachability checks waiting; ask another peer"
            if refusal is not None:
                await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=traffic)
                return
            proto, ip, relayed = _observed_ip(info.addr)
            ok, where = False, ""
            if ip is not None and not relayed:
                maddrs = [f"/{proto}/{ip}/tcp/{p}" for p in dict.fromkeys(ports)]
                waiting[0] += 1
                try:
                    async with one_at_a_time:
                        hit = await dial_back(sender, maddrs)
                except _DialerUnavailable as e:
                    logger.warning(f"[{node.short_id}] cannot check reachability for {short_id(sender)}: {e}")
                    await write_frame(writer, {"t": "refuse", "reason": "this peer could not start its "
                                               "dial-back check; ask another peer"}, traffic=traffic)
                    return
                finally:
                    waiting[0] -= 1
                ok = hit is not None
                where = _hostport(hit if hit is not None else maddrs[0])
            await write_frame(writer, {"t": "reach", "ok": ok, "addr": where, "relayed": relayed}, traffic=traffic)
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            await refuse_bad_request(node, sender, e, writer)
        finally:
            await close_after_reply(reader, writer)

    node.add_handler(HANDLER, handle)


async def _ask(node, helper: str, ports: Sequence[int], timeout: float) -> Optional[dict]:
    from hivemind.p2p import PeerID

    async def ask() -> dict:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(helper), HANDLER)
        try:
            await write_frame(writer, {"t": "reach", "v": PROTOCOL_VERSION, "ports": list(ports)},
                              traffic=node.traffic)
            reply, _ = await read_frame(reader, 0, node.traffic, helper)
            return reply
        finally:
            writer.close()

    try:
        reply = await asyncio.wait_for(ask(), timeout)
    except Exception as e:  # unreachable helper, an older peer without the handler, a timeout
        logger.info(f"[{node.short_id}] reachability helper {short_id(helper)} did not answer ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]})")
        return None
    if reply.get("t") == "refuse":
        logger.info(f"[{node.short_id}] reachability helper {short_id(helper)} refused: {str(reply.get('reason'))[:200]}")
    return reply if reply.get("t") == "reach" and isinstance(reply.get("ok"), bool) else None


def verdict(candidates: int, answers: Sequence[bool]) -> bool:
    """Public? ``answers``: one per helper that answered (True: it proved the dial-back), out of
    ``candidates`` helpers asked (module docstring: why a single yes counts only when alone)."""
    if candidates == 0:
        return True
    yes = sum(1 for a in answers if a)
    if 2 * yes <= len(answers):
        return False
    return yes >= 2 or candidates == 1


async def _routing_table_peers(_dht, dht_node) -> List[str]:
    """Runs in the DHT process: the peer ids in our routing table's buckets (DHT servers, all public)."""
    return sorted(pid.to_base58() for bucket in dht_node.protocol.routing_table.buckets
                  for pid in bucket.nodes_to_peer_id.values())


async def helper_candidates(node, initial: Sequence[str], timeout: float = 5.0) -> List[str]:
    """Who to ask: the ``initial`` peer ids, then the DHT servers we know, without us or repeats."""
    known: List[str] = []
    try:
        known = list(await asyncio.wait_for(node.dht.run_coroutine(_routing_table_peers, return_future=True),
                                            timeout))
    except Exception as e:  # the initial peers alone still give a verdict (a stricter one, never looser)
        logger.info(f"[{node.short_id}] could not list the DHT's known peers ({type(e).__name__}: {e})")
    return [h for h in dict.fromkeys([*initial, *known]) if h != node.peer_id_str]


async def detect(node, helpers: Sequence[str], ports: Sequence[int], timeout: float = 10.0) -> Tuple[str, str]:
    """(``public`` | ``private``, why) from asking ``helpers`` (peer ids, best first: at most
    :data:`MAX_HELPERS` are asked) to dial us back on ``ports``."""
    helpers = [h for h in dict.fromkeys(helpers) if h != node.peer_id_str][:MAX_HELPERS]
    if not helpers:
        return "public", "no other peer to ask (the first peer of a swarm is dialed by everyone else)"
    if not ports:
        return "private", "this peer listens on no TCP port"
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(random.uniform(*RETRY_PAUSE_S))
            logger.info(f"[{node.short_id}] no reachability helper answered; asking again")
        replies = await asyncio.gather(*(_ask(node, h, ports, timeout) for h in helpers))
        answered = [(h, r) for h, r in zip(helpers, replies) if r is not None]
        if answered:
            break
    else:
        return "private", "no helper answered the reachability check, twice; assuming private (safe side)"
    yes = [(h, r) for h, r in answered if r["ok"]]
    no = [(h, r) for h, r in answered if not r["ok"]]
    tally = f"{len(yes)} of {len(answered)} helper(s) that answered ({len(helpers)} asked) dialed us back"
    if verdict(len(helpers), [r["ok"] for _, r in answered]):
        where = ", ".join(f"{short_id(h)} at {r.get('addr')}" for h, r in yes)
        return "public", f"{tally}, proving our peer id: {where}"
    seen = ", ".join(f"{short_id(h)} could not dial {r.get('addr') or 'us'}" for h, r in no)
    if not yes:
        return "private", f"{tally}: {seen} (behind NAT or a firewall)"
    rule = ("one helper's yes counts only when it is the only other peer we know" if len(yes) == 1
            else "the yes must outnumber the no")
    return "private", f"{tally}; {rule}{': ' + seen if seen else ''}; assuming private (safe side)"
