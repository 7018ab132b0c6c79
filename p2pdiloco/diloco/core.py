"""DiLoCo for any ``torch.nn.Module``: call :meth:`DiLoCo.after_inner_step` after each inner step.

DiLoCo (Douillard et al., arXiv 2311.08105): every peer takes H inner optimiser steps from the
global parameters θ, then the peers average their pseudo-gradients Δ_m = θ − θ_m (weighted by
samples processed) and apply an outer Nesterov step; every peer then restarts from the new θ.
With fragments (Streaming DiLoCo, arXiv 2501.18512) fragment p does the same on its own parameters
at inner steps t = p·H/P + k·H, k ≥ 1, so each fragment still takes H inner steps between syncs.

Syncs run in the background (:mod:`.overlap`): the pseudo-gradient is taken at the send step, the
all-reduce runs on a worker thread while the loop keeps taking inner steps, and the result is applied
at the due step the mode defines (``streaming.mode``: ``tau``, ``delay`` or ``eager``). With the
defaults (P = 1, mode ``tau``, tau = 0, alpha = 0) the due step is the send step: blocking DiLoCo.

A failed sync (``SyncFailed``: a peer died, a timeout) is discarded on every peer: the global copy
stays as it was and the peer's progress is part of its next pseudo-gradient, so no inner step is lost.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compression import Codec, get_codec
from ..config import RunConfig
from ..errors import ConfigError, RoundMissed, SyncFailed
from .clock import SwarmClock
from .fragments import FragmentLayout, Schedule, split_fragments
from .outer import OuterState, nesterov_step_
from .overlap import BandwidthMeter, SyncJob, SyncWorker, lookahead, merge_into, pseudo_gradient_from
from .reducers import Reducer, make_reducer

__all__ = ["DiLoCo", "SyncReport"]

logger = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What one fragment sync did (one line of metrics.jsonl)."""

    step: int                 # inner step after which the pseudo-gradient was sent
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
    applied_step: int = 0     # inner step after which the result reached the model
    wait_seconds: float = 0.0  # how long the training loop blocked on this sync
    overlapped_steps: int = 0  # inner steps taken while its all-reduce was in flight
    peak_bytes_per_s: float = 0.0  # peak traffic (sent + received, 1 s window) since the previous report
    #: more fields for the sync event: the reducer's info() (after a success) and group_wait_seconds
    #: (how long the sync waited for its group: 0 when formation, started ahead of time, was done)
    extra: Dict[str, object] = field(default_factory=dict)


def fp32_allreduce_bytes(numel: int, group_size: int) -> int:
    """Payload one member sends in an fp32 butterfly all-reduce of ``numel`` values among ``group_size``
    peers: its parts for the other owners and its shard's mean back to the others, 2·(N−1)/N·4·numel
    (algorithm.md §5). The sync event's ``fp32_bytes``: what the same sync would have cost uncompressed."""
    n = max(1, group_size)
    return int(2 * (n - 1) * 4 * numel // n)


class _SoloGroup:
    size = 1


class DiLoCo:
    """The outer loop around a user's model and inner optimiser.

    :param model: any module; with ``streaming.fragments > 1`` it needs ``blocks.<i>.`` parameters.
    :param cfg: run configuration (``inner.sync_every``, ``outer.*``, ``streaming.*``, ``compression.*``).
    :param swarm: a :class:`p2pdiloco.swarm.swarm.Swarm`, or None to train alone (the reference).

    Threads: ``after_inner_step``, ``finish`` and ``load_snapshot`` belong to the training thread; the
    background worker only writes the global copies (under ``state_lock``) and its own jobs.
    """

    def __init__(self, model: nn.Module, cfg: RunConfig, swarm=None, *, outer_device: str = "cpu"):
        self.model = model
        self.cfg = cfg
        self.swarm = swarm
        self.H = cfg.inner.sync_every
        st = cfg.streaming
        st.validate()
        P = st.fragments
        if self.H % P:
            raise ConfigError(f"inner.sync_every ({self.H}) must be divisible by streaming.fragments ({P}) so "
                              "fragment syncs are evenly staggered")
        if st.mode == "tau" and st.tau >= self.H // P:
            raise ConfigError(f"streaming.tau ({st.tau}) must be smaller than inner.sync_every / streaming.fragments "
                              f"= {self.H // P}")
        self.mode, self.tau, self.alpha = st.mode, st.tau, st.alpha
        self.schedule = Schedule(self.H, P)
        #: group formation starts this many steps ahead (never before the previous fragment's send)
        self.lead = min(st.prepare_steps, self.H // P - 1)
        #: ... or this many seconds ahead, in steps of the measured step time (same cap): see _lead_steps
        self.lead_seconds = float(st.prepare_seconds)
        self._step_seconds: Optional[float] = None      # moving average of the wall time of one inner step
        self._last_step_at: Optional[float] = None
        self.layout: FragmentLayout = split_fragments(model, P, st.pattern)
        named = dict(model.named_parameters())
        self.local: List[List[torch.Tensor]] = [[named[n] for n in names] for names in self.layout.names]
        self.outer: List[OuterState] = [
            OuterState(ps, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov,
                       device=outer_device)
            for ps in self.local
        ]
        self.codec: Codec = get_codec(cfg.compression.codec)
        #: one reducer per fragment: how its pseudo-gradient is averaged (plain, or compressed)
        self.reducers: List[Reducer] = [make_reducer(cfg, ps, names)
                                        for ps, names in zip(self.local, self.layout.names)]
        #: the schedule position: inner steps taken (rounds of H steps), or the swarm clock's position
        #: (inner.round_samples > 0, :mod:`.clock`); send steps, synced_step and tau count positions
        self.inner_step = 0
        #: inner steps this peer took (the inner lr warm-up's counter with the swarm clock)
        self.local_steps = 0
        #: rounds by the swarm's samples (issue 23): the swarm clock, None for rounds of H steps
        self.clock: Optional[SwarmClock] = (SwarmClock(self.H, cfg.inner.round_samples)
                                            if cfg.inner.round_samples else None)
        self._resumed_at = math.nan  # time.time() when the loop last got control back (compute time)
        #: send step of the last sync applied to the global copy (the schedule position the digest belongs to)
        self.synced_step = 0
        self.samples_since = [0] * P
        self.on_sync: Optional[Callable[[SyncReport], None]] = None
        #: held while the global state changes, so snapshots served to joiners are consistent
        self.state_lock = threading.RLock()
        #: seconds the training loop spent blocked on syncs (the network), all fragments
        self.wait_seconds = 0.0
        self._epoch = 0                                   # bumped when a downloaded state replaces ours
        self._inflight: List[SyncJob] = []                # sent, not yet applied to the model; send order
        self._groups: Dict[Tuple[int, int], concurrent.futures.Future] = {}  # (frag, round) -> Group
        # delay/eager: the point each fragment's current inner phase started from (W_m)
        self._start: List[Optional[List[torch.Tensor]]] = [None] * P
        self.eager_estimate = st.eager_estimate
        # eager_estimate "paper": this peer's offset (f, e) from the agreed (θ, b), per fragment (None = 0)
        self._offsets: List[Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]]] = [None] * P
        # ... and the own term last added to it, as (share ρ, Δ'_m) with term = Δ'_m·ρ (None = nothing):
        # the next round subtracts exactly this product, so f telescopes to the latest own term
        self._own: List[Optional[Tuple[float, torch.Tensor]]] = [None] * P
        if self.mode != "tau":
            self._start = [[t.clone() for t in o.params] for o in self.outer]
        # two background threads: all-reduces in send order, and group formation in schedule order, so
        # forming the group of an upcoming sync never waits behind an all-reduce still in flight
        self._worker = SyncWorker("p2pdiloco-sync")
        self._matchmaking = SyncWorker("p2pdiloco-groups", torch_work=False)  # network and DHT only
        self.meter: Optional[BandwidthMeter] = BandwidthMeter(swarm.node.traffic) if swarm is not None else None

    # ---- schedule ---------------------------------------------------------------------------------
    @property
    def num_fragments(self) -> int:
        return self.layout.num_fragments

    def offset(self, p: int) -> int:
        return self.schedule.offset(p)

    def due(self, t: int) -> List[int]:
        """Fragments that sync right after inner step ``t`` (1-based count of steps taken)."""
        return self.schedule.due(t)

    def round_of(self, p: int, t: int) -> int:
        return self.schedule.round_of(p, t)

    def next_sync_step(self) -> int:
        """Inner step of this peer's next group formation: a sync whose group is still forming, or the
        next scheduled one. Peers matchmaking for a step wait for everyone whose next sync is not later."""
        forming = [j.send_step for j in self._inflight if j.group is not None and not j.group.done()]
        forming += [self.schedule.send_step(p, r) for (p, r), fut in self._groups.items() if not fut.done()]
        return min(forming + [self.schedule.next_send(self.inner_step)])

    def outer_round(self) -> int:
        """Outer rounds of fragment 0 applied or still in flight (failed ones are not counted): the
        run's outer step counter. With blocking syncs this is the number applied."""
        with self.state_lock:
            return self.outer[0].steps + sum(1 for j in self._inflight
                                             if j.fragment == 0 and not (j.applied or j.failed))

    # ---- the training loop's entry points ------------------------------------------------------------
    @property
    def lr_step(self) -> int:
        """The inner lr schedule's step: the schedule position with rounds of H steps (as the papers),
        this peer's own step count with the swarm clock (positions are not steps there)."""
        return self.inner_step if self.clock is None else self.local_steps

    def after_inner_step(self, samples: int) -> List[SyncReport]:
        """Count one inner step of ``samples`` sequences; send the fragments that are due and apply the
        results that are due (waiting for them if they are late). Returns the syncs applied now.

        Rounds of H steps: one step is one schedule position. Swarm clock: the position moves to where
        the clock says the swarm is, sending early what our next step would carry past (:mod:`.clock`);
        every position passed runs its sends, results due and group preparation in order."""
        self.local_steps += 1
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at      # a step and whatever the loop did around it (validation too)
            self._step_seconds = dt if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * dt
        self._last_step_at = now
        for p in range(self.num_fragments):
            self.samples_since[p] += samples
        for job in self._inflight:
            if not job.future.done():
                job.overlapped_steps += 1
        if self.clock is None:
            return self._advance_to(self.inner_step + 1)
        reports = self._advance_to(self._clock_target(samples))
        self._resumed_at = time.time()
        return reports

    def _advance_to(self, target: int) -> List[SyncReport]:
        reports: List[SyncReport] = []
        blocking_at = None  # the position of the last blocking sync that ended here
        while self.inner_step < target:
            self.inner_step += 1
            t = self.inner_step
            for p in self.schedule.due(t):
                reports += self._send(p, t)
            if self.mode == "tau":
                for job in [j for j in self._inflight if j.due_step <= t]:
                    reports.append(self._resolve(job))
                    if job.ok and job.due_step == job.send_step:
                        blocking_at = t
            self._prepare(t)
        if self.clock is not None and blocking_at == target:
            # swarm clock: the members of a blocking sync finished it together, at its send point (clock.py);
            # not when this step carried the clock past it (it is past it then)
            self.clock.settle(target)
        return reports

    def start_clock(self) -> None:
        """Training (re)starts now: the swarm clock's first step counts its time from here."""
        if self.clock is not None:
            self._resumed_at = time.time()
            self.clock.start(self._resumed_at)

    def _clock_target(self, samples: int) -> int:
        """The position to advance to after a step of ``samples`` sequences (swarm clock)."""
        clock, now = self.clock, time.time()
        compute = now - self._resumed_at if not math.isnan(self._resumed_at) else 0.0
        view = self.swarm.peers_view() if self.swarm is not None else None
        others = {pid: v for pid, v in (view or {}).items() if pid != self.swarm.peer_id and not v.get("gone")}
        rates = [float(v["rate"]) if isinstance(v.get("rate"), (int, float)) and 0 < v["rate"] < 1e9 else None
                 for v in others.values()]
        # a peer whose rate we do not know yet (its first records) counts as fast as we are
        clock.others_rate = sum(r if r is not None else clock.rate() for r in rates)
        clock.observe(samples, now, compute)
        clock.align([(pid, float(v["pos"]), float(v["pt"])) for pid, v in others.items()
                     if isinstance(v.get("pos"), (int, float)) and isinstance(v.get("pt"), (int, float))
                     and math.isfinite(v["pos"]) and math.isfinite(v["pt"])], now)
        return clock.target(self.inner_step, self.schedule.next_send)

    def finish(self) -> List[SyncReport]:
        """End of training: wait for every sync in flight and apply it (in ``delay``/``eager`` the model
        then takes the global copy). Returns their reports (``on_sync`` is called for each)."""
        if self.mode == "tau":
            return [self._resolve(job) for job in list(self._inflight)]
        reports = [self._resolve(job, notify=False) for job in list(self._inflight)]
        with self.state_lock:
            for p, o in enumerate(self.outer):
                o.copy_to(self.local[p])
                self._start[p] = [t.clone() for t in o.params]
            # the model is on the agreed trajectory now: no offset, no own term in it
            self._offsets = [None] * self.num_fragments
            self._own = [None] * self.num_fragments
        for r in reports:  # reported once the model holds them (validation measures that model)
            self._notify(r)
        return reports

    def close(self) -> None:
        """Stop the background threads (a job still running is abandoned)."""
        self._worker.close()
        self._matchmaking.close()
        if self.meter is not None:
            self.meter.close()

    # ---- sending ----------------------------------------------------------------------------------
    def _send(self, p: int, t: int) -> List[SyncReport]:
        if self.clock is not None and self.samples_since[p] == 0:
            return [self._not_a_member(p, t)]
        reports: List[SyncReport] = []
        for job in [j for j in self._inflight if j.fragment == p]:
            if self.mode == "tau":  # cannot happen with tau < H/P; never two rounds of a fragment in flight
                reports.append(self._resolve(job))
        if self.mode == "tau":
            # Algorithm 2: Δ_m = θ − θ_m against the global copy (no job of fragment p is running, so the
            # worker is not writing it)
            delta = self.outer[p].pseudo_gradient(self.local[p])
            weight = self.samples_since[p]
            self.samples_since[p] = 0
            self._launch(p, t, delta, weight, due=t + self.tau)
            return reports
        # delay / eager: progress since this phase's start point, then apply round k−1, then restart
        delta = pseudo_gradient_from(self._start[p], self.local[p])
        weight = self.samples_since[p]
        self.samples_since[p] = 0
        prev = next((j for j in self._inflight if j.fragment == p), None)
        if prev is not None:
            reports.append(self._resolve(prev, notify=False))
            if not prev.ok:  # nothing of round k−1 was applied anywhere: send our part of it again
                delta.add_(prev.delta)
                weight += prev.weight
        round_ = self.schedule.round_of(p, t)
        key = (p, round_)
        if key not in self._groups:  # stays listed until launch: next_sync_step() must see it forming
            self._groups[key] = self._form_group(p, round_, t)
        group = self._groups[key]
        outer = self.outer[p]
        with self.state_lock:
            if self.mode == "delay":
                start = [x.clone() for x in outer.params]
            elif self.eager_estimate == "fresh_heuristic":  # our fresh Δ_m stands in for the whole average
                start = lookahead(outer, delta)
            else:  # "paper": agreed θ plus this peer's offset (overlap.py, ``eager``)
                start = self._eager_start(p, delta, weight, prev, group)
            self._start[p] = start
            merge_into(self.local[p], start, 0.0)
        for r in reports:  # after the model restarted from the result: validation measures that model
            self._notify(r)
        del self._groups[key]
        self._launch(p, t, delta, weight, due=t + self.H, group=group)
        return reports

    def _not_a_member(self, p: int, t: int) -> SyncReport:
        """Swarm clock: the clock passed fragment ``p``'s send point with no sample of ours since its last
        round (one inner step longer than a round). We are no member of that round; reported as missed,
        so the loop catches up from the swarm's verified state (:mod:`.clock`)."""
        round_ = self.schedule.round_of(p, t)
        self._groups.pop((p, round_), None)
        report = SyncReport(step=t, fragment=p, round=round_, ok=False, missed=True, applied_step=t,
                            error=f"no sample of fragment {p} since its last round: not a member of round "
                                  f"{round_} (an inner step longer than a round); catching up")
        logger.warning(f"fragment {p} round {round_}: {report.error}")
        self._notify(report)
        return report

    def _eager_start(self, p: int, delta: torch.Tensor, weight: float, prev: Optional[SyncJob],
                     group: concurrent.futures.Future) -> List[torch.Tensor]:
        """Eager Updates as published, split into the agreed part and this peer's offset (overlap.py).

        The paper's peer applies OuterOpt with Δ~_m(k) = Δ(k−1) + δ_k, δ_k = ρ_k·Δ'_m(k) − (the own term
        it added last): its fresh term replaces its stale one in the late average. Δ'_m(k) is what round
        k sends (with a failed round's Δ'_m resent in it); ρ_k = w_m/W is its share of round k's
        average, not known before the round ends: estimated as ρ_{k−1}·M_{k−1}/M_k from round k−1's
        covered weight when that arrived, else 1/M_k (with equal weights the paper's 1/M). The term
        subtracted is exactly the term added before (``_own``), whatever happened in between (a failed
        round, a resend, another group size or weight), so the offset always holds the latest own term
        alone and the estimate's error never accumulates. The agreed copy applies Δ(k−1) alone (done by
        the worker when round k−1 arrived), so the offset (f, e) = (θ_m − θ, b_m − b) follows
        e ← μ·e + δ_k, f ← f − lr·(δ_k + μ·e) (Nesterov SGD is linear). When round k−1 brought no average
        (the first round, a failed round, the first round after a download) the agreed copy took no step
        but the paper's peer did, with Δ~_m(k) = δ_k: then e ← μ·(b + e) + δ_k − b and
        f ← f − lr·(δ_k + μ·(b + e)). Returns θ + f."""
        outer = self.outer[p]
        mu, lr = outer.momentum, outer.lr
        size = self._expected_size(group, prev)
        arrived = prev is not None and prev.ok
        if arrived:  # our share of round k: as in round k−1 (speeds change slowly), scaled to k's group size
            share = prev.weight / prev.covered_weight * max(prev.group_size, 1) / size
        else:
            share = 1.0 / size
        d_flat = delta * share
        last = self._own[p]
        if last is not None:  # the same product as when it was added: the same bits, an exact cancellation
            d_flat = d_flat - last[1].to(delta.device) * last[0]
        self._own[p] = (share, delta)  # the job's Δ'_m: never written after its send
        if self._offsets[p] is None:
            self._offsets[p] = ([torch.zeros_like(x) for x in outer.params], [torch.zeros_like(x) for x in outer.params])
        f_list, e_list = self._offsets[p]
        for f, e, b, d in zip(f_list, e_list, outer.buffers, outer.unflatten(d_flat)):
            if arrived:
                nesterov_step_(f, e, d, lr=lr, momentum=mu, nesterov=outer.nesterov)
            else:  # the peer's own step from (θ + f, b + e); the agreed copy stays at (θ, b)
                bm = b + e
                nesterov_step_(f, bm, d, lr=lr, momentum=mu, nesterov=outer.nesterov)
                e.copy_(bm - b)
        return [x + f for x, f in zip(outer.params, f_list)]

    def _expected_size(self, group: concurrent.futures.Future, prev: Optional[SyncJob]) -> int:
        """Members expected in the round being sent (for the peer's own share ρ): its group when formed,
        else the last round's, else the live peers."""
        if group.done() and group.exception() is None:
            return max(1, int(getattr(group.result(), "size", 1)))
        if prev is not None and prev.ok:
            return max(1, prev.group_size)
        return max(1, self.swarm.expected_group(self.inner_step)) if self.swarm is not None else 1

    def _group_future(self, p: int, round_: int, t: int) -> concurrent.futures.Future:
        key = (p, round_)
        fut = self._groups.pop(key, None)
        if fut is None:
            fut = self._form_group(p, round_, t)
        return fut

    def _form_group(self, p: int, round_: int, send_step: int) -> concurrent.futures.Future:
        if self.swarm is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(_SoloGroup())
            return fut
        return self._matchmaking.submit(self.swarm.form_group, p, round_, send_step)

    def _lead_steps(self) -> int:
        """How many steps ahead group formation starts: ``prepare_steps``, or ``prepare_seconds`` of
        measured step time if that is more, never more than H/P - 1 (issue 17: the group is agreed
        before the pseudo-gradient is ready, the slowest member's drift included)."""
        cap = self.H // self.num_fragments - 1
        lead = self.lead
        if self.lead_seconds > 0 and self._step_seconds:
            lead = max(lead, math.ceil(self.lead_seconds / max(self._step_seconds, 1e-3)))
        return max(0, min(lead, cap))

    def _prepare(self, t: int) -> None:
        """Queue group formation for the syncs of the next ``_lead_steps()`` steps (after this step's sends)."""
        lead = self._lead_steps() if self.swarm is not None else 0
        if lead <= 0:
            return
        for s in range(t + 1, t + lead + 1):
            for p in self.schedule.due(s):
                if self.clock is not None and self.samples_since[p] == 0:
                    continue  # nothing to send yet: no group (a member with no sample is no member)
                key = (p, self.schedule.round_of(p, s))
                if key not in self._groups:
                    self._groups[key] = self._form_group(p, key[1], s)

    def _launch(self, p: int, t: int, delta: torch.Tensor, weight: float, due: int,
                group: Optional[concurrent.futures.Future] = None) -> None:
        round_ = self.schedule.round_of(p, t)
        job = SyncJob(fragment=p, round=round_, send_step=t, due_step=due, delta=delta, weight=float(weight),
                      epoch=self._epoch, group=group if group is not None else self._group_future(p, round_, t))
        job.future = self._worker.submit(self._run, job)
        self._inflight.append(job)

    # ---- the background side ------------------------------------------------------------------------
    def _run(self, job: SyncJob) -> None:
        """Worker thread: group, all-reduce through the fragment's reducer, apply to the global copy."""
        p = job.fragment
        traffic = self.swarm.node.traffic if self.swarm is not None else None
        sent0, recv0 = traffic.snapshot() if traffic else (0, 0)
        try:
            t0 = time.perf_counter()
            group = job.group.result()
            job.group_wait = time.perf_counter() - t0  # > 0: group formation was not ready at the send
            job.group_size = group.size
            if self.swarm is None:
                allreduce = self._solo_allreduce
            else:
                allreduce = self._group_allreduce(job, group)
            avg = self.reducers[p].reduce(job.delta, allreduce)
            info = getattr(self.reducers[p], "info", None)
            job.extra = dict(info()) if info is not None else {}
            self._note_coverage(job, group)
        except SyncFailed as e:
            job.error = str(e)
            job.missed = isinstance(e, RoundMissed)
            job.failed = True
            logger.warning(f"sync of fragment {p} round {job.round} failed, keeping local progress: {e}")
        else:
            with self.state_lock:
                if job.epoch == self._epoch:
                    self.outer[p].step(avg)
                    self.synced_step = max(self.synced_step, job.send_step)
                    job.digest = self.outer[p].digest()
                    job.ok = job.applied = True
                else:
                    job.failed = True
                    job.error = "dropped: the state was replaced by a download while this sync ran"
        finally:
            if traffic:
                sent1, recv1 = traffic.snapshot()
                job.bytes_sent, job.bytes_received = sent1 - sent0, recv1 - recv0
            job.seconds = time.perf_counter() - job.launched

    def _group_allreduce(self, job: SyncJob, group):
        """The reducer's all-reduce for one sync. Every phase must average the same members: after a
        phase that covered fewer than the group (a dropped part), later phases run on the group
        restricted to them, and a phase that covers fewer still fails the sync (on every member alike:
        they all read the same coverage)."""
        from ..swarm.allreduce import restricted_group

        state = {"group": group}

        def seen(cov) -> None:
            first = job.coverage
            if first is None:
                job.coverage = cov
                if not cov.complete:
                    state["group"] = restricted_group(group, cov.members)
            elif set(cov.members) != set(first.members):
                raise SyncFailed(f"phases of one sync covered different members ({len(first.members)} then "
                                 f"{len(cov.members)} of {group.size}); not applied")

        def allreduce(vec: torch.Tensor, phase: str, codec: Optional[Codec] = None) -> torch.Tensor:
            return self.swarm.allreduce(state["group"], f"f{job.fragment}.{phase}", vec, job.weight,
                                        codec or self.codec, on_coverage=seen)
        return allreduce

    def _note_coverage(self, job: SyncJob, group) -> None:
        """Group size, total weight and, for a round over fewer members, who was left out: in the report."""
        cov = job.coverage
        if cov is None:  # alone (or a fake swarm without coverage): everyone we know of is in
            job.covered_weight = job.weight * group.size
            return
        job.group_size = len(cov.members)
        job.covered_weight = cov.weight
        job.extra["coverage"] = cov.kind
        if cov.left_out:
            job.extra["left_out"] = list(cov.left_out)

    def _solo_allreduce(self, vec: torch.Tensor, phase: str, codec: Optional[Codec] = None) -> torch.Tensor:
        """A group of one: what crossed the wire is what a lone peer applies too."""
        codec = codec or self.codec
        return codec.roundtrip(vec) if codec.relative_error_bound else vec.clone()

    # ---- applying results to the model ------------------------------------------------------------------
    def _resolve(self, job: SyncJob, notify: bool = True) -> SyncReport:
        """Wait for ``job`` if it is still running (the wait is recorded), apply it to the model (mode
        ``tau``; the others apply it when they restart the next inner phase), report."""
        t0 = time.perf_counter()
        job.future.result()  # re-raises a bug in the worker; SyncFailed was caught there
        waited = time.perf_counter() - t0
        self.wait_seconds += waited
        self._inflight.remove(job)
        p = job.fragment
        if job.ok and self.mode == "tau":
            with self.state_lock:  # θ_m ← alpha·θ_m + (1 − alpha)·θ~   (Algorithm 2)
                merge_into(self.local[p], self.outer[p].params, self.alpha)
        if not job.ok and self.mode == "tau":
            self.samples_since[p] += int(job.weight)  # the progress stays in the model: so does its weight
        report = SyncReport(step=job.send_step, fragment=p, round=job.round, ok=job.ok, group_size=job.group_size,
                            seconds=job.seconds, samples=int(job.weight), bytes_sent=job.bytes_sent,
                            bytes_received=job.bytes_received, digest=job.digest, error=job.error,
                            missed=job.missed, applied_step=self.inner_step, wait_seconds=waited,
                            overlapped_steps=job.overlapped_steps,
                            peak_bytes_per_s=self.meter.take_peak() if self.meter is not None else 0.0,
                            extra={**(job.extra if job.ok else {}),
                                   **({"round_samples": job.covered_weight,
                                       "fp32_bytes": fp32_allreduce_bytes(job.delta.numel(), job.group_size)}
                                      if job.ok else {}),
                                   "group_wait_seconds": round(job.group_wait, 4)})
        if notify:
            self._notify(report)
        return report

    def _notify(self, report: SyncReport) -> None:
        if self.on_sync is not None:
            self.on_sync(report)

    # ---- digests, snapshots ---------------------------------------------------------------------------
    def _digest(self) -> str:
        return "-".join(o.digest() for o in self.outer)

    def digest(self) -> str:
        """Digest of every fragment's global state, joined."""
        with self.state_lock:
            return self._digest()

    def sync_point(self) -> Tuple[int, str]:
        """(synced_step, digest), read together: what this peer publishes for state download and repair."""
        with self.state_lock:
            return self.synced_step, self._digest()

    def snapshot(self) -> Tuple[Dict[str, object], bytes]:
        """(meta, payload): every fragment's θ then momentum as fp32 bytes, taken under the lock."""
        with self.state_lock:
            chunks = []
            for o in self.outer:
                chunks += [t.detach().cpu().contiguous().view(-1) for t in (*o.params, *o.buffers)]
            payload = torch.cat(chunks).numpy().tobytes()
            meta = {"step": self.synced_step, "outer_steps": [o.steps for o in self.outer],
                    "numels": [o.numel for o in self.outer], "digest": self._digest()}
        return meta, payload

    def first_difference(self, meta: Dict[str, object], payload: bytes) -> Optional[Dict[str, object]]:
        """Where a snapshot of the *same* synced step differs from our global state: the first differing
        tensor (fragment, parameter name, θ or momentum) and how many of its elements differ. None when
        the snapshot is of another step (a normal catch-up) or equal. Peers at one step must hold the
        same bits, so a difference is a bug to report (docs: exactness)."""
        if int(meta.get("step", -1)) != self.synced_step:
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        off = 0
        with self.state_lock:
            for p, o in enumerate(self.outer):
                names = self.layout.names[p]
                for kind, tensors in (("theta", o.params), ("momentum", o.buffers)):
                    for name, t in zip(names, tensors):
                        theirs = flat[off: off + t.numel()].view_as(t)
                        off += t.numel()
                        mine = t.detach().cpu()
                        differ = mine.view(torch.int32) != theirs.view(torch.int32)
                        n = int(differ.sum())
                        if n:
                            return {"fragment": p, "tensor": name, "kind": kind, "differing": n, "numel": t.numel(),
                                    "max_abs_diff": float((mine - theirs).abs().max())}
        return None

    def load_snapshot(self, meta: Dict[str, object], payload: bytes) -> None:
        """Adopt a verified snapshot: global state, local parameters and schedule position. Syncs in
        flight are dropped (their results would belong to the state we are leaving)."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        with self.state_lock:
            self._epoch += 1
            off = 0
            for o, steps in zip(self.outer, meta["outer_steps"]):
                for t in (*o.params, *o.buffers):
                    t.copy_(flat[off: off + t.numel()].view_as(t))
                    off += t.numel()
                o.steps = int(steps)
            for o, local in zip(self.outer, self.local):
                o.copy_to(local)
            self.inner_step = self.synced_step = int(meta["step"])
            if self.clock is not None:
                self.clock.jump_to(self.inner_step)
                self._resumed_at = time.time()  # the download's time was no computing
            self.samples_since = [0] * self.num_fragments
            if self._inflight:
                logger.info(f"dropped {len(self._inflight)} sync(s) in flight for the downloaded state")
            self._inflight.clear()
            # prepared groups for rounds still ahead stay valid: the group is about the round, not our state
            for key in [k for k in self._groups if self.schedule.send_step(*k) <= self.inner_step]:
                del self._groups[key]
            if self.mode != "tau":
                self._start = [[t.clone() for t in o.params] for o in self.outer]
            self._offsets = [None] * self.num_fragments  # the peer restarts on the agreed trajectory
            self._own = [None] * self.num_fragments
        for r in self.reducers:  # their residuals belong to the history we just left
            reset = getattr(r, "reset", None)
            if reset is not None:
                reset()

    # ---- checkpoints ------------------------------------------------------------------------------------
    def overlap_state_dict(self) -> Dict[str, object]:
        """Bookkeeping of ``delay``/``eager`` that a checkpoint needs besides the model and global copies:
        each fragment's start point W_m and, for eager, this peer's offset from the agreed copy and the
        own term in it (the next round takes that term out again). (Syncs in flight are not saved: after
        a resume they are lost and the swarm's divergence repair brings this peer back.)"""
        cpu = lambda ts: [t.cpu().clone() for t in ts]  # noqa: E731
        with self.state_lock:
            return {"mode": self.mode,
                    "start": None if self.mode == "tau" else [cpu(s) for s in self._start],
                    "offsets": [None if o is None else (cpu(o[0]), cpu(o[1])) for o in self._offsets],
                    "own": [None if o is None else (o[0], o[1].cpu().clone()) for o in self._own]}

    def load_overlap_state(self, state: Optional[Dict[str, object]]) -> None:
        if self.mode == "tau":
            return
        with self.state_lock:
            self._offsets = [None] * self.num_fragments
            self._own = [None] * self.num_fragments
            if not state or state.get("mode") != self.mode or state.get("start") is None:
                self._start = [[t.clone() for t in o.params] for o in self.outer]
                return
            for dst, src in zip(self._start, state["start"], strict=True):
                for d, s in zip(dst, src, strict=True):
                    d.copy_(s)
            offsets = state.get("offsets") or [None] * self.num_fragments
            owns = state.get("own")
            # an offset is only usable with the own term it holds (the next round takes that out again);
            # without it (an older checkpoint) the peer restarts its offset from the agreed trajectory
            if self.mode == "eager" and len(offsets) == self.num_fragments and owns is not None:
                for p, (o, saved, own) in enumerate(zip(self.outer, offsets, owns, strict=True)):
                    if saved is not None:
                        self._offsets[p] = ([x.to(g.device).clone() for x, g in zip(saved[0], o.params, strict=True)],
                                            [x.to(g.device).clone() for x, g in zip(saved[1], o.params, strict=True)])
                    if own is not None:
                        if own[1].numel() != o.numel:
                            raise ValueError(f"the eager own term of fragment {p} does not match its parameters")
                        self._own[p] = (float(own[0]), own[1].to(o.params[0].device).clone())
