"""Nothing outlives a crashed peer (issue 16, item 1; p2pdiloco/swarm/lifeline.py, identity.py).

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
