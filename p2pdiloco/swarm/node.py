"""SwarmNode: one peer's presence in the swarm.

It owns hivemind's Kademlia DHT (a forked process with the libp2p daemon; both exit when this
process dies, by any signal: lifeline.py), a replica of the P2P client in this process, and an
asyncio event loop running in a background thread where every network coroutine of this peer runs
(stream handlers, matchmaking, all-reduce). The training loop stays in the main thread and hands
coroutines over with :meth:`submit` / :meth:`call`.

Reachability (reachability.py): every node serves the dial-back check. A node with
``reachability="auto"`` and initial peers starts its DHT node as a *client* (it reads and stores,
but is in nobody's routing table), asks its initial peers and the DHT servers it knows to dial it
back, and becomes a full DHT node only once enough of them could: a private peer never appears in
others' routing tables, so their DHT calls never wait on a node they cannot reach.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections import Counter
from functools import partial
from typing import Any, Awaitable, Callable, Collection, Dict, FrozenSet, List, Optional, Set

import msgpack

from ..addresses import parse_maddrs, with_quic
from ..errors import BootstrapUnreachable, UserError
from ..ids import short_id
from ..identity import (discard_ephemeral, ephemeral_identity, load_signing_key, note_helpers, prepare_identity,
                        release_identity)
from . import ledger
from .keys import kind_of
from . import punch as punch_mod
from . import relay as relay_mod
from .lifeline import descendants, start_dht
from .protocol import PeerGate, Traffic
from .reachability import SETTINGS, detect, helper_candidates, listen_ports, serve_reach
from .records import RecordBook
from .relay import RelayLimits

__all__ = ["SwarmNode", "pack", "unpack"]

logger = logging.getLogger(__name__)


def pack(value: Dict[str, Any]) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(blob: Any) -> Optional[Dict[str, Any]]:
    """Decode a DHT record value written by :func:`pack`; None when it is not a msgpack map."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) > 1 << 16:
        return None
    try:
        value = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception:
        return None
    return value if isinstance(value, dict) else None


async def _serve_dht(initial_peers: List[str], _dht: Any, node: Any) -> int:
    """Runs in the DHT process: turn a client-mode DHT node into a full one (the state
    ``hivemind.dht.protocol.DHTProtocol.create`` gives a non-client node) and ping the peers we know,
    which adds us to their routing tables. Returns how many answered."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils.auth import AuthRole, AuthRPCWrapper

    proto = node.protocol
    if not proto.client_mode:
        return 0
    await proto.add_p2p_handlers(proto.p2p, AuthRPCWrapper(proto, AuthRole.SERVICER, proto.authorizer))
    proto.node_info = dht_pb2.NodeInfo(node_id=proto.node_id.to_bytes())
    proto.client_mode = False
    peers = set(proto.routing_table.peer_id_to_uid) | {PeerID.from_base58(p) for p in initial_peers}
    answers = await asyncio.gather(*(proto.call_ping(p) for p in peers), return_exceptions=True)
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))


# ---- the background records' cheap path (Swarm's periodic publisher and reader: quiet when idle) ----
# hivemind's DHT.store first looks the key's nearest nodes up, and its find RPC returns the value it asks
# about: every store of one progress record downloaded the whole dictionary (every peer's record, ~1.2 KB
# each) from every node it asked, and a dictionary store into a cached key started a full read besides.
# Measured on the emulated WAN (4 peers, records every 2 s): 15 KB/s sent per peer for publishing alone,
# 24 KB/s with the reads. These three run in the DHT process and move only what has to move.

#: among how many of a key's nearest nodes a network read of the background reader draws the node it
#: asks, and how many it asks at most (SwarmNode._read_nodes)
READ_BEAM = 2

#: how many of a key's nearest nodes hold each record (hivemind's default), and how wide the other reads and
#: the stores' node lookups search. hivemind searches 20 wide (its bucket size): with every peer a DHT
#: server, a read of 24 peers' records asked ~20 nodes, each answering with the whole dictionary, and a
#: store's lookup downloaded the dictionary from each node it met. A search this wide still ends at the
#: key's nearest nodes, which are where every writer stores.
REPLICAS = 5

#: how many nodes a node names when it answers a lookup or a read (hivemind: its bucket size, 20). Our
#: lookups want a key's REPLICAS nearest nodes; every reply naming 20 made the node lookups a sixth of a
#: peer's DHT bytes at 24 peers. Kademlia deployments answer with 8 (BitTorrent's k); the routing table
#: keeps hivemind's buckets of 20.
REPLY_NODES = 8


def _key_id(key: str) -> Any:
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key)


def _beside(key: str) -> Any:
    """The id next to ``key``'s (its lowest bit flipped): nobody stores under it, so a node lookup for it
    meets the key's nearest nodes and no node answers with the key's records."""
    from hivemind.dht.routing import DHTID

    return DHTID(int(_key_id(key)) ^ 1)


def _nearest(node: Any, key_id: Any) -> List[Any]:
    """(node id, peer id) of the key's ``num_replicas`` nearest nodes we know (ourselves included as
    ``(our id, None)`` when a full node), nearest first, skipping nodes that did not answer lately."""
    proto = node.protocol
    known = [(n, p) for n, p in proto.routing_table.get_nearest_neighbors(key_id, node.num_replicas, exclude=node.node_id)
             if p not in node.blacklist]
    if not proto.client_mode:
        known.append((node.node_id, None))
    return sorted(known, key=lambda np_: key_id.xor_distance(np_[0]))[:node.num_replicas]


async def _store_near(key: str, subkey: bytes, value: bytes, expiration: float, _dht: Any, node: Any) -> int:
    """Runs in the DHT process: store one signed dictionary entry on the key's nearest nodes that the
    routing table knows, without hivemind's lookup (``DHTNode.store_many`` minus ``find_nearest_nodes``
    and the cache refresh). Returns how many nodes accepted it. The routing table of a small swarm
    holds every node (each node meets all others when it joins); :func:`_lookup_near` keeps the part
    near our keys current in a large one."""
    from hivemind.dht.validation import DHTRecord

    proto = node.protocol
    key_id = _key_id(key)
    value_bytes = proto.serializer.dumps(value)
    record = DHTRecord(key_id.to_bytes(), proto.serializer.dumps(subkey), value_bytes, expiration)
    if proto.record_validator is not None:
        value_bytes = proto.record_validator.sign_value(record)
        record = DHTRecord(record.key, record.subkey, value_bytes, expiration)
    accepted, peers = 0, []
    for _, peer_id in _nearest(node, key_id):
        if peer_id is not None:
            peers.append(peer_id)
        elif proto.record_validator is None or proto.record_validator.validate(record):
            accepted += bool(proto.storage.store(key_id, value_bytes, expiration, subkey=subkey))
    answers = await asyncio.gather(*(proto.call_store(p, keys=[key_id], values=[value_bytes], expiration_time=[expiration],
                                                      subkeys=[subkey]) for p in peers), return_exceptions=True)
    for peer_id, ok in zip(peers, answers):
        if ok is None or isinstance(ok, BaseException):  # no answer: skipped for a while, as hivemind's lookups do
            node.blacklist.register_failure(peer_id)
        else:
            node.blacklist.register_success(peer_id)
            accepted += bool(ok and ok[0])
    if key_id in proto.cache:  # a stale cached copy must not outlive ours in a local read
        proto.cache.store_subkey(key_id, subkey, value_bytes, expiration)
    return accepted


async def _read_near(key: str, _dht: Any, node: Any) -> Any:
    """Runs in the DHT process: ``(True, value)`` from our own storage (and cache) when we are one of the
    key's nearest nodes, so every writer stores to us and a read moves no byte; ``(False, None)`` when
    we are not (a DHT client, or far from the key): the caller reads over the network. ``value`` has
    the shape of ``DHT.get``'s answer (signatures stripped, expired entries left out), or None."""
    proto = node.protocol
    key_id = _key_id(key)
    if not any(peer_id is None for _, peer_id in _nearest(node, key_id)):
        return False, None
    held = [h.value for h in (proto.storage.get(key_id), proto.cache.get(key_id)) if h is not None]
    return True, _as_found(proto, key_id, held)


def _as_found(proto: Any, key_id: Any, dictionaries: List[Any]) -> Any:
    """The newest unexpired entry per subkey of ``dictionaries`` (hivemind's ``DictionaryDHTValue``s, as a
    node stores them: signed), in the shape of ``DHT.get``'s answer (signatures stripped), or None."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import ValueWithExpiration, get_dht_time

    now, entries = get_dht_time(), {}
    for held in dictionaries:
        if not isinstance(held, DictionaryDHTValue):
            continue
        for subkey, (value_bytes, expiration) in held.items():
            if expiration > now and expiration > entries.get(subkey, (b"", -1.0))[1]:
                entries[subkey] = (value_bytes, expiration)
    out = {}
    for subkey, (value_bytes, expiration) in entries.items():
        if proto.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), proto.serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = proto.record_validator.strip_value(record)
        out[subkey] = ValueWithExpiration(proto.serializer.loads(value_bytes), expiration)
    return ValueWithExpiration(out, max(e for _, e in entries.values())) if out else None


async def _read_node(key: str, rank: int, _dht: Any, node: Any) -> Any:
    """Runs in the DHT process: ``(asked, value)``: the records under ``key`` that the ``rank``-th nearest
    other node we know holds (one find RPC; its answer is the whole dictionary, validated record by
    record as hivemind's reads are), in the shape of :func:`_read_near`'s value. ``asked`` is False when
    we know no such node, and ``value`` None when it did not answer or holds nothing."""
    proto = node.protocol
    key_id = _key_id(key)
    others = [peer_id for _, peer_id in _nearest(node, key_id) if peer_id is not None]
    if rank >= len(others):
        return False, None
    answer = await proto.call_find(others[rank], [key_id])
    if answer is None:  # no answer: skipped for a while, as hivemind's lookups do
        node.blacklist.register_failure(others[rank])
        return True, None
    node.blacklist.register_success(others[rank])
    found, _ = answer.get(key_id, (None, {}))
    return True, (None if found is None else _as_found(proto, key_id, [found.value]))


async def _store_found(key: str, subkey: bytes, value: bytes, expiration: float, _dht: Any, node: Any) -> int:
    """Runs in the DHT process: a node lookup next to ``key`` (as :func:`_lookup_near`, REPLICAS wide:
    the replies name nodes and carry no record), then :func:`_store_near` on the nearest nodes it met.
    hivemind's store looks the key itself up, and every node it asks answers with every record it
    holds under the key (a ready record store at 24 peers downloaded 24 peers' records from ~20 nodes)."""
    await node.find_nearest_nodes([_beside(key)], k_nearest=node.num_replicas, beam_size=REPLICAS)
    return await _store_near(key, subkey, value, expiration, _dht, node)


async def _narrow_replies(_dht: Any, node: Any) -> int:
    """Runs in the DHT process: answer lookups with REPLY_NODES nodes (the protocol's ``bucket_size`` is
    what ``rpc_find`` names and the default width of hivemind's own searches; the routing table has its
    own copy, unchanged)."""
    node.protocol.bucket_size = REPLY_NODES
    return REPLY_NODES


async def _lookup_near(key: str, initial_peers: List[str], _dht: Any, node: Any) -> int:
    """Runs in the DHT process: a Kademlia node lookup next to ``key`` (its id with the lowest bit
    flipped, which nobody stores under, so no value comes back): the nodes met join our routing table
    and :func:`_store_near` / :func:`_read_near` see the key's current nearest nodes. Returns how many
    nodes it found.

    hivemind drops a node that did not answer from the routing table, and only a lookup (or the node
    calling us) brings it back: after a partition heals, each side meets the other through a node that
    kept both (a bootstrap peer, which never calls out). Initial peers missing from the table are
    pinged first (an isolated node's table can be empty: nothing to start a lookup from)."""
    from hivemind.p2p import PeerID

    proto = node.protocol
    missing = [PeerID.from_base58(p) for p in initial_peers]
    missing = [p for p in missing if p not in proto.routing_table.peer_id_to_uid]
    if missing:
        await asyncio.gather(*(proto.call_ping(p) for p in missing), return_exceptions=True)
    found = await node.find_nearest_nodes([_beside(key)], k_nearest=node.num_replicas)
    return sum(len(v) for v in found.values())


#: go-libp2p's switch for binding outgoing TCP connections to the listening port (default on)
REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"


def no_tcp_reuseport() -> None:
    """Outgoing TCP connections of our p2p daemon from ephemeral ports, not the listening port,
    unless ``LIBP2P_TCP_REUSEPORT`` is set already.

    With go-libp2p's default (reuseport on) a connection from A to B runs from A's listening port to
    B's. When A and B dial each other at the same moment, both SYNs carry the same two address:port
    pairs, cross in flight, and the kernels join them into ONE TCP connection (TCP simultaneous open).
    Both daemons then act as the initiator of the security handshake and both dials fail ("failed to
    negotiate security protocol"); libp2p then refuses new dials to those addresses for 5 s and more
    ("dial backoff"), both ways. Peers dial each other at the same moment all the time (both ends of a
    pair warming a group's links, the DHT), and a delay of 50 ms makes the window
    wide: measured on the emulated WAN, 12 of 12 simultaneous dials failed with reuseport and 0 of 12
    without (``tests/test_dial.py``). The daemon reads the variable when it starts (it inherits our
    environment). Nothing of ours needs reuseport: private peers connect outbound and never rely on
    hole punching or on the port others observe (swarm/reachability.py)."""
    os.environ.setdefault(REUSEPORT_ENV, "false")


def _identity_in_use(peer_id: str, initial_peers: List[str]) -> bool:
    """Whether a peer with this id already answers in the swarm reached through ``initial_peers``:
    a throwaway client daemon asks its own routing for that peer id and tries to connect."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    async def probe() -> bool:
        client = await P2P.create(initial_peers=initial_peers, dht_mode="client")
        try:
            await client._client.connect(PeerID.from_base58(peer_id), [])
            return True
        except ControlFailure:
            return False
        finally:
            await client.shutdown()

    try:
        return asyncio.run(probe())
    except Exception as e:  # initial peers unreachable etc.: the DHT start reports that more clearly
        logger.debug(f"identity check skipped: {e}")
        return False


async def held(coro: Awaitable[Any], tasks: Set[asyncio.Task]) -> Any:
    """Await ``coro`` with its task in ``tasks`` until it is done. The event loop references its tasks
    only weakly: a task that awaits a future nothing else holds (hivemind's MPFuture, registered by a
    weak reference only) forms a cycle with it, and a garbage collection destroys both while pending,
    so the coroutine never finishes and whoever waits for it times out."""
    task = asyncio.current_task()
    tasks.add(task)
    try:
        return await coro
    finally:
        tasks.discard(task)


class SwarmNode:
    """Start (or join) the DHT and keep a P2P client with its own event loop thread.

    :param initial_peers: multiaddrs with ``/p2p/<id>``; empty = this peer is the first.
    :param bootstrap_timeout: keep retrying unreachable initial peers this long, then raise
        :class:`BootstrapUnreachable`.
    :param reachability: ``public`` / ``private`` (taken as given) or ``auto`` (detected by a dial-back
        through the initial peers; see the module docstring). The result is :attr:`reachability`.
    :param client_mode: only a client of the DHT and of the swarm (``p2pdiloco status``): no check.
    :param relay: serve as a relay for private peers within these limits (swarm/relay.py) when we are
        public; None: do not relay.
    :param relays: peer ids of the relays a private node asks for a reservation, in order (default: its
        initial peers); a private node that gets one is ``relayed`` (reachable through it).
    """

    def __init__(
        self,
        initial_peers: List[str],
        *,
        host_maddrs: List[str],
        announce_maddrs: List[str] = (),
        identity_path: str = "",
        bootstrap_timeout: float = 20.0,
        client_mode: bool = False,
        reachability: str = "public",
        relay: Optional["RelayLimits"] = None,
        relays: Optional[List[str]] = None,
    ):
        if reachability not in SETTINGS:
            raise UserError(f"swarm.reachability ({reachability!r}) must be one of {', '.join(SETTINGS)}")
        # a node that may be private starts as a DHT client and becomes a server once it is known to be public
        dht_client = client_mode or reachability == "private" or (reachability == "auto" and bool(initial_peers))

        parse_maddrs(initial_peers, "initial peer", require_peer_id=True)
        self._initial_ids = [str(m).rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in str(m)]
        parse_maddrs(host_maddrs, "--host-maddrs")
        parse_maddrs(announce_maddrs, "--announce-maddrs")
        self.identity_path = prepare_identity(identity_path) if identity_path else None
        #: network reads of records by "<kind>:<why>" (the callers' purposes), counted with the DHT ledger on
        self.read_counts: Counter = Counter()
        self._count_reads = ledger.enabled()
        self._reads_lock = threading.Lock()
        # the identity key also signs our DHT records (records.py); without a key file: an ephemeral key
        key_path = self.identity_path or ephemeral_identity()
        try:
            self.records = RecordBook(load_signing_key(key_path))
        except BaseException:
            release_identity(self.identity_path)
            raise
        # A peer that stops answering is skipped for 3 s, then tried again: with hivemind's default (the ban
        # doubles at every miss) the two sides of a healed partition would ignore each other for about as long
        # again as the partition lasted. What a read finds stays with the reader: hivemind would push each
        # dictionary found to one more node and re-read, wide, a cached key before it expires (every record).
        kwargs: Dict[str, Any] = dict(host_maddrs=list(host_maddrs), client_mode=dht_client, identity_path=key_path,
                                      record_validators=self.records.validators(), blacklist_time=3.0,
                                      backoff_rate=1.0, cache_nearest=0, cache_refresh_before_expiry=0,
                                      num_replicas=REPLICAS)
        # is our key file already running elsewhere (copied to another machine)? Asked here for every key
        # kind: hivemind's own check (check_if_identity_free) reads RSA keys only. A fresh random key
        # cannot be taken.
        kwargs["check_if_identity_free"] = False
        if self.identity_path and initial_peers and _identity_in_use(self.records.peer_id, list(initial_peers)):
            release_identity(self.identity_path)
            raise UserError(f"identity {self.identity_path} is already used by a running peer "
                            f"({self.records.peer_id} answers in the swarm): give this peer its own key file")
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        no_tcp_reuseport()
        # a node listening on QUIC reaches its initial peers over QUIC where it can (addresses.with_quic)
        quic = any("/quic-v1" in str(m) for m in host_maddrs)
        dial_peers = with_quic(initial_peers) if quic else [str(m) for m in initial_peers]
        self.dht = self._start_dht(dial_peers, list(host_maddrs), bootstrap_timeout, kwargs)
        if ledger.enabled():  # benchmarks: count this node's DHT RPCs by record kind (ledger.py)
            self.dht.run_coroutine(ledger.install)
        if not self.identity_path:
            discard_ephemeral(key_path)  # the daemon has read it; the key now lives only in memory
        else:  # a restart after a crash waits for these (or stops them) before it takes the identity over
            note_helpers(self.identity_path, [self.dht.pid, *descendants(self.dht.pid)])
        self._start_network()
        #: ``public``, ``relayed`` or ``private`` (reachability.py); published in our progress record
        self.reachability = "private" if client_mode else reachability
        #: the relay we hold a reservation with while ``relayed`` (its peer id), else ""
        self.via = ""
        #: other relayed peers' relays, from their records and join requests (matchmaking keeps it)
        self.relay_routes: Dict[str, str] = {}
        #: streams our relayed traffic took: inbound / outbound count, bytes we wrote on them; hole punches
        self.relay_stats: Counter = Counter()
        #: hole punching to other relayed peers (punch.py)
        self.punches = punch_mod.Punches()
        self.relay_server = None
        self._handlers: Dict[str, Callable] = {}  # name -> the gated handler (relayed streams call it too)
        #: whether our DHT node is only a client (not in others' routing tables)
        self.dht_client = dht_client
        if not client_mode:
            self._take_position(reachability, initial_peers, announce_maddrs, relay, relays)

    def _start_network(self) -> None:
        """Our event loop thread and p2p client; who we are."""
        #: offences, bans and request limits of the peers that talk to us (protocol.PeerGate)
        self.gate = PeerGate()
        self.traffic = Traffic()
        #: the part of ``traffic`` that state downloads moved (served or fetched): not a sync's bytes
        self.state_traffic = Traffic(parent=self.traffic)
        self.loop = asyncio.new_event_loop()
        #: the tasks started by :meth:`submit`, held until done (see :func:`held`)
        self._tasks: Set[asyncio.Task] = set()
        self._thread = threading.Thread(target=self._run_loop, name="p2pdiloco-net", daemon=True)
        self._thread.start()
        self.p2p = self.call(self.dht.replicate_p2p(), timeout=30)
        self.peer_id = self.p2p.peer_id
        self.peer_id_str = self.peer_id.to_base58()
        self.short_id = short_id(self.peer_id_str)
        self.gate.short_id = self.short_id
        self._closed = False

    def _take_position(self, reachability: str, initial_peers: List[str], announce_maddrs: List[str],
                       relay: Optional["RelayLimits"], relays: Optional[List[str]]) -> None:
        """Serve what every trainer serves, find out whether others can dial us, and then relay for
        private peers (public, when asked) or take a slot on a relay (private)."""
        self.call(self.p2p.add_binary_stream_handler(relay_mod.INBOUND, self._inbound), timeout=30)
        serve_reach(self)
        self._resolve_reachability(reachability, initial_peers, announce_maddrs)
        if self.reachability == "public" and relay is not None and relay.enabled:
            self.relay_server = relay_mod.RelayServer(self, relay)
        elif self.reachability == "private":
            initial = [str(m).rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in str(m)]
            self._find_relay(list(relays) if relays is not None else initial)

    def _start_dht(self, initial_peers: List[str], host_maddrs: List[str], bootstrap_timeout: float,
                   kwargs: Dict[str, Any]):
        """Start our DHT node (its process and p2p daemon exit when this process dies, by any signal:
        lifeline.py), retrying while the initial peers do not answer yet, for up to
        ``bootstrap_timeout`` seconds; a failure is a :class:`UserError` that says what to fix."""
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

        deadline = time.monotonic() + bootstrap_timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                dht = start_dht(initial_peers=initial_peers or None, **kwargs)
                dht.run_coroutine(_narrow_replies)
                return dht
            except P2PDaemonError as e:
                msg = str(e)
                if "bootstrap" in msg and time.monotonic() < deadline:
                    logger.info(f"initial peers not reachable yet (attempt {attempt}); retrying")
                    time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
                    continue
                if "bootstrap" in msg:
                    raise BootstrapUnreachable(
                        f"none of the initial peers answered within {bootstrap_timeout:.0f} s: "
                        f"{', '.join(m for m in initial_peers if '/quic-v1' not in m) or ', '.join(initial_peers)}. "
                        "Check that the bootstrap peer is running and the address "
                        "(including /p2p/<peer id>) is the one it printed"
                    ) from None
                if "address already in use" in msg.lower() or "bind" in msg.lower():
                    raise UserError(f"cannot listen on {', '.join(host_maddrs)}: address already in use") from None
                if "identity" in msg.lower():
                    raise UserError(f"identity {self.identity_path} is already used by a running peer") from None
                raise UserError(f"the libp2p daemon failed to start: {msg.splitlines()[0][:300]}") from None

    async def _inbound(self, info, reader, writer) -> None:
        """A stream our relay forwards (relay.serve_inbound); nothing escapes onto the event loop."""
        try:
            await relay_mod.serve_inbound(self, lambda: {self.via} if self.via else set(), self._handlers,
                                          info, reader, writer)
        except Exception as e:  # noqa: BLE001 - a malformed forward from our relay, a dropped stream
            logger.info(f"[{self.short_id}] a relayed stream failed: {type(e).__name__}: {str(e)[:200]}")
            writer.close()

    def _find_relay(self, candidates: List[str]) -> None:
        """Private: reserve a slot on the first relay that grants one, become ``relayed`` through it and
        renew the reservation in the background (which also keeps our connection to it open)."""
        refusals = []
        for relay in candidates:
            why = self.call(relay_mod.reserve(self, relay), timeout=15)
            if why is None:
                self.reachability, self.via = "relayed", relay
                self._renewer = self.submit(self._renew(relay))
                self.add_handler(punch_mod.HANDLER, partial(punch_mod.serve_punch, self))
                self.punches.task = self.submit(punch_mod.puncher(self))
                logger.info(f"[{self.short_id}] relayed through {short_id(relay)}: other peers reach us through it")
                return
            refusals.append(f"{short_id(relay)}: {why}")
        if candidates:
            logger.warning(f"[{self.short_id}] no relay took us ({'; '.join(refusals)}): we stay private "
                           "(we train, but cannot lead a group or own a shard)")

    async def _renew(self, relay: str) -> None:
        while True:
            await asyncio.sleep(relay_mod.RESERVATION_TTL / 3)
            why = await relay_mod.reserve(self, relay)
            if why is not None:
                logger.warning(f"[{self.short_id}] renewing our relay reservation with {short_id(relay)} failed: {why}")

    def _resolve_reachability(self, setting: str, initial_peers: List[str], announce_maddrs: List[str]) -> None:
        """Decide :attr:`reachability` (detecting it for ``auto``) and serve the DHT when public."""
        why = "as configured, not checked"
        if setting == "auto":
            initial = [str(m).rsplit("/p2p/", 1)[1] for m in initial_peers if "/p2p/" in str(m)]
            ports = listen_ports(announce_maddrs) or listen_ports(self.dht.get_visible_maddrs())
            try:
                helpers = self.call(helper_candidates(self, initial), timeout=10)
                self.reachability, why = self.call(detect(self, helpers, ports), timeout=30)
            except Exception as e:  # pragma: no cover - detect() handles its own failures
                self.reachability, why = "private", f"the check failed ({type(e).__name__}); assuming private"
        if self.reachability == "public" and self.dht_client:
            self.dht.run_coroutine(partial(_serve_dht, [h.rsplit("/p2p/", 1)[1] for h in initial_peers]))
            self.dht_client = False
        logger.info(f"[{self.short_id}] reachability: {self.reachability} ({why}); DHT "
                    f"{'client only' if self.dht_client else 'node serving others'}")

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    # ---- running coroutines on the network thread -------------------------------------------
    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        """Run ``coro`` on the network thread; its task is held until done (:func:`held`)."""
        return asyncio.run_coroutine_threadsafe(held(coro, self._tasks), self.loop)

    def call(self, coro: Awaitable[Any], timeout: Optional[float] = None) -> Any:
        return self.submit(coro).result(timeout)

    def add_handler(self, name: str, handler: Callable) -> None:
        """Serve ``name``; the handler runs behind :attr:`gate` (bans, request limits, no crash), for
        direct streams and for those our relay forwards."""
        gated = self.gate.wrap(handler)
        self._handlers[name] = gated
        self.call(self.p2p.add_binary_stream_handler(name, gated), timeout=30)

    # ---- addresses ----------------------------------------------------------------------------
    def visible_maddrs(self) -> List[str]:
        """Full multiaddrs (with /p2p/<id>) others can use as --initial-peers."""
        out = []
        for m in self.dht.get_visible_maddrs():
            s = str(m)
            out.append(s if "/p2p/" in s else f"{s}/p2p/{self.peer_id_str}")
        return out

    # ---- DHT records: signed by their owner, schema-checked (records.py) ------------------------
    def _record(self, key: str, value: Dict[str, Any], ttl: float, subkey: Optional[str]) -> Dict[str, Any]:
        if subkey is not None and subkey != self.peer_id_str:
            raise ValueError(f"a peer can only write its own records (subkey {subkey!r} is not our peer id)")
        from hivemind.utils import get_dht_time

        return dict(key=key, subkey=self.records.owner_subkey, value=self.records.encode(key, value),
                    expiration_time=get_dht_time() + ttl)

    def store(self, key: str, value: Dict[str, Any], ttl: float, subkey: Optional[str] = None) -> bool:
        """Publish our record under ``key`` (signed; readers see it under our peer id) on the key's
        REPLICAS nearest nodes, found by a node lookup (:func:`_store_found`)."""
        return self.call(self.astore(key, value, ttl, subkey), timeout=60)

    async def astore(self, key: str, value: Dict[str, Any], ttl: float, subkey: Optional[str] = None) -> bool:
        rec = self._record(key, value, ttl, subkey)
        return bool(await self.dht.run_coroutine(
            partial(_store_found, key, rec["subkey"], rec["value"], rec["expiration_time"]), return_future=True))

    def get_subkeys(self, key: str, why: str = "other") -> Dict[str, Dict[str, Any]]:
        """``{peer id: record}`` of every valid, owner-signed record under ``key`` (newest per owner).
        ``why``: the caller's purpose, for :attr:`read_counts`. The read searches REPLICAS wide and takes
        the copies of every node it asks (the key's nearest nodes and those met on the way; each answers
        with every peer's record under the key), not only the first: right after a partition heals, the
        writer's own node may be the only one near the key that holds its newest record."""
        self._note_read(key, why)
        return self.records.decode(key, self.dht.get(key, latest=True, beam_size=REPLICAS))

    async def aget_subkeys(self, key: str, why: str = "other") -> Dict[str, Dict[str, Any]]:
        self._note_read(key, why)
        return self.records.decode(key, await self.dht.get(key, latest=True, beam_size=REPLICAS, return_future=True))

    def _note_read(self, key: str, why: str) -> None:
        if self._count_reads:
            with self._reads_lock:
                self.read_counts[f"{kind_of(key)}:{why}"] += 1

    # ---- the background records' cheap path (see _store_near above) ---------------------------------
    async def astore_near(self, key: str, value: Dict[str, Any], ttl: float) -> int:
        """Publish our record under ``key`` on its nearest known nodes, without a lookup (hivemind's store
        downloads the whole dictionary from every node it looks up). Returns how many nodes took it."""
        rec = self._record(key, value, ttl, None)
        return int(await self.dht.run_coroutine(
            partial(_store_near, key, rec["subkey"], rec["value"], rec["expiration_time"]), return_future=True))

    def store_near(self, key: str, value: Dict[str, Any], ttl: float) -> int:
        return self.call(self.astore_near(key, value, ttl), timeout=30)

    def read_near(self, key: str, network: bool = True,
                  expect: Collection[str] = ()) -> Optional[Dict[str, Dict[str, Any]]]:
        """Like :meth:`get_subkeys`, for the background reader: from our own DHT storage when we are one of
        the key's nearest nodes (every writer stores to us: no byte on the wire), else, if ``network``,
        over the network (:meth:`_read_nodes`; ``expect``: the peers whose records the reader holds
        already); else None."""
        ours, found = self.dht.run_coroutine(partial(_read_near, key))
        if ours:
            return self.records.decode(key, found)
        if not network:
            return None
        self._note_read(key, "background")
        return self._read_nodes(key, frozenset(expect))

    def _read_nodes(self, key: str, expect: FrozenSet[str]) -> Dict[str, Dict[str, Any]]:
        """A network read of the records under ``key`` from one of the key's READ_BEAM nearest nodes (drawn
        at random, so that no single node answers every read), and from the next when that one's answer
        will not do: none came, it lacks a record of a peer in ``expect``, or it holds an older record
        than we have seen (a node that missed stores, or withholds them). Every node near the key holds
        every record, so one answer is the whole dictionary; asking two each time doubled the bytes."""
        first = random.randrange(READ_BEAM)
        out: Optional[Dict[str, Dict[str, Any]]] = None
        for rank in [first, *(r for r in range(READ_BEAM) if r != first)]:
            asked, found = self.dht.run_coroutine(partial(_read_node, key, rank))
            if not asked:
                continue
            stale = self.records.stale
            out = self.records.decode(key, found)
            held = {self.records.owner_of(s) for s in (found.value if found is not None else ())}
            if found is not None and expect <= held and self.records.stale == stale:
                break
        # no node near the key known (or none answered): the records we verified stay until they expire
        return out if out is not None else self.records.decode(key, None)

    def lookup_near(self, key: str) -> concurrent.futures.Future:
        """Refresh the routing table around ``key`` in the background (:func:`_lookup_near`)."""
        return self.dht.run_coroutine(partial(_lookup_near, key, self._initial_ids), return_future=True)

    @staticmethod
    async def _cancel_tasks() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=3)

    def dht_ledger(self) -> Dict[str, List[int]]:
        """The DHT RPCs this node made, by kind (ledger.py); empty unless the ledger is enabled."""
        if not ledger.enabled():
            return {}
        try:
            return self.dht.run_coroutine(ledger.snapshot)
        except Exception as e:  # a dead DHT process: the summary goes on without it
            logger.debug(f"no DHT ledger: {e!r}")
            return {}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.call(self.p2p.shutdown(), timeout=5)
        except Exception:
            pass
        try:  # let handlers still running end (cancelled) rather than be dropped with the loop
            self.call(self._cancel_tasks(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.dht.shutdown()
        release_identity(self.identity_path)
