"""Sync jobs and the background threads that run them.

A fragment's sync is a :class:`SyncJob`: created at its send step with this peer's pseudo-gradient,
run on a :class:`SyncWorker` (one daemon thread, jobs in submission order) while training goes on,
and resolved by the training loop at its due step (:mod:`.overlap` says which step that is per mode)
into a :class:`SyncReport`.
:func:`solo_allreduce` is the all-reduce of a job alone (:func:`.core.group_allreduce` the one in a group);
:class:`BandwidthMeter` measures the traffic they cause.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..compression import Codec

__all__ = ["SyncJob", "SyncReport", "SyncWorker", "BandwidthMeter", "solo_allreduce", "note_coverage"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SyncJob:
    """One fragment sync between its send step and its due step."""

    fragment: int
    round: int
    send_step: int
    due_step: int
    delta: torch.Tensor            # this peer's flat fp32 pseudo-gradient, as measured
    weight: float                  # samples behind it
    epoch: int                     # DiLoCo's state epoch at launch; results of an older epoch are dropped
    group: concurrent.futures.Future = None   # the Group (or SyncFailed from matchmaking)
    future: concurrent.futures.Future = None  # done when the job finished (ok or failed)
    launched: float = field(default_factory=time.perf_counter)
    # filled in by the worker
    ok: bool = False
    applied: bool = False          # the average went into the global copy
    failed: bool = False
    group_size: int = 0
    seconds: float = 0.0           # launch to result, wall clock
    bytes_sent: int = 0
    bytes_received: int = 0
    digest: str = ""
    error: str = ""
    missed: bool = False
    extra: dict = field(default_factory=dict)  # the reducer's info() after a successful sync
    group_wait: float = 0.0        # seconds the worker waited for the group (formation not done in time)
    steps: int = 0                 # inner steps behind ``delta`` (a resend's included)
    scale: float = 1.0             # what is sent is delta * scale (DiLoCo.step_scale: normalized to H steps)
    coverage: Any = None           # swarm.allreduce.Coverage of the applied result (None alone)
    covered_weight: float = 0.0    # total sample weight the applied average covers (W)
    # counted by the loop
    overlapped_steps: int = 0      # inner steps completed while the job was still running


@dataclass
class SyncReport:
    """What one fragment sync did (one line of metrics.jsonl)."""

    step: int                 # schedule position after which the pseudo-gradient was sent
    fragment: int
    round: int                # the fragment's outer round (0-based)
    ok: bool
    group_size: int = 0
    seconds: float = 0.0      # from sending to the averaged result (group formation included if not prepared)
    samples: int = 0          # samples this peer contributed (its weight)
    bytes_sent: int = 0       # during this sync, payload and framing
    bytes_received: int = 0
    digest: str = ""          # of the fragment's θ and momentum after the sync
    error: str = ""
    missed: bool = False      # the round's group closed without us: the caller must catch up
    applied_step: int = 0     # schedule position after which the result reached the model
    wait_seconds: float = 0.0  # how long the training loop blocked on this sync
    overlapped_steps: int = 0  # inner steps taken while its all-reduce was in flight
    peak_bytes_per_s: float = 0.0  # peak traffic (sent + received, 1 s window) since the previous report
    #: more fields for the sync event: the reducer's info() (after a success) and group_wait_seconds
    #: (how long the sync waited for its group: 0 when formation, started ahead of time, was done)
    extra: Dict[str, object] = field(default_factory=dict)


class SyncWorker:
    """One daemon thread running submitted callables in order (a daemon, unlike a ThreadPoolExecutor
    worker, so a sync stuck in the network never keeps the process from exiting). A worker that runs
    torch code (``torch_work``) is given up to ``EXIT_GRACE`` seconds at interpreter exit to finish
    what it started: a thread stopped inside a torch kernel aborts the process ("terminate called
    without an active exception")."""

    EXIT_GRACE = 15.0

    def __init__(self, name: str = "p2pdiloco-sync", torch_work: bool = True):
        self._q: "queue.Queue[Optional[Tuple[concurrent.futures.Future, Callable, tuple]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if torch_work:
            _WORKERS.add(self)

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def close(self) -> None:
        self._q.put(None)


_WORKERS: "weakref.WeakSet[SyncWorker]" = weakref.WeakSet()


@atexit.register
def _finish_workers_at_exit() -> None:
    workers = list(_WORKERS)
    for w in workers:
        w.close()
    deadline = time.monotonic() + SyncWorker.EXIT_GRACE
    for w in workers:
        w._thread.join(max(0.0, deadline - time.monotonic()))


class BandwidthMeter:
    """Peak bytes per second (sent + received) over any ``window`` seconds, sampled every ``period`` s.

    ``take_peak()`` returns the peak since its previous call (per sync event); ``peak`` is the run's.
    """

    def __init__(self, traffic, window: float = 1.0, period: float = 0.05):
        self.traffic, self.window, self.period = traffic, window, period
        self.peak = 0.0
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._samples: "deque[Tuple[float, int]]" = deque()
        self._thread = threading.Thread(target=self._run, name="p2pdiloco-meter", daemon=True)
        self._thread.start()

    def _total(self) -> int:
        sent, recv = self.traffic.snapshot()
        return sent + recv

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def sample(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        total = self._total()
        with self._lock:
            self._samples.append((now, total))
            while len(self._samples) > 1 and now - self._samples[1][0] >= self.window:
                self._samples.popleft()
            t0, b0 = self._samples[0]
            if now - t0 >= self.window:  # a full window: its average rate
                rate = (total - b0) / (now - t0)
                self.peak = max(self.peak, rate)
                self._since = max(self._since, rate)

    def take_peak(self) -> float:
        with self._lock:
            peak, self._since = self._since, 0.0
        return peak

    def close(self) -> None:
        self._stop.set()



def solo_allreduce(codec: Codec) -> Callable[..., torch.Tensor]:
    """The all-reduce of a group of one: what would have crossed the wire is what a lone peer applies too."""
    def allreduce(vec: torch.Tensor, phase: str, phase_codec: Optional[Codec] = None) -> torch.Tensor:
        c = phase_codec or codec
        return c.roundtrip(vec) if c.relative_error_bound else vec.clone()
    return allreduce


def note_coverage(job: SyncJob, group) -> None:
    """Group size, total weight and, for a round over fewer members, who was left out: in the job's report."""
    cov = job.coverage
    if cov is None:  # alone (or a fake swarm without coverage): everyone we know of is in
        job.covered_weight = job.weight * group.size
        return
    job.group_size = len(cov.members)
    job.covered_weight = cov.weight
    job.extra["coverage"] = cov.kind
    if cov.left_out:
        job.extra["left_out"] = list(cov.left_out)
    if cov.subgroups:
        job.extra["subgroups"] = cov.subgroups
