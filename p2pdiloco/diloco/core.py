"""DiLoCo for any ``torch.nn.Module``: call :meth:`DiLoCo.after_inner_step` after each inner step.

DiLoCo (Douillard et al., arXiv 2311.08105): every peer takes H inner optimiser steps from the
global parameters θ, then the peers average their pseudo-gradients Δ_m = θ − θ_m (weighted by
samples processed) and apply an outer Nesterov step; every peer then restarts from the new θ.
With fragments (Streaming DiLoCo, arXiv 2501.18512) fragment p does the same on its own parameters
at inner steps t = p·H/P + k·H, k ≥ 1, so each fragment still takes H inner steps between syncs.

Syncs run in the background (:mod:`.background`): the pseudo-gradient is taken at the send step, the
all-reduce runs on a worker thread while the loop keeps taking inner steps, and the result is applied
at the due step the mode defines (``streaming.mode``: ``tau``, ``delay`` or ``eager``; :mod:`.overlap`). With the
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
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..compression import Codec, get_codec
from ..config import RunConfig
from ..errors import ConfigError, RoundMissed, SyncFailed
from ..snapshot import walk
from .background import BandwidthMeter, SyncJob, SyncReport, SyncWorker, note_coverage, solo_allreduce
from .clock import SwarmClock
from .fragment_state import FragmentState
from .fragments import FragmentLayout, Schedule, split_fragments
from .groups import PreparedGroups
from .outer import OuterState
from .overlap import OverlapMode, overlap_mode
from .reducers import Reducer, make_reducer

__all__ = ["DiLoCo", "SyncReport", "fp32_allreduce_bytes"]

logger = logging.getLogger(__name__)


def fp32_allreduce_bytes(numel: int, group_size: int) -> int:
    """Payload one member sends in an fp32 butterfly all-reduce of ``numel`` values among ``group_size``
    peers: its parts for the other owners and its shard's mean back to the others, 2·(N−1)/N·4·numel.
    The sync event's ``fp32_bytes``: what the same sync would have cost uncompressed."""
    n = max(1, group_size)
    return int(2 * (n - 1) * 4 * numel // n)


def _minus(traffic, part) -> Tuple[int, int]:
    """(sent, received) of ``traffic`` less its ``part`` (None: nothing), or (0, 0) without ``traffic``."""
    if traffic is None:
        return 0, 0
    sent, recv = traffic.snapshot()
    if part is None:
        return sent, recv
    part_sent, part_recv = part.snapshot()
    return sent - part_sent, recv - part_recv


def group_allreduce(swarm, job: SyncJob, group, codec: Codec) -> Callable[..., torch.Tensor]:
    """The reducer's all-reduce for one sync. Every phase must average the same members: after a
    phase that covered fewer than the group (a dropped part), later phases run on the group
    restricted to them, and a phase that covers fewer still fails the sync (on every member alike:
    they all read the same coverage)."""
    state = {"group": group}

    def seen(cov) -> None:
        first = job.coverage
        if first is None:
            job.coverage = cov
            if not cov.complete:
                state["group"] = group.restricted_to(cov.members)
        elif set(cov.members) != set(first.members):
            raise SyncFailed(f"phases of one sync covered different members ({len(first.members)} then "
                             f"{len(cov.members)} of {group.size}); not applied")

    def allreduce(vec: torch.Tensor, phase: str, phase_codec: Optional[Codec] = None) -> torch.Tensor:
        return swarm.allreduce(state["group"], f"f{job.fragment}.{phase}", vec, job.weight,
                               phase_codec or codec, on_coverage=seen)
    return allreduce


class DiLoCo:
    """The outer loop around a user's model and inner optimiser.

    :param model: any module; with ``streaming.fragments > 1`` it needs ``blocks.<i>.`` parameters.
    :param cfg: run configuration (``inner.sync_every``, ``outer.*``, ``streaming.*``, ``compression.*``).
    :param swarm: a :class:`p2pdiloco.swarm.swarm.Swarm`, or None to train alone (the reference).

    State: one :class:`~.fragment_state.FragmentState` per fragment (``fragments``), the mode's rules
    (``overlap``, :mod:`.overlap`), the groups formed ahead (``groups``, :mod:`.groups`) and the syncs
    in flight. Threads: ``after_inner_step``, ``finish`` and ``load_snapshot`` belong to the training
    thread; the background worker only writes the global copies (under ``state_lock``) and its own jobs.
    """

    def __init__(self, model: nn.Module, cfg: RunConfig, swarm=None, *, outer_device: str = "cpu"):
        self.model = model
        self.cfg = cfg
        self.swarm = swarm
        self.H = cfg.inner.sync_every
        self.normalize_steps = cfg.inner.normalize_steps
        st = cfg.streaming
        st.validate()
        P = st.fragments
        if self.H % P:
            raise ConfigError(f"inner.sync_every ({self.H}) must be divisible by streaming.fragments ({P}) so "
                              "fragment syncs are evenly staggered")
        if st.mode == "tau" and st.tau >= self.H // P:
            raise ConfigError(f"streaming.tau ({st.tau}) must be smaller than inner.sync_every / streaming.fragments "
                              f"= {self.H // P}")
        #: ``streaming.mode`` as configured, and the rules that implement it
        self.mode = st.mode
        self.overlap: OverlapMode = overlap_mode(st, self.H, keep_residual=cfg.compression.feedback_form == "model")
        self.schedule = Schedule(self.H, P)
        self.layout: FragmentLayout = split_fragments(model, P, st.pattern)
        self.codec: Codec = get_codec(cfg.compression.codec)
        self.fragments: List[FragmentState] = self._build_fragments(model, cfg, outer_device)
        #: the schedule position: inner steps taken (rounds of H steps), or the swarm clock's position
        #: (inner.round_samples > 0, :mod:`.clock`); send steps, synced_step and tau count positions
        self.position = 0
        #: inner steps this peer took (the inner lr warm-up's counter with the swarm clock)
        self.local_steps = 0
        #: rounds by the swarm's samples: the swarm clock, None for rounds of H steps
        self.clock: Optional[SwarmClock] = (SwarmClock(self.H, cfg.inner.round_samples)
                                            if cfg.inner.round_samples else None)
        self._resumed_at = math.nan  # time.time() when the loop last got control back (compute time)
        #: send step of the last sync applied to the global copy (the schedule position the digest belongs to)
        self.synced_step = 0
        self.on_sync: Optional[Callable[[SyncReport], None]] = None
        #: held while the global state changes, so snapshots served to joiners are consistent
        self.state_lock = threading.RLock()
        #: seconds the training loop spent blocked on syncs (the network), all fragments
        self.wait_seconds = 0.0
        self._epoch = 0                                   # bumped when a downloaded state replaces ours
        self._inflight: List[SyncJob] = []                # sent, not yet applied to the model; send order
        for frag in self.fragments:
            self.overlap.begin_phase(frag)
        # two background threads: all-reduces in send order, and group formation in schedule order, so
        # forming the group of an upcoming sync never waits behind an all-reduce still in flight
        self._worker = SyncWorker("p2pdiloco-sync")
        self.groups = PreparedGroups(swarm, self.schedule, st.prepare_steps, st.prepare_seconds)
        self.meter: Optional[BandwidthMeter] = BandwidthMeter(swarm.node.traffic) if swarm is not None else None

    def _build_fragments(self, model: nn.Module, cfg: RunConfig, outer_device: str) -> List[FragmentState]:
        named = dict(model.named_parameters())
        frags = []
        for p, names in enumerate(self.layout.names):
            params = [named[n] for n in names]
            outer = OuterState(params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov,
                               device=outer_device)
            frags.append(FragmentState(p, names, params, outer, make_reducer(cfg, params, names)))
        return frags

    # ---- views over the fragments (what checkpoints and the loop read) ------------------------------
    @property
    def outer(self) -> List[OuterState]:
        """Each fragment's global copy, in fragment order."""
        return [f.outer for f in self.fragments]

    @property
    def reducers(self) -> List[Reducer]:
        """Each fragment's reducer, in fragment order."""
        return [f.reducer for f in self.fragments]

    @property
    def samples_since(self) -> List[int]:
        """Each fragment's samples since its last send (a checkpoint entry)."""
        return [f.samples_since_send for f in self.fragments]

    @samples_since.setter
    def samples_since(self, counts: List[int]) -> None:
        for f, n in zip(self.fragments, counts, strict=True):
            f.samples_since_send = n

    @property
    def steps_since(self) -> List[int]:
        """Each fragment's inner steps since its last send (a checkpoint entry)."""
        return [f.steps_since_send for f in self.fragments]

    @steps_since.setter
    def steps_since(self, counts: List[int]) -> None:
        for f, n in zip(self.fragments, counts, strict=True):
            f.steps_since_send = n

    # ---- schedule ---------------------------------------------------------------------------------
    @property
    def num_fragments(self) -> int:
        return self.layout.num_fragments

    def offset(self, p: int) -> int:
        return self.schedule.offset(p)

    def due(self, t: int) -> List[int]:
        """Fragments that sync right after schedule position ``t`` (1-based; with rounds of H steps the
        count of inner steps taken)."""
        return self.schedule.due(t)

    def round_of(self, p: int, t: int) -> int:
        return self.schedule.round_of(p, t)

    def next_sync_step(self) -> int:
        """Schedule position of this peer's next group formation: a sync whose group is still forming, or the
        next scheduled one. Peers matchmaking for a step wait for everyone whose next sync is not later."""
        forming = [j.send_step for j in self._inflight if j.group is not None and not j.group.done()]
        forming += self.groups.forming_send_steps()
        return min(forming + [self.schedule.next_send(self.position)])

    def outer_round(self) -> int:
        """Outer rounds of fragment 0 applied or still in flight (failed ones are not counted): the
        run's outer step counter. With blocking syncs this is the number applied."""
        with self.state_lock:
            return self.fragments[0].outer.steps + sum(1 for j in self._inflight
                                                       if j.fragment == 0 and not (j.applied or j.failed))

    def landing(self, t: int) -> Set[int]:
        """Fragments whose sync result may be applied in ``after_inner_step`` at schedule position ``t``.
        Exact between two inner steps of the training thread (the jobs in flight cannot change then)."""
        return self.overlap.landing(self, t, self.schedule.due(t))

    # ---- the training loop's entry points ------------------------------------------------------------
    @property
    def lr_step(self) -> int:
        """The inner lr schedule's step: the schedule position with rounds of H steps (as the papers),
        this peer's own step count with the swarm clock (positions are not steps there)."""
        return self.position if self.clock is None else self.local_steps

    def after_inner_step(self, samples: int) -> List[SyncReport]:
        """Count one inner step of ``samples`` sequences; send the fragments that are due and apply the
        results that are due (waiting for them if they are late). Returns the syncs applied now.

        Rounds of H steps: one step is one schedule position. Swarm clock: the position moves to where
        the clock says the swarm is, sending early what our next step would carry past (:mod:`.clock`);
        every position passed runs its sends, results due and group preparation in order."""
        self.local_steps += 1
        self.groups.observe_step()
        for frag in self.fragments:
            frag.samples_since_send += samples
            frag.steps_since_send += 1
        for job in self._inflight:
            if not job.future.done():
                job.overlapped_steps += 1
        if self.clock is None:
            return self._advance_to(self.position + 1)
        reports = self._advance_to(self._clock_target(samples))
        self._resumed_at = time.time()
        return reports

    def _advance_to(self, target: int) -> List[SyncReport]:
        reports: List[SyncReport] = []
        blocking_at = None  # the position of the last blocking sync that ended here
        has_samples = (lambda p: True) if self.clock is None else (lambda p: self.fragments[p].samples_since_send > 0)
        while self.position < target:
            self.position += 1
            t = self.position
            for p in self.schedule.due(t):
                reports += self._send(self.fragments[p], t)
            resolved, blocking_ended = self.overlap.resolve_due(self, t)
            reports += resolved
            if blocking_ended:
                blocking_at = t
            self.groups.prepare(t, has_samples)
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
        clock.step(samples, now, compute, others)
        return clock.target(self.position, self.schedule.next_send)

    def steps_to_agreed_rounds(self) -> int:
        """Leaving: no group forms for rounds ahead any more, and this returns how many inner steps are
        left to the last round we already joined (0 when none). Formation runs up to H/P − 1 positions
        ahead, so a peer that stops at once leaves a sealed group whose members then wait for a part
        and a shard that never come, and fail that round; training on to it costs at most H/P − 1
        steps and fails nobody."""
        first = self.groups.preparing
        self.groups.preparing = False
        left = max([s - self.position for s in self.groups.agreed_send_steps()] + [0])
        if first and left:
            logger.info(f"leaving after {left} more step(s): other peers already count on us for a round")
        return left

    def finish(self) -> List[SyncReport]:
        """End of training: wait for every sync in flight and apply it, then the model takes every
        fragment's global copy, in every mode (:meth:`.overlap.OverlapMode.finish`): the run's result
        is the global model. Returns the reports of the syncs applied here; ``on_sync`` is called for
        each once the model holds the result."""
        return self.overlap.finish(self)

    def close(self) -> None:
        """Stop the background threads (a job still running is abandoned)."""
        self._worker.close()
        self.groups.close()
        if self.meter is not None:
            self.meter.close()

    # ---- sending ----------------------------------------------------------------------------------
    def _send(self, frag: FragmentState, t: int) -> List[SyncReport]:
        if self.clock is not None and frag.samples_since_send == 0:
            return [self._not_a_member(frag.index, t)]
        return self.overlap.send(self, frag, t)

    def _not_a_member(self, p: int, t: int) -> SyncReport:
        """Swarm clock: the clock passed fragment ``p``'s send point with no sample of ours since its last
        round (one inner step longer than a round). We are no member of that round; reported as missed,
        so the loop catches up from the swarm's verified state (:mod:`.clock`)."""
        round_ = self.schedule.round_of(p, t)
        self.groups.discard(p, round_)
        report = SyncReport(step=t, fragment=p, round=round_, ok=False, missed=True, applied_step=t,
                            error=f"no sample of fragment {p} since its last round: not a member of round "
                                  f"{round_} (an inner step longer than a round); catching up")
        logger.warning(f"fragment {p} round {round_}: {report.error}")
        self._notify(report)
        return report

    def step_scale(self, steps: int) -> float:
        """What a pseudo-gradient of ``steps`` inner steps is multiplied by before it is averaged.

        Rounds of H steps: 1. Swarm clock: ``H / steps``, so that a member sends its displacement per
        step times H and the round's average is ``H · Σ_m p_m Δ_m / k_m`` with p_m its share of the
        round's samples (FedNova, Wang et al. 2020). A member's influence is then its samples, as the
        weight says, not samples times steps (a multi-step AdamW displacement grows with its steps),
        and the update stays H steps' worth of progress whatever the swarm's mix of speeds. Members at
        equal speeds take H steps per round when N = peers x H x batch: the scale is exactly 1 then."""
        if self.clock is None or steps <= 0 or not self.normalize_steps:
            return 1.0
        return self.H / steps

    def _launch(self, frag: FragmentState, t: int, delta: torch.Tensor, weight: float, due: int,
                group: Optional[concurrent.futures.Future] = None, steps: int = 0) -> None:
        """Hand fragment ``frag``'s sync sent at position ``t`` to the background worker; due at ``due``.
        ``steps``: the inner steps behind ``delta`` (it is sent times :meth:`step_scale` of them)."""
        round_ = self.schedule.round_of(frag.index, t)
        if group is None:
            group = self.groups.take(frag.index, round_, t)
        job = SyncJob(fragment=frag.index, round=round_, send_step=t, due_step=due, delta=delta,
                      weight=float(weight), epoch=self._epoch, group=group, steps=int(steps),
                      scale=self.step_scale(steps))
        job.future = self._worker.submit(self._run, job)
        self._inflight.append(job)

    # ---- the background side ------------------------------------------------------------------------
    def _run(self, job: SyncJob) -> None:
        """Worker thread: group, all-reduce through the fragment's reducer, apply to the global copy."""
        frag = self.fragments[job.fragment]
        traffic = self.swarm.node.traffic if self.swarm is not None else None
        # a state download served (or fetched) while the sync runs shares the node's counter: not the sync's
        state = getattr(self.swarm.node, "state_traffic", None) if self.swarm is not None else None
        sent0, recv0 = _minus(traffic, state)
        try:
            t0 = time.perf_counter()
            group = job.group.result()
            job.group_wait = time.perf_counter() - t0  # > 0: group formation was not ready at the send
            job.group_size = group.size
            if self.swarm is None:
                allreduce = solo_allreduce(self.codec)
            else:
                allreduce = group_allreduce(self.swarm, job, group, self.codec)
            sent = job.delta if job.scale == 1.0 else job.delta * job.scale
            avg = frag.reducer.reduce(sent, allreduce)
            info = getattr(frag.reducer, "info", None)
            job.extra = dict(info()) if info is not None else {}
            note_coverage(job, group)
        except SyncFailed as e:
            job.error = str(e)
            job.missed = isinstance(e, RoundMissed)
            job.failed = True
            logger.warning(f"sync of fragment {frag.index} round {job.round} failed, keeping local progress: {e}")
        else:
            with self.state_lock:
                if job.epoch == self._epoch:
                    frag.outer.step(avg)
                    self.synced_step = max(self.synced_step, job.send_step)
                    job.digest = frag.outer.digest()
                    job.ok = job.applied = True
                    # the size of what the outer step consumed (its step is lr x Nesterov of it)
                    job.extra["avg_norm"] = float(avg.norm())
                else:
                    job.failed = True
                    job.error = "dropped: the state was replaced by a download while this sync ran"
        finally:
            if traffic:
                sent1, recv1 = _minus(traffic, state)
                job.bytes_sent, job.bytes_received = sent1 - sent0, recv1 - recv0
            job.seconds = time.perf_counter() - job.launched

    # ---- applying results to the model ------------------------------------------------------------------
    def _resolve(self, job: SyncJob, notify: bool = True) -> SyncReport:
        """Wait for ``job`` if it is still running (the wait is recorded), take it off the list, let the
        mode apply it to the model (``tau`` does now; the others when they restart the next inner
        phase), report."""
        t0 = time.perf_counter()
        job.future.result()  # re-raises a bug in the worker; SyncFailed was caught there
        waited = time.perf_counter() - t0
        self.wait_seconds += waited
        self._inflight.remove(job)
        p = job.fragment
        self.overlap.on_resolved(self, self.fragments[p], job)
        report = SyncReport(step=job.send_step, fragment=p, round=job.round, ok=job.ok, group_size=job.group_size,
                            seconds=job.seconds, samples=int(job.weight), bytes_sent=job.bytes_sent,
                            bytes_received=job.bytes_received, digest=job.digest, error=job.error,
                            missed=job.missed, applied_step=self.position, wait_seconds=waited,
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
            chunks = [t.detach().cpu().contiguous().view(-1) for _, _, _, t, _ in walk(self.outer)]
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
        with self.state_lock:
            for p, kind, i, t, off in walk(self.outer):
                theirs = flat[off: off + t.numel()].view_as(t)
                mine = t.detach().cpu()
                n = int((mine.view(torch.int32) != theirs.view(torch.int32)).sum())
                if n:
                    return {"fragment": p, "tensor": self.layout.names[p][i], "kind": kind, "differing": n,
                            "numel": t.numel(), "max_abs_diff": float((mine - theirs).abs().max())}
        return None

    def load_snapshot(self, meta: Dict[str, object], payload: bytes) -> None:
        """Adopt a verified snapshot: global state, model parameters and schedule position. Syncs in
        flight are dropped (their results would belong to the state we are leaving)."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        with self.state_lock:
            self._epoch += 1
            for _, _, _, t, off in walk(self.outer):
                t.copy_(flat[off: off + t.numel()].view_as(t))
            for o, steps in zip(self.outer, meta["outer_steps"]):
                o.steps = int(steps)
            for frag in self.fragments:
                frag.outer.copy_to(frag.model_params)
            self.position = self.synced_step = int(meta["step"])
            if self.clock is not None:
                self.clock.jump_to(self.position)
                self._resumed_at = time.time()  # the download's time was no computing
            for frag in self.fragments:
                frag.samples_since_send = frag.steps_since_send = 0
            if self._inflight:
                logger.info(f"dropped {len(self._inflight)} sync(s) in flight for the downloaded state")
            self._inflight.clear()
            self.groups.drop_through(self.position)
            for frag in self.fragments:
                self.overlap.begin_phase(frag)
                frag.forget_offset()  # the peer restarts on the agreed trajectory
        for frag in self.fragments:  # their residuals belong to the history we just left
            reset = getattr(frag.reducer, "reset", None)
            if reset is not None:
                reset()

    # ---- checkpoints ------------------------------------------------------------------------------------
    def overlap_state_dict(self) -> Dict[str, object]:
        """Bookkeeping of ``delay``/``eager`` that a checkpoint needs besides the model and global copies:
        each fragment's start point W_m and, for eager, this peer's offset from the agreed copy and the
        own term in it (the next round takes that term out again). (Syncs in flight are not saved: after
        a resume they are lost and the swarm's divergence repair brings this peer back.)"""
        with self.state_lock:
            return self.overlap.state_dict(self.fragments)

    def load_overlap_state(self, state: Optional[Dict[str, object]]) -> None:
        with self.state_lock:
            self.overlap.load_state(self.fragments, state)
