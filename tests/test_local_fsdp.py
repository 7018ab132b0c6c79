"""Local workers that shard the replica (``local.sharding = "fsdp"``, torch FSDP2).

Through the real CLI on CPU with gloo, bootstrap included, fp32 and blocking DiLoCo pinned (``PINNED``
of test_local_workers.py):

* default: a 2-worker fsdp peer and a 1-worker peer train QUICK rounds to their budget. Each fsdp
  worker holds about half of the model's parameter elements (what it logs). Every sync is a group
  of 2 with equal digests on both peers; both workers log the same ``local_sync`` events (the
  swarm's digest after every sync) and each logs the digest of its own shard of the model, which
  equals the reference's new global parameters cut as FSDP cuts them (dimension 0 in two chunks).
  The reference: single-process DiLoCo in which the fsdp peer is one replica taking the summed
  batch, its gradient clipped by the norm taken as the shards take it (:func:`_reference`'s
  ``sharded``); the digests after every round are its bits, the final global parameters and the
  machine's checkpointed inner optimiser state (gathered from the two shards) within 1e-6.
* slow: the streaming scheme (2 fragments, tau/alpha overlap, 4-bit) with fsdp; and ``delay`` mode.
* a bad ``local.sharding`` value, and fsdp with the swarm clock, are one ``error:`` line.
"""
from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import TINY, cli_argv
from local_support import BRIEF_INFO, run_two_ranks
from p2pdiloco.checkpoint import find_checkpoint, load_checkpoint
from p2pdiloco.config import load_config
from p2pdiloco.digest import tensors_digest as digest_of
from p2pdiloco.local.fsdp import shard_of
from p2pdiloco.metrics import read_metrics
from test_local_workers import (H, PINNED, QUICK, STREAMING, _first_rounds_together, _join, _reference,
                                _syncs, _worker_pids)

FSDP = ["local.sharding=fsdp"]


@pytest.mark.timeout(240)
def test_fsdp_peer_in_a_swarm_matches_the_reference(procs, tmp_path):
    addr = procs.bootstrap()
    settings = [*FSDP, f"train.max_outer_steps={QUICK}", "swarm.min_peers_to_start=2", "swarm.run_id=lw-fsdp"]
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    _worker_pids(procs, "a", 2)
    assert procs.wait(a, 180) == 0, procs.err("a")[-3000:]
    assert procs.wait(b, 180) == 0, procs.err("b")[-3000:]
    assert "Traceback" not in procs.err("a")

    ra, rb = read_metrics(str(tmp_path / "a" / "metrics.jsonl")), read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
    w1 = read_metrics(str(tmp_path / "a" / "worker1.jsonl"))
    # each worker holds a shard: about half of the model's parameter elements (the tiny model's matrices
    # have an even number of rows: exactly half)
    (mine,) = [r for r in ra if r["event"] == "local_shard"]
    (start1,) = [r for r in w1 if r["event"] == "start"]
    total = mine["params"]
    assert mine["sharding"] == start1["sharding"] == "fsdp"
    assert mine["param_numel"] + start1["param_numel"] == total
    assert 0.45 * total <= mine["param_numel"] <= 0.55 * total and 0.45 * total <= start1["param_numel"] <= 0.55 * total

    by = _first_rounds_together(ra, rb)

    # both workers log the same global state; each its own shard of the model
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "final")
    ev0, ev1 = ([r for r in rs if r["event"] == "local_sync"] for rs in (ra, w1))
    assert [{k: e[k] for k in keys} for e in ev0] == [{k: e[k] for k in keys} for e in ev1]
    assert len(ev0) == QUICK + 2 and ev0[-1]["final"]  # the start, every sync, the end

    cfg = load_config(TINY, [*PINNED, *settings])
    ids = [[r for r in rs if r["event"] == "start"][0]["peer"] for rs in (ra, rb)]
    states: list = []
    want, digests = _reference(cfg, ids, rounds=QUICK, sharded=True, states=states)
    assert digests == [by[k]["a"]["digest"] for k in range(1, QUICK + 1)]  # bitwise the reference's state
    for k in range(1, QUICK + 1):
        params = states[k - 1][0]
        (e0,) = [e for e in ev0 if e["outer_steps"] == [k] and not e["final"]]
        (e1,) = [e for e in ev1 if e["outer_steps"] == [k] and not e["final"]]
        assert e0["digest"] == by[k]["a"]["digest"] and e0["step"] == by[k]["a"]["step"] == k * H, k
        # blocking fp32 (alpha 0): after the sync every worker's model shard is its piece of the new θ
        assert e0["model_digest"] == digest_of([shard_of(p, 0, 2) for p in params]), k
        assert e1["model_digest"] == digest_of([shard_of(p, 1, 2) for p in params]), k
        assert e0["model_digest"] != e1["model_digest"]
    state = load_checkpoint(find_checkpoint(str(tmp_path / "a")))
    got = torch.cat([t.reshape(-1) for t in state["outer"][0]["params"]])
    err = float((got - want).abs().max())
    print(f"\nfsdp peer: max |swarm - summed-batch reference| = {err:.3g}")
    assert err <= 1e-6
    # one checkpoint per machine, the inner optimiser state whole (gathered from both shards)
    assert state["local_workers"] == 2
    ref_opt = states[-1][1]
    assert sorted(state["inner_opt"]["state"]) == sorted(ref_opt)
    for i, st in ref_opt.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert state["inner_opt"]["state"][i][k].shape == st[k].shape
            assert float((state["inner_opt"]["state"][i][k] - st[k]).abs().max()) <= 1e-6, (i, k)
        assert float(state["inner_opt"]["state"][i]["step"]) == float(st["step"]) == QUICK * H


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["tau", "delay"])
def test_fsdp_peer_with_streaming_fragments(procs, tmp_path, mode):
    """2 fragments, 4-bit, overlap (``tau`` with tau 2 and alpha 0.5, or ``delay``): a 2-worker fsdp peer and
    a 1-worker peer; equal digests on both peers for every sync, both workers log every global state the
    swarm reached, and the fsdp peer's final checkpoint resumes alone with one worker."""
    addr = procs.bootstrap()
    overlap = STREAMING if mode == "tau" else [s for s in STREAMING if "tau" not in s and "alpha" not in s] + \
        ["streaming.mode=delay"]
    settings = [*FSDP, *overlap, "train.max_outer_steps=3", "swarm.min_peers_to_start=2",
                f"swarm.run_id=lw-fsdp-{mode}"]
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    assert procs.wait(a, 200) == 0, procs.err("a")[-3000:]
    assert procs.wait(b, 200) == 0, procs.err("b")[-3000:]
    ra, rb, w1 = (read_metrics(str(tmp_path / p)) for p in ("a/metrics.jsonl", "b/metrics.jsonl", "a/worker1.jsonl"))
    theirs = {(r["fragment"], r["outer_step"]): r["digest"] for r in rb if r["event"] == "sync" and r["ok"]}
    ours = [r for r in ra if r["event"] == "sync" and r["ok"]]
    assert len(ours) >= 4 and all(theirs[(r["fragment"], r["outer_step"])] == r["digest"] for r in ours)
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "final")
    ev0, ev1 = ([{k: r[k] for k in keys} for r in rs if r["event"] == "local_sync"] for rs in (ra, w1))
    assert ev0 == ev1 and ev1[-1]["final"]
    received = {(int(p), d) for e in ev1 for p, d in e["fragments"].items()}
    assert all((r["fragment"], r["digest"]) in received for r in ours)
    summary = [r for r in ra if r["event"] == "summary"][-1]
    r = _join(procs, None, "a1", tmp_path / "a", *overlap, "train.max_outer_steps=4", f"swarm.run_id=lw-fsdp-{mode}",
              "data.shard=0")
    assert procs.wait(r, 120) == 0, procs.err("a1")[-3000:]
    resumed = [x for x in read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if x["event"] == "resume"][-1]
    assert resumed["digest"] == summary["digest"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("settings, needle", [
    (["local.sharding=zero3"], "local.sharding ('zero3') must be replicate or fsdp"),
    (["local.sharding=fsdp", "inner.round_samples=64"], "local.sharding=fsdp does not work with inner.round_samples"),
])
def test_bad_sharding_is_one_clear_line(tmp_path, settings, needle):
    res = subprocess.run(cli_argv("join", "--config", TINY, "--local-workers", "2",
                                  *sum((["--set", s] for s in settings), [])),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, start_new_session=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert needle in res.stderr


def test_shard_of_is_fsdp2s_cut():
    """The pieces the tests rebuild digests from are torch.chunk's along dimension 0, empty past the end."""
    t = torch.arange(10.0).reshape(5, 2)
    assert shard_of(t, 0, 2).tolist() == [[0, 1], [2, 3], [4, 5]] and shard_of(t, 1, 2).tolist() == [[6, 7], [8, 9]]
    assert shard_of(torch.arange(3.0), 3, 4).numel() == 0


#: the overlap modes checked in one process pair: 2 fragments, 4-bit, gradient clipping off (the only
#: step whose summation order differs between a sharded and a whole gradient), 2.5 rounds (finish()
#: applies what is still in flight)
MODES = {"tau": ["streaming.mode=tau", "streaming.tau=2", "streaming.alpha=0.5"],
         "delay": ["streaming.mode=delay"], "eager": ["streaming.mode=eager"]}
STEPS = 25


def _mode_cfg(mode):
    return load_config(TINY, [*PINNED, "compression.codec=e3m0", "streaming.fragments=2", "inner.grad_clip=0",
                              *MODES[mode]])


def _fsdp_rank(rank: int, port: int, out: str, modes) -> None:
    """One local worker of test_overlap_modes_through_the_shards (a spawned process): rank 0 runs a
    solo DiLoCo over its CPU mirror as the peer's loop does, rank 1 follows."""
    import json
    import os

    from p2pdiloco.data import load_corpus
    from p2pdiloco.diloco.core import DiLoCo
    from p2pdiloco.train.inner import inner_step
    from p2pdiloco.local.group import LocalFollower, LocalGroup, LocalLeader
    from p2pdiloco.local.fsdp import FsdpShards, build_sharded
    from p2pdiloco.local.worker import local_stream
    from p2pdiloco.model import build_model

    torch.set_num_threads(1)
    os.environ.update(P2PDILOCO_LOCAL_RANK=str(rank), P2PDILOCO_LOCAL_WORLD="2",
                      P2PDILOCO_LOCAL_STORE=f"127.0.0.1:{port}")
    group = LocalGroup.from_env("cpu")
    group.sharded = True
    group.connect()
    result = {}
    for mode in modes:
        cfg = _mode_cfg(mode)
        corpus = load_corpus(cfg.data)
        stream = local_stream(cfg, corpus, 0, rank, 2)
        model = build_sharded(cfg, "cpu")
        shards = FsdpShards(group, model)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                                betas=(cfg.inner.beta1, cfg.inner.beta2))
        if rank == 0:
            torch.manual_seed(cfg.train.seed)
            mirror = build_model(cfg.model)
            holder = torch.optim.AdamW(mirror.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                                       betas=(cfg.inner.beta1, cfg.inner.beta2))  # its param_groups reach every shard
            diloco = DiLoCo(mirror, cfg, None)
            leader = LocalLeader(group, mirror, diloco, shards, opt)
            leader.brief(BRIEF_INFO, holder)
            leader.tell(True, diloco.lr_step)
            for i in range(STEPS):
                inner_step(cfg, model, opt, stream, diloco.lr_step, "cpu", local=group)
                leader.after_step()
                diloco.after_inner_step(2 * cfg.inner.batch_size)
                leader.tell(i < STEPS - 1, diloco.lr_step)
            diloco.finish()
            ctl = leader.tell(False, diloco.lr_step, final=True)
            result[mode] = dict(digest=diloco.digest(), model=digest_of(list(mirror.parameters())),
                                shard=ctl.event["model_digest"],
                                opt=digest_of([t for s in leader.opt_state["state"].values() for k, t in sorted(s.items())]))
            diloco.close()
        else:
            index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
            from p2pdiloco.diloco.fragments import split_fragments

            layout = split_fragments(model, cfg.streaming.fragments, cfg.streaming.pattern)
            named = dict(model.named_parameters())
            follower = LocalFollower(group, model, [sum(named[n].numel() for n in names) for names in layout.names],
                                     shards=shards, frag_params=[[index[n] for n in names] for names in layout.names])
            follower.brief(opt)
            ctl = follower.recv()
            while ctl.keep_going:
                inner_step(cfg, model, opt, stream, ctl.lr_step, "cpu", local=group)
                follower.after_step()
                ctl = follower.recv()
            ctl = follower.recv()
            result[mode] = dict(digest=follower.digest, shard=ctl.event["model_digest"])
    with open(out, "w") as f:
        json.dump(result, f)
    group.close()


def _overlap_reference(mode):
    """The same schedule in one process: one replica taking the summed batch (the mean of the halves'
    gradients), a solo DiLoCo over its model."""
    from p2pdiloco.data import load_corpus
    from p2pdiloco.diloco.core import DiLoCo
    from p2pdiloco.train.inner import _inner_lr, inner_setup
    from p2pdiloco.local.worker import local_stream

    torch.set_num_threads(1)
    cfg = _mode_cfg(mode)
    corpus = load_corpus(cfg.data)
    model, opt, _ = inner_setup(cfg, corpus, 0)
    halves = [local_stream(cfg, corpus, 0, r, 2) for r in range(2)]
    diloco = DiLoCo(model, cfg, None)
    for _ in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = _inner_lr(cfg, diloco.lr_step)
        grads = []
        for s in halves:
            x, y = s.next_batch("cpu")
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            grads.append([p.grad for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = torch.add(g0, g1).div_(2)
        opt.step()
        diloco.after_inner_step(2 * cfg.inner.batch_size)
    diloco.finish()
    diloco.close()
    params = list(model.parameters())
    opt_state = opt.state_dict()["state"]
    return dict(digest=diloco.digest(), model=digest_of(params),
                shards=[digest_of([shard_of(p, r, 2) for p in params]) for r in range(2)],
                opt=digest_of([t for s in opt_state.values() for k, t in sorted(s.items())]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("modes", [pytest.param(["tau"], id="tau"),
                                   pytest.param(["delay", "eager"], id="delay-eager", marks=pytest.mark.slow)])
def test_overlap_modes_through_the_shards(tmp_path, modes):
    """tau (tau 2, alpha 0.5: the merge reads the model; the default suite), delay and eager (the restart
    writes it; slow), each 2.5 rounds of 2 fragments: two spawned fsdp workers (gloo) whose rank 0 runs
    DiLoCo over its CPU mirror, refreshed from the shards only at the steps DiLoCo touches it, against one
    process taking the summed batch. Bitwise: the global state, the mirror, each worker's shard and the
    gathered optimiser state. (Gathering fewer fragments at a landing, say, fails it.)"""
    r0, r1 = run_two_ranks(_fsdp_rank, tmp_path, modes, timeout=150)
    assert sorted(r0) == sorted(r1) == sorted(modes)
    for mode in modes:
        want = _overlap_reference(mode)
        assert r0[mode]["digest"] == r1[mode]["digest"] == want["digest"], mode
        assert r0[mode]["model"] == want["model"] and r0[mode]["opt"] == want["opt"], mode
        assert [r0[mode]["shard"], r1[mode]["shard"]] == want["shards"], mode


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_equals_replicate_for_a_hugging_face_model(procs, tmp_path):
    """A Llama (transformers; rotary buffers, tied embedding) trained by a lone 2-worker peer, sharded and
    replicated: with gradient clipping off (the one step whose summation order differs) the global state
    after the round is the same bits, and the sharded workers hold half the elements each."""
    hf = ["model.kind=hf", "model.hf_config=llama", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
          "model.hf_kv_heads=2", "model.seq_len=64", "inner.grad_clip=0", "data.shard=0", "train.max_outer_steps=1"]
    digests = {}
    for sharding in ("replicate", "fsdp"):
        p = _join(procs, None, sharding, tmp_path / sharding, *hf, f"local.sharding={sharding}",
                  f"swarm.run_id=lw-hf-{sharding}", workers=2)
        assert procs.wait(p, 200) == 0, procs.err(sharding)[-3000:]
        rs = read_metrics(str(tmp_path / sharding / "metrics.jsonl"))
        (shard,) = [r for r in rs if r["event"] == "local_shard"]
        held = shard["param_numel"] / shard["params"]
        assert held == (1.0 if sharding == "replicate" else 0.5), shard
        digests[sharding] = [r["digest"] for r in rs if r["event"] == "sync"]
    assert digests["replicate"] == digests["fsdp"] and len(digests["fsdp"]) == 1
