"""Checkpoints are atomic and resume exactly.

The multi-process test stalls a real peer inside a checkpoint write (fault injection: the temp file
is written and fsynced, the rename has not happened), kills it with SIGKILL there, and restarts it
on the same run directory: it must resume from the last *committed* checkpoint, exactly.
"""
from __future__ import annotations

import collections
import glob
import logging
import os
import signal

import pytest
import torch

from elastic_support import faults_env, join_args, ok_syncs, read_events, wait_for
from p2pdiloco import faults
from p2pdiloco.checkpoint import CheckpointWriter, find_checkpoint, host_copy, load_checkpoint, save_checkpoint
from p2pdiloco.errors import CheckpointError, SyncFailed

H = 10


def _partials(run_dir):
    return glob.glob(os.path.join(str(run_dir), ".checkpoint-*.tmp"))


@pytest.mark.timeout(180)
def test_kill_during_checkpoint_write_then_resume_exactly(procs, tmp_path):
    run_dir = tmp_path / "p"
    run = ("swarm.run_id=ckpt", f"inner.sync_every={H}")
    stall = faults_env({"phase": "checkpoint.write", "action": "stall", "seconds": 600, "step": 3 * H})
    p = procs.start(*join_args(None, run_dir, *run, "train.max_outer_steps=100"), name="p", env=stall)
    fired = wait_for(lambda: read_events(run_dir, "fault"), 120, "the stall inside the checkpoint write", procs, ["p"])
    os.killpg(p.pid, signal.SIGKILL)  # kill -9 the peer (and its DHT / p2p daemon) mid-write
    assert procs.wait(p, 30) == -signal.SIGKILL
    assert [(f["phase"], f["action"], f["step"], f["count"]) for f in fired] == [("checkpoint.write", "stall", 3 * H, 1)]

    assert len(_partials(run_dir)) == 1  # the interrupted write is there, never renamed
    committed = load_checkpoint(find_checkpoint(str(run_dir)))
    assert committed["inner_step"] == committed["synced_step"] == 2 * H  # the last committed one
    synced = {r["step"]: r["digest"] for r in ok_syncs(run_dir)}
    assert synced[2 * H] == committed["digest"] and 3 * H in synced  # the sync at 3H happened, its save did not

    q = procs.start(*join_args(None, run_dir, *run, "train.max_outer_steps=5"), name="q")
    assert procs.wait(q, 120) == 0, procs.err("q")[-3000:]
    resumed = read_events(run_dir, "resume")
    assert [(r["step"], r["synced_step"], r["digest"], r["outer_step"]) for r in resumed] == [
        (2 * H, 2 * H, committed["digest"], 2)]
    after = [r for r in ok_syncs(run_dir) if r["time"] > resumed[0]["time"]]
    assert [r["step"] for r in after] == [3 * H, 4 * H, 5 * H]
    final = load_checkpoint(find_checkpoint(str(run_dir)))
    assert final["inner_step"] == 5 * H and final["digest"] == after[-1]["digest"]
    assert not _partials(run_dir)  # the next save cleaned up the interrupted one

    # a corrupt checkpoint: one clear error line, no traceback, exit status 2
    with open(find_checkpoint(str(run_dir)), "r+b") as f:
        f.truncate(1000)
    r = procs.start(*join_args(None, run_dir, *run, "train.max_outer_steps=6"), name="r")
    assert procs.wait(r, 120) == 2
    err = procs.err("r")
    assert "Traceback" not in err and [l for l in err.splitlines() if l.startswith("error:")] == [
        l for l in err.splitlines() if "corrupt" in l], err[-2000:]
    assert "checkpoint" in err and "corrupt" in err


def test_save_is_atomic_when_interrupted(tmp_path):
    save_checkpoint(str(tmp_path), {"format": 1, "x": torch.arange(3)})
    faults.install([{"phase": "checkpoint.write", "action": "fail"}])
    try:
        with pytest.raises(SyncFailed, match="injected"):
            save_checkpoint(str(tmp_path), {"format": 1, "x": torch.arange(5)})
        assert faults.counters() == {"checkpoint.write:fail": 1}
    finally:
        faults.clear()
    assert torch.equal(load_checkpoint(find_checkpoint(str(tmp_path)))["x"], torch.arange(3))
    assert not _partials(tmp_path)
    # a temp file left by a killed save is never read, and the next save removes it
    (tmp_path / ".checkpoint-dead.tmp").write_bytes(b"half a checkpoint")
    assert torch.equal(load_checkpoint(find_checkpoint(str(tmp_path)))["x"], torch.arange(3))
    save_checkpoint(str(tmp_path), {"format": 1, "x": torch.arange(7)})
    assert not _partials(tmp_path)
    assert torch.equal(load_checkpoint(find_checkpoint(str(tmp_path)))["x"], torch.arange(7))


def test_corrupt_or_foreign_checkpoints_are_clear_errors(tmp_path):
    path = save_checkpoint(str(tmp_path), {"format": 1, "x": torch.zeros(1000)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="corrupt or unreadable.*delete it"):
        load_checkpoint(path)
    torch.save({"something": "else"}, path)
    with pytest.raises(CheckpointError, match="not a p2pdiloco checkpoint"):
        load_checkpoint(path)
    assert find_checkpoint(str(tmp_path / "nowhere")) is None


def test_background_writer_copies_the_state_and_keeps_one_write_in_flight(tmp_path, caplog):
    """The training thread hands a checkpoint over and goes on: the file holds the state of that moment
    (changes after submit do not reach it), a save due while a write stalls is skipped (no second copy
    held), and flush waits for the write."""
    run_dir = str(tmp_path)
    x = torch.arange(6, dtype=torch.float32)
    state = {"format": 1, "model": collections.OrderedDict(w=x), "outer": [{"m": x * 2}], "inner_step": 20}
    state["model"]._metadata = {"": {"version": 1}}
    writer = CheckpointWriter()
    faults.install([{"phase": "checkpoint.write", "action": "stall", "seconds": 3, "step": 20}])
    try:
        assert writer.submit(run_dir, state, 20)
        x.add_(100.0)  # training goes on with the live tensors
        assert not writer.submit(run_dir, dict(state, inner_step=25), 25) and writer.skipped == 1
        assert find_checkpoint(run_dir) is None  # submit returned while its write stalls before the rename
        writer.flush()
        assert faults.counters() == {"checkpoint.write:stall": 1}  # the stall fired, at the state's step
    finally:
        faults.clear()
    assert find_checkpoint(run_dir) is not None  # flush waited for it
    got = load_checkpoint(find_checkpoint(run_dir))
    assert got["inner_step"] == 20 and torch.equal(got["model"]["w"], torch.arange(6, dtype=torch.float32))
    assert torch.equal(got["outer"][0]["m"], 2 * torch.arange(6, dtype=torch.float32))
    assert got["model"]._metadata == {"": {"version": 1}}
    assert writer.submit(run_dir, dict(state, inner_step=30), 30)  # idle again: the next one is written
    writer.flush()
    assert load_checkpoint(find_checkpoint(run_dir))["inner_step"] == 30 and not _partials(tmp_path)


def test_a_failed_background_write_keeps_the_last_checkpoint_and_says_so(tmp_path, caplog):
    run_dir = str(tmp_path)
    writer = CheckpointWriter()
    writer.save_now(run_dir, {"format": 1, "inner_step": 10}, 10)
    faults.install([{"phase": "checkpoint.write", "action": "fail", "step": 20}])
    try:
        with caplog.at_level(logging.ERROR, logger="p2pdiloco.checkpoint"):
            assert writer.submit(run_dir, {"format": 1, "inner_step": 20}, 20)
            writer.flush()
        assert faults.counters() == {"checkpoint.write:fail": 1}
    finally:
        faults.clear()
    assert writer.failures == 1 and "checkpoint at step 20 not written" in caplog.text
    assert "last committed checkpoint stays" in caplog.text
    assert load_checkpoint(find_checkpoint(run_dir))["inner_step"] == 10 and not _partials(tmp_path)
    # the run's last checkpoint is written on the caller's thread and its failure raised
    faults.install([{"phase": "checkpoint.write", "action": "fail"}])
    try:
        with pytest.raises(SyncFailed):
            writer.save_now(run_dir, {"format": 1, "inner_step": 30}, 30)
    finally:
        faults.clear()


def test_host_copy_rebuilds_containers_and_copies_tensors():
    pair = collections.namedtuple("pair", "a b")
    x = torch.arange(3.0)
    state = {"n": pair(x, [x]), "size": torch.Size([2, 3]), "t": (x, 1), "s": "text"}
    got = host_copy(state)
    x.add_(10.0)
    assert isinstance(got["n"], pair) and torch.equal(got["n"].a, torch.arange(3.0))
    assert torch.equal(got["n"].b[0], torch.arange(3.0)) and got["size"] == torch.Size([2, 3])
    assert torch.equal(got["t"][0], torch.arange(3.0)) and got["t"][1] == 1 and got["s"] == "text"
