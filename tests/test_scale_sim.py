"""bench.scale_sim: the real matchmaking code on simulated transports, in virtual time."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from p2pdiloco.bench import scale_sim
from p2pdiloco.swarm import joining, matchmaking


def test_virtual_time_jumps_to_the_next_timer_and_orders_timers():
    loop = scale_sim.VirtualLoop()
    seen = []

    async def sleeper(d):
        await asyncio.sleep(d)
        seen.append((d, loop.time()))

    async def main():
        await asyncio.gather(sleeper(3600.0), sleeper(0.5), sleeper(60.0))

    t0 = time.monotonic()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert time.monotonic() - t0 < 5  # an hour of virtual time, not of this machine's
    assert [d for d, _ in seen] == [0.5, 60.0, 3600.0]
    assert all(abs(t - d) < 1e-9 for d, t in seen)


def test_a_swarm_without_churn_forms_one_group_of_everyone_and_the_modules_are_restored():
    clock_before, dial_before = matchmaking.time, joining.open_stream
    run = scale_sim.simulate(12, 2, verbose=False, churn=0.0, seed=3)
    assert (matchmaking.time, joining.open_stream) == (clock_before, dial_before)
    for r in run["rounds"]:
        assert (r["groups"], r["in_main_group"], r["missed"], r["split"]) == (1, 12, 0, False)
        # a butterfly group of all: every member talks to every other (the leader at least)
        assert r["peers_talked"]["leader"] == 11
        # a follower enters with its fresh background view: the live peers are read over the network by the
        # peers that may lead and those that polled, not once by every peer as its formation starts
        assert 0 < r["reads_per_peer"]["progress:formation"] < 1.0
        assert r["formation_bytes"]["leader"] > r["formation_bytes"]["median"] > 0


def test_with_a_cap_a_member_warms_links_to_its_subgroup_and_column_only():
    """30 peers, cap 5: six subgroups of five owners; a member's warm step connects to its 4 subgroup
    owners and its column's 5 other owners (plus the leader, and the peers that asked it to lead): far fewer
    than the 29 others an uncapped butterfly would. One group of all still forms."""
    capped = scale_sim.simulate(30, 2, verbose=False, churn=0.0, seed=3, cap=5)
    flat = scale_sim.simulate(30, 2, verbose=False, churn=0.0, seed=3)
    for c, f in zip(capped["rounds"], flat["rounds"]):
        assert (c["groups"], c["in_main_group"], c["missed"]) == (1, 30, 0)
        assert f["peers_talked"]["median"] == 29
        assert c["peers_talked"]["median"] <= 4 + 5 + 3, c["peers_talked"]


def test_leading_spreads_over_the_swarm_with_the_draw_and_funnels_into_one_peer_by_id():
    """Over 4 rounds of 12 peers, the per-round draw gives each round another leader, and the heaviest
    peer's formation bytes over the run fall; ranked by the id alone, one peer leads (and carries) them all."""
    drawn = scale_sim.simulate(12, 4, verbose=False, churn=0.0, seed=3)["over_run"]
    by_id = scale_sim.simulate(12, 4, verbose=False, churn=0.0, seed=3, rank_by_id=True)["over_run"]
    assert by_id["leaders"] == 1 and by_id["most_rounds_led"] == 4
    assert drawn["leaders"] >= 3 and drawn["most_rounds_led"] <= 2, drawn
    assert drawn["formation_bytes"]["max"] < 0.7 * by_id["formation_bytes"]["max"], (drawn, by_id)


def test_peers_leaving_mid_round_are_left_out_and_the_round_never_splits():
    run = scale_sim.simulate(40, 2, verbose=False, churn=0.1, seed=1)
    for r in run["rounds"]:
        assert r["left"] == 4  # the fault fired: 10% of the live peers left during the round
        assert not r["split"]
        assert r["in_main_group"] + r["missed"] == r["peers"] - r["left"]
        assert r["in_main_group"] >= r["peers"] - r["left"] - 2


def test_a_read_counts_the_records_bytes_from_every_replica():
    sim = scale_sim.Sim(3, replicas=5)
    peers = list(sim.peers.values())
    try:
        size = sim.dht.store("sim:progress", peers[1].pid, {"step": 1}, ttl=10)
        size += sim.dht.store("sim:progress", peers[2].pid, {"step": 2}, ttl=10)
        got = sim.loop.run_until_complete(peers[0].node.aget_subkeys("sim:progress", why="formation"))
    finally:
        sim.loop.close()
    assert set(got) == {peers[1].pid, peers[2].pid}
    assert size > 2 * 100  # signed records: the owner key and the signature are most of a small one
    assert peers[0].stats["dht_bytes"] == 5 * (size + 64)
    assert peers[0].stats["read:progress:formation"] == 1


def test_the_command_writes_its_table_results_and_plot(tmp_path, capsys):
    out = str(tmp_path / "sim")
    assert scale_sim.main(["--peers", "6,10", "--rounds", "1", "--churn", "0", "--sync-s", "2",
                           "--matchmaking-timeout", "20", "--out", out]) == 0
    res = json.load(open(os.path.join(out, "results.json")))
    assert [r["n"] for r in res["runs"]] == [6, 10]
    assert res["runs"][0]["settings"]["sync_s"] == 2 and res["runs"][0]["settings"]["matchmaking_timeout"] == 20
    assert os.path.getsize(os.path.join(out, "scale_sim.png")) > 0
    assert "| 10 | 0 | 10 / 10 (0, 0)" in open(os.path.join(out, "table.md")).read()
    assert scale_sim.main(["--peers", "1,x", "--out", out]) == 2
    assert "--peers must be" in capsys.readouterr().err


@pytest.mark.parametrize("silent,stalling,bound", [(1, 0, 22), (2, 0, 29), (0, 1, 50)])
def test_identities_ground_to_lead_the_round_that_answer_no_join_request_cost_it_seconds_not_a_split(
        silent, stalling, bound):
    """Hostile identities ground to draw first in the round, ready every round, take every join request and answer
    none (silent), or keep saying 'wait' and never propose (stalling). Every honest peer asked them (the
    attack fired), dropped them, and the round formed one group of every honest peer, none missed: a
    silent one costs SILENT_S (6 s), a stalling one the honest peers' own waits and the patience
    (a round without them takes ~6 s; before they were dropped: ~50 s and three groups)."""
    run = scale_sim.simulate(20, 1, verbose=False, churn=0.0, silent=silent, stalling=stalling, seed=2)
    (r,) = run["rounds"]
    assert r["held"] >= 19  # every honest peer asked one of them at least once
    assert r["peers"] == 20 and r["group_sizes"] == [20] and r["missed"] == 0
    assert r["formation_seconds"]["max"] < bound  # virtual time


@pytest.mark.parametrize("n,stalling,seed", [(20, 1, 0), (20, 1, 2), (50, 1, 2), (20, 2, 0)])
def test_a_stalling_identity_drawing_first_beside_one_claiming_to_be_due_never_splits_the_first_round(
        n, stalling, seed):
    """Round 0: a stalling identity ground to draw first holds every request saying 'wait', and one claiming
    to be due (never ready, not yet overdue: nobody has seen it miss a round) keeps every peer due from
    being ready, so no follower can drop the staller by that rule: each request runs to its timeout, at
    each follower's own moment. Dropped as stalled then, with the fallback leader admitting for as long,
    every honest peer ends in one group (before: 9 + 8 + 3 of 20, 21 + 17 + 10 of 50; or 11 of 20
    with 9 missed)."""
    run = scale_sim.simulate(n, 1, verbose=False, churn=0.0, stalling=stalling, claiming=1, seed=seed)
    (r,) = run["rounds"]
    assert r["held"] >= n - 1  # every honest peer's request was held (the attack fired)
    assert r["group_sizes"] == [n] and r["missed"] == 0 and not r["split"], r["group_sizes"]
    assert r["formation_seconds"]["max"] < 150  # virtual time: the requests' timeouts and the fallback grace


def test_an_identity_claiming_to_be_due_and_slow_holds_up_fewer_and_fewer_rounds():
    """One identity claims in every round to be one step short of the sync at 0.001 steps/s and never
    gets ready. A round that waits for it waits to the matchmaking timeout (the fault: the honest
    peers' formation takes ~30 s longer); each such round doubles the rounds that do not wait for it:
    rounds 0, 2 and 5 of 6 wait, the others take an honest round's time. One group of every honest
    peer in every round."""
    run = scale_sim.simulate(12, 6, verbose=False, churn=0.0, claiming=1, seed=2)
    slow = [r["round"] for r in run["rounds"] if r["formation_seconds"]["median"] > 25]
    assert slow == [0, 2, 5], [(r["round"], r["formation_seconds"]) for r in run["rounds"]]
    for r in run["rounds"]:
        assert r["peers"] == 12 and r["group_sizes"] == [12] and r["missed"] == 0, r
        if r["round"] not in slow:
            assert r["formation_seconds"]["median"] < 10, r


@pytest.mark.parametrize("silent,stalling,churn,seed", [(1, 0, 0.05, 0), (1, 0, 0.05, 1), (0, 1, 0.0, 2)])
def test_a_leader_waiting_for_an_identity_its_followers_skip_as_overdue_is_no_stall_and_the_round_never_splits(
        silent, stalling, churn, seed):
    """A silent (or stalling) identity and one claiming to be due every round, among 100 peers (5% leaving
    each round, or none). The peers that waited for the claiming one in round 0 skip it in round 1; a peer
    that did not (its record said it was no longer due when that peer last read it) waits for it as round
    1's leader, up to the matchmaking timeout. Its followers give it that long rather than dropping it as
    stalled after their own wait and the patience: dropped, they led groups of their own, and two groups
    synced round 1 (53 + 31 peers with the silent one, the formation ~350 s, until the leader's group
    record expired; 67 + 27 with the stalling one)."""
    run = scale_sim.simulate(100, 2, verbose=False, churn=churn, silent=silent, stalling=stalling, claiming=1,
                             seed=seed)
    r = run["rounds"][1]
    assert r["left"] == round(churn * 100) and r["held"] >= 1  # the faults fired: peers left, requests were held
    assert not r["split"] and len(r["group_sizes"]) == 1, r["group_sizes"]
    assert r["in_main_group"] + r["missed"] == r["peers"] - r["left"]
    assert r["in_main_group"] >= 0.8 * (r["peers"] - r["left"]), r
    assert r["formation_seconds"]["median"] < 60, r["formation_seconds"]
