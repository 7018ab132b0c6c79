"""The benchmarks' local processes: ``p2pdiloco`` CLI commands (a bootstrap, volunteers) on this machine,
each in its own process group with its output in files of a work folder, all killed at the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence

from ..errors import UserError

__all__ = ["LocalProcs", "child_env"]


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL="WARNING", **(extra or {}))


class LocalProcs:
    """The CLI processes of one run (a benchmark part, a swarm size), each in its own process group; all
    killed at the end."""

    def __init__(self, work: str):
        self.work, self.procs = work, []

    def start(self, name: str, *args: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        out = open(os.path.join(self.work, f"{name}.out"), "w")
        err = open(os.path.join(self.work, f"{name}.err"), "w")
        p = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", *args], stdout=out, stderr=err, cwd=self.work,
                             env=child_env(env), start_new_session=True)
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def bootstrap(self, timeout: float = 90) -> str:
        p = self.start("boot", "bootstrap", "--identity", os.path.join(self.work, "boot.key"))
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(os.path.join(self.work, "boot.out")) as f:
                lines = [ln.strip() for ln in f if "/p2p/" in ln]
            if lines:
                return lines[0]
            if p.poll() is not None:
                break
            time.sleep(0.2)
        raise UserError(f"the bootstrap peer printed no address (see {self.work}/boot.err)")

    def tail(self, name: str, n: int = 1500) -> str:
        try:
            with open(os.path.join(self.work, f"{name}.err")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait(self, names: Sequence[str], timeout: float) -> Dict[str, Optional[int]]:
        deadline = time.time() + timeout
        byname = {p.name: p for p in self.procs}  # type: ignore[attr-defined]
        codes: Dict[str, Optional[int]] = {}
        for n in names:
            try:
                codes[n] = byname[n].wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                codes[n] = None
        return codes

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
