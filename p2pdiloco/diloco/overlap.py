"""The overlap modes: when a fragment's averaged pseudo-gradient reaches the model.

A fragment's sync is a :class:`~.background.SyncJob`. At its *send step* the training loop takes the
fragment's pseudo-gradient and hands the job to a background worker that runs the jobs in submission
order (``reducer.reduce`` with its all-reduce calls); training goes on meanwhile. Group formation for
an upcoming sync is queued ``prepare_steps`` inner steps early on a second worker (:mod:`.groups`, so
it never waits behind an all-reduce in flight), and at the send step only the all-reduce is left.
When the averaged Δ arrives, the worker applies it to the fragment's **global copy** at once, under
``DiLoCo.state_lock``:
``(θ, b) ← OuterOpt(θ, b, Δ)`` — the global copy and the Nesterov momentum only ever take true
averages, in round order. The job's *due step* is when the loop applies the result to the model;
if the job is not finished then, the loop waits and records the wait. A failed job (``SyncFailed``:
every member of the group fails together) applies nothing anywhere.

Each mode is an :class:`OverlapMode` (:func:`overlap_mode` picks it): how it sends, what it applies
when and what a checkpoint keeps of it (the end of training is the same in every mode, below). What
the model gets, per mode (fragment p, round k sent after inner step s_k, ``M`` peers):

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
``n`` outer steps applies ``n`` averages in every mode; then, in every mode, the model takes every
fragment's global copy: a run ends on the global model, as the papers evaluate it (``tau`` drops the
local steps since each fragment's last sync, up to H − H/P of them; ``eager`` the peer's offset;
:meth:`OverlapMode.finish`). A state download (:meth:`DiLoCo.load_snapshot`) drops the jobs in flight: a result
that arrives later belongs to the state left behind and is discarded (an epoch counter).

Memory on the outer device besides the global copy and momentum: each job in flight holds its Δ_m
(one fragment; in ``delay``/``eager`` up to all P fragments at once, i.e. one model's worth);
``delay``/``eager`` keep the start points W_m (one model), ``eager`` with the ``paper`` estimate the
offset (f, e) (two models' worth) and a reference to the last Δ'_m sent per fragment (the job's own,
so no extra memory while it is in flight; one model's worth in a checkpoint).
"""
from __future__ import annotations

import concurrent.futures
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from .background import SyncJob, SyncReport
from .fragment_state import FragmentState
from .outer import nesterov_step_

__all__ = ["OverlapMode", "TauMode", "DelayMode", "EagerMode", "EagerHeuristicMode", "overlap_mode",
           "lookahead", "minus_residual", "pseudo_gradient_from", "merge_into"]


class OverlapMode:
    """How one mode (``streaming.mode``) sends a fragment and applies its results (module docstring);
    the end of training (:meth:`finish`) is the same for all.

    The modes are parts of :class:`~.core.DiLoCo` (``dl``, not imported here: core imports this
    module): they run on the training thread and use its job list, groups and lock.
    ``restarts_phases``: each inner phase restarts from a start point W_m (``delay``/``eager``);
    ``keeps_offset``: the start point carries a per-peer offset that a checkpoint keeps (``eager``).
    """

    name = ""
    restarts_phases = False
    keeps_offset = False

    def begin_phase(self, frag: FragmentState) -> None:
        """The start of training, or a state just adopted: set the fragment's start point."""

    def send(self, dl: "DiLoCo", frag: FragmentState, t: int) -> List[SyncReport]:
        """Send the fragment's pseudo-gradient at position ``t``; returns the syncs applied meanwhile."""
        raise NotImplementedError

    def resolve_due(self, dl: "DiLoCo", t: int) -> Tuple[List[SyncReport], bool]:
        """Apply the results due at position ``t`` (after its sends): their reports, and whether a
        blocking sync (due at its own send step) ended here."""
        return [], False

    def on_resolved(self, dl: "DiLoCo", frag: FragmentState, job: SyncJob) -> None:
        """A job of ``frag`` was taken off the list: what the model gets from it now."""

    def finish(self, dl: "DiLoCo") -> List[SyncReport]:
        """End of training, the same in every mode: apply every sync in flight, then the model takes
        every fragment's global copy. The run's result is the global model, as the papers evaluate it:
        not a peer's local steps since a fragment's last sync (``tau``: up to H − H/P of them, and the
        ``alpha`` merge), nor its own eager offset. What those steps carried is dropped with its weight
        and step count, so a checkpoint written now resumes from the global model with nothing unsent
        (``tau`` measures its next Δ_m against the global copy; ``delay``/``eager`` restart their start
        point there). The syncs applied here are reported once the model holds the result, so a
        validation in ``on_sync`` measures the final model."""
        reports = [dl._resolve(job, notify=False) for job in list(dl._inflight)]
        with dl.state_lock:
            for frag in dl.fragments:
                frag.outer.copy_to(frag.model_params)
                self.begin_phase(frag)
                frag.forget_offset()
                frag.samples_since_send = frag.steps_since_send = 0
        for r in reports:
            dl._notify(r)
        return reports

    def landing(self, dl: "DiLoCo", t: int, due: Sequence[int]) -> Set[int]:
        """Fragments whose sync result may reach the model at position ``t`` (``due``: those sent then)."""
        raise NotImplementedError

    def state_dict(self, frags: Sequence[FragmentState]) -> Dict[str, object]:
        """The checkpoint's ``overlap`` entry: each fragment's start point (None in ``tau``), the eager
        offsets and the own terms in them."""
        cpu = lambda ts: [t.cpu().clone() for t in ts]  # noqa: E731
        return {"mode": self.name,
                "start": [cpu(f.start) for f in frags] if self.restarts_phases else None,
                "offsets": [None if f.offset is None else (cpu(f.offset[0]), cpu(f.offset[1])) for f in frags],
                "own": [None if f.own_term is None else (f.own_term[0], f.own_term[1].cpu().clone())
                        for f in frags]}

    def load_state(self, frags: Sequence[FragmentState], state: Optional[Dict[str, object]]) -> None:
        """Restore what :meth:`state_dict` saved (under ``DiLoCo.state_lock``)."""


class TauMode(OverlapMode):
    """``tau``: the average reaches the model ``tau`` positions after the send, merged with weight
    ``1 − alpha`` (tau = 0, alpha = 0: blocking DiLoCo).

    ``keep_residual`` (``compression.feedback_form = "model"``): what this peer's compressed part left
    out of its Δ_m (the reducer's error-feedback residual e_m) stays in its model, which is merged with
    θ~ − e_m instead of θ~. The next Δ_m = θ~ − θ_m then holds e_m as it holds the local progress, so
    the reducer adds nothing (it hands e_m over and forgets it), and the next inner phase starts from
    a point that already has the progress this peer did not send: it is neither re-learned nor sent
    twice. The global copy, the average and every digest are untouched: e_m only moves this peer's
    own model."""

    name = "tau"

    def __init__(self, tau: int, alpha: float, keep_residual: bool = False):
        self.tau, self.alpha, self.keep_residual = tau, alpha, keep_residual

    def send(self, dl: "DiLoCo", frag: FragmentState, t: int) -> List[SyncReport]:
        # never two rounds of a fragment in flight (tau < H/P): this resolves nothing in a valid run
        reports = [dl._resolve(job) for job in [j for j in dl._inflight if j.fragment == frag.index]]
        # Algorithm 2: Δ_m = θ − θ_m against the global copy (no job of this fragment is running, so
        # the worker is not writing it)
        delta = frag.outer.pseudo_gradient(frag.model_params)
        dl._launch(frag, t, delta, frag.take_samples(), due=t + self.tau, steps=frag.take_steps())
        return reports

    def resolve_due(self, dl: "DiLoCo", t: int) -> Tuple[List[SyncReport], bool]:
        reports, blocking_ended = [], False
        for job in [j for j in dl._inflight if j.due_step <= t]:
            reports.append(dl._resolve(job))
            if job.ok and job.due_step == job.send_step:
                blocking_ended = True
        return reports, blocking_ended

    def on_resolved(self, dl: "DiLoCo", frag: FragmentState, job: SyncJob) -> None:
        if job.ok:
            with dl.state_lock:  # θ_m ← alpha·θ_m + (1 − alpha)·θ~   (Algorithm 2)
                target = frag.outer.params
                residual = frag.reducer.take_residual() if self.keep_residual else None
                if residual is not None:  # θ~ − e_m: this peer's unsent part stays in its model
                    if job.scale != 1.0:  # e_m is in units of the scaled Δ_m that was sent
                        residual = residual / job.scale
                    target = minus_residual(frag.outer, residual)
                merge_into(frag.model_params, target, self.alpha)
        else:
            frag.samples_since_send += int(job.weight)  # the progress stays in the model: so does its weight
            frag.steps_since_send += job.steps

    def landing(self, dl: "DiLoCo", t: int, due: Sequence[int]) -> Set[int]:
        return {j.fragment for j in dl._inflight if j.due_step <= t} | (set(due) if self.tau == 0 else set())


class DelayMode(OverlapMode):
    """``delay``: round k's average reaches the model at round k+1's send, when the next inner phase
    restarts from the global copy."""

    name = "delay"
    restarts_phases = True

    def __init__(self, H: int):
        self.H = H

    def begin_phase(self, frag: FragmentState) -> None:
        frag.start_from_global()

    def send(self, dl: "DiLoCo", frag: FragmentState, t: int) -> List[SyncReport]:
        """Progress since this phase's start point, then apply round k−1, then restart, then send."""
        p = frag.index
        delta = pseudo_gradient_from(frag.start, frag.model_params)
        weight, steps = frag.take_samples(), frag.take_steps()
        reports = []
        prev = next((j for j in dl._inflight if j.fragment == p), None)
        if prev is not None:
            reports.append(dl._resolve(prev, notify=False))
            if not prev.ok:  # nothing of round k−1 was applied anywhere: send our part of it again
                delta.add_(prev.delta)
                weight += prev.weight
                steps += prev.steps
        round_ = dl.schedule.round_of(p, t)
        group = dl.groups.ensure(p, round_, t)  # stays listed until launch: next_sync_step() sees it forming
        with dl.state_lock:
            frag.start = self.next_start(dl, frag, delta, prev, group, dl.step_scale(steps))
            merge_into(frag.model_params, frag.start, 0.0)
        for r in reports:  # after the model restarted from the result: validation measures that model
            dl._notify(r)
        dl.groups.discard(p, round_)
        dl._launch(frag, t, delta, weight, due=t + self.H, group=group, steps=steps)
        return reports

    def next_start(self, dl: "DiLoCo", frag: FragmentState, delta: torch.Tensor, prev: Optional[SyncJob],
                   group: concurrent.futures.Future, scale: float = 1.0) -> List[torch.Tensor]:
        """The start point W_m of the next inner phase (under ``state_lock``): here the global copy θ."""
        return [x.clone() for x in frag.outer.params]

    def landing(self, dl: "DiLoCo", t: int, due: Sequence[int]) -> Set[int]:
        return set(due)  # a fragment's previous round lands when it is sent again

    def load_state(self, frags: Sequence[FragmentState], state: Optional[Dict[str, object]]) -> None:
        for frag in frags:
            frag.forget_offset()
        if not state or state.get("mode") != self.name or state.get("start") is None:
            for frag in frags:
                frag.start_from_global()
            return
        for frag, src in zip(frags, state["start"], strict=True):
            for d, s in zip(frag.start, src, strict=True):
                d.copy_(s)
        offsets = state.get("offsets") or [None] * len(frags)
        owns = state.get("own")
        # an offset is only usable with the own term it holds (the next round takes that out again);
        # without it (an older checkpoint) the peer restarts its offset from the agreed trajectory
        if self.keeps_offset and len(offsets) == len(frags) and owns is not None:
            for frag, saved, own in zip(frags, offsets, owns, strict=True):
                _load_offset(frag, saved, own)


def _load_offset(frag: FragmentState, saved, own) -> None:
    params = frag.outer.params
    if saved is not None:
        frag.offset = ([x.to(g.device).clone() for x, g in zip(saved[0], params, strict=True)],
                       [x.to(g.device).clone() for x, g in zip(saved[1], params, strict=True)])
    if own is not None:
        if own[1].numel() != frag.outer.numel:
            raise ValueError(f"the eager own term of fragment {frag.index} does not match its parameters")
        frag.own_term = (float(own[0]), own[1].to(params[0].device).clone())


class EagerHeuristicMode(DelayMode):
    """``eager`` with ``eager_estimate = fresh_heuristic``: the next phase starts from a look-ahead with
    this peer's fresh Δ_m standing in for the whole average (not the paper's rule)."""

    name = "eager"
    keeps_offset = True

    def next_start(self, dl: "DiLoCo", frag: FragmentState, delta: torch.Tensor, prev: Optional[SyncJob],
                   group: concurrent.futures.Future, scale: float = 1.0) -> List[torch.Tensor]:
        return lookahead(frag.outer, delta if scale == 1.0 else delta * scale)


class EagerMode(DelayMode):
    """``eager`` with ``eager_estimate = paper``: Eager Updates as published, split into the agreed
    part and this peer's offset (module docstring)."""

    name = "eager"
    keeps_offset = True

    def next_start(self, dl: "DiLoCo", frag: FragmentState, delta: torch.Tensor, prev: Optional[SyncJob],
                   group: concurrent.futures.Future, scale: float = 1.0) -> List[torch.Tensor]:
        """θ + f after this round's offset step.

        The paper's peer applies OuterOpt with Δ~_m(k) = Δ(k−1) + δ_k, δ_k = ρ_k·Δ'_m(k) − (the own term
        it added last): its fresh term replaces its stale one in the late average. Δ'_m(k) is what round
        k sends (with a failed round's Δ'_m resent in it); ρ_k = w_m/W is its share of round k's
        average, not known before the round ends: estimated as ρ_{k−1}·M_{k−1}/M_k from round k−1's
        covered weight when that arrived, else 1/M_k (with equal weights the paper's 1/M). The term
        subtracted is exactly the term added before (``own_term``), whatever happened in between (a
        failed round, a resend, another group size or weight), so the offset always holds the latest
        own term alone and the estimate's error never accumulates. The agreed copy applies Δ(k−1)
        alone (done by the worker when round k−1 arrived), so the offset (f, e) = (θ_m − θ, b_m − b)
        follows e ← μ·e + δ_k, f ← f − lr·(δ_k + μ·e) (Nesterov SGD is linear). When round k−1 brought
        no average (the first round, a failed round, the first round after a download) the agreed
        copy took no step but the paper's peer did, with Δ~_m(k) = δ_k: then e ← μ·(b + e) + δ_k − b
        and f ← f − lr·(δ_k + μ·(b + e))."""
        outer = frag.outer
        size = _expected_size(dl, group, prev)
        arrived = prev is not None and prev.ok
        if arrived:  # our share of round k: as in round k−1 (speeds change slowly), scaled to k's group size
            share = prev.weight / prev.covered_weight * max(prev.group_size, 1) / size
        else:
            share = 1.0 / size
        share = share * scale  # the average holds our Δ'_m as sent: times DiLoCo.step_scale
        d_flat = delta * share
        last = frag.own_term
        if last is not None:  # the same product as when it was added: the same bits, an exact cancellation
            d_flat = d_flat - last[1].to(delta.device) * last[0]
        frag.own_term = (share, delta)  # the job's Δ'_m: never written after its send
        if frag.offset is None:
            frag.offset = ([torch.zeros_like(x) for x in outer.params], [torch.zeros_like(x) for x in outer.params])
        f_list, e_list = frag.offset
        for f, e, b, d in zip(f_list, e_list, outer.buffers, outer.unflatten(d_flat)):
            if arrived:
                nesterov_step_(f, e, d, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
            else:  # the peer's own step from (θ + f, b + e); the agreed copy stays at (θ, b)
                bm = b + e
                nesterov_step_(f, bm, d, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
                e.copy_(bm - b)
        return [x + f for x, f in zip(outer.params, f_list)]


def _expected_size(dl: "DiLoCo", group: concurrent.futures.Future, prev: Optional[SyncJob]) -> int:
    """Members expected in the round being sent (for the peer's own share ρ): its group when formed,
    else the last round's, else the live peers."""
    if group.done() and group.exception() is None:
        return max(1, int(getattr(group.result(), "size", 1)))
    if prev is not None and prev.ok:
        return max(1, prev.group_size)
    return max(1, dl.swarm.expected_group(dl.position)) if dl.swarm is not None else 1


def overlap_mode(streaming, H: int, keep_residual: bool = False) -> OverlapMode:
    """The mode ``streaming`` (a validated ``[streaming]`` config section) asks for; ``keep_residual``
    (``tau`` only, the config checks it): the model keeps the reducer's error-feedback residual."""
    if streaming.mode == "tau":
        return TauMode(streaming.tau, streaming.alpha, keep_residual)
    if streaming.mode == "delay":
        return DelayMode(H)
    if streaming.eager_estimate == "fresh_heuristic":
        return EagerHeuristicMode(H)
    return EagerMode(H)


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
def minus_residual(outer, residual: torch.Tensor) -> List[torch.Tensor]:
    """θ − e_m per parameter: the point a peer that keeps its residual ``e_m`` (flat, the fragment's
    order) in its model is merged with."""
    return [g - e.to(g.device) for g, e in zip(outer.params, outer.unflatten(residual))]


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
