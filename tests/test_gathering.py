"""Gathering (``swarm/matchmaking.py`` item 13): with a group cap G and at least 2G peers due, each gathering
bucket's head carries its bucket's join requests to the round's leader, so the leader takes about N/G + 2G
requests instead of N. The rules (``swarm/formation.py``), the simulated swarm at 50-100 peers (the real
matchmakers on simulated transports, in virtual time: ``bench/scale_sim.py``), and real peers on loopback.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import List

import pytest

from conftest import loopback_nodes
from p2pdiloco.bench import scale_sim
from p2pdiloco.swarm import formation
from p2pdiloco.swarm.group import TIER_PRIVATE
from p2pdiloco.swarm.joining import SILENT_S
from p2pdiloco.swarm.keys import handler_name, progress_key, ready_key


def _rank(key):
    return lambda p: (0, formation.draw(key, p), p)


def test_gathering_is_off_unless_asked_for_and_checked():
    from p2pdiloco.config import ConfigError, load_config

    assert load_config(None).swarm.gather is False
    assert load_config(None, ["swarm.gather=true", "swarm.group_cap=8"]).swarm.gather is True
    with pytest.raises(ConfigError, match="swarm.gather"):
        load_config(None, ["swarm.gather=3"])


def test_buckets_come_in_powers_of_two_from_two_caps_of_peers_up():
    assert formation.gather_buckets(1000, 0) == 1                      # no cap: no gathering
    assert [formation.gather_buckets(n, 8) for n in (8, 15, 16, 31, 32, 63, 64, 1000)] == [1, 1, 2, 2, 4, 4, 8, 64]
    # views a few peers apart agree on the count unless they straddle a doubling
    assert {formation.gather_buckets(n, 32) for n in range(960, 1024)} == {16}


def test_every_bucket_has_its_best_ranked_dialable_peer_as_head_and_the_leader_heads_its_own():
    key = ready_key("r", 0, 7)
    peers = {f"peer{i:04d}" for i in range(1000)}
    private = {p for p in peers if p.endswith(("3", "7"))}
    tier = lambda p: TIER_PRIVATE if p in private else 0  # noqa: E731
    rank = lambda p: (tier(p), formation.draw(key, p), p)  # noqa: E731
    buckets, heads = formation.gather_heads(peers, key, 32, rank, tier)
    assert buckets == 16 and len(heads) == 16
    sizes = Counter(formation.gather_bucket(key, p, buckets) for p in peers)
    assert max(sizes.values()) <= 3 * 32 and min(sizes.values()) >= 32 // 2, sizes  # about N / buckets each
    for b, head in heads.items():
        bucket = [p for p in peers if formation.gather_bucket(key, p, buckets) == b]
        assert head == min((p for p in bucket if p not in private), key=rank)
    leader = min(peers, key=rank)
    assert leader in heads.values()
    assert formation.gather_head(peers, leader, key, 32, rank, tier) is None      # the leader asks nobody
    # a peer that does not head its bucket is carried by its head; its head asks the leader itself
    rider = next(p for p in sorted(peers) if p not in heads.values())
    head = heads[formation.gather_bucket(key, rider, buckets)]
    assert formation.gather_head(peers - {rider}, rider, key, 32, rank, tier) == head
    assert formation.gather_head(peers, head, key, 32, rank, tier) is None
    # a head that left our request unanswered is passed over for the bucket's next one
    after = formation.gather_head(peers, rider, key, 32, rank, tier, exclude={head})
    assert after not in (head, None) and after not in private
    # below two caps of peers, or without a cap: nobody gathers
    assert formation.gather_head(set(sorted(peers)[:63]), rider, key, 32, rank, tier) is None
    assert formation.gather_head(peers, rider, key, 0, rank, tier) is None


def _leader_and_busiest(run):
    return [(r["requests_taken"]["leader"], r["requests_taken"]["max"]) for r in run["rounds"]]


def test_gathered_the_leader_takes_a_request_per_bucket_not_one_per_peer():
    """100 peers, cap 8: 8 buckets of about 12. The leader takes its own bucket's requests and one per other
    bucket's head, and no peer takes more than a bucket's; one group of all, nobody missed. Without gathering
    (the same swarm) the leader takes one request from every other peer."""
    gathered = scale_sim.simulate(100, 2, verbose=False, churn=0.0, seed=1, cap=8, gathering=True)
    direct = scale_sim.simulate(100, 2, verbose=False, churn=0.0, seed=1, cap=8)
    for r in gathered["rounds"] + direct["rounds"]:
        assert (r["groups"], r["in_main_group"], r["missed"], r["split"]) == (1, 100, 0, False), r
    for leader, busiest in _leader_and_busiest(gathered):
        assert leader <= 7 + 3 * 8 and busiest <= 3 * 8, (leader, busiest)
    for leader, _ in _leader_and_busiest(direct):
        assert leader >= 90, leader
    gathered_msgs = [r["formation_msgs"]["leader"] for r in gathered["rounds"]]
    direct_msgs = [r["formation_msgs"]["leader"] for r in direct["rounds"]]
    assert all(a < b for a, b in zip(gathered_msgs, direct_msgs)), (gathered_msgs, direct_msgs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_peers_leaving_mid_round_heads_among_them_never_split_a_gathered_round(seed):
    """10% of the peers leave during each round (half crash): heads among them. Their riders drop them
    (a broken stream, or silence) and ask the bucket's next head or the leader: one group of every peer
    still there, nobody missing the round."""
    run = scale_sim.simulate(60, 3, verbose=False, churn=0.1, seed=seed, cap=8, gathering=True)
    for r in run["rounds"]:
        assert (r["groups"], r["missed"], r["split"]) == (1, 0, False), r
        assert r["in_main_group"] >= r["peers"] - r["left"], r  # (a peer leaving after its group formed is in it)


@pytest.mark.parametrize("silent_heads", [1, 2])
def test_a_silent_head_costs_its_bucket_seconds_not_the_round(silent_heads):
    """Identities ground to head a gathering bucket in round 0 take their bucket's requests and answer none:
    the riders drop them after SILENT_S and ask the bucket's next head, and the leader waits that much
    longer for ready peers whose head did not join it. One group of all the honest peers."""
    honest = scale_sim.simulate(50, 1, verbose=False, churn=0.0, seed=2, cap=8, gathering=True)["rounds"][0]
    run = scale_sim.simulate(50, 2, verbose=False, churn=0.0, seed=2, cap=8, silent_heads=silent_heads,
                             gathering=True)
    first = run["rounds"][0]
    assert first["held"] > 0  # the attack fired: the silent heads took requests
    for r in run["rounds"]:
        assert (r["groups"], r["in_main_group"], r["missed"], r["split"]) == (1, 50, 0, False), r
    assert first["formation_seconds"]["median"] < honest["formation_seconds"]["median"] + SILENT_S + 3, first


# ---- real peers on loopback ----------------------------------------------------------------------
def _roles(nodes, key, silent):
    """(liar, honest peers) for the round under ``key``, or (None, None) when its draw gives no head a rider.
    The liar (with ``silent``): the best-ranked node after the leader that heads a bucket of its own (the
    buckets of all nine identities) holding an honest peer too. The honest peers: the other eight, one of
    whose buckets other than the leader's holds two or more of them."""
    rank = _rank(key)
    order = sorted(nodes, key=lambda n: rank(n.peer_id_str))
    buckets = formation.gather_buckets(len(nodes) if silent else len(nodes) - 1, 2)
    bucket = {n: formation.gather_bucket(key, n.peer_id_str, buckets) for n in nodes}
    liar = None
    if silent:
        heads = [n for n in order[1:] if bucket[n] != bucket[order[0]]
                 and all(order.index(n) < order.index(m) for m in nodes if m is not n and bucket[m] == bucket[n])
                 and sum(bucket[m] == bucket[n] for m in nodes) >= 2]
        if not heads:
            return None, None
        liar = heads[0]
    honest = [n for n in nodes if n is not liar][:8]
    leader = min(honest, key=lambda n: rank(n.peer_id_str))
    riders = Counter(bucket[n] for n in honest if bucket[n] != bucket[leader])
    if max(riders.values(), default=0) < 2:
        return None, None
    return liar, honest


@pytest.fixture(scope="module")
def nodes():
    with loopback_nodes(9) as ns:
        yield ns


def _swarms(nodes, run, cap):
    from p2pdiloco.swarm.swarm import Swarm

    swarms = []
    for n in nodes:
        s = Swarm(n, run, matchmaking_timeout=20, allreduce_timeout=5, group_cap=cap, gather=True)
        s.matchmaker.record_lifetime = 120.0  # nobody re-publishes in this test
        s.update_progress(step=49, synced_step=40, digest="0" * 16, round=4, next_sync=50, sps=1.0)
        s.publish_progress(wait=True)
        swarms.append(s)
    return swarms


@pytest.mark.timeout(180)
@pytest.mark.parametrize("silent", [False, True])
def test_real_peers_form_one_group_gathered_by_heads(nodes, silent):
    """Eight peers with a cap of 2 (four buckets) form fragment 0's group at one sync step on real libp2p
    streams: the heads carry their buckets' requests, the leader takes fewer requests than there are
    other peers, every member ends in the same group. The round is one whose draw puts a rider behind a
    head (:func:`_roles`). With ``silent``, a ninth identity heading a bucket with an honest peer in it
    (as one ground to would; records copied from an honest peer, a ready record) takes requests and
    answers none: the group still forms, SILENT_S later."""
    round_ = 5
    for attempt in range(1000):  # a round whose buckets put a rider behind a head (and, with silent, a liar)
        run = f"gather{int(silent)}-{time.time_ns() % 10**6}-{attempt}"
        key = ready_key(run, 0, round_)
        liar, honest = _roles(nodes, key, silent)
        if honest is not None:
            break
    held: List[str] = []

    async def hold(info, reader, writer):  # take the request; answer nothing until the joiner hangs up
        held.append(info.peer_id.to_base58())
        while await reader.read(1 << 16):
            pass

    swarms = _swarms(honest, run, cap=2)
    if liar is not None:
        liar.add_handler(handler_name(run, "join"), hold)
        (template,) = [v for p, v in honest[0].get_subkeys(progress_key(run)).items() if p == honest[0].peer_id_str]
        assert liar.store(progress_key(run), dict(template, t=time.time()), ttl=120, subkey=liar.peer_id_str)
        assert liar.store(key, {"t": time.time(), "reach": "public"}, ttl=120, subkey=liar.peer_id_str)
    view = swarms[0].live_peers()
    assert len(view) == len(honest) + (liar is not None), view
    t0 = time.monotonic()
    futs = [n.submit(s.matchmaker.form_group(0, round_, len(view), sync_step=50)) for n, s in zip(honest, swarms)]
    groups = [f.result(150) for f in futs]
    took = time.monotonic() - t0
    ids = tuple(sorted(n.peer_id_str for n in honest))
    assert all(g.members == ids for g in groups) and len({g.gid for g in groups}) == 1, groups
    stats = [s.matchmaker.join_stats for s in swarms]
    leader = next(s for s, g in zip(swarms, groups) if s.matchmaker._slots[(0, round_)].leading)
    taken = leader.matchmaker.join_stats["requests"] + leader.matchmaker.join_stats["carriers"]
    if not silent:
        assert sum(st["carried"] for st in stats) >= 1, stats          # heads carried requests ...
        assert leader.matchmaker.join_stats["carriers"] >= 1, stats     # ... to the leader, in their own
        assert taken < len(honest) - 1, stats
    else:  # the silent head's riders drop it and ask the leader themselves (or their bucket's next head)
        assert held, "the silent head took no request"  # the attack fired
        assert took < SILENT_S + 20, took
    print(f"\ngathered formation of {len(honest)} peers{' with a silent head' if silent else ''}: {took:.1f} s; "
          f"the leader took {taken} request(s); heads carried {sum(st['carried'] for st in stats)}")
