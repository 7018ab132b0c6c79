"""The DHT byte ledger (swarm/ledger.py) that the benchmark's byte breakdown reads.

* A node with the ledger on counts the DHT RPCs it makes by RPC and record kind, with the protobuf
  bytes each moved; a node without it counts nothing and changes nothing.
* The benchmark averages the peers' ledgers per mode and lays them out as a breakdown of the
  interface bytes (on fixtures).
"""
from __future__ import annotations

import time
from functools import partial

import pytest

from p2pdiloco.bench.run import format_breakdown, summarize_mode
from p2pdiloco.swarm import keys, ledger
from p2pdiloco.swarm.node import SwarmNode

LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.parametrize("key, kind", [
    ("run:mm:0:12", "ready"), ("run:group:3:1", "group"), ("run:progress", "progress"),
    ("run:fingerprint", "fingerprint"), ("run:short:progress", "progress"), ("run", "generic"),
    ("run:weird:thing", "generic"), ("mm", "generic"),
])
def test_the_ledger_labels_keys_by_their_record_kind(key, kind):
    assert keys.kind_of(key) == kind


@pytest.mark.timeout(120)
def test_a_node_with_the_ledger_counts_its_rpcs_by_kind(monkeypatch):
    first = SwarmNode([], host_maddrs=LOOP)
    nodes = [first]
    try:
        nodes.append(SwarmNode(first.visible_maddrs(), host_maddrs=LOOP))  # ledger off
        monkeypatch.setenv(ledger.ENV, "1")
        counted = SwarmNode(first.visible_maddrs(), host_maddrs=LOOP)
        nodes.append(counted)
        assert counted.dht_ledger() == {}  # nothing made yet
        value = {"step": 7, "pad": "x" * 500}
        assert counted.store_near("led:progress", value, ttl=30) >= 2
        assert counted.read_near("led:progress")[counted.peer_id_str]["step"] == 7
        counted.store("led:mm:0:3", {"ready": True}, ttl=30, subkey=counted.peer_id_str)
        assert counted.peer_id_str in counted.get_subkeys("led:mm:0:3", why="ready poll")
        assert counted.peer_id_str in counted.get_subkeys("led:mm:0:3", why="ready poll")
        counted.get_subkeys("led:progress", why="formation")
        # the network reads by the callers' purposes (the read_near above came from the node's own storage
        # or the network: only the latter counts, as "background")
        reads = dict(counted.read_counts)
        assert reads.pop("ready:ready poll") == 2 and reads.pop("progress:formation") == 1, reads
        assert set(reads) <= {"progress:background"}, reads
        rows = counted.dht_ledger()
        # our store went to the two other full nodes, each carrying the 500-byte value and its signature
        calls, req, resp = rows["store:progress"]
        assert calls == 2 and req > 2 * 500 and resp > 0
        assert any(k.startswith("store:ready") for k in rows) and any(k.startswith("find:") for k in rows), rows
        assert all(v[0] >= 1 and v[1] > 0 for v in rows.values()), rows
        monkeypatch.delenv(ledger.ENV)
        assert nodes[1].dht_ledger() == {}  # the ledger is off for it
        nodes[1].get_subkeys("led:mm:0:3", why="ready poll")
        assert not nodes[1].read_counts
    finally:
        for n in nodes:
            n.shutdown()


def _events(peer: int, ledger_rows):
    return [
        {"event": "start", "time": 100.0, "val_loss": 4.0},
        {"event": "sync", "ok": True, "time": 110.0, "step": 20, "fragment": 0, "outer_step": 1, "val_loss": 3.0},
        {"event": "summary", "time": 120.0, "val_loss_end": 3.0, "inner_steps": 20, "syncs": 4,
         "bytes_sent": 1000 + peer, "failed_syncs": 0, **({"dht_ledger": ledger_rows} if ledger_rows else {})},
    ]


def test_the_benchmark_averages_ledgers_and_breaks_the_interface_bytes_down():
    events = [_events(0, {"find:ready": [10, 400, 4000], "store:progress": [4, 3000, 40]}),
              _events(1, {"find:ready": [20, 800, 8000]})]
    samples = [(99.0, [(0, 0), (0, 0)]), (120.2, [(30000, 30000), (50000, 50000)])]
    m = summarize_mode(events, samples, tokens_per_step=1024, baseline=False)
    assert m["dht_ledger_per_peer"] == {"find:ready": [15.0, 600.0, 6000.0], "store:progress": [2.0, 1500.0, 20.0]}
    assert m["syncs_per_peer"] == 4
    m["status"] = "ok"
    text = "\n".join(format_breakdown({"mode-a": m, "no-ledger": dict(m, dht_ledger_per_peer=None)}))
    assert "mode-a" in text and "no-ledger" not in text
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # interface 40 KB per peer; DHT 6.6 KB + 1.52 KB; all-reduce 1000.5 B; the rest is the difference
    assert "40.0 KB" in lines["interface (everything)"]
    assert "6.6 KB" in lines["DHT find:ready"] and "16.5%" in lines["DHT find:ready"]
    assert "8.1 KB" in lines["DHT total"]
    assert "30.9 KB" in lines["rest (framing, encryption, TCP/IP, matchmaking messages)"]
    assert format_breakdown({"no-ledger": dict(m, dht_ledger_per_peer=None)}) == []


class _Node:
    """read_near as the background reader calls it: records which reads went over the network."""

    def __init__(self, records):
        self.records, self.network, self.expected = records, [], []

    def read_near(self, key, network=True, expect=()):
        self.network.append(network)
        self.expected.append(set(expect))
        return self.records if network else None  # not one of the key's nearest nodes: no local copy


def test_the_background_reader_takes_a_formation_read_as_its_read_of_the_period():
    """A peer that is not one of the progress key's nearest nodes reads every record over the network once
    per period; a formation read (every record, from every node) within the period is that read."""
    import threading
    import time as _time

    from p2pdiloco.swarm.swarm import Swarm

    swarm = Swarm.__new__(Swarm)
    swarm.run_id, swarm.progress_period, swarm._progress_lock, swarm._view = "r", 10.0, threading.Lock(), None
    swarm.node = _Node({"b": {"step": 2}})
    swarm.matchmaker = type("MM", (), {"live_of": staticmethod(lambda recs: dict(recs))})()
    now = _time.monotonic()
    swarm.matchmaker.last_read = (now - 1.0, {"a": {"step": 1}})        # matchmaking read a second ago
    last = swarm.read_view(-float("inf"))
    assert swarm.node.network == [False] and swarm.peers_view() == {"a": {"step": 1}} and last == now - 1.0
    swarm.matchmaker.last_read = (now - 20.0, {"a": {"step": 1}})       # long ago: the period's read is due
    last = swarm.read_view(now - 20.0)
    assert swarm.node.network == [False, True] and swarm.peers_view() == {"b": {"step": 2}} and last >= now
    assert swarm.node.expected[-1] == {"a"}  # the view it held: peers whose records one node's answer must have


class _SlowNode(_Node):
    def read_near(self, key, network=True, expect=()):
        import time as _time

        _time.sleep(0.3)
        return super().read_near(key, network, expect)


def test_a_view_stays_fresh_while_the_next_read_takes_as_long_as_the_last():
    """A follower enters a round with the background view while the reader keeps to its period: the view's
    age bound covers the reader's tick and its reads' own duration (a view read by a 0.3 s read stays
    fresh until period + tick + 0.6 s), and no more."""
    import threading
    import time as _time

    from p2pdiloco.swarm.swarm import LOCAL_READ_PERIOD, Swarm

    swarm = Swarm.__new__(Swarm)
    swarm.run_id, swarm.progress_period, swarm._progress_lock, swarm._view = "r", 1.0, threading.Lock(), None
    swarm._view_at, swarm._read_s = -float("inf"), 0.0
    swarm.node = _SlowNode({"b": {"step": 2}})
    swarm.matchmaker = type("MM", (), {"live_of": staticmethod(lambda recs: dict(recs))})()
    swarm.matchmaker.last_read = (-float("inf"), {})
    swarm.read_view(-float("inf"))
    assert swarm.node.network == [True] and 0.3 <= swarm._read_s < 1.0
    swarm._read_s = 0.3  # as measured, without this machine's scheduling on top
    bound = 1.0 + LOCAL_READ_PERIOD
    for age, fresh in [(bound - 0.2, True), (bound + 0.4, True), (bound + 0.8, False)]:
        swarm._view_at = _time.monotonic() - age
        assert (swarm.fresh_view() is not None) == fresh, age


@pytest.mark.parametrize("live, period", [(1, 10.0), (8, 10.0), (9, 20.0), (40, 50.0), (1000, 1250.0)])
def test_the_background_network_reads_are_spaced_out_in_a_larger_swarm(live, period):
    """A network read carries every live peer's record: one read per progress period per 8 live peers
    keeps a peer's background bytes per second flat as the swarm grows."""
    import threading
    import time as _time

    from p2pdiloco.swarm.swarm import Swarm, network_read_period

    assert network_read_period(10.0, live) == period
    swarm = Swarm.__new__(Swarm)
    swarm.run_id, swarm.progress_period, swarm._progress_lock = "r", 10.0, threading.Lock()
    records = {f"p{i}": {"step": 1} for i in range(live)}
    swarm._view, swarm.node = dict(records), _Node(records)
    swarm.matchmaker = type("MM", (), {"live_of": staticmethod(lambda recs: dict(recs))})()
    swarm.matchmaker.last_read = (-float("inf"), {})
    now = _time.monotonic()
    for ago, due in [(period - 1.0, False), (period + 0.5, True)]:
        swarm.node.network.clear()
        swarm.read_view(now - ago)
        assert swarm.node.network == [due], (live, ago)


@pytest.mark.timeout(240)
async def _nodes_named(peer, _dht, node) -> int:
    """Runs in the DHT process: how many nodes ``peer`` names in its reply to a lookup."""
    from hivemind.dht.routing import DHTID

    answer = await node.protocol.call_find(peer, [DHTID.generate(source="elsewhere")])
    return len(next(iter(answer.values()))[1])


async def _nodes_known(_dht, node) -> int:
    """Runs in the DHT process: how many nodes our routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_reads_and_stores_ask_the_keys_nearest_nodes_only_and_leave_no_copies_behind(monkeypatch):
    """Every node asked answers with the whole dictionary (every peer's record): in a swarm of more DHT
    servers than REPLICAS, the background reader's network read asks one of the key's nearest nodes,
    matchmaking's read searches REPLICAS wide (every copy on the nodes it asks, not every node of the
    swarm), and a store's node lookup downloads no record at all. No read pushes a copy to another node
    or reads the key again by itself before its entries expire."""
    from p2pdiloco.swarm.node import REPLICAS, REPLY_NODES

    monkeypatch.setenv(ledger.ENV, "1")
    first = SwarmNode([], host_maddrs=LOOP)
    nodes = [first]
    try:
        nodes += [SwarmNode(first.visible_maddrs(), host_maddrs=LOOP) for _ in range(13)]
        for n in nodes:
            n.lookup_near("wide:progress").result(timeout=30)
        for i, n in enumerate(nodes[:8]):
            assert n.store_near("wide:progress", {"step": i, "pad": "x" * 300}, ttl=12) >= 3
        reader = SwarmNode(first.visible_maddrs(), host_maddrs=LOOP, client_mode=True)  # holds no copy itself
        nodes.append(reader)
        # a node that just started knows few others: its nearest known nodes to the key may hold nothing (the
        # full run at 883daba once read {} here); a lookup first, as every node above did, finds the holders
        reader.lookup_near("wide:progress").result(timeout=30)

        def found(node: SwarmNode, rpc: str = "find:progress") -> list:
            return node.dht_ledger().get(rpc, [0, 0, 0])

        one_copy = 8 * 300  # the pads alone: a copy of the dictionary is at least this
        before = found(reader)
        got = reader.read_near("wide:progress")  # not a holder (a DHT client): over the network
        narrow_asked, narrow = found(reader)[0] - before[0], found(reader)[2] - before[2]
        assert {d["step"] for d in got.values()} == set(range(8))
        before = found(reader)
        got = reader.get_subkeys("wide:progress", why="formation")
        asked, wide = found(reader)[0] - before[0], found(reader)[2] - before[2]
        assert {d["step"] for d in got.values()} == set(range(8))
        # store_near put every record on the key's 5 nearest nodes: the read gets a copy from each of them
        assert wide >= REPLICAS * one_copy and wide >= 2 * narrow, (narrow, wide)
        assert narrow_asked == 1 and one_copy <= narrow, (narrow_asked, narrow, wide)  # one node's answer
        # hivemind's default search (20 wide) asks every one of the 14 servers
        assert asked <= 2 * REPLICAS < len(nodes) - 1, asked
        stores = found(reader, "store:progress")[0]
        assert stores == 0, "a read pushed the dictionary it found to another node"

        writer = nodes[9]  # stores through a node lookup, not hivemind's store (which reads the key first)
        before, stored = found(writer), found(writer, "store:progress")[0]
        assert writer.store("wide:progress", {"step": 9, "pad": "x" * 300}, ttl=12)
        assert found(writer) == before, "the store's lookup downloaded the records under the key"
        assert 1 <= found(writer, "store:progress")[0] - stored <= REPLICAS
        assert {d["step"] for d in reader.get_subkeys("wide:progress").values()} == set(range(8)) | {9}

        finds = found(reader)[0]
        time.sleep(9)  # past expiration - 5 s, when hivemind's cache refresh would read the key again
        assert found(reader)[0] == finds, "the key was read again in the background"

        # a node answering a lookup names REPLY_NODES nodes, though its routing table knows all 14 others
        for asker, answerer in ((reader, nodes[3]), (nodes[5], first)):
            known = answerer.dht.run_coroutine(_nodes_known)
            count = asker.dht.run_coroutine(partial(_nodes_named, answerer.dht.peer_id))
            assert count == REPLY_NODES < known, (count, known)
    finally:
        for n in nodes:
            n.shutdown()


async def _nearest_others(key, _dht, node) -> list:
    """Runs in the DHT process: the peer ids of the key's nearest other nodes we know, nearest first."""
    from p2pdiloco.swarm.node import _key_id, _nearest

    return [p.to_base58() for _, p in _nearest(node, _key_id(key)) if p is not None]


async def _store_on(key, subkey, value, expiration, peer, _dht, node) -> bool:
    """Runs in the DHT process: store one signed record on one node only (a node the others' stores
    reached and this one's did not)."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.p2p import PeerID

    from p2pdiloco.swarm.node import _key_id

    proto, key_id = node.protocol, _key_id(key)
    record = DHTRecord(key_id.to_bytes(), proto.serializer.dumps(subkey), proto.serializer.dumps(value), expiration)
    signed = proto.record_validator.sign_value(record)
    ok = await proto.call_store(PeerID.from_base58(peer), keys=[key_id], values=[signed], expiration_time=[expiration],
                                subkeys=[subkey])
    return bool(ok and ok[0])


@pytest.mark.timeout(180)
def test_a_background_read_asks_a_second_node_only_when_the_first_answer_will_not_do(monkeypatch):
    """One node near the key holds every record, so the background reader asks one (drawn among the
    READ_BEAM nearest) and a second only when the first's answer lacks a peer the reader expects, holds
    an older record than the reader has seen (a node that missed a store), or does not come."""
    import p2pdiloco.swarm.node as node_mod

    monkeypatch.setenv(ledger.ENV, "1")
    first = SwarmNode([], host_maddrs=LOOP)
    nodes = [first]
    try:
        nodes += [SwarmNode(first.visible_maddrs(), host_maddrs=LOOP) for _ in range(3)]
        key = "one:progress"
        for i, n in enumerate(nodes[1:]):
            assert n.store_near(key, {"step": i}, ttl=60) >= 3
        writers = {n.peer_id_str for n in nodes[1:]}
        reader = SwarmNode(first.visible_maddrs(), host_maddrs=LOOP, client_mode=True)
        nodes.append(reader)
        order = []
        monkeypatch.setattr(node_mod.random, "randrange", lambda n: order.pop(0))

        def read(rank: int, expect=()) -> tuple:
            order[:] = [rank]
            before = reader.dht_ledger().get("find:progress", [0])[0]
            got = reader.read_near(key, expect=expect)
            return reader.dht_ledger()["find:progress"][0] - before, {p: v["step"] for p, v in got.items()}

        asked, got = read(0)
        assert asked == 1 and set(got) == writers
        assert read(1, expect=writers)[0] == 1
        asked, got = read(0, expect=writers | {"QmSomeoneElse"})  # a peer no node holds: both nodes asked
        assert asked == 2 and set(got) == writers

        # the nearest node gets a newer record of one writer (not that node itself) that the second node missed
        near = reader.dht.run_coroutine(partial(_nearest_others, key))
        writer = next(n for n in nodes[1:4] if n.dht.peer_id.to_base58() != near[0])
        newer = writer._record(key, {"step": 100}, ttl=60, subkey=None)
        assert writer.dht.run_coroutine(partial(_store_on, key, newer["subkey"], newer["value"],
                                                newer["expiration_time"], near[0]))
        assert read(0, expect=writers) == (1, {**got, writer.peer_id_str: 100})
        stale = reader.records.stale
        asked, got = read(1, expect=writers)  # the second node answers with the older record
        assert reader.records.stale > stale, "the second node's answer held no older record"
        assert asked == 2 and got[writer.peer_id_str] == 100

        # no node near the key known (a client whose routing table lost them): the verified records stay
        run_coroutine = reader.dht.run_coroutine

        def no_nodes(fn, *a, **k):
            if getattr(fn, "func", None) is node_mod._read_node:
                return False, None
            return run_coroutine(fn, *a, **k)

        monkeypatch.setattr(reader.dht, "run_coroutine", no_nodes)
        order[:] = [0]
        assert reader.read_near(key, expect=writers) == reader.records.decode(key, None) != {}
        monkeypatch.setattr(reader.dht, "run_coroutine", run_coroutine)

        # the first node drawn is down: the next one answers
        down = next(n for n in nodes[:4] if n.dht.peer_id.to_base58() == near[0])
        down.shutdown()
        asked, got = read(0, expect=writers - {down.peer_id_str})
        assert asked == 2 and writers - {down.peer_id_str} <= set(got)
    finally:
        for n in nodes:
            n.shutdown()
