"""End to end: a bootstrap peer and three volunteers started through the real CLI on 127.0.0.1.

Asserts: at least 3 outer steps; after every sync every peer logs the same
digest of θ and the outer state; the final global parameters equal a single-process reference
DiLoCo (independent implementation below) within 1e-6; validation loss goes down; ``status``
lists the live peers; a peer with a different configuration is refused naming the field.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import TINY
from p2pdiloco.config import load_config
from p2pdiloco.data import load_corpus
from p2pdiloco.train.inner import inner_setup
from p2pdiloco.metrics import read_metrics
from p2pdiloco.model import build_model

H = 20
OUTER_STEPS = 6
SETTINGS = [f"inner.sync_every={H}", f"train.max_outer_steps={OUTER_STEPS}", "inner.batch_size=4",
            "swarm.run_id=swarmtest", "train.progress_bar=false", "swarm.min_peers_to_start=3"]


def reference_diloco(cfg, shards_in_member_order, outer_steps):
    """Single-process DiLoCo: per-peer AdamW (state kept across rounds), sample-weighted mean of
    θ − θ_m summed in the all-reduce's member order, Nesterov SGD written out as the outer optimizer
    (b ← μ·b + g; θ ← θ − lr·(g + μ·b), one rounding per operation as on every peer; torch's own SGD
    may fuse a multiply-add on this CPU)."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.train.seed)
    global_model = build_model(cfg.model)
    bufs = [torch.zeros_like(p) for p in global_model.parameters()]
    corpus = load_corpus(cfg.data)
    peers = []
    for shard in shards_in_member_order:
        peers.append(inner_setup(cfg, corpus, shard))
    step = 0
    for _ in range(outer_steps):
        for m, opt, stream in peers:
            for k in range(cfg.inner.sync_every):
                lr = cfg.inner.lr * min(1.0, (step + k + 1) / cfg.inner.warmup_steps)
                for g in opt.param_groups:
                    g["lr"] = lr
                x, y = stream.next_batch("cpu")
                _, loss = m(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.inner.grad_clip)
                opt.step()
        step += cfg.inner.sync_every
        w = float(cfg.inner.sync_every * cfg.inner.batch_size)
        with torch.no_grad():
            for gp, *lps in zip(global_model.parameters(), *[m.parameters() for m, _, _ in peers]):
                acc = torch.zeros_like(gp)
                for lp in lps:
                    acc.add_((gp - lp) * w)
                gp.grad = acc / (w * len(lps))
            mu, lr = cfg.outer.momentum, cfg.outer.lr
            for gp, b in zip(global_model.parameters(), bufs):
                b.copy_(b * mu + gp.grad)
                gp.copy_(gp - (gp.grad + b * mu) * lr)
        with torch.no_grad():
            for m, _, _ in peers:
                for gp, lp in zip(global_model.parameters(), m.parameters()):
                    lp.copy_(gp)
    return global_model


# (case, other peers' claim ages in seconds (None: a claim without ``since``), within 15 s?)
CLAIMS = [
    ("no other claim: nobody to start with", [], False),
    ("every claim made seconds ago: peers starting together", [1.0, 3.0], True),
    ("one claim older than the window: a run that was there before us", [1.0, 20.0], False),
    ("a claim without its time counts as old", [1.0, None], False),
]


@pytest.mark.parametrize("case,ages,recent", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_only_recent_claims(case, ages, recent):
    from p2pdiloco.swarm.swarm import Swarm

    swarm = Swarm.__new__(Swarm)  # the rule only reads the claims' times
    swarm._claimed_since = [None if a is None else time.time() - a for a in ages]
    assert swarm.only_recent_claims(15.0) is recent


@pytest.mark.timeout(240)
def test_three_volunteers_match_reference(procs, tmp_path):
    addr = procs.bootstrap()
    peers = []
    for i in range(3):
        peers.append(procs.start("join", "--initial-peers", addr, "--config", TINY, *sum(
            (["--set", s] for s in SETTINGS + [f"data.shard={i}", f"train.run_dir={tmp_path}/p{i}"]), []),
            name=f"p{i}"))

    # while they train: `status` reads the live peers from the DHT, no server involved
    metrics = [tmp_path / f"p{i}" / "metrics.jsonl" for i in range(3)]
    deadline = time.time() + 120
    while time.time() < deadline and not all(m.exists() and '"start"' in m.read_text() for m in metrics):
        time.sleep(0.5)
    seen, attempt, live = {}, 0, {}
    while len(seen) < 3 and any(p.poll() is None for p in peers):
        attempt += 1
        st = procs.start("status", "--initial-peers", addr, "--run-id", "swarmtest", "--json", name=f"status{attempt}")
        assert procs.wait(st, 60) == 0, procs.err(f"status{attempt}")
        live = json.loads(procs.out(f"status{attempt}"))
        seen = {pid: v for pid, v in live.items() if v["samples"] > 0 and v["step"] > 0}
    assert len(seen) == 3, f"status never listed the 3 training peers (last answer: {live})"

    # a peer configured differently is refused, naming the field that differs
    bad = procs.start("join", "--initial-peers", addr, "--config", TINY, "--set", "swarm.run_id=swarmtest",
                      "--set", "inner.sync_every=7", "--set", f"train.run_dir={tmp_path}/bad", name="bad")
    assert procs.wait(bad, 60) == 2
    assert "inner.sync_every" in procs.err("bad") and "Traceback" not in procs.err("bad")

    for p in peers:
        assert procs.wait(p, 180) == 0, procs.err(p.name)[-3000:]
    # peers that start together tell each other from a run in progress: none waited out join_run's
    # deadline for progress records (a period + 5 s) before starting the run afresh
    for i in range(3):
        assert "has no live peer" not in procs.err(f"p{i}"), procs.err(f"p{i}")[-2000:]

    starts, syncs = {}, {}
    for i in range(3):
        recs = read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"))
        starts[i] = [r for r in recs if r["event"] == "start"][0]
        syncs[i] = [r for r in recs if r["event"] == "sync"]
        assert [r["outer_step"] for r in syncs[i]] == list(range(1, OUTER_STEPS + 1))
        assert all(r["ok"] and r["group_size"] == 3 for r in syncs[i]), syncs[i]
    for k in range(OUTER_STEPS):
        digests = {syncs[i][k]["digest"] for i in range(3)}
        assert len(digests) == 1, f"peers disagree after sync {k + 1}: {digests}"
    assert syncs[0][-1]["val_loss"] < starts[0]["val_loss"] - 0.5

    # the swarm's θ (checkpointed after the last sync) equals the single-process reference
    cfg = load_config(TINY, SETTINGS)
    member_order = sorted(range(3), key=lambda i: starts[i]["peer"])
    ref = reference_diloco(cfg, [starts[i]["shard"] for i in member_order], OUTER_STEPS)
    ckpt = torch.load(tmp_path / "p0" / "checkpoint.pt", weights_only=True)
    swarm_params = ckpt["outer"][0]["params"]
    ref_params = [p.detach() for p in ref.parameters()]
    assert len(swarm_params) == len(ref_params)
    worst = max(float((a - b).abs().max()) for a, b in zip(swarm_params, ref_params))
    assert worst < 1e-6, f"swarm differs from the reference DiLoCo by {worst}"
    # and it is not trivially equal to the initialization
    torch.manual_seed(cfg.train.seed)
    init = [p.detach() for p in build_model(cfg.model).parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(swarm_params, init)) > 1e-3


def test_waiting_for_peers_to_start_backs_off_its_reads(monkeypatch):
    """Holding the first step until min_peers_to_start peers are live reads every live peer's record at
    each poll: the polls back off from 0.5 s to 2 s, end as soon as enough peers are live, and never
    sleep past the timeout."""
    from p2pdiloco.swarm import swarm as swarm_mod

    clock = [0.0]
    sleeps = []
    monkeypatch.setattr(swarm_mod.time, "monotonic", lambda: clock[0])

    def sleep(s):
        sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(swarm_mod.time, "sleep", sleep)
    from types import SimpleNamespace

    s = swarm_mod.Swarm.__new__(swarm_mod.Swarm)
    s.node = SimpleNamespace(peer_id_str="me")
    arrivals = {"a": 1.0, "b": 6.0}  # when each other peer's record shows
    reads = []

    def live_peers(why="other"):
        reads.append(clock[0])
        return {p: {} for p, t in arrivals.items() if t <= clock[0]}

    s.live_peers = live_peers
    assert s.wait_for_peers(3, timeout=60) == 3
    assert sleeps == [0.5, 1.0, 2.0, 2.0, 2.0] and reads[-1] == 7.5
    sleeps.clear()
    clock[0] = 0.0
    arrivals = {}
    assert s.wait_for_peers(3, timeout=3.0) == 1  # nobody came: gives up at the timeout, not after it
    assert sleeps == [0.5, 1.0, 1.5] and clock[0] == 3.0
