"""Nothing outlives a crashed peer: hivemind's DHT process and its p2p daemon end with the main process.

hivemind runs the DHT in a forked process, which starts the libp2p daemon (``p2pd``) as its own
child. Neither notices when the main process dies without shutting them down (SIGKILL, OOM kill,
a crash): they kept running, kept the listen port, and ignored SIGTERM (a fork inherits the main
process's Python signal handlers, which only set a stop flag nobody reads in the fork).

:func:`start_dht` starts a subclass of ``hivemind.DHT`` that fixes this from both sides:

* in the DHT process, a watchdog thread checks every :data:`POLL_S` seconds that its parent is
  still the process that started it. ``os.getppid()`` changes as soon as the parent dies, whatever
  killed it, and cannot be fooled by pid reuse (an orphan is re-parented to init or a subreaper).
  When the parent is gone it stops the daemon (SIGTERM, SIGKILL after :data:`GRACE_S`), removes its
  socket files and exits. ``prctl(PR_SET_PDEATHSIG)`` would not do: it fires when the *thread* that
  forked exits, and a SwarmNode may be started from any thread;
* SIGTERM in the DHT process: while the main process lives it is ignored (a ``kill`` of the whole
  process group, e.g. ``killpg``, must leave the DHT to the main process's clean shutdown, which
  still stores the goodbye record); with the main process gone it exits at once, as above;
* in the main process, ``terminate()`` (what hivemind calls when the DHT does not stop within its
  grace period, and what multiprocessing calls at exit) stops the daemon and then the DHT process
  with SIGKILL, so it works although the DHT ignores SIGTERM.

The DHT process inherits no identity lock (:mod:`p2pdiloco.identity` closes it in every fork), so
the lock ends with the main process.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, List

import psutil

__all__ = ["start_dht", "stop_tree", "descendants", "POLL_S", "GRACE_S"]

logger = logging.getLogger(__name__)

#: how often the DHT process checks that the main process is alive, seconds
POLL_S = 0.2
#: how long the p2p daemon gets to exit after SIGTERM before SIGKILL, seconds
GRACE_S = 1.0


def descendants(pid: int) -> List[int]:
    """Pids of every live descendant of ``pid`` (children first); empty if ``pid`` is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def stop_tree(pid: int, *, include_root: bool, grace: float = GRACE_S) -> None:
    """Stop the descendants of ``pid`` (SIGTERM, then SIGKILL after ``grace`` s), then ``pid`` itself
    with SIGKILL if ``include_root``. Never raises."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)
    if include_root:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _guard_child(parent_pid: int, on_orphan: Callable[[], None]) -> None:
    """In the DHT process: call ``on_orphan`` (which must not return) once ``parent_pid`` is gone."""

    def orphaned() -> bool:
        return os.getppid() != parent_pid

    def on_sigterm(signum: int, frame: Any) -> None:
        if orphaned():
            on_orphan()
        logger.debug("DHT process: SIGTERM ignored, the main process shuts the DHT down")

    signal.signal(signal.SIGTERM, on_sigterm)  # replaces the main process's handler inherited by the fork

    def watch() -> None:
        while not orphaned():
            time.sleep(POLL_S)
        on_orphan()

    threading.Thread(target=watch, name="p2pdiloco-lifeline", daemon=True).start()


@functools.lru_cache(maxsize=None)
def _dht_class() -> type:
    import hivemind

    class _DHT(hivemind.DHT):
        def __init__(self, *args: Any, **kwargs: Any):
            self._lifeline_parent = os.getpid()  # before hivemind forks (start=True forks in __init__)
            self._orphan_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def run(self) -> None:
            _guard_child(self._lifeline_parent, self._exit_orphaned)
            super().run()

        def _exit_orphaned(self) -> None:
            if not self._orphan_lock.acquire(blocking=False):  # the watchdog and SIGTERM both got here
                while True:
                    time.sleep(60)
            try:
                logger.warning(f"DHT process {os.getpid()}: the main process {self._lifeline_parent} is gone; "
                               "stopping the p2p daemon and exiting")
                stop_tree(os.getpid(), include_root=False)
                p2p = getattr(getattr(self, "_node", None), "p2p", None)
                for attr in ("_daemon_listen_maddr", "_client_listen_maddr"):
                    try:
                        os.remove(getattr(p2p, attr)["unix"])
                    except Exception:
                        pass
            finally:
                os._exit(0)

        def terminate(self) -> None:
            if self.pid is not None and self.pid != os.getpid():
                stop_tree(self.pid, include_root=True)

    return _DHT


def start_dht(**kwargs: Any) -> Any:
    """Start a ``hivemind.DHT`` (same keyword arguments, ``start=True``) whose process and p2p daemon
    exit within about a second of the main process's death, by any signal (see the module docstring)."""
    return _dht_class()(start=True, **kwargs)
