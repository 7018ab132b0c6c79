"""Reachability, in-process on 127.0.0.1: the parts that need no NAT.

* the dial-back check says public when the helper can connect to our port and private when it cannot;
  the connection must prove our peer id (an open port served by anything else does not count), and a
  public verdict needs several helpers to agree (one lying helper cannot make a private peer public);
* a private member owns no shard: it only sends parts and reads means, its part still counts with its
  weight, every member ends with identical bytes, and nobody opens a stream to it;
* a private peer never leads, whatever its id: the public peer leads and names the public members as
  shard owners; a round of private peers only fails at once with one clear message;
* state donors: public first; the config key and its validation.

The real NAT (network namespaces, nftables masquerading) is tests/test_nat.py.
"""
from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time

import pytest
import torch

from p2pdiloco.compression import get_codec
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.errors import ConfigError, MatchmakingFailed
from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import Group, make_group_id
from p2pdiloco.swarm.partition import shard_bounds
from p2pdiloco.swarm.matchmaking import Matchmaker
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.protocol import close_after_reply, read_header, write_frame
from p2pdiloco.swarm.reachability import HANDLER, detect, dial_back, listen_ports, verdict
from p2pdiloco.swarm.state_sync import dialable_first

LOOP = ["/ip4/127.0.0.1/tcp/0"]
_runs = itertools.count()


@pytest.fixture(scope="module")
def nodes():
    first = SwarmNode([], host_maddrs=LOOP)
    ns = [first]
    try:
        for _ in range(3):
            ns.append(SwarmNode(first.visible_maddrs(), host_maddrs=LOOP))
        yield ns
    finally:
        for n in ns:
            n.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.mark.timeout(60)
def test_the_dial_back_says_public_when_the_helper_connects_and_private_when_it_cannot(nodes):
    helper, asker = nodes[0], nodes[1]
    ports = listen_ports(asker.dht.get_visible_maddrs())
    assert ports, asker.dht.get_visible_maddrs()
    reach, why = asker.call(detect(asker, [helper.peer_id_str], ports), timeout=30)
    assert reach == "public" and "dialed us back" in why, why
    reach, why = asker.call(detect(asker, [helper.peer_id_str], [_closed_port()]), timeout=30)
    assert reach == "private" and "could not dial" in why, why
    # nobody to ask: the first peer of a swarm is public; nobody answering: private (the safe side)
    assert asker.call(detect(asker, [], ports), timeout=10)[0] == "public"
    unknown = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
    reach, why = asker.call(detect(asker, [unknown], ports, timeout=3), timeout=30)
    assert reach == "private" and "no helper answered" in why, why


def test_a_check_nobody_answered_is_asked_again_before_it_says_private(monkeypatch):
    """A swarm that starts at once keeps its helpers busy (each dials back one asker at a time and
    refuses more than MAX_WAITING): a check that did not run says nothing of our reachability, so the
    helpers are asked once more after a short pause; only two rounds without an answer say private."""
    from types import SimpleNamespace

    from p2pdiloco.swarm import reachability

    asked = []

    async def busy_then(answer):
        async def ask(node, helper, ports, timeout):
            asked.append(helper)
            return None if len(asked) == 1 else answer  # the first round: refused as busy
        return ask

    node = SimpleNamespace(short_id="me", peer_id_str="me")
    monkeypatch.setattr(reachability, "RETRY_PAUSE_S", (0.0, 0.01))
    monkeypatch.setattr(reachability, "_ask", asyncio.run(busy_then({"t": "reach", "ok": True, "addr": "x"})))
    reach, why = asyncio.run(detect(node, ["h"], [4000]))
    assert (reach, asked) == ("public", ["h", "h"]) and "dialed us back" in why, why
    asked.clear()
    monkeypatch.setattr(reachability, "_ask", asyncio.run(busy_then(None)))
    reach, why = asyncio.run(detect(node, ["h"], [4000]))
    assert (reach, asked) == ("private", ["h", "h"]) and "twice" in why, why


def test_the_verdict_needs_several_helpers_unless_there_is_only_one():
    """public iff at least two yes and a strict majority of the answers; one yes only as our only candidate."""
    table = [
        # (candidates, answers, public)
        (0, [], True),                       # the first peer of a swarm
        (1, [True], True),                   # a swarm of that peer and us
        (1, [False], False),
        (1, [], False),                      # nobody answered: the safe side
        (2, [True], False),                  # one yes while another peer is known (it did not answer)
        (2, [True, False], False),           # a lone yes against an honest no
        (2, [True, True], True),
        (3, [True, True, False], True),      # one helper saying no cannot veto a clear majority
        (3, [True, False, False], False),
        (4, [True, True, False, False], False),  # a tie is not a majority
        (5, [True, True, True, False, False], True),
        (5, [True, True], True),             # three asked peers did not answer
    ]
    for candidates, answers, public in table:
        assert verdict(candidates, answers) is public, (candidates, answers)


class _PlainListener:
    """A TCP server that is not libp2p (answers an HTTP line and closes): counts the connections."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.accepted += 1
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            except OSError:
                pass
            conn.close()

    def close(self):
        self._stop = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def plain():
    server = _PlainListener()
    try:
        yield server
    finally:
        server.close()


def _liar(nodes, says: bool):
    """A real node whose reach handler answers ``says`` without dialing anyone; returns it and the list
    of the peers it answered. The asker under test (nodes[1]) is connected to it directly."""
    liar = SwarmNode(nodes[0].visible_maddrs(), host_maddrs=LOOP, client_mode=True)  # serves no honest handler
    answered = []

    async def handle(info, reader, writer):
        sender = info.peer_id.to_base58()
        await read_header(reader, liar.traffic, sender)
        answered.append(sender)
        await write_frame(writer, {"t": "reach", "ok": says, "addr": "127.0.0.1:1", "relayed": False},
                          traffic=liar.traffic)
        await close_after_reply(reader, writer)

    liar.add_handler(HANDLER, handle)
    from multiaddr import Multiaddr

    addrs = [Multiaddr(m.split("/p2p/")[0]) for m in liar.visible_maddrs()]
    nodes[1].call(nodes[1].p2p._client.connect(liar.peer_id, addrs), timeout=30)
    return liar, answered


@pytest.mark.timeout(120)
def test_one_lying_helper_does_not_make_a_private_peer_public(nodes):
    """The asker listens on no port the helpers can reach (a closed one), so it is private. A helper
    that says yes without dialing is outvoted by honest helpers, alone against one and against two.
    The lie fired each time (counted at the liar, and the asker's tally shows the yes it received)."""
    asker, honest = nodes[1], [nodes[0].peer_id_str, nodes[2].peer_id_str]
    liar, lies = _liar(nodes, True)
    try:
        closed = [_closed_port()]
        reach, why = asker.call(detect(asker, [liar.peer_id_str, honest[0]], closed), timeout=60)
        assert reach == "private", why
        assert lies == [asker.peer_id_str] and "1 of 2 helper(s)" in why, (lies, why)
        reach, why = asker.call(detect(asker, [liar.peer_id_str, *honest], closed), timeout=60)
        assert reach == "private", why
        assert len(lies) == 2 and "1 of 3 helper(s)" in why, (lies, why)
        # a lone yes while another known helper does not answer is not enough either
        unknown = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
        reach, why = asker.call(detect(asker, [liar.peer_id_str, unknown], closed, timeout=3), timeout=60)
        assert reach == "private", why
        assert len(lies) == 3 and "1 of 1 helper(s)" in why, (lies, why)
    finally:
        liar.shutdown()


@pytest.mark.timeout(120)
def test_a_lying_no_only_errs_on_the_safe_side_and_is_outvoted(nodes):
    """A helper that says no without dialing, against honest helpers that can dial us: one honest yes
    against it gives private (the safe direction), two give public (the majority)."""
    asker = nodes[1]
    ports = listen_ports(asker.dht.get_visible_maddrs())
    liar, lies = _liar(nodes, False)
    try:
        reach, why = asker.call(detect(asker, [liar.peer_id_str, nodes[0].peer_id_str], ports), timeout=60)
        assert reach == "private", why
        assert lies == [asker.peer_id_str] and "1 of 2 helper(s)" in why, (lies, why)
        reach, why = asker.call(detect(asker, [liar.peer_id_str, nodes[0].peer_id_str, nodes[2].peer_id_str],
                                       ports), timeout=60)
        assert reach == "public", why
        assert len(lies) == 2 and "2 of 3 helper(s)" in why, (lies, why)
    finally:
        liar.shutdown()


@pytest.mark.timeout(120)
def test_an_open_port_that_does_not_prove_our_peer_id_is_no_dial_back(nodes, plain):
    """At the asked port: a TCP server that is not libp2p, or another peer's daemon (its own peer id).
    Every helper really connected there (the plain server counted them; the other daemon does answer a
    dial for its own id), yet none of them counts as a dial-back: private."""
    asker, helpers = nodes[1], [nodes[0].peer_id_str, nodes[2].peer_id_str]
    reach, why = asker.call(detect(asker, helpers, [plain.port]), timeout=60)
    assert reach == "private", why
    assert plain.accepted >= len(helpers) and "0 of 2 helper(s)" in why, (plain.accepted, why)
    other = nodes[3]
    other_port = listen_ports(other.dht.get_visible_maddrs())[0]
    assert other.call(dial_back(other.peer_id_str, [f"/ip4/127.0.0.1/tcp/{other_port}"]), timeout=30) \
        == f"/ip4/127.0.0.1/tcp/{other_port}"  # a live libp2p listener: only the peer id is wrong
    reach, why = asker.call(detect(asker, helpers, [other_port]), timeout=60)
    assert reach == "private", why
    assert "0 of 2 helper(s)" in why and f"127.0.0.1:{other_port}" in why, why


@pytest.mark.timeout(120)
def test_honest_helpers_find_a_public_peer_public_at_the_port_that_is_really_its_own(nodes, plain):
    """Asked about two ports, a non-libp2p server's first and then the asker's own: three honest helpers
    all prove the dial-back, each at the asker's own port, never the other one."""
    asker = nodes[1]
    own = listen_ports(asker.dht.get_visible_maddrs())[0]
    helpers = [nodes[0].peer_id_str, nodes[2].peer_id_str, nodes[3].peer_id_str]
    reach, why = asker.call(detect(asker, helpers, [plain.port, own]), timeout=60)
    assert reach == "public", why
    assert f":{plain.port}" not in why and why.count(f"127.0.0.1:{own}") == 3, why
    assert "3 of 3 helper(s)" in why, why


@pytest.mark.timeout(120)
def test_a_private_member_owns_no_shard_and_its_part_counts(nodes):
    """Two of four members are private: the two public ones own the shards. Every member gets the
    same bytes, equal to the sample-weighted mean of all four parts (in member order), the coverage
    names all four with their total weight, and the private members reduced nothing (no part was
    ever sent to them)."""
    run = f"reach{next(_runs)}"
    reducers = [AllReducer(n, run, timeout=20) for n in nodes]
    ids = sorted(n.peer_id_str for n in nodes)
    by_id = {n.peer_id_str: i for i, n in enumerate(nodes)}
    private = {ids[0], ids[2]}  # the smallest id among them: it would own shard 0 if everyone owned one
    owners = tuple(p for p in ids if p not in private)
    gid = make_group_id(run, 0, 0, ids, "", owners)
    assert gid != make_group_id(run, 0, 0, ids)  # members told different owners never meet in a round
    codec = get_codec("fp32")
    torch.manual_seed(0)
    vecs = [torch.randn(1001) for _ in nodes]
    weights = [1.0, 2.0, 3.0, 4.0]
    futs = [n.submit(r.allreduce_covered(Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, 0, owners=owners),
                                         "d", v, w, codec))
            for n, r, v, w in zip(nodes, reducers, vecs, weights)]
    results = [f.result(90) for f in futs]
    order = [by_id[p] for p in ids]
    want = torch.empty(1001)
    for lo, hi in shard_bounds(1001, len(owners)):
        want[lo:hi] = weighted_mean([vecs[i][lo:hi] for i in order], [weights[i] for i in order])
    for out, cov in results:
        assert torch.equal(out, results[0][0])
        assert cov.complete and cov.members == tuple(ids)
        assert cov.weight == sum(weights[i] for i in order)
    assert torch.equal(results[0][0], want)
    for p in ids:
        assert reducers[by_id[p]].stats["rounds"] == (0 if p in private else 1), (p in private, reducers[by_id[p]].stats)
    # a round re-done without a member keeps the owners among the rest; none left: one clear failure
    sub = Group(gid, tuple(ids), 0, 0, 0, owners=owners).restricted_to([ids[0], ids[1], ids[2]])
    assert sub.owners == (ids[1],)
    only_private = Group(gid, tuple(ids), 0, 0, 0, owners=owners).restricted_to([ids[0], ids[2]])
    assert only_private.owners == ()
    with pytest.raises(Exception, match="every member is private"):
        nodes[by_id[ids[0]]].call(reducers[by_id[ids[0]]].allreduce(only_private, "d", vecs[0], 1.0, codec),
                                  timeout=10)


@pytest.mark.timeout(120)
def test_a_private_peer_never_leads_and_the_leader_names_the_public_owners(nodes):
    """Three peers ready for one round; the two with the smallest ids are private. The public peer
    (largest id) leads, every member gets the same group, and it names only itself as owner."""
    ns = sorted(nodes[1:], key=lambda n: n.peer_id_str)
    run = f"reach{next(_runs)}"
    mms = [Matchmaker(n, run, matchmaking_timeout=10, join_grace=1.0) for n in ns]
    for n in ns[:2]:
        n.reachability = "private"
    try:
        futs = [n.submit(m.form_group(0, 1, 3)) for n, m in zip(ns, mms)]
        groups = [f.result(60) for f in futs]
    finally:
        for n in ns:
            n.reachability = "public"
    ids = tuple(n.peer_id_str for n in ns)
    assert all(g.gid == groups[0].gid and g.members == ids for g in groups), groups
    assert all(g.owners == (ids[2],) for g in groups), [g.owners for g in groups]
    assert mms[2]._slots[(0, 1)].leading and not mms[0]._slots[(0, 1)].leading


def _fake(me, records, reach):
    from types import SimpleNamespace

    async def aget_subkeys(key, why="other"):
        return dict(records.get(key, {}))

    async def astore(key, value, ttl, subkey):
        records.setdefault(key, {})[subkey] = value

    node = SimpleNamespace(peer_id_str=me, short_id=me, traffic=None, add_handler=lambda *a: None, relay_routes={},
                           aget_subkeys=aget_subkeys, astore=astore, reachability=reach,
                           gate=SimpleNamespace(banned=lambda pid: False))
    mm = Matchmaker(node, "t", matchmaking_timeout=5, join_grace=0.2)
    mm._draw = lambda key, peer: b""  # within a tier, rank by id alone: the cases read in id order
    return mm


def test_a_follower_asks_the_public_peer_not_the_smaller_private_one():
    records = {"t:progress": {p: {"step": 99, "sps": 1.0, "next_sync": 100, "t": 1.0, "reach": r}
                              for p, r in (("a", "private"), ("b", "public"), ("me", "public"))}}
    mm = _fake("me", records, "public")
    asked = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        return Group(gid="g", members=("a", "b", "me"), my_index=2, frag=frag, round=round_, owners=("b", "me")), None

    mm._join = join
    group = asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert asked == ["b"] and group.owners == ("b", "me")


def test_private_peers_without_a_public_one_fail_at_once_with_one_clear_message():
    records = {"t:progress": {p: {"step": 99, "sps": 1.0, "next_sync": 100, "t": 1.0, "reach": "private"}
                              for p in ("a", "me")},
               "t:mm:0:5": {"a": {"t": 1.0, "reach": "private"}}}
    mm = _fake("me", records, "private")

    asked = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):  # a could not be dialed anyway
        asked.append(leader)
        return None, None

    mm._join = join
    t0 = time.monotonic()
    with pytest.raises(MatchmakingFailed, match="no public peer is ready .* no relay took it.* a bootstrap that relays"):
        asyncio.run(mm.form_group(0, 5, 2, sync_step=100))
    assert time.monotonic() - t0 < 5 and asked == []  # not a timeout; no dial to another private peer
    # alone, a private peer syncs alone like anyone (no dial needed)
    alone = _fake("me", {"t:progress": {"me": {"next_sync": 100, "reach": "private"}}}, "private")
    group = asyncio.run(alone.form_group(0, 5, 1, sync_step=100))
    assert group.members == ("me",)


def test_state_donors_are_public_first():
    peers = {"a": {"reach": "private"}, "b": {"reach": "public"}, "c": {}}
    assert dialable_first(["a", "b", "c"], peers) == ["b", "c"]
    assert dialable_first(["a"], peers) == ["a"]  # nobody else claims it: try (an open connection may carry it)


def test_reachability_setting_is_validated_and_not_fingerprinted():
    from p2pdiloco.config import load_config

    with pytest.raises(ConfigError, match="swarm.reachability"):
        load_config(None, ["swarm.reachability=maybe"])
    a, b = load_config(None, ["swarm.reachability=private"]), load_config(None, [])
    assert a.swarm.reachability == "private" and b.swarm.reachability == "auto"
    from p2pdiloco.run_identity import run_fingerprint

    assert run_fingerprint(a) == run_fingerprint(b)


def test_relayed_peers_lead_and_own_shards_only_when_no_direct_peer_can():
    """Leadership and shard ownership by tier: public (dialed directly), then relayed (through their
    relay), never private (nobody can reach them)."""
    records = {"t:progress": {"a": {"reach": "relayed", "via": "R" * 52}, "b": {"reach": "private"},
                              "c": {"reach": "public"}, "d": {"reach": "relayed", "via": "R" * 52}}}
    mm = _fake("me", records, "relayed")
    mm._note_reach(records["t:progress"])
    assert sorted(["me", "a", "b", "c", "d"], key=mm._ranking("t:mm:0:5")) == ["c", "a", "d", "me", "b"]
    assert mm._owners(("a", "b", "c", "d", "me")) == ("c",)  # a direct member: it owns
    assert mm._owners(("a", "b", "d", "me")) == ("a", "d", "me")  # none: the relayed members own
    assert mm._owners(("a", "d", "me")) is None  # every member owns
    assert mm.node.relay_routes == {"a": "R" * 52, "d": "R" * 52}  # where streams to them go
    mm._note_reach({"a": {"reach": "public"}})  # a got an open port: dialed directly again
    assert "a" not in mm.node.relay_routes
