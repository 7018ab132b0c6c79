"""Shared fixtures: start the real ``p2pdiloco`` command as a user would, and clean up after it.

Every process is started in its own session (process group) so that teardown kills it together
with its hivemind DHT process and p2pd daemon; teardown asserts that nothing is left behind.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny-diloco.toml")  # tiny-cpu.toml + the blocking fp32 scheme


def cli_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "p2pdiloco.cli", *args]


class Procs:
    """Processes started by one test; all killed (with their process groups) at teardown."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.procs: List[subprocess.Popen] = []

    def start(self, *args: str, name: str, env: Optional[dict] = None) -> subprocess.Popen:
        return self.start_argv(cli_argv(*args), name=name, env=env)

    def start_script(self, script: str, *args: str, name: str, env: Optional[dict] = None) -> subprocess.Popen:
        return self.start_argv([sys.executable, script, *args], name=name, env=env)

    def start_argv(self, argv: List[str], *, name: str, env: Optional[dict] = None) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.out", "w")
        err = open(self.tmp / f"{name}.err", "w")
        e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        p = subprocess.Popen(argv, stdout=out, stderr=err, cwd=str(self.tmp), env=e,
                             start_new_session=True)
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def out(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text()

    def err(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def bootstrap(self, name: str = "boot", timeout: float = 60) -> str:
        p = self.start("bootstrap", "--identity", str(self.tmp / f"{name}.key"), name=name)
        deadline = time.time() + timeout
        while time.time() < deadline:
            lines = [l for l in self.out(name).splitlines() if "/p2p/" in l]
            if lines:
                return lines[0].strip()
            if p.poll() is not None:
                raise AssertionError(f"bootstrap exited early: {self.err(name)[-2000:]}")
            time.sleep(0.2)
        raise AssertionError("bootstrap printed no address in time")

    def wait(self, p: subprocess.Popen, timeout: float) -> int:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{p.name} did not finish in {timeout}s; stderr tail:\n{self.err(p.name)[-3000:]}")

    def kill_all(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def leftovers(self) -> List[int]:
        """Pids of processes still alive in any of our process groups."""
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                state, pgid = fields[0], int(fields[2])
            except (OSError, IndexError, ValueError):
                continue
            if state != "Z" and pgid in {p.pid for p in self.procs}:
                alive.append(int(pid))
        return alive


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.kill_all()
    deadline = time.time() + 10
    while ps.leftovers() and time.time() < deadline:
        time.sleep(0.2)
    assert not ps.leftovers(), f"processes left behind: {ps.leftovers()}"


def reset_gates(nodes) -> None:
    """Bans, offences and memberships are per node: a clean slate for the next test (module-scoped nodes)."""
    for n in nodes:
        n.gate.forgive()
        n.gate.configure(ban_after=3, ban_seconds=600)
        n.gate._members.clear()


@contextlib.contextmanager
def loopback_nodes(n: int):
    """``n`` in-process SwarmNodes on 127.0.0.1 (each with its own DHT process and daemon), the first one
    the others' initial peer; all shut down afterwards."""
    from p2pdiloco.swarm.node import SwarmNode

    loop = ["/ip4/127.0.0.1/tcp/0"]
    first = SwarmNode([], host_maddrs=loop)
    ns = [first]
    try:
        for _ in range(n - 1):
            ns.append(SwarmNode(first.visible_maddrs(), host_maddrs=loop))
        yield ns
    finally:
        for node in ns:
            node.shutdown()
