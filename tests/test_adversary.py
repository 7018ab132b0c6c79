"""Fake identities (Sybils): a table of attacks on the rules that pick a state, a
fingerprint or "who is ahead", run against real nodes.

Every peer here is a real SwarmNode on 127.0.0.1 (its own DHT process and libp2p daemon); records are
signed and schema-checked as in a run; honest peers decide with the production code (``Swarm``, its
matchmaker's voters, ``state_sync``), joiners download with ``download_state`` from real state servers.
An attacker is k identities (k nodes) that publish well-formed, signed progress records claiming what
the row says, and optionally serve a state of their own. Each row asserts what the honest peers keep:

* an honest peer with a history (its partners: the other honest peers) is not "behind", finds no
  rival history to give way to and is not in the minority: it keeps training and syncing;
* a joiner (no history) downloads exactly the honest peers' state: it adopts nothing from the attackers;
* every honest record is still in the view (nothing of theirs disappears);
* the attack fired: the attackers' records are in the same view, signed and schema-valid.

The end-to-end version (three volunteers training through the CLI while Sybils attack) is
``test_sybils_attack_a_training_swarm`` below.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
import torch

from conftest import loopback_nodes
from p2pdiloco.errors import FingerprintMismatch
from p2pdiloco.swarm.standing import in_minority, pick_target, rival_lineage
from p2pdiloco.swarm.state_sync import StateServer, download_state, state_digest
from p2pdiloco.swarm.swarm import Swarm

NUMELS = [3000, 2000]
H = 10
STEP = 40  # the honest peers' synced step; their next sync is at STEP + H
_runs = itertools.count()


def make_state(step: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    payload = torch.randn(2 * sum(NUMELS), generator=g).numpy().tobytes()
    outer = [step // H, step // H]
    return {"step": step, "outer_steps": outer, "numels": NUMELS,
            "digest": state_digest(payload, NUMELS, outer)}, payload


@pytest.fixture(scope="module")
def nodes():
    with loopback_nodes(10) as ns:  # a plain DHT node, 3 honest, 1 joiner, 5 attackers
        yield ns


@dataclass
class Attack:
    name: str
    honest: int  # honest peers with a history (they synced together)
    sybils: int  # fake identities
    claim: str  # "far": synced_step 2**62 - H (the schema's limit); "next": the honest peers' next sync; "same": our step, another digest
    history: bool  # the fake identities also claim a group of their own (a made-up gid)
    serves: str  # what they answer a state request with: "nothing" (no handler) or "junk" (bytes of their claim)


ATTACKS = [
    Attack("2 sybils claim a far-future step", 3, 2, "far", False, "nothing"),
    Attack("5 sybils claim a far-future step, outnumbering 3 honest", 3, 5, "far", False, "junk"),
    Attack("2 sybils claim the plausible next step", 3, 2, "next", False, "junk"),
    Attack("5 sybils claim the next step against 2 honest", 2, 5, "next", False, "nothing"),
    Attack("5 sybils with a faked history claim a far-future step against 2 honest", 2, 5, "far", True, "junk"),
    Attack("5 sybils with a faked history claim our step with another digest", 2, 5, "same", True, "junk"),
    Attack("2 sybils with a faked history claim the next step against 3 honest", 3, 2, "next", True, "nothing"),
]


def _claim(attack: Attack) -> int:
    return {"far": 2 ** 62 - H, "next": STEP + H, "same": STEP}[attack.claim]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_fake_identities_take_nothing_over(nodes, attack):
    run = f"adv{next(_runs)}"
    honest_nodes, joiner_node = nodes[1:1 + attack.honest], nodes[4]
    sybil_nodes = nodes[5:5 + attack.sybils]
    meta, payload = make_state(STEP, seed=1)
    honest: List[Swarm] = []
    for n in honest_nodes:
        s = Swarm(n, run, matchmaking_timeout=2, allreduce_timeout=5)
        StateServer(n, run, lambda: (meta, payload))
        s.update_progress(step=STEP + 3, synced_step=STEP, digest=meta["digest"], round=STEP // H,
                          next_sync=STEP + H, gid="g-honest")
        s.publish_progress(wait=True)
        honest.append(s)
    for s in honest:  # they synced together: each other's partners
        s.matchmaker.set_companions([x.peer_id for x in honest])

    # the attack: well-formed, signed records of k identities; a state server when the row says so
    fake_step = _claim(attack)
    fake_digest = "f" * 16 + "-" + "e" * 16
    served: List[int] = []
    for i, n in enumerate(sybil_nodes):
        if attack.serves == "junk":
            junk = ({"step": fake_step, "outer_steps": [0, 0], "numels": NUMELS, "digest": fake_digest},
                    bytes(8 * sum(NUMELS)))
            StateServer(n, run, lambda junk=junk: served.append(1) or junk)
        record = {"step": fake_step + 1, "synced_step": fake_step, "digest": fake_digest, "round": fake_step // H,
                  "next_sync": fake_step + H}
        if attack.history:
            record["gid"] = "g-sybil"
        assert n.store(f"{run}:progress", record, ttl=120, subkey=n.peer_id_str)

    view = honest[0].live_peers()
    sybil_ids = {n.peer_id_str for n in sybil_nodes}
    honest_ids = {s.peer_id for s in honest}
    # the attack fired: every fake record is there, signed and schema-valid, beside every honest one
    assert sybil_ids <= set(view) and all(view[p]["synced_step"] == fake_step for p in sybil_ids), view
    assert honest_ids <= set(view)

    # an honest peer with a history: not behind, no rival history, not the minority digest
    for s in honest:
        peers = s.live_peers()
        me = s.peer_id
        assert honest_ids - {me} <= set(peers) and sybil_ids <= set(peers)
        trusted = s.matchmaker.voters(peers)
        assert trusted == honest_ids - {me}, "fake identities have no say for a peer with partners"
        assert pick_target(peers, me, STEP + H - 1, len(NUMELS), companions=s.matchmaker.companions,
                           trusted=trusted) is None, "an honest peer was made to think it is behind"
        assert rival_lineage(peers, me, {"g-honest"}, STEP, meta["digest"], s.matchmaker.companions,
                             trusted=trusted) is None
        assert not in_minority(peers, me, STEP, meta["digest"], trusted=trusted)

    # a joiner with no history of its own: it downloads the honest peers' state, nothing else
    joiner = Swarm(joiner_node, run, matchmaking_timeout=2, allreduce_timeout=5)
    got = download_state(joiner_node, run, joiner.live_peers, NUMELS, timeout=5, hedge_after=2,
                         partners=joiner.matchmaker.partners.current())
    assert got is not None and got.step == STEP and got.digest == meta["digest"] and got.payload == payload
    assert set(got.donors) <= honest_ids
    if attack.history and attack.sybils >= attack.honest:
        # they outnumber the honest established peers: their claim was tried first and their junk refused
        assert served and {d for d, _ in got.rejected} <= sybil_ids, got.rejected
        assert got.targets >= 2
    else:
        assert not got.rejected and not served, (got.rejected, served)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sybils", ["without-records", "with-progress", "with-faked-history"])
def test_fake_identities_claiming_another_fingerprint_lock_out_nobody(nodes, sybils):
    """Five identities claim another run fingerprint (and publish progress records without a history,
    or with a made-up one): two honest peers that trained claim the real one. A joiner with the real
    configuration is accepted; one with a different configuration is still refused with the clear
    message (the rule counts trained peers first, it does not stop checking)."""
    run = f"adv{next(_runs)}"
    fields = {"inner.sync_every": 10, "protocol.version": 1}
    honest = []
    for n in nodes[1:3]:
        s = Swarm(n, run, matchmaking_timeout=2, allreduce_timeout=5)
        s.check_fingerprint("real", fields)
        s.update_progress(step=43, synced_step=STEP, digest="0" * 16, gid="g-honest")
        s.publish_progress(wait=True)
        honest.append(s)
    other = dict(fields, **{"inner.sync_every": 99})
    for n in nodes[5:10]:
        assert n.store(f"{run}:fingerprint", {"fp": "fake", "fields": other, "since": time.time()}, ttl=120,
                       subkey=n.peer_id_str)
        if sybils != "without-records":
            record = {"step": 2 ** 40, "synced_step": 2 ** 40, "digest": "f" * 16}
            if sybils == "with-faked-history":
                record["gid"] = "g-sybil"
            assert n.store(f"{run}:progress", record, ttl=120, subkey=n.peer_id_str)
    claims = nodes[4].get_subkeys(f"{run}:fingerprint")
    assert sum(v.get("fp") == "fake" for v in claims.values()) == 5  # the attack is visible to the joiner
    Swarm(nodes[4], run, matchmaking_timeout=2, allreduce_timeout=5).check_fingerprint("real", fields)
    # (with a faked history the Sybils are the majority of "trained" claims, so the message names theirs)
    run_has = "99" if sybils == "with-faked-history" else "10"
    with pytest.raises(FingerprintMismatch, match=rf"inner.sync_every: run has {run_has}, you have 7"):
        Swarm(nodes[3], run, matchmaking_timeout=2, allreduce_timeout=5).check_fingerprint(
            "mine", dict(fields, **{"inner.sync_every": 7}))


@pytest.mark.timeout(120)
def test_a_failure_reason_with_record_syntax_leaves_the_members_records_readable(nodes):
    """A malicious shard owner aborts a round with a reason that carries record syntax
    (``[signature:...]``, ``[owner:...]``). Every member writes the reason into its own record (the
    dashboard's history of failed rounds): the record must stay valid, and readable by everyone."""
    from p2pdiloco.swarm.keys import history_key

    run = f"adv{next(_runs)}"
    members = [Swarm(n, run, matchmaking_timeout=2, allreduce_timeout=5) for n in nodes[1:4]]
    evil = "owner aborted: [signature:AAAA] [owner:ssh-ed25519 AAAA] " + "x" * 40
    for s in members:
        s.update_progress(step=STEP, synced_step=STEP, digest="0" * 16, gid="g")
        s.note_failure(4, 0, evil)
        s.publish_progress(wait=True)
        assert s.publish_history()
    deadline = time.time() + 10
    while len(view := nodes[4].get_subkeys(history_key(run))) < len(members) and time.time() < deadline:
        time.sleep(0.2)
    assert {s.peer_id for s in members} <= set(view), "a member's own record was made unstorable or unreadable"
    for s in members:
        (reason,) = view[s.peer_id]["fw"]
        assert reason.startswith("owner aborted") and "[signature:" not in reason and "[owner:" not in reason


@pytest.mark.timeout(240)
@pytest.mark.parametrize("liars", [1, 2])
def test_identities_ground_to_lead_the_round_that_hold_join_requests_cost_seconds_not_a_split(nodes, liars):
    """Leadership goes by a per-round draw of the round's key and the id, and anyone can try keys until
    one draws first in a round it knows in advance: here the identities of the pool that draw first in
    the round are the attackers'. Their progress records are copies of an honest one (due
    at the same sync, the same speed), they store a ready record for the round, and their join handler
    takes every request and answers nothing. Three honest peers form the round's group: one group of
    the three, the same on each, in far less than one request timeout (matchmaking_timeout + 13 s per
    attacker, which each honest peer waited before a silent holder was dropped, each at its own
    moment: the round then split)."""
    from p2pdiloco.swarm.formation import draw
    from p2pdiloco.swarm.joining import SILENT_S
    from p2pdiloco.swarm.keys import handler_name, progress_key, ready_key

    run = f"adv{next(_runs)}"
    pool = sorted(nodes[1:], key=lambda n: draw(ready_key(run, 0, 5), n.peer_id_str))
    liar_nodes, honest_nodes = pool[:liars], pool[liars:liars + 3]
    held: List[str] = []

    async def hold(info, reader, writer):  # take the request; answer nothing until the joiner hangs up
        held.append(info.peer_id.to_base58())
        while await reader.read(1 << 16):
            pass

    for n in liar_nodes:
        n.add_handler(handler_name(run, "join"), hold)
    swarms = []
    for n in honest_nodes:
        s = Swarm(n, run, matchmaking_timeout=30, allreduce_timeout=5)
        s.matchmaker.record_lifetime = 120.0  # nobody re-publishes in this test
        s.update_progress(step=STEP + H - 1, synced_step=STEP, digest="0" * 16, round=STEP // H,
                          next_sync=STEP + H, sps=1.0)
        s.publish_progress(wait=True)
        swarms.append(s)
    honest_ids = tuple(sorted(n.peer_id_str for n in honest_nodes))
    (template,) = [v for p, v in honest_nodes[0].get_subkeys(progress_key(run)).items() if p == honest_ids[0]]
    for n in liar_nodes:
        assert n.store(progress_key(run), dict(template, t=time.time()), ttl=120, subkey=n.peer_id_str)
        assert n.store(ready_key(run, 0, 5), {"t": time.time(), "reach": "public"}, ttl=120, subkey=n.peer_id_str)
    view = swarms[0].live_peers()
    assert set(view) == {n.peer_id_str for n in liar_nodes} | set(honest_ids), view
    # an attacker is every honest peer's presumable leader
    assert min(view, key=lambda p: draw(ready_key(run, 0, 5), p)) == liar_nodes[0].peer_id_str

    t0 = time.monotonic()
    futs = [n.submit(s.matchmaker.form_group(0, 5, len(view), sync_step=STEP + H))
            for n, s in zip(honest_nodes, swarms)]
    groups = [f.result(150) for f in futs]
    took = time.monotonic() - t0
    assert set(held) == set(honest_ids)  # the attack fired: every honest peer's request was taken
    assert all(g.members == honest_ids for g in groups) and len({g.gid for g in groups}) == 1, groups
    print(f"\n{liars} attacker(s): the honest group formed in {took:.1f} s")
    assert took < liars * SILENT_S + 20, took


# ---- end to end: a training swarm under attack -----------------------------------------------------
@pytest.mark.timeout(420)
def test_sybils_attack_a_training_swarm(procs, tmp_path):
    """Three volunteers train through the CLI. Five fake identities (a separate process) then claim a
    far-future step with a made-up digest and a made-up shared history, claim another run fingerprint
    and hold silent streams open on every honest handler, all the time. The honest peers keep syncing
    together (every sync after the attack ok, one digest per sync, no download from anyone), a
    volunteer who joins during the attack is accepted and downloads the honest state, and every honest
    record stays in the DHT."""
    from elastic_support import assert_agree, join_args, ok_syncs, read_events, stop, wait_for

    addr = procs.bootstrap()
    run = ("swarm.run_id=sybil", f"inner.sync_every={H}", "train.max_outer_steps=1000")
    names = ["a", "b", "c"]
    peers = {n: procs.start(*join_args(addr, tmp_path / n, *run, "swarm.min_peers_to_start=3"), name=n)
             for n in names}
    wait_for(lambda: all(len(ok_syncs(tmp_path / n)) >= 2 for n in names), 150, "the first syncs", procs, names)
    ids = {n: read_events(tmp_path / n, "start")[0]["peer"] for n in names}

    report_path = tmp_path / "attack.json"
    procs.start_argv([sys.executable, str(Path(__file__).parent / "adversary_support.py"), addr, "sybil", "5",
                      str(report_path)], name="attacker")

    def report():
        try:
            return json.loads(report_path.read_text())
        except (OSError, ValueError):
            return {}

    # the attack fired: the fake records are in the DHT, read back, and silent streams were opened
    wait_for(lambda: report().get("own_seen", 0) == 5 and report().get("streams", 0) >= 20, 120,
             "the attack to start", procs, ["attacker"])
    t_attack = time.time()
    j = procs.start(*join_args(addr, tmp_path / "j", *run), name="j")

    def after(n):
        return [r for r in read_events(tmp_path / n, "sync") if r["time"] > t_attack]

    # the honest peers sync on while the attack goes on: six of its rounds (30 fake records stored)
    wait_for(lambda: all(len(after(n)) >= 4 for n in names) and len(ok_syncs(tmp_path / "j")) >= 2
             and report()["stores"] >= 30, 150, "syncs during the attack", procs, names + ["j", "attacker"])
    # no honest record disappeared: the attacker itself reads all four honest peers' records
    j_id = read_events(tmp_path / "j", "start")[0]["peer"]
    wait_for(lambda: set(ids.values()) | {j_id} <= set(report()["honest_seen"]), 30, "the honest records")
    for n in names + ["j"]:
        assert stop(procs, peers.get(n, j)) == 0, procs.err(n)[-3000:]

    for n in names:
        syncs = after(n)
        assert all(r["ok"] for r in syncs), [(r["step"], r.get("error")) for r in syncs if not r["ok"]]
        assert not [r for r in read_events(tmp_path / n, "catch_up") if r["time"] > t_attack]
    # the joiner was accepted (fingerprint) and downloaded the honest state from honest donors
    (catch,) = [r for r in read_events(tmp_path / "j", "catch_up")][:1]
    assert set(catch["donors"]) <= set(ids.values()), catch
    assert_agree([tmp_path / n for n in names + ["j"]], min_common=2)
