"""The swarm clock's rules (p2pdiloco/diloco/clock.py), each as a row of a table, and the
one rule DiLoCo applies on top: a fragment with no sample since its last round is not sent."""
from __future__ import annotations

import pytest
import torch

import p2pdiloco
from p2pdiloco.diloco import core as core_module
from p2pdiloco.diloco.clock import SwarmClock
from p2pdiloco.diloco.fragments import Schedule

H, N = 20, 480   # 24 sequences of the swarm per position


# (case, others' samples/s, steps as (samples, seconds since the previous one), expected position)
ADVANCE = [
    ("alone: own samples only", 0.0, [(24, 0.5)], 1.0),
    ("others add their rate over the step's time", 48.0, [(24, 0.5)], 2.0),
    ("several steps add up", 48.0, [(24, 0.5), (24, 0.5), (48, 1.0)], 2.0 + 2.0 + 4.0),
    ("a slow step: others' samples dominate", 96.0, [(8, 2.5)], (8 + 240) / 24),
]


@pytest.mark.parametrize("case,others,steps,want", ADVANCE, ids=[r[0] for r in ADVANCE])
def test_advance(case, others, steps, want):
    clock = SwarmClock(H, N)
    clock.start(100.0)
    now = 100.0
    for samples, dt in steps:
        now += dt
        clock.others_rate = others
        clock.observe(samples, now, compute_seconds=dt)
    assert clock.pos == pytest.approx(want)


# (case, others' (pos, time) records, expected move): our history is one position per second, pos(t) = t
# for t in 0..10; each record is compared with our position at its own time
ALIGN = [
    ("a record equal to ours at its time: no move", [(5.0, 5.0)], 0.0),
    ("an old record is compared at its own time: age is no difference", [(3.0, 3.0), (4.5, 4.5)], 0.0),
    ("two peers meet halfway", [(9.0, 5.0)], 2.0),
    ("offsets either way cancel", [(7.0, 5.0), (3.0, 5.0)], 0.0),
    ("the median offset of the peers and ours", [(8.0, 5.0), (9.0, 5.0)], 3.0),
    ("an outlier does not move the median", [(5.5, 5.0), (1e6, 5.0)], 0.5),
    ("behind: moved back, by the median", [(2.0, 5.0), (1.0, 5.0)], -3.0),
    ("a record older than we remember is ignored", [(100.0, -50.0)], 0.0),
    ("alone: unchanged", [], 0.0),
]


@pytest.mark.parametrize("case,records,move", ALIGN, ids=[r[0] for r in ALIGN])
def test_align(case, records, move):
    clock = SwarmClock(H, N)
    clock.start(0.0)
    for t in range(1, 11):
        clock.observe(24, float(t), compute_seconds=1.0)
    assert clock.pos == pytest.approx(10.0)
    records = [(f"peer{i}", p, t) for i, (p, t) in enumerate(records)]
    assert clock.align(records, now=10.0) == pytest.approx(move)
    assert clock.pos == pytest.approx(10.0 + move)
    assert clock.align(records, now=10.0) == 0.0  # a record counts once


def test_a_sync_everyone_waited_in_does_not_advance_the_clock():
    """Blocking sync: 5 s blocked between two steps, the others (rate 48/s) blocked as well. Only the
    compute seconds count, for us and for them."""
    clock = SwarmClock(H, N)
    clock.start(0.0)
    clock.others_rate = 48.0
    clock.observe(24, 0.5, compute_seconds=0.5)           # (24 + 24) / 24
    clock.observe(24, 6.0, compute_seconds=0.5)           # 5 s of it blocked in a sync
    assert clock.pos == pytest.approx(4.0)
    assert clock.rate() == pytest.approx(48.0)            # samples per second of computing


# (case, P, positions run, clock position, lookahead in positions, expected target)
TARGET = [
    ("mid-round: where the clock is", 1, 12, 18.2, 1.0, 18),
    ("the next step would pass the send point: send now", 1, 18, 19.1, 1.0, 20),
    ("a slow peer sends a long step early", 1, 12, 15.0, 6.0, 20),
    ("never two rounds of one fragment early (lookahead capped below H)", 1, 12, 15.0, 30.0, 20),
    ("sent early, clock behind: no going back", 1, 20, 16.0, 1.0, 20),
    ("a clock that jumped runs every position passed", 1, 3, 25.5, 1.0, 25),
    ("two fragments in one long step, both early", 2, 12, 15.0, 16.0, 30),
]


@pytest.mark.parametrize("case,P,processed,pos,look,want", TARGET, ids=[r[0] for r in TARGET])
def test_target(case, P, processed, pos, look, want):
    clock = SwarmClock(H, N)
    clock.pos = pos
    clock.step_seconds = 1.0
    clock.others_rate = look * clock.unit  # speed x one-second steps = the lookahead
    assert clock.target(processed, Schedule(H, P).next_send) == want


def test_a_fragment_without_samples_is_not_sent():
    """One inner step worth two rounds of the swarm's samples: the first send point carries our samples,
    the second has none of ours: we are no member of that round (a missed round, so the loop catches up)."""
    cfg = p2pdiloco.load_config(None, ["scheme=diloco"])  # one fragment, blocking
    cfg.inner.sync_every, cfg.inner.round_samples = 4, 40
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    diloco = p2pdiloco.DiLoCo(model, cfg)
    diloco.start_clock()
    reports = diloco.after_inner_step(10)    # 1 round of 4 positions... of 10 each: position 1
    assert reports == [] and diloco.position == 1
    reports = diloco.after_inner_step(75)    # 8.5 positions: to 9, passing 4 (ours) and 8 (nothing of ours)
    assert [(r.step, r.ok, r.missed) for r in reports] == [(4, True, False), (8, False, True)]
    assert "not a member" in reports[1].error
    assert reports[0].samples == 85 and diloco.local_steps == 2 and diloco.lr_step == 2


def test_settle_moves_the_clock_and_what_it_remembers():
    """A blocking sync of point 20 ended: the clock reads 20 whether it was behind (sent early) or ahead,
    and a record made before the sync compares with the settled history (no second pull)."""
    for before in (16.0, 21.5):
        clock = SwarmClock(H, N)
        clock.start(0.0)
        clock.observe(int(before * clock.unit), 1.0, compute_seconds=1.0)
        clock.settle(20)
        assert clock.pos == 20.0
        assert clock.align([("peer", 20.0, 1.0)], now=2.0) == pytest.approx(0.0)


@pytest.mark.parametrize("steps,at,settled", [
    # steps of one position each; the seventh one's lookahead reaches point 8: sent early at 7
    ([10] * 7, 8, 8.0),
    # a step carries the clock to 8.5: sent at 8 (its samples are the round's), then reads 8
    ([10] * 6 + [25], 8, 8.0),
    # a step carries the clock past position 9: the sync of 8 on the way, the clock stays at 9.5
    ([10] * 6 + [35], 9, 9.5),
], ids=["sent early: the clock reads the send point after the sync",
        "a step that ended past the point: the clock reads the point",
        "a step that carried the clock a whole position past the point: no going back"])
def test_a_blocking_sync_sets_the_clock(monkeypatch, steps, at, settled):
    cfg = p2pdiloco.load_config(None, ["scheme=diloco"])  # one fragment, blocking
    cfg.inner.sync_every, cfg.inner.round_samples = 8, 80     # 10 samples per position
    torch.manual_seed(0)
    diloco = p2pdiloco.DiLoCo(torch.nn.Linear(4, 2), cfg)
    now = [100.0]
    monkeypatch.setattr(core_module.time, "time", lambda: now[0])
    diloco.start_clock()
    reports = []
    for samples in steps:
        now[0] += 1.0                                       # every step one second of computing
        reports += diloco.after_inner_step(samples)
    assert [(r.step, r.ok) for r in reports] == [(8, True)]
    assert diloco.position == at
    assert diloco.clock.pos == pytest.approx(settled)


# (case, weights, round_samples, dropped): the owner (index 0) screens weights (compression/robust.py)
WEIGHTS = [
    ("rounds of H steps: 100x the median is absurd", [8.0, 8.0, 800.0], 0, {2}),
    ("rounds by samples: a fast peer's honest share passes", [8.0, 8.0, 800.0], 640, set()),
    ("rounds by samples: more than twice the budget is absurd", [8.0, 8.0, 5000.0], 640, {2}),
]


@pytest.mark.parametrize("case,weights,budget,dropped", WEIGHTS, ids=[r[0] for r in WEIGHTS])
def test_weight_screen_with_a_budget(case, weights, budget, dropped):
    from p2pdiloco.compression.robust import RobustConfig, screen

    got = screen(weights, [1.0] * len(weights), 0, RobustConfig(), numel=10_000, round_samples=budget)
    assert set(got) == dropped, got
