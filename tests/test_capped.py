"""Capped groups: a group larger than ``swarm.group_cap`` reduces in two levels (swarm/allreduce.py,
"Capped groups"), exactly and identically on every member.

* The plan (group.capped_plan): every member in one subgroup, subgroups within the cap when enough
  members can own a shard, sizes within one of each other, the same number of owners everywhere, and
  never a private member as an owner.
* Seven real nodes with a cap of 3 (subgroups of 3, 2 and 2): every member ends with the same bytes,
  equal to the documented two-level arithmetic (per subgroup the owner's weighted mean in member
  order, then per shard the subgroups' means weighted by their total weights in the column's member
  order, encoded once); and each member talks to its subgroup and its column, not to everyone.
* A member that sends one owner a bad part: that shard covers fewer members than the others, the
  round is re-done without it (as a capped group of six) and the six honest members end identical.
* A member absent from the round (it never sends a part), or killed by its pid after half of its
  part: the whole round fails on every member, in every subgroup; nobody applies a partial mean.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from p2pdiloco.compression import get_codec
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.errors import SyncFailed
from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import capped_plan
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.partition import shard_bounds
from reducer_support import run_allreduce

LOOP = ["/ip4/127.0.0.1/tcp/0"]
HERE = os.path.dirname(os.path.abspath(__file__))
_runs = itertools.count()


@pytest.mark.parametrize("n,cap,owners", [(n, cap, o) for n in range(2, 41, 3) for cap in (2, 3, 5, 8)
                                          for o in (n, max(1, n // 3), 1)])
def test_the_plan_covers_every_member_once_within_the_cap(n, cap, owners):
    members = [f"peer{i:03d}" for i in range(n)]
    owner_ids = random.Random(n * cap + owners).sample(members, owners)
    plan = capped_plan(members, sorted(owner_ids), cap)
    if n <= cap or owners < 2:
        assert plan is None
        return
    assert plan is not None
    flat = sorted(i for sub in plan.subgroups for i in sub)
    assert flat == list(range(n))                                   # every member exactly once
    sizes = [len(sub) for sub in plan.subgroups]
    assert max(sizes) - min(sizes) <= 1
    if owners >= -(-n // cap):
        assert max(sizes) <= cap
    owner_idx = {members.index(o) for o in owner_ids}
    assert plan.shards >= 1 and all(len(own) == plan.shards for own in plan.owners)
    for sub, own in zip(plan.subgroups, plan.owners):
        assert set(own) <= set(sub) and set(own) <= owner_idx       # owners of their own subgroup, dialable
        assert list(sub) == sorted(sub)
    assert plan == capped_plan(list(members), list(sorted(owner_ids)), cap)  # a function of the group alone


@pytest.fixture(scope="module")
def seven():
    first = SwarmNode([], host_maddrs=LOOP)
    nodes = [first] + [SwarmNode(first.visible_maddrs(), host_maddrs=LOOP) for _ in range(6)]
    try:
        yield nodes
    finally:
        for n in nodes:
            n.shutdown()


def _allreduce(nodes, vecs, weights, codec, cap, reducers=None, timeout=30.0):
    return run_allreduce(nodes, vecs, weights, codec, reducers=reducers, cap=cap, timeout=timeout, covered=True)


def two_level_reference(ids, by_id, vecs, weights, codec, cap):
    """The documented arithmetic: per shard and subgroup, the owner's decoded parts (its own through the
    codec too) averaged in member order; the column's weighted mean of the subgroups' means (weights:
    their totals), each through the codec, in the column's member order; then through the codec twice
    (the column's result, and the subgroup owner's encoding of it)."""
    plan = capped_plan(ids, ids, cap)
    numel = vecs[0].numel()
    out = torch.empty(numel)
    for k, (lo, hi) in enumerate(shard_bounds(numel, plan.shards, codec.block_size)):
        means = {}
        for sub, own in zip(plan.subgroups, plan.owners):
            order = [by_id[ids[j]] for j in sub]
            means[ids[own[k]]] = (weighted_mean([codec.roundtrip(vecs[i][lo:hi]) for i in order],
                                                [weights[i] for i in order]),
                                  float(sum(weights[i] for i in order)))
        column = sorted(means)
        mean = weighted_mean([codec.roundtrip(means[o][0]) for o in column], [means[o][1] for o in column])
        out[lo:hi] = codec.roundtrip(codec.roundtrip(mean))
    return out


class Recording(AllReducer):
    """Remembers every peer it opened a part stream to."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dialed = set()

    async def _connect(self, peer):
        self.dialed.add(peer)
        return await super()._connect(peer)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["fp32", "e3m0"])
def test_a_capped_group_is_bitwise_identical_and_equals_the_two_level_mean(seven, name):
    codec = get_codec(name)
    numel = 2 * 5000 + 17
    g = torch.Generator().manual_seed(11)
    vecs = [torch.randn(numel, generator=g) * (i + 1) for i in range(7)]
    weights = [3.0, 1.0, 2.5, 4.0, 1.5, 2.0, 7.0]
    run = f"capped{next(_runs)}"
    reducers = [Recording(n, run, timeout=30.0, cap=3) for n in seven]
    results, ids, reducers = _allreduce(seven, vecs, weights, codec, cap=3, reducers=reducers)
    assert all(isinstance(r, tuple) for r in results), results
    outs = [r[0] for r in results]
    assert all(o.numpy().tobytes() == outs[0].numpy().tobytes() for o in outs)
    by_id = {n.peer_id_str: i for i, n in enumerate(seven)}
    assert torch.equal(outs[0], two_level_reference(ids, by_id, vecs, weights, codec, cap=3))
    for _, cov in results:
        assert cov.complete and cov.members == tuple(ids) and cov.weight == sum(weights[by_id[p]] for p in ids)
        assert cov.subgroups == 3
    # two levels ran: 3 subgroups x 2 shards, and each shard's 3 owners averaged in a column
    assert sum(r.stats["rounds_capped"] for r in reducers) == 6
    # ... and not one butterfly of seven: the flat mean (every member's parts in one owner's order) differs
    flat = torch.empty(numel)
    order = [by_id[p] for p in ids]
    for lo, hi in shard_bounds(numel, 7, codec.block_size):
        flat[lo:hi] = codec.roundtrip(weighted_mean([codec.roundtrip(vecs[i][lo:hi]) for i in order],
                                                    [weights[i] for i in order]))
    assert not torch.equal(flat, outs[0])
    # each member sent parts to its subgroup's owners and, as an owner, to its column: never to everyone
    plan = capped_plan(ids, ids, 3)
    for node, r in zip(seven, reducers):
        me = ids.index(node.peer_id_str)
        i = next(i for i, sub in enumerate(plan.subgroups) if me in sub)
        allowed = {ids[j] for j in plan.owners[i]}
        if me in plan.owners[i]:
            k = plan.owners[i].index(me)
            allowed |= {ids[own[k]] for own in plan.owners}
        assert r.dialed and r.dialed <= allowed - {ids[me]}, (r.dialed, allowed)


@pytest.mark.timeout(300)
def test_a_column_larger_than_the_cap_is_capped_again(seven):
    """Cap 2: four subgroups of 2, 2, 2 and 1, so each shard's column (4 owners) is larger than the cap
    and averages in two levels itself. Still one result on every member: the weighted mean, to fp32
    rounding, covering everyone."""
    codec = get_codec("fp32")
    numel = 4000
    g = torch.Generator().manual_seed(8)
    vecs = [torch.randn(numel, generator=g) for _ in range(7)]
    weights = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
    results, ids, reducers = _allreduce(seven, vecs, weights, codec, cap=2)
    assert all(isinstance(r, tuple) for r in results), results
    assert all(r[0].numpy().tobytes() == results[0][0].numpy().tobytes() for r in results)
    exact = sum(w * v.double() for w, v in zip(weights, vecs)) / sum(weights)
    assert torch.allclose(results[0][0].double(), exact, atol=1e-6)
    assert all(cov.complete and cov.subgroups == 4 for _, cov in results)
    # the columns were capped too: more two-level shard rounds than the 4 subgroups' one shard each
    assert sum(r.stats["rounds_capped"] for r in reducers) > 4
    for n in seven:
        n.gate.forgive()


@pytest.mark.timeout(300)
def test_a_member_that_sends_one_owner_a_bad_part_is_left_out_and_the_others_agree(seven):
    """Member 0 (by the nodes' order) sends a NaN part to one owner only: that shard's column covers six
    members, the other shard seven, so the round is re-done over the six, a capped group again."""
    codec = get_codec("fp32")
    numel = 2 * 3000
    g = torch.Generator().manual_seed(3)
    vecs = [torch.randn(numel, generator=g) for _ in range(7)]
    weights = [1.0] * 7
    run = f"capped{next(_runs)}"

    class OneBadPart(AllReducer):
        def _outgoing(self, group, phase, j, part, weight):
            me = group.members[group.my_index]
            target = next(o for o in group.shard_owners if o != me)
            if phase == "d" and group.members[j] == target:
                part = part.clone()
                part[0] = float("nan")
            return part, weight

    reducers = [OneBadPart(seven[0], run, timeout=30.0, cap=3)] + \
        [AllReducer(n, run, timeout=30.0, cap=3) for n in seven[1:]]
    results, ids, reducers = _allreduce(seven, vecs, weights, codec, cap=3, reducers=reducers)
    honest = results[1:]
    assert all(isinstance(r, tuple) for r in honest), honest
    assert all(r[0].numpy().tobytes() == honest[0][0].numpy().tobytes() for r in honest)
    bad = seven[0].peer_id_str
    for _, cov in honest:
        assert cov.redone and cov.left_out == (bad,) and len(cov.members) == 6 and cov.subgroups == 2
    # the fault fired: an owner dropped the part as not finite
    assert sum(r.stats["dropped:finite"] for r in reducers) >= 1
    by_id = {n.peer_id_str: i for i, n in enumerate(seven)}
    kept = [p for p in ids if p != bad]
    assert torch.equal(honest[0][0], two_level_reference(kept, by_id, vecs, weights, codec, cap=3))
    for n in seven:
        n.gate.forgive()


@pytest.mark.timeout(300)
def test_a_member_absent_from_a_capped_round_fails_it_on_every_member(seven):
    codec = get_codec("fp32")
    numel = 2 * 2000
    vecs = [torch.ones(numel) * i for i in range(7)]
    vecs[4] = None  # this member never takes part: its subgroup's owners wait for its part in vain
    results, ids, reducers = _allreduce(seven, vecs, [1.0] * 7, codec, cap=3, timeout=4.0)
    assert len(results) == 6
    assert all(isinstance(r, SyncFailed) for r in results), results
    # the wait that fired: an owner of the absent member's subgroup named it
    absent = seven[4].peer_id_str
    assert any(absent[-6:] in str(r) or "incomplete" in str(r) or "timed out" in str(r) for r in results), results
    for n in seven:
        n.gate.forgive()


@pytest.mark.timeout(300)
def test_a_member_killed_mid_part_fails_the_capped_round_on_every_member(tmp_path):
    """Six processes, cap 3 (two subgroups of three): the victim SIGKILLs itself once half the chunks of a
    part are out. Every survivor, in its subgroup and in the other, gets SyncFailed and no result."""
    numel, chunk, peers = 3 * 40_000, 4096, 6
    kill = json.dumps({"phase": "allreduce.half_sent", "action": "kill"})
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "chunk_support.py"), str(tmp_path), str(r),
                               str(peers), str(numel), "fp32", str(chunk), "3"],
                              env={**os.environ, **({"P2PDILOCO_FAULTS": kill} if r == peers - 1 else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(peers)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    assert procs[-1].returncode == -signal.SIGKILL, outs[-1][-2000:]
    assert "injected fault: kill at allreduce.half_sent" in outs[-1], outs[-1][-2000:]   # the fault fired
    assert not os.path.exists(tmp_path / f"result.{peers - 1}.json")
    for r in range(peers - 1):
        assert procs[r].returncode == 0, outs[r][-2000:]
        res = json.load(open(tmp_path / f"result.{r}.json"))
        assert res["error"] is not None and res["error"].startswith("SyncFailed"), res
        assert not res["exact"] and res["subgroups"] == 2


def test_the_cap_is_checked_and_part_of_the_fingerprint():
    from p2pdiloco.config import load_config
    from p2pdiloco.errors import ConfigError
    from p2pdiloco.run_identity import fingerprint_fields

    with pytest.raises(ConfigError, match="swarm.group_cap"):
        load_config(None, ["swarm.group_cap=1"])
    with pytest.raises(ConfigError, match="group_cap"):
        load_config(None, ["compression.codec=sparse", "outer.lr=1", "outer.momentum=0", "swarm.group_cap=8"])
    capped, flat = fingerprint_fields(load_config(None, ["swarm.group_cap=8"])), fingerprint_fields(load_config(None))
    assert capped["swarm.group_cap"] == 8 and "swarm.group_cap" not in flat  # peers that cap differently never meet
