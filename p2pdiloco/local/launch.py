"""``p2pdiloco join --local-workers K``: start K local workers, watch them, take them down together.

The launcher is the process the user started. It holds the rendezvous (a ``torch.distributed``
TCPStore listening on 127.0.0.1 only, on a port the kernel picks: no race for a free port; see
:func:`loopback_store`) and starts K copies of the same ``join`` command, worker ``r`` told its
rank by the environment (:data:`.group.ENV_RANK`). Worker 0 is the swarm member; the others never
touch the network (their collectives are on loopback too: :meth:`.group.LocalGroup.connect`). The
workers stay in the launcher's process group, so a Ctrl-C in the terminal reaches all of them
(workers 1..K-1 ignore it: rank 0 decides when the machine stops and tells them) and a ``kill`` of
the group ends everything.

The watchdog (what "a local worker that dies takes the machine's peer down cleanly" means here):

* worker 0 ends (done, an error, a signal): the others get :data:`END_GRACE_S` seconds to end
  themselves (after a normal finish they already have), then SIGKILL. The launcher exits with
  worker 0's status.
* worker r > 0 ends first with a failure (killed, a crash): SIGTERM to worker 0, which stops at its
  next collective (gloo reports the dead connection: :class:`~p2pdiloco.errors.LocalWorkerLost`) and
  leaves the swarm as any peer does (its goodbye record; syncs in flight are abandoned, so no outer
  step is half-applied: the swarm's group fails that round on every member, and our checkpoint is the
  last complete one); :data:`LEAVE_GRACE_S` seconds later anything left gets SIGKILL. Exit status 1.
* worker r sends no heartbeat for ``local.heartbeat_timeout`` seconds (60 by default): it is alive but
  stopped (SIGSTOP, a debugger) or frozen (holding the interpreter, stuck in the kernel), which no
  collective notices until its 2-hour timeout. Each worker beats from a thread (:func:`watch_parent`,
  one byte every :data:`HEARTBEAT_PERIOD_S` seconds on a pipe to the launcher), so a beat says the
  process runs, not that it makes progress: worker 0 may legitimately wait minutes on the network
  while the others wait for it. The launcher names the worker, SIGKILLs it (a stopped process can do
  nothing else) and goes on as for a dead worker: worker 0 leaves the swarm (or, if worker 0 itself
  was silent, the others end). Exit status 1. A worker's first beat may take
  :data:`FIRST_BEAT_GRACE_S` seconds (its start). If the launcher itself was stopped too (Ctrl-Z
  stops the whole process group), its clocks restart when it runs again.
* SIGINT/SIGTERM to the launcher are passed on to worker 0 (which stops after its current step; a
  repeat within a second, e.g. the terminal's Ctrl-C reaching both, counts once).
* the launcher itself killed: each worker watches its parent (:func:`watch_parent`) and leaves.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Sequence, Tuple

from ..errors import ConfigError
from .group import COLLECTIVE_TIMEOUT_S, ENV_PARENT, ENV_RANK, ENV_STORE, ENV_WORLD, LOOPBACK

__all__ = ["launch", "loopback_store", "watch_parent", "END_GRACE_S", "LEAVE_GRACE_S", "MAX_LOCAL_WORKERS",
           "HEARTBEAT_PERIOD_S", "FIRST_BEAT_GRACE_S", "ENV_HEARTBEAT"]

logger = logging.getLogger(__name__)

#: after worker 0 ended, how long the other workers get to end by themselves (seconds)
END_GRACE_S = 10.0
#: after a worker r > 0 failed, how long worker 0 gets to leave the swarm cleanly (seconds)
LEAVE_GRACE_S = 30.0
MAX_LOCAL_WORKERS = 64
POLL_S = 0.1
#: a worker writes one byte to its heartbeat pipe this often (seconds)
HEARTBEAT_PERIOD_S = 0.5
#: how long a worker may take to its first beat (python, torch and the config loading)
FIRST_BEAT_GRACE_S = 120.0
#: a gap this long in the launcher's own polling means the launcher was stopped too (seconds)
LAUNCHER_GAP_S = 2.0
#: the write end of the worker's heartbeat pipe (a file descriptor number), set by the launcher
ENV_HEARTBEAT = "P2PDILOCO_LOCAL_HEARTBEAT"


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


def launch(argv: Sequence[str], k: int, heartbeat_timeout: float = 60.0) -> int:
    """Run ``argv`` (a ``python -m p2pdiloco.cli join ...`` command line) as K local workers; returns the
    exit status (worker 0's, or 1 if another worker failed or went silent first)."""
    store = loopback_store(k + 1)
    procs: List[subprocess.Popen] = []
    beats: List[int] = []  # read ends of the heartbeat pipes
    for r in range(k):
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        env = dict(os.environ, **{ENV_RANK: str(r), ENV_WORLD: str(k), ENV_STORE: f"{LOOPBACK}:{store.port}",
                                  ENV_PARENT: str(os.getpid()), ENV_HEARTBEAT: str(wfd)})
        try:
            procs.append(subprocess.Popen(list(argv), env=env, pass_fds=(wfd,)))
        finally:
            os.close(wfd)
        beats.append(rfd)
    logger.info("local workers: " + ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(procs)))

    def forward(signum, frame) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs, _Heartbeats(beats, heartbeat_timeout))
    finally:
        for fd in beats:
            os.close(fd)
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:  # nothing outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        del store


def loopback_store(world_size: int, timeout: float = COLLECTIVE_TIMEOUT_S):
    """The rendezvous: a ``torch.distributed`` TCPStore server listening on 127.0.0.1 only, on a port the
    kernel picks. (Given a host, TCPStore's server binds every interface: the host is only where its
    clients connect. So the listening socket is made here, on loopback, and handed over; the store
    owns and closes it.)"""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(LOOPBACK, port, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout), master_listen_fd=sock.detach())


class _Heartbeats:
    """When each worker last beat (monotonic seconds), read from the pipes without blocking."""

    def __init__(self, fds: List[int], timeout: float):
        self.fds, self.timeout = fds, timeout
        now = time.monotonic()
        self.last = [now] * len(fds)
        self.started = [False] * len(fds)
        self._polled = now

    def silent(self) -> List[Tuple[int, float]]:
        """(rank, seconds without a beat) of the workers past their timeout."""
        now = time.monotonic()
        if now - self._polled > LAUNCHER_GAP_S:  # we were stopped too (Ctrl-Z): nobody could beat
            self.last = [now] * len(self.fds)
        self._polled = now
        out = []
        for r, fd in enumerate(self.fds):
            try:
                if os.read(fd, 4096):
                    self.last[r], self.started[r] = now, True
            except BlockingIOError:
                pass
            limit = self.timeout if self.started[r] else max(self.timeout, FIRST_BEAT_GRACE_S)
            if now - self.last[r] > limit:
                out.append((r, now - self.last[r]))
        return out


def _watch(procs: List[subprocess.Popen], beats: _Heartbeats) -> int:
    while True:
        time.sleep(POLL_S)
        codes = [p.poll() for p in procs]
        if codes[0] is not None:
            _reap(procs[1:], END_GRACE_S)
            return codes[0]
        silent = [(r, t) for r, t in beats.silent() if codes[r] is None]
        if silent:
            r, quiet = silent[0]
            fate = ("this machine's peer leaves the swarm" if r else
                    "it is the swarm member: it is killed without a goodbye (the swarm drops it when its record "
                    "expires) and the other local workers end")
            print(f"error: local worker {r} (pid {procs[r].pid}) sent no heartbeat for {quiet:.0f} s "
                  f"(local.heartbeat_timeout = {beats.timeout:g}): it is stopped or frozen; {fate} "
                  "(run the same command again to resume from its last checkpoint)", file=sys.stderr, flush=True)
            procs[r].kill()  # all a stopped process can take; the others' next collective then fails
            procs[r].wait()
            if r:
                procs[0].send_signal(signal.SIGTERM)
                _reap(procs, LEAVE_GRACE_S)
            else:
                _reap(procs[1:], END_GRACE_S)
            return 1
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
    """In a worker: beat (the launcher's liveness check), and leave when the launcher is gone (killed with
    SIGKILL, say). Worker 0 stops as on SIGTERM (and is killed 30 s later if it could not); the others
    exit at once (worker 0's next collective then fails and it leaves the swarm)."""
    _start_heartbeat()
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


def _start_heartbeat() -> None:
    """One byte every HEARTBEAT_PERIOD_S seconds on the launcher's pipe, from a daemon thread, until the
    launcher stops reading (gone: the parent watch ends us)."""
    fd = int(os.environ.get(ENV_HEARTBEAT, "-1"))
    if fd < 0:
        return
    os.set_blocking(fd, False)

    def beat() -> None:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:  # the launcher is not reading just now: the pipe is full
                pass
            except OSError:  # the launcher is gone
                return
            time.sleep(HEARTBEAT_PERIOD_S)
    threading.Thread(target=beat, name="p2pdiloco-heartbeat", daemon=True).start()
