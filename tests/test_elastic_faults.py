"""Crashes and stragglers through the real CLI.

* a peer is SIGKILLed in the middle of an all-reduce (placed precisely with fault injection):
  the survivors finish or abandon that round within the timeout, apply the same result (or none),
  keep training in a smaller group and end identical; the fault fired exactly once;
* a straggler (SIGSTOP on its whole process group, later SIGCONT): the group goes on without it;
  when it wakes it notices it is behind, re-syncs, and never sends a contribution for a round that
  is already over;
* a round that fails for every peer: each one's record says so, so no peer waits for a newer state
  that nobody has.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_support import assert_agree, faults_env, join_args, ok_syncs, read_events, stop, wait_for

H = 10


def run_settings(run_id: str, *extra: str):
    return (f"swarm.run_id={run_id}", f"inner.sync_every={H}", "swarm.min_peers_to_start=3", *extra)


@pytest.mark.timeout(240)
def test_sigkill_during_allreduce_survivors_agree_and_go_on(procs, tmp_path):
    addr = procs.bootstrap()
    run = run_settings("crash", "train.max_outer_steps=7")
    kill = faults_env({"phase": "allreduce.part_sent", "action": "kill", "frag": 0, "round": 2})
    a = procs.start(*join_args(addr, tmp_path / "a", *run), name="a")
    b = procs.start(*join_args(addr, tmp_path / "b", *run), name="b")
    k = procs.start(*join_args(addr, tmp_path / "k", *run), name="k", env=kill)
    assert procs.wait(k, 150) == -signal.SIGKILL, procs.err("k")[-3000:]
    for p in (a, b):
        assert procs.wait(p, 150) == 0, procs.err(p.name)[-3000:]

    fired = read_events(tmp_path / "k", "fault")
    assert [(f["phase"], f["action"], f["round"], f["count"]) for f in fired] == [
        ("allreduce.part_sent", "kill", 2, 1)], fired
    assert not read_events(tmp_path / "k", "summary")  # it really died there
    rounds = {n: {r["outer_step"] - 1: r for r in read_events(tmp_path / n, "sync")} for n in "ab"}
    crashed = [rounds[n][2] for n in "ab"]
    # the round with the crash: abandoned by both, or completed by both with one result
    assert crashed[0]["ok"] == crashed[1]["ok"], crashed
    if crashed[0]["ok"]:
        assert crashed[0]["digest"] == crashed[1]["digest"], crashed
    assert all(r["sync_seconds"] < 25 for r in crashed), crashed  # within the (derived, <= 20 s) timeout
    for n in "ab":
        assert [r["ok"] for i, r in sorted(rounds[n].items()) if i < 2] == [True, True]
        assert [r["group_size"] for i, r in sorted(rounds[n].items()) if i < 2] == [3, 3]
        after = [r for i, r in sorted(rounds[n].items()) if i > 2]
        assert after and all(r["ok"] and r["group_size"] == 2 for r in after), after  # training went on
    assert_agree([tmp_path / "a", tmp_path / "b"], min_common=6)
    summaries = [read_events(tmp_path / n, "summary")[0] for n in "ab"]
    assert summaries[0]["digest"] == summaries[1]["digest"] and summaries[0]["outer_steps"] == 7


@pytest.mark.timeout(240)
def test_straggler_is_left_behind_then_resyncs_without_stale_contributions(procs, tmp_path):
    addr = procs.bootstrap()
    run = run_settings("straggle", "train.max_outer_steps=1000")
    a = procs.start(*join_args(addr, tmp_path / "a", *run), name="a")
    b = procs.start(*join_args(addr, tmp_path / "b", *run), name="b")
    s = procs.start(*join_args(addr, tmp_path / "s", *run), name="s")
    wait_for(lambda: len(ok_syncs(tmp_path / "s")) >= 2, 150, "the straggler's first syncs", procs, ["s", "a"])

    os.killpg(s.pid, signal.SIGSTOP)  # the whole machine freezes: trainer, DHT and p2p daemon
    t_stop = time.time()
    try:
        wait_for(lambda: len([r for r in ok_syncs(tmp_path / "a") if r["time"] > t_stop + 1]) >= 3, 90,
                 "the others' syncs without the straggler", procs, ["a", "b"])
    finally:
        t_cont = time.time()
        os.killpg(s.pid, signal.SIGCONT)
    # the group went on without it: rounds completed, none of them with the straggler in it (a round
    # one of the two missed while the frozen peer's DHT node slowed their lookups is caught up later)
    while_stopped = [r for r in ok_syncs(tmp_path / "a") if t_stop + 1 < r["time"] < t_cont]
    assert len(while_stopped) >= 3 and all(r["group_size"] <= 2 for r in while_stopped), while_stopped

    def back_in():  # begun after waking: a sync the freeze caught mid-way can end after it, with the group's result
        return [r for r in ok_syncs(tmp_path / "s") if r["time"] - r["sync_seconds"] > t_cont and r["group_size"] == 3]

    wait_for(back_in, 90, "the straggler to sync with the group again", procs, ["s"])
    for p in (s, a, b):
        assert stop(procs, p) == 0, procs.err(p.name)[-3000:]

    first_back = back_in()[0]
    caught = [r for r in read_events(tmp_path / "s", "catch_up") if t_cont < r["time"] <= first_back["time"]]
    assert caught, "the straggler never re-synced after waking"
    # it adopted the swarm's state: the state the others held after that step
    a_digest = {r["step"]: r["digest"] for r in ok_syncs(tmp_path / "a")}
    assert caught[-1]["digest"] == a_digest[caught[-1]["step"]], (caught, a_digest)
    # between waking and re-syncing it applied nothing and sent no contribution: every sync it *began*
    # after waking and before its catch-up failed without putting a part on the wire
    began_after = [r for r in read_events(tmp_path / "s", "sync")
                   if t_cont < r["time"] - r["sync_seconds"] and r["time"] <= caught[-1]["time"]]
    assert all(not r["ok"] and r["sync_bytes_sent"] < 10_000 for r in began_after), began_after
    assert first_back["step"] > caught[-1]["step"]
    assert_agree([tmp_path / "a", tmp_path / "b", tmp_path / "s"], min_common=3)


@pytest.mark.timeout(180)
def test_a_frozen_peer_does_not_hide_the_live_peers_records():
    """A frozen peer (SIGSTOP of trainer, DHT node and p2p daemon) makes every DHT store that reaches it
    wait for the RPC timeout. The live peers' progress records must still be refreshed within their
    lifetime, or the others stop waiting for live peers (the straggler test's failures)."""
    from p2pdiloco.bench.dht_stall import measure

    r = measure(seconds=16, period=1.0, mode="background")
    # the fault fired: with the peer frozen, a store took the RPC timeout (it is instant otherwise)
    assert r["store_s"]["unfrozen"] < 1.0 and r["store_s"]["first_frozen"] >= 2.5, r
    assert r["reads"] >= 10, r
    assert r["missing_s"] == 0.0 and r["max_age_s"] < r["record_lifetime_s"], r


@pytest.mark.timeout(240)
def test_a_round_failed_by_everyone_is_not_waited_out(procs, tmp_path):
    """Every peer's send fails in round 1 (the fault on all three). A failed round may have completed
    for the others, so a peer looks for their newer state; here nobody has one, and each peer's
    record says its round failed too, so every peer stops looking once it has read the others'
    records (``catch_up_settled``) instead of polling three progress periods, and training goes on
    with one state everywhere."""
    addr = procs.bootstrap()
    run = run_settings("allfail", "train.max_outer_steps=4")
    fail = faults_env({"phase": "allreduce.send", "action": "fail", "frag": 0, "round": 1})
    peers = [procs.start(*join_args(addr, tmp_path / n, *run), name=n, env=fail) for n in "abc"]
    for p in peers:
        assert procs.wait(p, 200) == 0, procs.err(p.name)[-3000:]
    for n in "abc":
        fired = read_events(tmp_path / n, "fault")
        assert [(f["phase"], f["action"], f["round"]) for f in fired] == [("allreduce.send", "fail", 1)], fired
        syncs = read_events(tmp_path / n, "sync")
        failed = [r for r in syncs if not r["ok"]]
        assert [r["outer_step"] for r in failed] == [2], syncs  # round 1, and no other
        settled = read_events(tmp_path / n, "catch_up_settled")
        assert len(settled) == 1 and "failed for every live peer (3)" in settled[0]["reason"], settled
        assert settled[0]["step"] == failed[0]["step"], (settled, failed)  # at the failed round, not later
        assert sum(r["ok"] for r in syncs if r["step"] > failed[0]["step"]) >= 2, syncs  # training went on
    assert_agree([tmp_path / n for n in "abc"], min_common=3)


def test_failed_for_all_needs_every_other_peer_to_say_so_and_a_liar_cannot_hide_a_completed_round():
    """The rule behind ``catch_up_settled``, on records: our round at step 20 failed."""
    from types import SimpleNamespace

    from p2pdiloco.diloco.background import SyncReport
    from p2pdiloco.train.recovery import Recovery

    me = SimpleNamespace(node=SimpleNamespace(peer_id_str="me"))
    failed = [SyncReport(step=20, fragment=0, round=1, ok=False)]
    said = {"synced_step": 10, "failed": 20}
    rule = lambda view: Recovery._failed_for_all(me, view, failed)  # noqa: E731
    assert "failed for every live peer (3)" in rule({"me": {}, "a": said, "b": said})
    assert rule({"me": {}}) is not None  # alone: nobody can hold a newer state
    assert rule({}) is None  # nothing read (not even our own record): no evidence
    assert rule({"a": said, "b": {"synced_step": 10}}) is None  # b has not said (older record or version)
    assert rule({"a": said, "b": {"synced_step": 10, "failed": 10}}) is None  # b's failure is an older round
    # a completed round is visible in an honest record whatever a liar claims
    assert rule({"liar": said, "b": {"synced_step": 20}}) is None
    assert rule({"liar": said, "b": {"synced_step": 20, "failed": 20}}) is None
