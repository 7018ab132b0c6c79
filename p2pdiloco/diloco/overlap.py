"""Communication in the background, and the rules that apply its results (algorithm.md §3).

A fragment's sync is a :class:`SyncJob`. At its *send step* the training loop takes the fragment's
pseudo-gradient and hands the job to a :class:`SyncWorker`, a background thread that runs the jobs in
submission order (``reducer.reduce`` with its all-reduce calls); training goes on meanwhile. Group
formation for an upcoming sync is queued ``prepare_steps`` inner steps early on a second worker (so
it never waits behind an all-reduce in flight), and at the send step only the all-reduce is left.
When the averaged Δ arrives, the worker applies it to the fragment's **global copy** at once, under
``DiLoCo.state_lock``:
``(θ, b) ← OuterOpt(θ, b, Δ)`` — the global copy and the Nesterov momentum only ever take true
averages, in round order. The job's *due step* is when the loop applies the result to the model;
if the job is not finished then, the loop waits and records the wait. A failed job (``SyncFailed``:
every member of the group fails together) applies nothing anywhere.

What the model gets, per mode (fragment p, round k sent after inner step s_k, ``M`` peers):

``tau`` (Streaming DiLoCo, arXiv 2501.18512, Algorithm 2). Sent: Δ_m = θ − θ_m(s_k), θ the global
    copy. Due at s_k + tau: θ~ = OuterOpt(θ, Δ) (the global copy from before the result, as the
    paper says) and θ_m ← alpha·θ_m + (1 − alpha)·θ~ (``torch.lerp``). ``tau = 0, alpha = 0`` is
    blocking DiLoCo, bit for bit. On failure the model keeps its progress, which the next round's
    Δ_m = θ − θ_m then contains.

``delay`` (one-step delay, DiLoCoX arXiv 2506.21263; the Eager Updates paper's naive baseline).
    Each peer remembers the point W_m its current inner phase started from. At s_k:
    Δ_m(k) = W_m − θ_m(s_k); the loop waits for round k−1 (sent at s_{k−1}, a whole inner phase
    earlier: its due step is s_k), so the global copy θ holds rounds 0..k−1; the next phase starts
    from it, W_m ← θ, θ_m ← θ; then round k is sent. Round k's average reaches the model one
    round late, at s_{k+1}. (In round 0 there is nothing to apply: the model restarts from the
    initial θ and its progress arrives with round 0's average.)

``eager`` (Eager Updates, Kale et al., arXiv 2502.12996). As ``delay`` (round k−1's true average
    Δ(k−1) reaches the global copy θ at s_k), but the peer's own fresh term takes effect at once
    (``streaming.eager_estimate``):

    - ``paper`` (default): the published rule. Each peer steps *its own* outer state with
      Δ~_m(k) = Δ(k−1) + δ_k, where δ_k = ρ_k·Δ'_m(k) − (the own term it added last) replaces its
      stale term in the late average by its fresh one. Δ'_m(k) is what round k sends (a failed
      round's Δ'_m resent in it); ρ = w_m/W is the peer's share of a round's average, estimated
      before the round ends: ρ_k = ρ_{k−1}·M_{k−1}/M_k from round k−1's covered weight when that
      arrived, else 1/M_k (with equal weights ρ = 1/M, the paper's formula). The term subtracted is
      bit for bit the term added before, whatever happened in between (failed rounds, resends,
      other weights or group sizes), so the offset below holds the peer's latest own term alone and
      an estimate's error never accumulates. Nesterov SGD is linear in its gradient, so this
      peer's trajectory is exactly the agreed one (θ, b advanced by the true averages alone,
      identical on every peer, digest-checked) plus a per-peer offset (f, e)::

          e ← μ·e + δ_k;  f ← f − lr·(δ_k + μ·e)          (round k−1's average arrived)
          e ← μ·(b + e) + δ_k − b;  f ← f − lr·(δ_k + μ·(b + e))   (it did not: first round, failure)

      and the next inner phase starts from W_m ← θ + f. The second line is the paper's peer taking
      a step the agreed copy does not take (Δ~ = δ_k alone; also a peer's first round after it
      downloaded a state). The offset and the own term in it are this peer's own (saved in
      checkpoints, zeroed when it adopts a downloaded state); the equality with the paper's per-peer
      update sequence, through failed rounds, resends, changing weights and group sizes and a join,
      is checked in one process (tests/test_streaming.py).
    - ``fresh_heuristic``: W_m ← OuterOpt'(θ, b, Δ_m(k)), a look-ahead (:func:`lookahead`) with the
      peer's own fresh pseudo-gradient standing in for the whole average; θ and b are not changed
      and the deviation is dropped at the next round. A heuristic of this project, not the paper's
      method; kept for comparison (docs/benchmark.md).

    With a compressing reducer Δ_m is what the peer handed to the reducer, not its decoded share.

    *Why every peer holds the same global copy after each round* (induction over rounds
    applied): all peers start from the same θ (seeded init, :mod:`p2pdiloco.exact`) and b = 0.
    Round k applies ``OuterState.step(Δ(k))`` — element-wise fp32 arithmetic with one rounding per
    operation on θ, b and Δ(k) — and Δ(k) is bitwise identical on every member (the owner of each
    shard encodes the mean once, see swarm/allreduce.py). Rounds of one fragment are applied in
    round order (round k+1 is only sent after round k's job finished). Neither the offset, the
    look-ahead nor the carried progress below ever writes θ or b. A failed round is failed for the
    whole group, so no member applies it; a peer that missed a round's group applies nothing and
    downloads the verified majority state. So equal inputs give equal (θ, b) after every round;
    the digest in each sync event checks it.

    ``delay`` and ``eager`` on failure: the local phase of round k was already restarted, so the
    peer's unsent progress Δ_m(k) (and its sample weight) is added to its next pseudo-gradient.

When a run stops, :meth:`DiLoCo.finish` waits for the jobs in flight and applies them, so a run of
``n`` outer steps applies ``n`` averages in every mode; in ``delay``/``eager`` the model then takes
the global copy. A state download (:meth:`DiLoCo.load_snapshot`) drops the jobs in flight: a result
that arrives later belongs to the state left behind and is discarded (an epoch counter).

Memory on the outer device besides the global copy and momentum: each job in flight holds its Δ_m
(one fragment; in ``delay``/``eager`` up to all P fragments at once, i.e. one model's worth);
``delay``/``eager`` keep the start points W_m (one model), ``eager`` with the ``paper`` estimate the
offset (f, e) (two models' worth) and a reference to the last Δ'_m sent per fragment (the job's own,
so no extra memory while it is in flight; one model's worth in a checkpoint).
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
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .outer import nesterov_step_

__all__ = ["SyncJob", "SyncWorker", "BandwidthMeter", "lookahead", "pseudo_gradient_from", "merge_into"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SyncJob:
    """One fragment sync between its send step and its due step."""

    fragment: int
    round: int
    send_step: int
    due_step: int
    delta: torch.Tensor            # this peer's flat fp32 pseudo-gradient, as sent
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
    coverage: Any = None           # swarm.allreduce.Coverage of the applied result (None alone)
    covered_weight: float = 0.0    # total sample weight the applied average covers (W)
    # counted by the loop
    overlapped_steps: int = 0      # inner steps completed while the job was still running


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


@torch.no_grad()
def lookahead(outer, delta_flat: torch.Tensor) -> List[torch.Tensor]:
    """θ after ``outer.step(delta_flat)``, computed without changing ``outer`` (same arithmetic, so the
    result is bitwise what the step would give)."""
    out = []
    for p, b, d in zip(outer.params, outer.buffers, outer.unflatten(delta_flat.to(outer.params[0].device))):
        p = p.clone()
        nesterov_step_(p, b.clone(), d, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
        out.append(p)
    return out


@torch.no_grad()
def pseudo_gradient_from(start: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> torch.Tensor:
    """W − θ_m, flattened, fp32 on the device of ``start``."""
    return torch.cat([(w - l.detach().to(w.device, torch.float32)).view(-1) for w, l in zip(start, local)])


@torch.no_grad()
def merge_into(local: Sequence[torch.Tensor], target: Sequence[torch.Tensor], alpha: float) -> None:
    """θ_m ← alpha·θ_m + (1 − alpha)·target (``alpha = 0`` is an exact copy)."""
    for l, g in zip(local, target):
        g = g.to(l.device, l.dtype)
        if alpha == 0.0:
            l.copy_(g)
        else:
            l.lerp_(g, 1.0 - alpha)
