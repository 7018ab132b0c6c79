"""Reachability (issue 16, items 2-4), in-process on 127.0.0.1: the parts that need no NAT.

* the dial-back check says public when the helper can connect to our port and private when it cannot;
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
import time

import pytest
import torch

from p2pdiloco.compression import get_codec
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.errors import ConfigError, MatchmakingFailed
from p2pdiloco.swarm.allreduce import AllReducer, Group, make_group_id, restricted_group, shard_bounds
from p2pdiloco.swarm.matchmaking import Matchmaker
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.reachability import detect, listen_ports
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
    sub = restricted_group(Group(gid, tuple(ids), 0, 0, 0, owners=owners), [ids[0], ids[1], ids[2]])
    assert sub.owners == (ids[1],)
    only_private = restricted_group(Group(gid, tuple(ids), 0, 0, 0, owners=owners), [ids[0], ids[2]])
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

    async def aget_subkeys(key):
        return dict(records.get(key, {}))

    async def astore(key, value, ttl, subkey):
        records.setdefault(key, {})[subkey] = value

    node = SimpleNamespace(peer_id_str=me, short_id=me, traffic=None, add_handler=lambda *a: None,
                           aget_subkeys=aget_subkeys, astore=astore, reachability=reach,
                           gate=SimpleNamespace(banned=lambda pid: False))
    return Matchmaker(node, "t", matchmaking_timeout=5, join_grace=0.2)


def test_a_follower_asks_the_public_peer_not_the_smaller_private_one():
    records = {"t:progress": {p: {"step": 99, "sps": 1.0, "next_sync": 100, "t": 1.0, "reach": r}
                              for p, r in (("a", "private"), ("b", "public"), ("me", "public"))}}
    mm = _fake("me", records, "public")
    asked = []

    async def join(leader, frag, round_, due=None, timeout=None):
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

    async def join(leader, frag, round_, due=None, timeout=None):  # a could not be dialed anyway
        asked.append(leader)
        return None, None

    mm._join = join
    t0 = time.monotonic()
    with pytest.raises(MatchmakingFailed, match="no public peer is ready .* private peers cannot reach each other"):
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
    assert a.fingerprint() == b.fingerprint()
