"""``p2pdiloco join --local-workers K``: start K local workers, watch them, take them down together.

The launcher is the process the user started. It holds the rendezvous (a ``torch.distributed``
TCPStore on 127.0.0.1, on a port the kernel picks: no race for a free port) and starts K copies of
the same ``join`` command, worker ``r`` told its rank by the environment (:data:`.group.ENV_RANK`).
Worker 0 is the swarm member; the others never touch the network. The workers stay in the
launcher's process group, so a Ctrl-C in the terminal reaches all of them (workers 1..K-1 ignore it:
rank 0 decides when the machine stops and tells them) and a ``kill`` of the group ends everything.

The watchdog (what "a local worker that dies takes the machine's peer down cleanly" means here):

* worker 0 ends (done, an error, a signal): the others get :data:`END_GRACE_S` seconds to end
  themselves (after a normal finish they already have), then SIGKILL. The launcher exits with
  worker 0's status.
* worker r > 0 ends first with a failure (killed, a crash): SIGTERM to worker 0, which stops at its
  next collective (gloo reports the dead connection: :class:`~p2pdiloco.errors.LocalWorkerLost`) and
  leaves the swarm as any peer does (its goodbye record; syncs in flight are abandoned, so no outer
  step is half-applied: the swarm's group fails that round on every member, and our checkpoint is the
  last complete one); :data:`LEAVE_GRACE_S` seconds later anything left gets SIGKILL. Exit status 1.
* SIGINT/SIGTERM to the launcher are passed on to worker 0 (which stops after its current step; a
  repeat within a second, e.g. the terminal's Ctrl-C reaching both, counts once).
* the launcher itself killed: each worker watches its parent (:func:`watch_parent`) and leaves.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Sequence

from ..errors import ConfigError
from .group import COLLECTIVE_TIMEOUT_S, ENV_PARENT, ENV_RANK, ENV_STORE, ENV_WORLD

__all__ = ["launch", "watch_parent", "END_GRACE_S", "LEAVE_GRACE_S", "MAX_LOCAL_WORKERS"]

logger = logging.getLogger(__name__)

#: after worker 0 ended, how long the other workers get to end by themselves (seconds)
END_GRACE_S = 10.0
#: after a worker r > 0 failed, how long worker 0 gets to leave the swarm cleanly (seconds)
LEAVE_GRACE_S = 30.0
MAX_LOCAL_WORKERS = 64
POLL_S = 0.1


def check_local_workers(k: int, device: str) -> None:
    """Refuse an impossible ``--local-workers`` before anything starts."""
    if not 1 <= k <= MAX_LOCAL_WORKERS:
        raise ConfigError(f"--local-workers ({k}) must be between 1 and {MAX_LOCAL_WORKERS}")
    if device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        if k > n:
            raise ConfigError(f"--local-workers {k} trains one worker per GPU, but this machine has {n} CUDA "
                              f"device(s); use --local-workers {n} or fewer")


def launch(argv: Sequence[str], k: int) -> int:
    """Run ``argv`` (a ``python -m p2pdiloco.cli join ...`` command line) as K local workers; returns the
    exit status (worker 0's, or 1 if another worker failed first)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, k + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    procs: List[subprocess.Popen] = []
    for r in range(k):
        env = dict(os.environ, **{ENV_RANK: str(r), ENV_WORLD: str(k), ENV_STORE: f"127.0.0.1:{store.port}",
                                  ENV_PARENT: str(os.getpid())})
        procs.append(subprocess.Popen(list(argv), env=env))
    logger.info("local workers: " + ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(procs)))

    def forward(signum, frame) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:  # nothing outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        del store


def _watch(procs: List[subprocess.Popen]) -> int:
    while True:
        time.sleep(POLL_S)
        codes = [p.poll() for p in procs]
        if codes[0] is not None:
            _reap(procs[1:], END_GRACE_S)
            return codes[0]
        failed = [(r, c) for r, c in enumerate(codes) if r and c not in (None, 0)]
        if failed:
            r, code = failed[0]
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            print(f"error: local worker {r} (pid {procs[r].pid}) {how}; this machine's peer leaves the swarm "
                  "(run the same command again to resume from its last checkpoint)", file=sys.stderr, flush=True)
            procs[0].send_signal(signal.SIGTERM)
            _reap(procs, LEAVE_GRACE_S)
            return 1


def _reap(procs: List[subprocess.Popen], grace: float) -> None:
    """Wait up to ``grace`` seconds for ``procs`` to end, then SIGKILL the rest."""
    deadline = time.time() + grace
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            logger.warning(f"local worker pid {p.pid} did not end within {grace:.0f} s; killing it")
            p.kill()
            p.wait()


def watch_parent(rank: int) -> None:
    """In a worker: leave when the launcher is gone (killed with SIGKILL, say). Worker 0 stops as on
    SIGTERM (and is killed 30 s later if it could not); the others exit at once (worker 0's next
    collective then fails and it leaves the swarm)."""
    parent = int(os.environ.get(ENV_PARENT, "0"))
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if rank:
            os._exit(1)
        logger.warning("the local-workers launcher is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(LEAVE_GRACE_S)
        os._exit(1)
    threading.Thread(target=watch, name="p2pdiloco-launcher-watch", daemon=True).start()
