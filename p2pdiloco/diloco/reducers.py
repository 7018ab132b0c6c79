"""Reducers: how one fragment's pseudo-gradient becomes the group's average.

A reducer gets the flat fp32 pseudo-gradient Δ_m and an ``allreduce(vec, phase, codec=None)``
callable bound to the sync's group (weights, group and the default codec already applied; ``phase``
names one all-reduce within the sync). It returns the averaged Δ, identical on every member: it may
only derive the result from all-reduced values. A compressing reducer (low-rank, error feedback)
keeps its own state per fragment and may call ``allreduce`` several times.

Four reducers, chosen by ``[compression]`` (:func:`make_reducer`):

* :class:`PlainReducer`: one all-reduce of Δ with the run's codec (fp32 is OpenDiLoCo-style
  DiLoCo; a lossy codec without error feedback is Streaming DiLoCo's E3M0 as published).
* :class:`QuantizedReducer`: the same through a lossy codec, with error feedback.
* :class:`SparseReducer`: SparseLoCo's chunked top-k (:mod:`p2pdiloco.compression.sparse`) of a
  decayed error buffer, which stands in for the outer momentum.
* :class:`LowRankReducer`: PowerSGD-style shared-basis factors of the 2-D blocks
  (:mod:`p2pdiloco.compression.lowrank`), the factors through the run's codec, with adaptive,
  diminishing ranks agreed by the group every round.

Contract shared by all three: if any all-reduce raises (``SyncFailed``), the reducer's state is left
as it was before the sync (residuals included), so the caller can simply try again next round with
the pseudo-gradient that now also holds the local progress. ``state_dict()`` is what checkpoints
hold: the state after the last *completed* sync, returned at once even while a sync runs in a
background thread (a sync in flight is not part of a checkpoint). ``reset()`` forgets this peer's
residuals (it adopted another peer's state, whose history its residuals do not belong to); it waits
for a sync in flight. ``info()`` is what the last successful sync logs (``SyncReport.extra``).
``take_residual()`` hands the error-feedback residual of the last completed sync to the caller and
forgets it (``compression.feedback_form = "model"``: the peer keeps it in its model instead, so the next
pseudo-gradient holds it without the reducer adding it); ``None`` when the reducer keeps none.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch

from ..compression import Codec, get_codec
from ..compression.feedback import ErrorFeedback
from ..compression.lowrank import LowRankCompressor, LowRankConfig
from ..compression.sparse import sparse_codec

__all__ = ["Reducer", "PlainReducer", "QuantizedReducer", "SparseReducer", "LowRankReducer", "make_reducer", "AllReduceFn"]

AllReduceFn = Callable[..., torch.Tensor]

#: the exact codec for the few numbers (rank votes, energy stats) that decide the ranks
_EXACT = get_codec("fp32")


class Reducer(Protocol):
    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor: ...

    def state_dict(self) -> Dict[str, object]: ...

    def load_state_dict(self, state: Dict[str, object]) -> None: ...

    def reset(self) -> None: ...

    def info(self) -> Dict[str, object]: ...

    def take_residual(self) -> Optional[torch.Tensor]: ...


class PlainReducer:
    """One all-reduce of Δ with the run's codec (fp32 = OpenDiLoCo-style DiLoCo)."""

    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor:
        return allreduce(delta, "delta")

    def state_dict(self) -> Dict[str, object]:
        return {}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state and state.get("kind", "plain") != "plain":
            raise ValueError(f"reducer state is for a {state.get('kind')} reducer; this run has none "
                             "(compression settings differ)")

    def reset(self) -> None:
        pass

    def info(self) -> Dict[str, object]:
        return {}

    def take_residual(self) -> Optional[torch.Tensor]:
        return None


class QuantizedReducer:
    """One all-reduce of Δ through a lossy codec, with error feedback.

    Error feedback (Seide et al. 2014; Karimireddy et al. 2019, arXiv:1901.09847): round t sends
    ``s_t = Δ_t + e_{t-1}`` and keeps ``e_t = s_t − roundtrip(s_t)``. ``roundtrip(s_t)`` is exactly
    what the shard owners decoded from this peer (the all-reduce starts shards on codec block
    boundaries), so per peer ``Σ_t roundtrip(s_t) + e_T == Σ_t Δ_t`` up to fp32 rounding: nothing
    this peer meant to send is lost, only delayed. The owner's single re-quantization of the mean
    (bounded by the codec, identical for everyone) is not fed back: no peer knows the exact mean.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._ef = ErrorFeedback()
        self._lock = threading.Lock()
        self._saved: Dict[str, torch.Tensor] = {}  # residuals after the last completed sync (views)

    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor:
        with self._lock:
            s = self._ef.compensate("delta", delta)
            avg = allreduce(s, "delta", self.codec)  # raises SyncFailed: residual untouched
            self._ef.update("delta", s, self.codec.roundtrip(s))
            self._saved = self._ef.state_dict(copy=False)
            return avg

    def residual(self) -> Optional[torch.Tensor]:
        return self._ef.residual("delta")

    def state_dict(self) -> Dict[str, object]:
        return {"kind": "quantized", "residual": {k: v.detach().cpu().clone() for k, v in self._saved.items()}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state.get("kind") != "quantized":
            raise ValueError(f"reducer state is for a {state.get('kind', 'plain')} reducer, this run uses "
                             "error feedback on a quantized codec (compression settings differ)")
        with self._lock:
            self._ef.load_state_dict(state["residual"])
            self._saved = self._ef.state_dict(copy=False)

    def reset(self) -> None:
        with self._lock:
            self._ef.reset()
            self._saved = {}

    def info(self) -> Dict[str, object]:
        return {"residual_norm": round(self._ef.norm(), 6)}

    def take_residual(self) -> Optional[torch.Tensor]:
        with self._lock:
            r = self._ef.residual("delta")
            self._ef.reset()
            self._saved = {}
            return r


class SparseReducer:
    """SparseLoCo (Sarfi et al. 2025): top-k of a decayed error buffer, the buffer as the momentum.

    Round t, per peer and fragment, with decay β (``compression.sparse_decay``, 0.95)::

        e ← β·e + Δ_t            (one rounding per operation)
        send s = roundtrip(e)    (chunked top-k, low-bit values: what the owners decode from us)
        e ← e − s

    The group's weighted mean of the ``s`` is applied with outer lr 1 and no momentum (the config
    requires it): the buffer accumulates what was not sent and, through β, plays momentum's part.
    Per peer ``e_T = Σ_t β^(T−t)·(Δ_t − s_t)`` up to fp32 rounding: nothing is dropped but what β
    forgets. The shards'
    owners relay the parts instead of re-encoding the mean (:mod:`p2pdiloco.compression.sparse`),
    so the applied update is exactly the mean of what the members' buffers lost.
    """

    def __init__(self, codec: Codec, decay: float):
        self.codec, self.decay = codec, float(decay)
        self._lock = threading.Lock()
        self._e: Optional[torch.Tensor] = None
        self._saved: Optional[torch.Tensor] = None  # the buffer after the last completed sync (never modified)
        self._info: Dict[str, object] = {}

    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor:
        with self._lock:
            delta = delta.detach().float()
            e = self._e
            if e is not None and e.shape != delta.shape:
                raise ValueError(f"sparse error buffer has {e.numel()} values, the pseudo-gradient {delta.numel()}")
            acc = delta.clone() if e is None else torch.add(torch.mul(e.to(delta.device), self.decay), delta)
            avg = allreduce(acc, "delta", self.codec)  # raises SyncFailed: the buffer stays as it was
            sent = self.codec.roundtrip(acc).to(acc.device)
            self._e = self._saved = torch.sub(acc, sent)
            self._info = {"error_norm": round(float(self._e.double().norm()), 6),
                          "sent_norm": round(float(sent.double().norm()), 6)}
            return avg

    def residual(self) -> Optional[torch.Tensor]:
        return self._e

    def state_dict(self) -> Dict[str, object]:
        saved = self._saved
        return {"kind": "sparse", "error": None if saved is None else saved.detach().cpu().clone()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state.get("kind") != "sparse":
            raise ValueError(f"reducer state is for a {state.get('kind', 'plain')} reducer, this run uses the "
                             "sparse codec (compression settings differ)")
        err = state.get("error")
        with self._lock:
            self._e = self._saved = None if err is None else err.detach().float().clone()

    def reset(self) -> None:
        """Forget the buffer (this peer adopted another's state; its buffer belongs to its own history)."""
        with self._lock:
            self._e = self._saved = None

    def info(self) -> Dict[str, object]:
        return dict(self._info)

    def take_residual(self) -> Optional[torch.Tensor]:
        return None  # the buffer is the outer momentum: it stays here (the config refuses the model form)


class LowRankReducer:
    """Shared-basis low-rank averaging of one fragment (PowerSGD, Vogels et al. 2019, arXiv:1905.13648).

    Per sync, up to three all-reduces (phases ``hdr``, ``p``, ``q``)::

        hdr  fp32, 2·max_rank + 1 values per matrix: one-hot rank vote and last round's energy stats
             (adaptive ranks only; exact, so rank decisions are exact and agreed by everyone)
        p    the run's codec: P_m = M_m Q for every low-rank matrix, then the small/1-D tensors whole
        q    the run's codec: Q_m = M_m^T P for every low-rank matrix
        p2, q2, ...  with ``power_iterations`` k > 1: k − 1 more p/q pairs (P_m = M_m mean(Q_m), ...)

    Bytes per matrix: ``r * (rows + cols)`` values instead of ``rows * cols``. With error feedback
    the residual of each matrix is ``M_m − P Q^_m^T`` (``Q^_m``: what the owners decoded of this
    peer's Q_m), and the small tensors carry their own codec residual as in
    :class:`QuantizedReducer`; with a lossless codec both reduce to PowerSGD's ``(I − P P^T) M_m``.
    """

    def __init__(self, shapes: Sequence[torch.Size], codec: Codec, cfg: LowRankConfig, dense: Sequence[int] = ()):
        self.comp = LowRankCompressor(shapes, cfg, dense, align=codec.block_size)
        self.codec = codec
        self._shapes = [torch.Size(s) for s in shapes]
        self._numels = [s.numel() for s in self._shapes]
        self._lossy = codec.relative_error_bound > 0
        self._small_ef: Optional[ErrorFeedback] = (
            ErrorFeedback() if cfg.error_feedback and self._lossy and self.comp.small_indices else None)
        self._lock = threading.Lock()
        self._info: Dict[str, object] = {}
        self._commit()

    def _commit(self) -> None:
        """Remember the state after a completed sync (tensor views: nothing is modified in place)."""
        self._saved = (self.comp.state_dict(copy=False),
                       self._small_ef.state_dict(copy=False) if self._small_ef is not None else {})

    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor:
        with self._lock:
            comp = self.comp
            tensors: List[torch.Tensor] = list(torch.split(delta.detach().reshape(-1), self._numels))
            small = comp.small_indices
            if self._small_ef is not None:
                for i in small:
                    tensors[i] = self._small_ef.compensate(str(i), tensors[i])
            sent_header = comp.header_numel
            try:
                if sent_header:
                    comp.agree(allreduce(comp.header(), "hdr", _EXACT))
                v1 = comp.begin([t.view(s) for t, s in zip(tensors, self._shapes)])
                a1 = allreduce(v1, "p", self.codec) if v1.numel() else v1  # sizes agree: all skip alike
                v2 = comp.middle(a1)
                a2 = allreduce(v2, "q", self.codec) if v2.numel() else v2
                k, more = 1, 0
                while comp.iterations_left:  # more power iterations: phases p2/q2, p3/q3, ...
                    k += 1
                    v1k = comp.again(a2)
                    a1 = allreduce(v1k, f"p{k}", self.codec) if v1k.numel() else v1k
                    more += v1k.numel() + v2.numel()  # the earlier q and this p
                    v2 = comp.middle(a1)
                    a2 = allreduce(v2, f"q{k}", self.codec) if v2.numel() else v2
                contributed = self.codec.roundtrip(v2) if self._lossy and comp.cfg.error_feedback else None
                out = comp.finish(a2, contributed)
            except BaseException:
                comp.abort()
                raise
            if self._small_ef is not None:
                seen = self.codec.roundtrip(v1)  # what the owners decoded from us (block-aligned shards)
                off = v1.numel() - sum(self._numels[i] for i in small)
                for i in small:
                    n = self._numels[i]
                    self._small_ef.update(str(i), tensors[i], seen[off: off + n])
                    off += n
            self._info = {
                "ranks": comp.ranks,
                "rank_energy": [None if e != e else round(e, 4) for e in comp.energies],  # NaN -> None (JSON)
                "values_sent": sent_header + v1.numel() + more + v2.numel(),
                "values_dense": comp.dense_numel(),
                "residual_norm": round(self._residual_norm(), 6),
            }
            self._commit()
            return torch.cat([o.reshape(-1) for o in out]).to(delta.device)

    def _residual_norm(self) -> float:
        sq = self.comp.residual_norm() ** 2
        if self._small_ef is not None:
            sq += self._small_ef.norm() ** 2
        return sq ** 0.5

    def state_dict(self) -> Dict[str, object]:
        comp, small = self._saved
        cpu = lambda t: None if t is None else t.detach().cpu().clone()  # noqa: E731
        lowrank = {k: ([cpu(t) if isinstance(t, torch.Tensor) else t for t in v] if k in ("q", "residual", "pending_q")
                       else v) for k, v in comp.items()}
        return {"kind": "lowrank", "lowrank": lowrank, "small_residual": {k: cpu(v) for k, v in small.items()}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state.get("kind") != "lowrank":
            raise ValueError(f"reducer state is for a {state.get('kind', 'plain')} reducer, this run uses "
                             "low-rank compression (compression settings differ)")
        with self._lock:
            self.comp.load_state_dict(state["lowrank"])
            if self._small_ef is not None:
                self._small_ef.load_state_dict(state.get("small_residual") or {})
            self._commit()

    def reset(self) -> None:
        """Forget residuals. Ranks and bases stay: the next header vote re-agrees them anyway."""
        with self._lock:
            self.comp.reset_residuals()
            if self._small_ef is not None:
                self._small_ef.reset()
            self._commit()

    def info(self) -> Dict[str, object]:
        return dict(self._info)

    def take_residual(self) -> Optional[torch.Tensor]:
        """The flat residual of the fragment (each low-rank matrix's, each small tensor's codec
        residual, zeros where there is none), then forgotten; ``None`` when there is none at all."""
        with self._lock:
            comp, parts = self.comp, [None] * len(self._shapes)
            for j, i in enumerate(comp.lowrank_indices):
                parts[i] = comp.residual(j)
            if self._small_ef is not None:
                for i in comp.small_indices:
                    parts[i] = self._small_ef.residual(str(i))
            if all(p is None for p in parts):
                return None
            device = next(p.device for p in parts if p is not None)
            flat = torch.cat([torch.zeros(n, device=device) if p is None else p.reshape(-1).to(device)
                              for p, n in zip(parts, self._numels)])
            comp.reset_residuals()
            if self._small_ef is not None:
                self._small_ef.reset()
            self._commit()
            return flat


def make_reducer(cfg, params: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None) -> Reducer:
    """The reducer ``cfg.compression`` asks for, for one fragment's parameters (in fragment order).

    ``codec = "sparse"`` → :class:`SparseReducer`; ``lowrank`` → :class:`LowRankReducer` (factors with ``codec``); else a lossy ``codec`` with
    ``error_feedback`` → :class:`QuantizedReducer`; else :class:`PlainReducer`. ``names``: the
    parameters' names (same order); those containing one of ``compression.dense_params``' substrings
    are sent whole with ``codec`` instead of as low-rank factors (without names, none is).
    """
    c = cfg.compression
    if c.codec == "sparse":
        return SparseReducer(sparse_codec(c.sparse_chunk, c.sparse_k, c.sparse_bits), c.sparse_decay)
    codec = get_codec(c.codec)
    if c.lowrank:
        lr = LowRankConfig(rank=c.rank, min_rank=c.min_rank, adaptive=c.adaptive, energy_target=c.energy_target,
                           min_numel=c.min_numel, seed=int(cfg.train.seed) % (2**31),
                           error_feedback=c.error_feedback, rank_fraction=c.rank_fraction,
                           power_iterations=c.power_iterations, feedback_decay=c.feedback_decay,
                           factor_layout=c.factor_layout, warm_start=c.warm_start)
        subs = [x.strip() for x in c.dense_params.split(",") if x.strip()]
        dense = [i for i, n in enumerate(names or ()) if any(x in n for x in subs)]
        return LowRankReducer([p.shape for p in params], codec, lr, dense)
    if c.error_feedback and codec.relative_error_bound > 0:
        return QuantizedReducer(codec)
    return PlainReducer()
