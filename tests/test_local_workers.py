"""A peer with several local workers: ``join --local-workers K``, one swarm member per machine.

Through the real CLI, on CPU with gloo (this machine has no GPU), bootstrap included, fp32 and
blocking DiLoCo pinned (``PINNED``: the defaults may change):

* default run: a 2-worker peer and a 1-worker peer train together for QUICK rounds: every sync a
  group of 2, the 2-worker peer weighted by both workers' samples; equal digests on both peers, and
  both local workers of the 2-worker peer log the same ``local_sync`` events (the swarm's digest
  after every sync, the same model digest); the state after every round bitwise that of a
  single-process DiLoCo in which the 2-worker peer is one replica taking the summed batch; ``status``
  shows the local world size and samples/s. Then local worker 1 is SIGKILLed: its rank 0 leaves (one
  ``error:`` line, no traceback), the launcher exits within the timeout, no process of the machine is
  left, the swarm no longer lists the peer and the other peer trains on alone.
* slow: the same pair to its budget (both workers end with the final state; the final global
  parameters within 1e-6 of the reference), then the checkpoint resumed with one worker (data
  re-sliced: a warning and a ``reshard`` event, the global state and schedule as saved).
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import time

import psutil
import pytest
import torch

from conftest import TINY, cli_argv
from local_support import BRIEF_INFO, run_two_ranks
from p2pdiloco.checkpoint import find_checkpoint, load_checkpoint
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.config import load_config
from p2pdiloco.data import load_corpus
from p2pdiloco.train.inner import _inner_lr, inner_setup, inner_step
from p2pdiloco.diloco.outer import OuterState
from p2pdiloco.local.worker import local_stream
from p2pdiloco.metrics import read_metrics

H, BATCH, ROUNDS = 10, 8, 3
#: rounds the default test checks before its fault (the slow one runs ROUNDS)
QUICK = 2
#: what these tests rely on, pinned (the defaults may change): fp32, one fragment, blocking syncs
PINNED = ["compression.codec=fp32", "compression.lowrank=false", "streaming.fragments=1", "streaming.mode=tau",
          "streaming.tau=0", "streaming.alpha=0.0", "inner.round_samples=0", f"inner.sync_every={H}",
          f"inner.batch_size={BATCH}", "train.progress_bar=false"]


def _join(procs, addr, name, run_dir, *settings, workers=1):
    extra = ["--local-workers", str(workers)] if workers > 1 else []
    peers = ["--initial-peers", addr] if addr else []
    return procs.start("join", *peers, "--config", TINY, *extra,
                       *sum((["--set", s] for s in [*PINNED, *settings, f"train.run_dir={run_dir}"]), []), name=name)


def _worker_pids(procs, name, k, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(r"local workers: (.*)", procs.err(name))
        if m:
            pids = dict((int(r), int(p)) for r, p in re.findall(r"rank (\d+) pid (\d+)", m.group(1)))
            assert sorted(pids) == list(range(k)), m.group(0)
            return pids
        time.sleep(0.1)
    raise AssertionError(f"{name} printed no worker pids")


def _reference(cfg, peer_ids, one_forward=False, rounds=ROUNDS, sharded=False, states=None):
    """Blocking DiLoCo in one process: peer 0 is ONE replica (one model, one AdamW) whose inner step
    takes the summed batch of its two sub-shards (the batches the two local workers draw), peer 1 an
    ordinary replica on shard 1; each round averages their pseudo-gradients weighted by samples, in
    the group's member order.

    The summed batch's gradient (of the mean loss over both halves) is evaluated as the machine does:
    the mean of the two halves' gradients. ``one_forward``: one forward over the concatenated batch
    instead, the same function in another summation order: AdamW's normalised step turns its ulp-level
    gradient differences into lr-sized ones on parameters whose gradients are near zero (in one
    process, 1e-6 after one step, 8e-4 after 30: the effect hetero_support.py describes), so that
    variant is only printed.

    ``sharded``: the 2-worker peer is sharded (``local.sharding=fsdp``), and its gradient clipping
    takes the norm as FSDP's DTensors do: each parameter's norm reduced over the two shards,
    (||shard 0||² + ||shard 1||²)^½, then the norm of those (the same function as the norm of the whole
    gradient, in another summation order). ``states``: a list that gets, after every round, the global
    parameters (a list of tensors) and peer 0's inner optimiser state."""
    torch.set_num_threads(1)
    corpus = load_corpus(cfg.data)
    model0, opt0, _ = inner_setup(cfg, corpus, 0)
    halves = [local_stream(cfg, corpus, 0, r, 2) for r in range(2)]
    model1, opt1, stream1 = inner_setup(cfg, corpus, 1)
    outer = OuterState(list(model0.parameters()), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                       nesterov=cfg.outer.nesterov)
    step = 0
    digests = []
    for _ in range(rounds):
        for m in (model0, model1):
            outer.copy_to(list(m.parameters()))
        for i in range(H):
            for g in opt0.param_groups:
                g["lr"] = _inner_lr(cfg, step + i)
            xs, ys = zip(*(s.next_batch("cpu") for s in halves))
            if one_forward:
                _, loss = model0(torch.cat(xs), torch.cat(ys))
                opt0.zero_grad(set_to_none=True)
                loss.backward()
            else:
                grads = []
                for x, y in zip(xs, ys):
                    _, loss = model0(x, y)
                    opt0.zero_grad(set_to_none=True)
                    loss.backward()
                    grads.append([p.grad for p in model0.parameters()])
                for p, g0, g1 in zip(model0.parameters(), *grads):
                    p.grad = torch.add(g0, g1).div_(2)
            if cfg.inner.grad_clip and sharded:
                from p2pdiloco.local.fsdp import shard_of

                grads = [p.grad for p in model0.parameters()]
                per = [(torch.linalg.vector_norm(shard_of(g, 0, 2)) ** 2.0
                        + torch.linalg.vector_norm(shard_of(g, 1, 2)) ** 2.0) ** 0.5 for g in grads]
                coef = torch.clamp(cfg.inner.grad_clip / (torch.linalg.vector_norm(torch.stack(per)) + 1e-6), max=1.0)
                for g in grads:
                    g.mul_(coef)
            elif cfg.inner.grad_clip:
                torch.nn.utils.clip_grad_norm_(model0.parameters(), cfg.inner.grad_clip)
            opt0.step()
            inner_step(cfg, model1, opt1, stream1, step + i)
        step += H
        deltas = {0: outer.pseudo_gradient(list(model0.parameters())), 1: outer.pseudo_gradient(list(model1.parameters()))}
        weights = {0: 2.0 * H * BATCH, 1: 1.0 * H * BATCH}
        order = sorted((0, 1), key=lambda i: peer_ids[i])
        outer.step(weighted_mean([deltas[i] for i in order], [weights[i] for i in order]))
        digests.append(outer.digest())
        if states is not None:
            states.append(([p.clone() for p in outer.params], {i: {k: v.clone() for k, v in st.items()}
                                                             for i, st in opt0.state_dict()["state"].items()}))
    return torch.cat([p.reshape(-1) for p in outer.params]), digests


def _until_worker1_synced(procs, a, run_dir) -> dict:
    """The launcher's worker pids, once worker 1 has logged its first local_sync (the peer trains)."""
    pids = _worker_pids(procs, "a", 2)
    w1 = run_dir / "worker1.jsonl"
    deadline = time.time() + 90
    while not (w1.exists() and any(r["event"] == "local_sync" for r in read_metrics(str(w1)))):
        assert a.poll() is None and time.time() < deadline, procs.err("a")[-3000:]
        time.sleep(0.2)
    return pids


def _first_rounds_together(ra, rb) -> dict:
    """The first QUICK rounds of peers a (2 workers) and b (1): one group of both, equal digests, a's
    weight its two workers' samples; returns {outer step: {"a": sync, "b": sync}}."""
    by = {k: {w: [r for r in rs if r["event"] == "sync" and r["outer_step"] == k][0] for w, rs in (("a", ra), ("b", rb))}
          for k in range(1, QUICK + 1)}
    for k, r in by.items():
        assert r["a"]["ok"] and r["b"]["ok"] and r["a"]["group_size"] == r["b"]["group_size"] == 2, k
        assert r["a"]["digest"] == r["b"]["digest"], k
        assert r["a"]["samples"] == 2 * H * BATCH and r["a"]["round_samples"] == 3 * H * BATCH, k
    return by


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_worker_peer_finishes_and_resumes_with_one(procs, tmp_path):
    """A whole run to its budget (both workers end with the final state), the final global parameters
    against the summed-batch reference within 1e-6, and a resume with another number of workers."""
    addr = procs.bootstrap()
    settings = [f"train.max_outer_steps={ROUNDS}", "swarm.min_peers_to_start=2", "swarm.run_id=lw-agree"]
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    pids = _worker_pids(procs, "a", 2)
    assert procs.wait(a, 180) == 0, procs.err("a")[-3000:]
    assert procs.wait(b, 180) == 0, procs.err("b")[-3000:]
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids.values())

    ra, rb = read_metrics(str(tmp_path / "a" / "metrics.jsonl")), read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
    w1 = read_metrics(str(tmp_path / "a" / "worker1.jsonl"))
    syncs = {}
    for who, rs in (("a", ra), ("b", rb)):
        for r in rs:
            if r["event"] == "sync":
                assert r["ok"] and r["group_size"] == 2, (who, r)
                syncs.setdefault(r["outer_step"], {})[who] = r
    assert sorted(syncs) == list(range(1, ROUNDS + 1))
    for k, by in syncs.items():
        assert by["a"]["digest"] == by["b"]["digest"], k
        # the 2-worker replica's weight: both workers' samples
        assert by["a"]["samples"] == 2 * H * BATCH and by["b"]["samples"] == H * BATCH, k
        assert by["a"]["round_samples"] == 3 * H * BATCH

    # both local workers log the same events: the swarm's digest after every sync, the same model
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "model_digest", "final")
    ev0 = [{k: r[k] for k in keys} for r in ra if r["event"] == "local_sync"]
    ev1 = [{k: r[k] for k in keys} for r in w1 if r["event"] == "local_sync"]
    assert ev0 == ev1 and len(ev0) >= ROUNDS + 1 and ev1[-1]["final"]
    for k, by in syncs.items():
        got = [e for e in ev1 if e["outer_steps"] == [k] and e["fragments"]]
        assert len(got) == 1 and got[0]["digest"] == by["a"]["digest"] and got[0]["model_digest"], (k, got)
        assert got[0]["step"] == by["a"]["step"]  # blocking: sent with the step that synced
    summary1 = [r for r in w1 if r["event"] == "summary"][-1]
    assert summary1["digest"] == syncs[ROUNDS]["a"]["digest"] and summary1["inner_steps"] == ROUNDS * H

    # the reference: the 2-worker peer as one replica with the summed batch
    cfg = load_config(TINY, [*PINNED, *settings])
    ids = [[r for r in rs if r["event"] == "start"][0]["peer"] for rs in (ra, rb)]
    want, digests = _reference(cfg, ids)
    once, _ = _reference(cfg, ids, one_forward=True)
    for who in ("a", "b"):
        state = load_checkpoint(find_checkpoint(str(tmp_path / who)))
        got = torch.cat([t.reshape(-1) for t in state["outer"][0]["params"]])
        err = float((got - want).abs().max())
        print(f"\npeer {who}: max |swarm - summed-batch reference| = {err:.3g} (digests after every round "
              f"{'equal' if digests == [syncs[k]['a']['digest'] for k in sorted(syncs)] else 'differ'}); with "
              f"one forward over the concatenated batch: {float((got - once).abs().max()):.3g}")
        assert err <= 1e-6
    assert load_checkpoint(find_checkpoint(str(tmp_path / "a")))["local_workers"] == 2

    # resume the 2-worker peer's checkpoint with one worker, alone: data re-sliced, state as saved
    r = _join(procs, None, "a1", tmp_path / "a", f"train.max_outer_steps={ROUNDS + 1}", "swarm.run_id=lw-agree",
              "data.shard=0")
    assert procs.wait(r, 120) == 0, procs.err("a1")[-3000:]
    assert "re-sliced into 1 sub-shard(s)" in procs.err("a1")
    ra = read_metrics(str(tmp_path / "a" / "metrics.jsonl"))
    (resh,) = [x for x in ra if x["event"] == "reshard"]
    assert resh["saved_local_workers"] == 2 and resh["local_workers"] == 1 and resh["step"] == ROUNDS * H
    resumed = [x for x in ra if x["event"] == "resume"][-1]
    assert resumed["digest"] == syncs[ROUNDS]["a"]["digest"]
    assert [x["outer_step"] for x in ra if x["event"] == "sync"][-1] == ROUNDS + 1


def _status(addr, run_id):
    res = subprocess.run(cli_argv("status", "--initial-peers", addr, "--run-id", run_id, "--json"),
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def _syncs(path):
    return [r for r in read_metrics(str(path)) if r["event"] == "sync"] if os.path.exists(path) else []


@pytest.mark.timeout(240)
def test_local_workers_in_a_swarm_and_a_dead_one(procs, tmp_path):
    """The default run: a 2-worker and a 1-worker peer for QUICK rounds (equal digests, workers' logs,
    bitwise the summed-batch reference after every round, status), then local worker 1 SIGKILLed."""
    addr = procs.bootstrap()
    settings = ["swarm.min_peers_to_start=2", "swarm.run_id=lw-swarm", "swarm.progress_period=2"]
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    pids = _worker_pids(procs, "a", 2)
    deadline = time.time() + 150
    while not all(len(_syncs(tmp_path / w / "metrics.jsonl")) >= QUICK for w in "ab"):
        assert a.poll() is None and b.poll() is None, (procs.err("a")[-2000:], procs.err("b")[-2000:])
        assert time.time() < deadline, "too few syncs within 150 s"
        time.sleep(0.2)
    a_id = [r for r in read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if r["event"] == "start"][0]["peer"]
    seen = _status(addr, "lw-swarm")
    assert seen[a_id]["lw"] == 2 and [v["lw"] for p, v in seen.items() if p != a_id] == [1]  # status: local world size
    assert seen[a_id]["rate"] > 0  # ... and samples/s (the machine's: both workers' samples)

    # the fault: local worker 1 dies mid-run
    machine = [pids[0], *[c.pid for c in psutil.Process(pids[0]).children(recursive=True)], pids[1]]
    t0 = time.time()
    os.kill(pids[1], signal.SIGKILL)
    code = procs.wait(a, 45)
    took = time.time() - t0
    print(f"\nthe launcher exited {took:.1f} s after local worker 1 was killed")
    assert code == 1 and took < 40
    err = procs.err("a")
    assert f"error: local worker 1 (pid {pids[1]}) was killed by SIGKILL" in err  # the fault fired, and was seen
    assert "another local worker of this machine stopped" in err  # rank 0 noticed it in a collective
    assert "Traceback" not in err
    deadline = time.time() + 15  # rank 0's DHT process and daemon end soon after it (swarm/lifeline.py)
    while left := [p for p in machine if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.time() < deadline, f"left behind: {left}"
        time.sleep(0.2)

    # the swarm sees the peer leave; the other peer trains on, alone
    n0 = len([r for r in _syncs(tmp_path / "b" / "metrics.jsonl") if r["ok"]])
    assert a_id not in _status(addr, "lw-swarm")
    deadline = time.time() + 60
    while len(ok := [r for r in _syncs(tmp_path / "b" / "metrics.jsonl") if r["ok"]]) < n0 + 2:
        assert b.poll() is None, procs.err("b")[-3000:]
        assert time.time() < deadline, "the other peer made no progress after the kill"
        time.sleep(0.3)
    assert ok[-1]["group_size"] == 1
    os.killpg(b.pid, signal.SIGTERM)
    assert procs.wait(b, 60) == 0, procs.err("b")[-3000:]

    # the first QUICK rounds: one group of both, equal digests, both local workers logging them
    ra, rb = read_metrics(str(tmp_path / "a" / "metrics.jsonl")), read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
    w1 = read_metrics(str(tmp_path / "a" / "worker1.jsonl"))
    by = _first_rounds_together(ra, rb)
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "model_digest")
    ev0, ev1 = ([{k: r[k] for k in keys} for r in rs if r["event"] == "local_sync" and r["synced_step"] <= QUICK * H]
                for rs in (ra, w1))
    assert ev0 == ev1 and len(ev0) == QUICK + 1  # the start, then every sync
    for k, r in by.items():
        (e,) = [e for e in ev1 if e["outer_steps"] == [k]]
        assert e["digest"] == r["a"]["digest"] and e["step"] == r["a"]["step"] and e["model_digest"], (k, e)
    cfg = load_config(TINY, [*PINNED, *settings])
    _, digests = _reference(cfg, [[r for r in rs if r["event"] == "start"][0]["peer"] for rs in (ra, rb)], rounds=QUICK)
    assert digests == [by[k]["a"]["digest"] for k in range(1, QUICK + 1)]  # bitwise the reference's state


@pytest.mark.timeout(150)
def test_a_stopped_local_worker_is_caught_by_its_heartbeat(procs, tmp_path):
    """A local worker that is alive but silent (SIGSTOP: no collective notices it before its 2-hour
    timeout) is caught by the launcher's heartbeat check within local.heartbeat_timeout: named in one
    ``error:`` line, killed, and the machine's peer leaves cleanly (exit status 1), nothing left. The
    peer shards its replica (local.sharding=fsdp): rank 0 meets the killed worker inside one of FSDP's
    own collectives (its forward's gather, its backward's reduce-scatter), said in one line too."""
    timeout = 4.0
    a = _join(procs, None, "a", tmp_path / "a", "swarm.run_id=lw-hung", f"local.heartbeat_timeout={timeout}",
              "local.sharding=fsdp", workers=2)
    pids = _until_worker1_synced(procs, a, tmp_path / "a")
    time.sleep(1.5 * timeout)  # training, beating: no false alarm meanwhile
    assert a.poll() is None, procs.err("a")[-3000:]
    machine = [pids[0], *[c.pid for c in psutil.Process(pids[0]).children(recursive=True)], pids[1]]
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.time()
    while psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED:  # the fault fired: worker 1 is frozen
        assert time.time() < t0 + 2, psutil.Process(pids[1]).status()  # (the signal lands asynchronously)
        time.sleep(0.01)
    code = procs.wait(a, 60)
    took = time.time() - t0
    print(f"\nthe launcher exited {took:.1f} s after local worker 1 was stopped (heartbeat timeout {timeout:g} s)")
    err = procs.err("a")
    assert code == 1 and timeout <= took <= timeout + 20, err[-3000:]
    assert f"error: local worker 1 (pid {pids[1]}) sent no heartbeat for" in err and "stopped or frozen" in err
    assert "another local worker of this machine stopped" in err  # rank 0 left through its collective's error
    assert "did not end within" not in err and "Traceback" not in err  # rank 0 was not killed: it left
    deadline = time.time() + 15
    while left := [p for p in machine if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.time() < deadline, f"left behind: {left}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_stopped_rank_0_is_caught_by_its_heartbeat(procs, tmp_path):
    """Worker 0 (the swarm member) SIGSTOPped: the launcher names it and kills it (a stopped process can
    say no goodbye), worker 1 ends at its next collective, exit status 1, nothing left (rank 0's DHT
    process and daemon included)."""
    timeout = 4.0
    a = _join(procs, None, "a", tmp_path / "a", "swarm.run_id=lw-hung0", f"local.heartbeat_timeout={timeout}",
              workers=2)
    pids = _until_worker1_synced(procs, a, tmp_path / "a")
    machine = [pids[0], *[c.pid for c in psutil.Process(pids[0]).children(recursive=True)], pids[1]]
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.time()
    while psutil.Process(pids[0]).status() != psutil.STATUS_STOPPED:  # the fault fired
        assert time.time() < t0 + 2, psutil.Process(pids[0]).status()
        time.sleep(0.01)
    code = procs.wait(a, 60)
    took = time.time() - t0
    err = procs.err("a")
    assert code == 1 and timeout <= took <= timeout + 20, err[-3000:]
    assert f"error: local worker 0 (pid {pids[0]}) sent no heartbeat for" in err and "without a goodbye" in err
    assert "Traceback" not in err
    deadline = time.time() + 15
    while left := [p for p in machine if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.time() < deadline, f"left behind: {left}"
        time.sleep(0.2)


#: the streaming scheme the project is moving its defaults to, pinned: 2 fragments, tau/alpha overlap, 4-bit
STREAMING = ["compression.codec=e3m0", "streaming.fragments=2", "streaming.mode=tau", "streaming.tau=2",
             "streaming.alpha=0.5"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_worker_peer_joins_a_streaming_run_and_stops_on_ctrl_c(procs, tmp_path, sharding):
    """A 2-worker peer joins a run in progress (its state download reaches both workers), trains with
    2 fragments, tau/alpha overlap and 4-bit pseudo-gradients, and stops on a Ctrl-C to its process
    group (the terminal's): exit 0 for the launcher and both workers, the final state on both. With
    fsdp, each worker's ``model_digest`` is of its own shard (compared as such: present, and differing)."""
    addr = procs.bootstrap()
    settings = [*STREAMING, "swarm.run_id=lw-stream", "swarm.progress_period=2", f"local.sharding={sharding}"]
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    deadline = time.time() + 120
    while len(_syncs(tmp_path / "b" / "metrics.jsonl")) < 4:  # two outer steps before the 2-worker peer comes
        assert b.poll() is None and time.time() < deadline, procs.err("b")[-3000:]
        time.sleep(0.2)
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    pids = _worker_pids(procs, "a", 2)
    deadline = time.time() + 150
    while len([r for r in _syncs(tmp_path / "a" / "metrics.jsonl") if r["ok"] and r["group_size"] == 2]) < 4:
        assert a.poll() is None and b.poll() is None and time.time() < deadline, procs.err("a")[-3000:]
        time.sleep(0.2)
    os.killpg(a.pid, signal.SIGINT)  # what Ctrl-C in its terminal does: the launcher and both workers get it
    assert procs.wait(a, 60) == 0, procs.err("a")[-3000:]
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids.values())
    os.killpg(b.pid, signal.SIGTERM)
    assert procs.wait(b, 60) == 0, procs.err("b")[-3000:]

    ra, rb = read_metrics(str(tmp_path / "a" / "metrics.jsonl")), read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
    w1 = read_metrics(str(tmp_path / "a" / "worker1.jsonl"))
    # joined from the swarm's verified state (and, as a one-process joiner may, adopted it once more at its
    # first sync when that round's group had formed without it): every adopted state reached worker 1
    caught = [r for r in ra if r["event"] == "catch_up"]
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "final")
    if sharding == "replicate":
        keys += ("model_digest",)
    else:
        assert all(a["model_digest"] != b["model_digest"] for a, b in zip(
            *([r for r in rs if r["event"] == "local_sync"] for rs in (ra, w1))))
    ev0, ev1 = ([{k: r[k] for k in keys} for r in rs if r["event"] == "local_sync"] for rs in (ra, w1))
    assert caught and ev0 == ev1 and ev1[0]["digest"] == caught[0]["digest"] and ev1[-1]["final"]
    raw1 = [r for r in w1 if r["event"] == "local_sync"]
    assert all(any(e["digest"] == c["digest"] and e["model_digest"] for e in raw1) for c in caught)
    theirs = {(r["fragment"], r["outer_step"]): r["digest"] for r in rb if r["event"] == "sync" and r["ok"]}
    ours = [r for r in ra if r["event"] == "sync" and r["ok"]]
    assert len(ours) >= 4 and all(theirs[(r["fragment"], r["outer_step"])] == r["digest"] for r in ours)
    received = {(int(p), d) for e in ev1 for p, d in e["fragments"].items()}
    assert all((r["fragment"], r["digest"]) in received for r in ours)  # worker 1 holds every synced global copy
    summaries = [[r for r in rs if r["event"] == "summary"][-1] for rs in (ra, w1)]
    assert summaries[0]["digest"] == summaries[1]["digest"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_launcher_leaves_nothing_behind(procs, tmp_path):
    """The launcher itself SIGKILLed (its workers are not): they notice and leave, rank 0 with its DHT
    process and daemon."""
    a = _join(procs, None, "a", tmp_path / "a", "swarm.run_id=lw-orphan", workers=2)
    pids = _worker_pids(procs, "a", 2)
    deadline = time.time() + 120
    while not _syncs(tmp_path / "a" / "metrics.jsonl"):
        assert a.poll() is None and time.time() < deadline, procs.err("a")[-3000:]
        time.sleep(0.2)
    machine = [pids[0], *[c.pid for c in psutil.Process(pids[0]).children(recursive=True)], pids[1]]
    os.kill(a.pid, signal.SIGKILL)  # the launcher only
    deadline = time.time() + 45
    while left := [p for p in machine if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.time() < deadline, f"left behind: {left}"
        time.sleep(0.2)
    print(f"\nthe workers were gone {45 - (deadline - time.time()):.1f} s after the launcher was killed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k, needle", [("0", "--local-workers (0) must be between 1 and 64"),
                                       ("two", "invalid int value: 'two'")])
def test_bad_local_workers_is_one_clear_line(tmp_path, k, needle):
    res = subprocess.run(cli_argv("join", "--config", TINY, "--local-workers", k), capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, start_new_session=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert needle in res.stderr


def test_status_table_shows_local_workers(monkeypatch, capsys):
    """``status`` (the table): each peer's local workers (1 when its record has none: an older peer) and
    samples/s; a peer that has not synced yet (loss null) prints '-' instead of failing."""
    import p2pdiloco.swarm.node as node
    from p2pdiloco.cli import main

    records = {"Qm" + "A" * 40 + "aaaaaa": {"lw": 8, "rate": 123.4, "round": 3, "step": 60, "samples": 9000,
                                           "loss": 3.2, "val_loss": 3.3, "last_sync": time.time(), "reach": "public"},
               "Qm" + "B" * 40 + "bbbbbb": {"rate": 12.0, "loss": None, "val_loss": 5.4}}

    class FakeNode:
        def __init__(self, *args, **kwargs):
            pass

        def get_subkeys(self, key, why="other"):
            return records

        def shutdown(self):
            pass
    monkeypatch.setattr(node, "SwarmNode", FakeNode)
    assert main(["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + "Qm" + "C" * 44]) == 0
    head, a, b = capsys.readouterr().out.splitlines()
    assert head.split()[:4] == ["peer", "reach", "workers", "outer"]
    assert a.split()[:2] + a.split()[2:3] + [a.split()[5]] == ["aaaaaa", "public", "8", "123.4"]
    assert b.split()[2] == "1" and b.split()[-2:] == ["-", "5.400"]


def _protocol_rank(rank: int, port: int, out: str) -> None:
    """One side of test_protocol_between_two_processes (a spawned process)."""
    from p2pdiloco.diloco.core import DiLoCo
    from p2pdiloco.local.group import LocalFollower, LocalGroup, LocalLeader
    from p2pdiloco.model import build_model

    torch.set_num_threads(1)
    cfg = load_config(TINY, [*PINNED, "streaming.fragments=2", "inner.sync_every=10"])
    os.environ.update(P2PDILOCO_LOCAL_RANK=str(rank), P2PDILOCO_LOCAL_WORLD="2",
                      P2PDILOCO_LOCAL_STORE=f"127.0.0.1:{port}")
    group = LocalGroup.from_env("cpu")
    group.connect()
    torch.manual_seed(rank)  # different starting points: everything a worker holds must come from rank 0
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    if rank == 0:  # a resumed rank 0: its AdamW has state
        model(x, x)[1].backward()
        opt.step()
        diloco = DiLoCo(model, cfg, None)
        leader = LocalLeader(group, model, diloco)
        leader.brief(BRIEF_INFO, opt)
        first = leader.tell(True, 0)
        leader.mark()
        with torch.no_grad():  # what a sync does between our step and the message: a merge, an outer step
            next(model.parameters()).mul_(0.5)
        diloco.outer[1].step(torch.full((diloco.outer[1].numel,), 1e-3))
        second = leader.tell(False, 7, final=True)
        result = dict(events=[first.event, second.event], digest=diloco.digest())
    else:
        diloco = DiLoCo(model, cfg, None)
        follower = LocalFollower(group, model, [o.numel for o in diloco.outer])
        info = follower.brief(opt)
        first, second = follower.recv(), follower.recv()
        result = dict(info=info, events=[first.event, second.event], digest=follower.digest,
                      lr_step=second.lr_step, go=[first.keep_going, second.keep_going], final=second.final)
    result["model"] = digest_model(model)
    result["opt"] = digest_model([t for s in opt.state.values() for t in s.values()])
    with open(out, "w") as f:
        json.dump(result, f)
    group.close()


def digest_model(x) -> str:
    from p2pdiloco.digest import tensors_digest as digest_of

    return digest_of(list(x.parameters()) if isinstance(x, torch.nn.Module) else x)


@pytest.mark.timeout(120)
def test_protocol_between_two_processes(tmp_path):
    """The brief and two messages between two real processes (gloo): worker 1 ends with rank 0's inner
    optimiser state, parameters and global copies (it started from other ones), and both log the same
    events: the start (everything), then the one parameter and the one fragment that changed."""
    r0, r1 = run_two_ranks(_protocol_rank, tmp_path, timeout=90)
    assert r1["info"] == BRIEF_INFO and r1["go"] == [True, False] and r1["final"] and r1["lr_step"] == 7
    assert r0["opt"] == r1["opt"] and r0["model"] == r1["model"] and r0["digest"] == r1["digest"]
    drop_rank = [{k: v for k, v in e.items() if k != "rank"} for e in r0["events"]]
    assert drop_rank == [{k: v for k, v in e.items() if k != "rank"} for e in r1["events"]]
    start, change = r1["events"]
    assert sorted(start["fragments"]) == ["0", "1"] and start["model_digest"]
    assert sorted(change["fragments"]) == ["1"] and change["outer_steps"] == [0, 1] and change["final"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restart_after_a_dead_worker_resumes(procs, tmp_path):
    """After a local worker died, the same command resumes from the
    machine's checkpoint (same K: no re-slicing), catches up with the swarm, and trains in its groups."""
    addr = procs.bootstrap()
    settings = ["swarm.min_peers_to_start=2", "swarm.run_id=lw-restart", "swarm.progress_period=2"]
    a = _join(procs, addr, "a", tmp_path / "a", *settings, "data.shard=0", workers=2)
    b = _join(procs, addr, "b", tmp_path / "b", *settings, "data.shard=1")
    pids = _worker_pids(procs, "a", 2)
    deadline = time.time() + 150
    while len(_syncs(tmp_path / "a" / "metrics.jsonl")) < 2:
        assert a.poll() is None and b.poll() is None and time.time() < deadline, procs.err("a")[-3000:]
        time.sleep(0.2)
    os.kill(pids[1], signal.SIGKILL)
    assert procs.wait(a, 45) == 1
    before = len(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))
    a2 = _join(procs, addr, "a2", tmp_path / "a", *settings, "data.shard=0", workers=2)
    deadline = time.time() + 150
    while len([r for r in _syncs(tmp_path / "a" / "metrics.jsonl")[2:] if r["ok"] and r["group_size"] == 2]) < 2:
        assert a2.poll() is None and b.poll() is None and time.time() < deadline, procs.err("a2")[-3000:]
        time.sleep(0.2)
    for p in (a2, b):
        os.killpg(p.pid, signal.SIGTERM)
    assert procs.wait(a2, 60) == 0 and procs.wait(b, 60) == 0, procs.err("a2")[-3000:]
    ra = read_metrics(str(tmp_path / "a" / "metrics.jsonl"))[before:]
    assert [r["event"] for r in ra if r["event"] in ("resume", "reshard")] == ["resume"]
    theirs = {(r["fragment"], r["outer_step"]): r["digest"] for r in read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
              if r["event"] == "sync" and r["ok"]}
    ours = [r for r in ra if r["event"] == "sync" and r["ok"]]
    assert len(ours) >= 2 and all(theirs[(r["fragment"], r["outer_step"])] == r["digest"] for r in ours)
    w1 = read_metrics(str(tmp_path / "a" / "worker1.jsonl"))
    restart = max(i for i, r in enumerate(w1) if r["event"] == "start")
    keys = ("step", "synced_step", "outer_steps", "fragments", "digest", "model_digest", "final")
    assert [{k: r[k] for k in keys} for r in ra if r["event"] == "local_sync"] == \
        [{k: r[k] for k in keys} for r in w1[restart:] if r["event"] == "local_sync"]


def _listening(pid: int):
    """(protocol, address, port) of every TCP socket process ``pid`` listens on and every UDP socket it
    has bound (psutil reads /proc/<pid>/fd's socket inodes against /proc/<pid>/net/{tcp,udp}{,6})."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []
    return [("udp" if c.type == socket.SOCK_DGRAM else "tcp", c.laddr.ip, c.laddr.port) for c in conns
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr)]


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


@pytest.mark.timeout(150)
def test_local_workers_listen_on_loopback_only(procs, tmp_path):
    """While a 2-worker peer trains, no process of the machine listens beyond loopback: the rendezvous
    (the launcher's TCPStore) and gloo (a listener per worker) are bound to 127.0.0.1, and so is every
    other socket of the launcher, the workers and rank 0's DHT process. The p2p daemon's TCP listeners
    are where swarm.host_maddrs says (127.0.0.1 here); its UDP sockets (NAT port mapping, the swarm's
    business) are left out. The local workers' listeners are counted: the check cannot pass by
    finding none."""
    a = _join(procs, None, "a", tmp_path / "a", "swarm.run_id=lw-loopback", workers=2)
    pids = _until_worker1_synced(procs, a, tmp_path / "a")
    tree = [psutil.Process(a.pid), *psutil.Process(a.pid).children(recursive=True)]
    assert set(pids.values()) <= {p.pid for p in tree}
    every = {p.pid: [s for s in _listening(p.pid) if p.name() != "p2pd" or s[0] == "tcp"] for p in tree}
    assert a.poll() is None, procs.err("a")[-3000:]
    print(f"\nlistening sockets of the machine's processes: {every}")
    store = every[a.pid]
    assert len(store) == 1 and store[0][0] == "tcp", store  # the launcher holds one socket: the rendezvous
    for r, pid in pids.items():
        assert any(s[0] == "tcp" for s in every[pid]), f"local worker {r} has no gloo listener"
    (daemon,) = [p.pid for p in tree if p.name() == "p2pd"]
    assert every[daemon], "the p2p daemon has no listener"
    wide = [(pid, *s) for pid, socks in every.items() for s in socks if not _is_loopback(s[1])]
    assert not wide, f"listening beyond loopback: {wide}"


class _OpensAFile:
    """A pickle that, unpickled, creates the file at ``path`` (what a hostile sender would run instead)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile_rank(rank: int, port: int, out: str, marker: str) -> None:
    """One side of test_a_worker_refuses_a_pickle_and_a_huge_length: rank 0 sends, as the start message,
    raw bytes on the wire (the length as one int64, then the bytes as uint8, which is also how
    torch's broadcast_object_list frames a pickle), first a pickle, then only a length of 2**40 bytes."""
    import pickle

    import torch.distributed as dist

    from p2pdiloco.diloco.core import DiLoCo
    from p2pdiloco.local.group import LocalFollower, LocalGroup
    from p2pdiloco.model import build_model

    torch.set_num_threads(1)
    os.environ.update(P2PDILOCO_LOCAL_RANK=str(rank), P2PDILOCO_LOCAL_WORLD="2",
                      P2PDILOCO_LOCAL_STORE=f"127.0.0.1:{port}")
    group = LocalGroup.from_env("cpu")
    group.connect()
    result = {}
    if rank == 0:
        payload = pickle.dumps(_OpensAFile(marker))
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)
        dist.broadcast(torch.tensor([1 << 40], dtype=torch.int64), 0)
        dist.barrier()
    else:
        cfg = load_config(TINY, PINNED)
        model = build_model(cfg.model)
        follower = LocalFollower(group, model, [o.numel for o in DiLoCo(model, cfg, None).outer])
        result["errors"] = []
        for _ in range(2):
            try:
                follower.brief(torch.optim.AdamW(model.parameters()))
                result["errors"].append(None)
            except Exception as e:  # noqa: BLE001 - reported to the test, which names what it wants
                result["errors"].append([type(e).__name__, str(e)])
        dist.barrier()
    with open(out, "w") as f:
        json.dump(result, f)
    group.close()


@pytest.mark.timeout(120)
def test_a_worker_refuses_a_pickle_and_a_huge_length(tmp_path):
    """Nothing a local worker receives is unpickled: a pickle sent as rank 0's start message is refused
    (one clear error, the worker's ``LocalWorkerLost``) and not run (the file it would create is not
    there); an announced length past the limit is refused before anything is allocated."""
    marker = tmp_path / "unpickled"
    _, r1 = run_two_ranks(_hostile_rank, tmp_path, str(marker), timeout=90)
    assert not marker.exists(), "the pickle was run"
    (kind1, msg1), (kind2, msg2) = r1["errors"]
    assert kind1 == "LocalWorkerLost" and "rank 0's start message failed validation" in msg1, msg1
    assert kind2 == "LocalWorkerLost" and f"announced a message of {1 << 40} bytes" in msg2, msg2


def _brief_bytes(**change) -> bytes:
    """A valid brief (a real AdamW's state skeleton), its top-level fields replaced by ``change``
    (None: the field left out), in the wire format but for that."""
    import msgpack

    from p2pdiloco.local.group import _split_state
    from p2pdiloco.local.messages import decode_brief, encode_brief

    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    good = encode_brief(BRIEF_INFO, _split_state(opt.state_dict())[0])
    assert decode_brief(good)["opt"] == _split_state(opt.state_dict())[0]  # the valid brief is accepted whole
    if not change:
        return good
    msg = msgpack.unpackb(good, raw=False, strict_map_key=False)
    for k, v in change.items():
        if v is None:
            msg.pop(k)
        else:
            msg[k] = v
    return msgpack.packb(msg, use_bin_type=True)


def _spec(obj) -> dict:
    return {"\x00tensor": obj}  # a tensor spec as the brief carries it


def _ext(code: int, obj) -> "msgpack.ExtType":
    import msgpack

    return msgpack.ExtType(code, msgpack.packb(obj))


def _opt(state=None, groups=None) -> dict:
    return {"state": {0: {"step": 1.0}} if state is None else state,
            "param_groups": [{"lr": 0.1, "params": [0]}] if groups is None else groups}


@pytest.mark.parametrize("case, data, needle", [
    ("empty", lambda: b"", "undecodable"),
    ("never-used byte", lambda: b"\xc1", "undecodable"),
    ("truncated", lambda: _brief_bytes()[:-5], "undecodable"),
    ("a pickle", lambda: __import__("pickle").dumps({"run_dir": "x"}), "undecodable"),
    ("an array", lambda: __import__("msgpack").packb([1, 2]), "is a list, not a map"),
    ("missing field", lambda: _brief_bytes(peer=None), "missing ['peer']"),
    ("unknown field", lambda: _brief_bytes(evil=1), "unknown [\"'evil'\"]"),
    ("other version", lambda: _brief_bytes(v=2), "of version 2, this worker reads 1"),
    ("negative shard", lambda: _brief_bytes(shard=-1), "shard = -1 is not a non-negative int"),
    ("bool shard", lambda: _brief_bytes(shard=True), "shard = True is not a non-negative int"),
    ("str position", lambda: _brief_bytes(batches_drawn="7"), "batches_drawn = '7' is not"),
    ("long path", lambda: _brief_bytes(run_dir="x" * 5000), "undecodable"),
    ("opt not a map", lambda: _brief_bytes(opt=[1]), "opt is not a map of 'state' and 'param_groups'"),
    ("state key", lambda: _brief_bytes(opt=_opt(state={"x": {}})), "opt.state has key 'x'"),
    ("state value", lambda: _brief_bytes(opt=_opt(state={0: {"step": "1"}})), "opt.state[0].'step' = '1' is not"),
    ("dtype", lambda: _brief_bytes(opt=_opt(state={0: {"m": _spec([[2], "complex64", "cpu"])}})),
     "dtype 'complex64' is not one of"),
    ("device", lambda: _brief_bytes(opt=_opt(state={0: {"m": _spec([[2], "float32", "tpu"])}})),
     "device 'tpu' is not one of"),
    ("shape", lambda: _brief_bytes(opt=_opt(state={0: {"m": _spec([[-1], "float32", "cpu"])}})),
     "shape [-1] is not a list"),
    ("spec size", lambda: _brief_bytes(opt=_opt(state={0: {"m": _spec([[2], "float32"])}})),
     "a tensor spec that is not a list of 3 items"),
    ("ext type", lambda: _brief_bytes(opt=_opt(state={0: {"m": _ext(7, [1])}})), "undecodable"),
    ("a former tensor ext", lambda: _brief_bytes(opt=_opt(state={0: {"m": _ext(1, [[2], "float32", "cpu"])}})),
     "undecodable"),
    ("tag beside another key", lambda: _brief_bytes(opt=_opt(state={0: {"m": {"\x00tensor": [[2], "float32", "cpu"],
                                                                              "x": 1}}})), "is not a number"),
    ("params", lambda: _brief_bytes(opt=_opt(groups=[{"lr": 0.1, "params": "all"}])),
     "param_groups[0].params is not a list of parameter indices"),
    ("group value", lambda: _brief_bytes(opt=_opt(groups=[{"lr": {"a": 1}, "params": [0]}])),
     "param_groups[0].'lr' = {'a': 1} is not a number"),
    ("oversized", lambda: b"\x00" * (16 * 2 ** 20 + 1), "limit 16777216"),
])
def test_brief_decoder_refuses_malformed_input(case, data, needle):
    """The start message's decoder (:mod:`p2pdiloco.local.messages`) refuses each malformed input with
    a WireError naming what is wrong: never a crash, a pickle or a partial result."""
    from p2pdiloco.errors import WireError
    from p2pdiloco.local.messages import decode_brief

    with pytest.raises(WireError) as err:
        decode_brief(data())
    assert needle in str(err.value), (case, str(err.value))
