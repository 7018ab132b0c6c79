"""Nothing outlives a crashed peer (p2pdiloco/swarm/lifeline.py, identity.py).

* ``kill -9`` of a ``join`` main process (its pid only, not its process group) in a swarm of a
  bootstrap peer and two volunteers: every process it had started (hivemind's DHT process, p2pd,
  whatever else) is gone within 5 s; a restart at once with the same identity file, port and run
  directory takes the stale identity lock over (and says so), resumes from its checkpoint and
  completes a sync with the other volunteer;
* the same for ``bootstrap``: after ``kill -9`` and a restart with the same identity and port it has
  the same address, and a client bootstraps through it again.

The descendants are collected from the process tree (psutil) before the kill, and matched by pid
*and* start time afterwards, so a reused pid cannot pass for a survivor or hide one.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from typing import List, Tuple

import psutil
import pytest

from elastic_support import join_args, ok_syncs, read_events, wait_for

H = 10
GONE_WITHIN_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> List[Tuple[int, float, str]]:
    """(pid, start time, name) of every live descendant of ``pid``."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append((p.pid, p.create_time(), p.name()))
        except psutil.Error:
            pass
    return out


def _alive(procs_before: List[Tuple[int, float, str]]) -> List[Tuple[int, float, str]]:
    out = []
    for pid, started, name in procs_before:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                out.append((pid, started, name))
        except psutil.Error:
            pass
    return out


def _sigkill_and_check_tree(procs, proc) -> List[Tuple[int, float, str]]:
    """kill -9 ``proc`` (its pid only); assert it died of it and left no descendant alive after 5 s."""
    before = _tree(proc.pid)
    names = sorted(name for _, _, name in before)
    # hivemind's DHT process (a fork: same name as ours) and its libp2p daemon
    assert "p2pd" in names and len(before) >= 2, before
    os.kill(proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    assert procs.wait(proc, 10) == -signal.SIGKILL
    left = _alive(before)
    while left and time.monotonic() - t_kill < GONE_WITHIN_S:
        time.sleep(0.1)
        left = _alive(before)
    assert not left, f"still running {time.monotonic() - t_kill:.1f} s after kill -9 of {proc.pid}: {left}"
    return before


def _assert_took_over_stale_lock(procs, name: str, key) -> None:
    err = procs.err(name)
    assert f"identity lock {key}.lock is stale" in err and "taking the lock over" in err, err[-3000:]


@pytest.mark.timeout(120)
def test_sigkilled_join_leaves_nothing_and_restarts_from_its_checkpoint(procs, tmp_path):
    addr = procs.bootstrap()
    port = _free_port()
    key, run_dir = tmp_path / "a.key", tmp_path / "a"
    run = ("swarm.run_id=crash-cleanup", f"inner.sync_every={H}", "swarm.min_peers_to_start=2",
           "train.max_outer_steps=1000")
    a_args = join_args(addr, run_dir, *run, f"swarm.identity_path={key}",
                       f"swarm.host_maddrs=/ip4/127.0.0.1/tcp/{port}")
    a = procs.start(*a_args, name="a")
    procs.start(*join_args(addr, tmp_path / "b", *run, f"swarm.identity_path={tmp_path / 'b.key'}"), name="b")
    wait_for(lambda: len(ok_syncs(run_dir)) >= 2 and os.path.exists(run_dir / "checkpoint.pt"), 60,
             "a's first syncs and checkpoint", procs, ["a", "b"])
    synced_before = {r["step"] for r in ok_syncs(run_dir)}

    _sigkill_and_check_tree(procs, a)
    assert not read_events(run_dir, "summary")  # it really died, nothing shut down cleanly

    t_restart = time.time()
    a2 = procs.start(*a_args, name="a2")
    resumed = wait_for(lambda: [r for r in read_events(run_dir, "resume") if r["time"] > t_restart], 45,
                       "the restarted peer's resume", procs, ["a2"])
    assert resumed[0]["synced_step"] in synced_before, (resumed, synced_before)  # its checkpoint, not a fresh start
    synced = wait_for(lambda: [r for r in ok_syncs(run_dir) if r["time"] > t_restart and r["group_size"] == 2], 45,
                      "a sync of the restarted peer with b", procs, ["a2", "b"])
    assert synced[0]["step"] > resumed[0]["synced_step"], (synced, resumed)
    assert a2.poll() is None
    _assert_took_over_stale_lock(procs, "a2", key)
    assert "address already in use" not in procs.err("a2")


def _address(procs, p, name: str, timeout: float = 45) -> str:
    def printed():
        assert p.poll() is None, procs.err(name)[-3000:]
        return [l.strip() for l in procs.out(name).splitlines() if "/p2p/" in l]

    return wait_for(printed, timeout, f"{name}'s address", procs, [name])[0]


@pytest.mark.timeout(90)
def test_sigkilled_bootstrap_leaves_nothing_and_serves_again_on_restart(procs, tmp_path):
    key = tmp_path / "boot.key"
    args = ("bootstrap", "--identity", str(key), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{_free_port()}")
    b1 = procs.start(*args, name="b1")
    addr = _address(procs, b1, "b1")

    _sigkill_and_check_tree(procs, b1)

    b2 = procs.start(*args, name="b2")
    assert _address(procs, b2, "b2") == addr  # same identity, same port
    _assert_took_over_stale_lock(procs, "b2", key)
    # it serves again: a client bootstraps through it (an unreachable bootstrap peer is exit status 2)
    status = procs.start("status", "--initial-peers", addr, "--run-id", "nobody", name="status")
    assert procs.wait(status, 45) == 0, procs.err("status")[-3000:]
    assert "no live peers in run 'nobody'" in procs.out("status")
    assert b2.poll() is None


# ---- the identity lock on its own (fast, no swarm) --------------------------------------------------

def _lock_then_fork_then_wait(path: str, ready, grandchild_pid) -> None:
    from p2pdiloco.identity import prepare_identity

    prepare_identity(path)
    pid = os.fork()  # like hivemind's DHT process: a fork, alive after we die
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    grandchild_pid.value = pid
    ready.set()
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_fork_does_not_keep_the_lock_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    import multiprocessing

    from p2pdiloco.identity import prepare_identity, release_identity

    path = str(tmp_path / "peer.key")
    ctx = multiprocessing.get_context("fork")
    ready, grandchild = ctx.Event(), ctx.Value("i", 0)
    holder = ctx.Process(target=_lock_then_fork_then_wait, args=(path, ready, grandchild), daemon=True)
    holder.start()
    try:
        assert ready.wait(30)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        assert holder.exitcode == -signal.SIGKILL
        assert psutil.pid_exists(grandchild.value)  # the fork outlives the holder, yet holds no lock
        with caplog.at_level("WARNING", logger="p2pdiloco.identity"):
            prepare_identity(path)
        release_identity(path)
        stale = [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]
        assert len(stale) == 1 and f"process {holder.pid} " in stale[0] and "taking the lock over" in stale[0], stale
    finally:
        if holder.is_alive():
            holder.kill()
        if grandchild.value:
            try:
                os.kill(grandchild.value, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(30)
def test_a_reused_pid_is_not_the_holder_and_leftover_helpers_are_stopped(tmp_path, caplog, monkeypatch):
    import json
    import subprocess
    import sys

    from p2pdiloco import identity

    monkeypatch.setattr(identity, "LEFTOVER_WAIT_S", 0.5)
    path = str(tmp_path / "peer.key")
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = psutil.Process(helper.pid).create_time()
        # the recorded holder's pid now belongs to another process (ours: alive, but started at another time)
        record = {"pid": os.getppid(), "started": 1.0, "argv": ["p2pdiloco", "join"],
                  "helpers": [[helper.pid, started], [os.getpid(), 2.0]]}
        with open(path + ".lock", "w") as f:
            json.dump(record, f)
        with caplog.at_level("WARNING", logger="p2pdiloco.identity"):
            identity.prepare_identity(path)
        try:
            assert helper.wait(10) == -signal.SIGKILL  # the recorded helper that did not exit was stopped
            messages = [r.getMessage() for r in caplog.records]
            assert any("is stale" in m and f"process {os.getppid()} " in m for m in messages), messages
            assert any(f"leftover process {helper.pid} " in m for m in messages), messages
            assert not any(f"leftover process {os.getpid()} " in m for m in messages)  # a reused pid: spared
            with open(path + ".lock") as f:
                assert json.load(f)["pid"] == os.getpid()
        finally:
            identity.release_identity(path)
        with open(path + ".lock") as f:
            assert f.read() == ""  # a clean release leaves no holder behind
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()


@pytest.mark.timeout(240)
def test_demo_stopped_by_sigterm_leaves_nothing(procs, tmp_path):
    """`p2pdiloco demo` stopped by SIGTERM (`timeout`, a service manager, `kill`: the signal reaches the
    demo only, its bootstrap and volunteers run in sessions of their own) stops everything it started.
    Before the first sync, its status line shows the volunteers' steps."""
    out = tmp_path / "demo"
    demo = procs.start("demo", "--peers", "2", "--outer-steps", "500", "--out", str(out), name="demo")
    def status():
        return [l for l in procs.out("demo").splitlines() if l.startswith("p0:")]

    wait_for(lambda: any(" step " in l or " outer " in l for l in status()), 150,
             "the demo's status line to show steps", procs, ["demo"])
    tree = _tree(demo.pid)
    assert {"p2pd"} <= {name for _, _, name in tree} and len(tree) >= 3 + 2 * 2, tree  # boot, 2 peers, DHTs, p2pds
    os.kill(demo.pid, signal.SIGTERM)
    assert procs.wait(demo, 30) != 0
    deadline = time.time() + 15
    while _alive(tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(tree), f"left running after the demo's SIGTERM: {_alive(tree)}"
