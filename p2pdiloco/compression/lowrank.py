"""Shared-basis low-rank compression of pseudo-gradients (PowerSGD-style), transport-agnostic.

PowerSGD: Vogels, Karimireddy, Jaggi 2019, arXiv:1905.13648; adaptive, diminishing rank in the
manner of DiLoCoX (arXiv:2506.21263), whose exact rule is not public: ours is documented below.

Each peer holds a :class:`LowRankCompressor` built from the same shapes and config. One sync round
is three local phases with two all-reduce-means between them, done by the caller::

    v1 = comp.begin(tensors)        # [P_m for each low-rank matrix] + [small tensors], fp32
    a1 = allreduce_mean(v1)         # identical on every peer
    v2 = comp.middle(a1)            # [Q_m for each low-rank matrix] + [energy stats], fp32
    a2 = allreduce_mean(v2)         # identical on every peer
    out = comp.finish(a2)           # averaged tensors, original shapes, fp32

For a low-rank matrix (``M_m`` = this peer's tensor reshaped to ``(shape[0], rest)`` plus its
error-feedback residual; ``Q`` is shared, ``n x r``):

1. ``begin``:  ``P_m = M_m Q``.
2. ``middle``: ``P = orth(mean P_m)`` (QR in fp64, signs fixed so ``diag(R) >= 0``: a unique
   function of the identical mean, so identical on every peer); ``Q_m = M_m^T P``.
3. ``finish``: applied update ``P (mean Q_m)^T = P P^T mean(M_m)`` -- the same on every peer because
   it is computed only from all-reduced values (fp64, then rounded to fp32).

Exactness: ``mean P_m = mean(M_m) Q``, so when ``rank(mean M_m) <= r`` (and the random ``Q`` is
generic) ``P`` spans the column space of the mean and the applied update equals ``mean M_m`` exactly
(to fp32 rounding), in one round. Peers' matrices themselves may have larger rank, e.g. peers with a
shared row space but different column spaces.

Error feedback (``cfg.error_feedback``) uses this peer's *local* reconstruction::

    residual_m = M_m - P Q_m^T = (I - P P^T) M_m        (Q_m: the local, pre-average Q)

``P Q_m^T`` is exactly this peer's contribution to the applied mean (the mean over peers of
``P Q_m^T`` is the applied update), so per peer ``sum_t P Q_{m,t}^T + residual_m == sum_t g_{m,t}``
and, averaged over peers, ``sum_t applied_t + mean_m residual_m == sum_t mean_m g_{m,t}``. With one
peer ``P Q_m^T`` *is* the applied update. (torch's DDP PowerSGD hook subtracts ``P mean(Q)^T``
instead, which feeds other peers' disagreement into each residual.) Error introduced by a lossy
codec inside the all-reduce is not covered here; wrap the wire with
:class:`~p2pdiloco.compression.feedback.ErrorFeedback` for that.

Adaptive rank (``cfg.adaptive``): in ``middle`` each peer appends, per matrix and per column ``j`` of
``P``, its captured energy fraction ``rho_j = ||Q_m[:, j]||^2 / ||M_m||_F^2`` (these add up to
``||P P^T M_m||^2 / ||M_m||^2 <= 1`` because ``P`` is orthonormal; a zero matrix reports
``rho = (1, 0, ...)``). After the second all-reduce every peer holds the same mean ``rho``; with the
columns sorted by mean ``rho`` (descending, ties by index), ``energy(k) = sqrt(sum of the top k)``
estimates ``||P_k P_k^T M||_F / ||M||_F``. Next round's rank per matrix:

* ``energy(r) < energy_target`` and ``r < max rank``: grow by one (a fresh seeded random column);
* otherwise: the smallest ``k >= min_rank`` with ``energy(k) >= energy_target`` ("rank
  diminishment": the rank falls as soon as fewer columns suffice; the top ``k`` columns of the
  averaged ``Q`` are kept as the warm start).

Every decision uses only all-reduced values, so ranks agree on all peers. The stats are the last
``stats_numel`` elements of the second vector, values in [0, 1]; a caller that quantizes that vector
may prefer to send them (a few numbers) in fp32.

Tensors that are 1-D, smaller than ``min_numel``, or whose factors would not be smaller than the
matrix (``max_rank * (rows + cols) >= rows * cols``) are sent whole, averaged exactly by the first
all-reduce. Warm start: the next round's ``Q`` is the averaged ``Q`` with unit-norm columns (a zero
column is replaced by a fresh one); fresh columns come from a CPU ``torch.Generator`` seeded by
``(cfg.seed, matrix index, round)``, so identical everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError

__all__ = ["LowRankConfig", "LowRankCompressor"]


@dataclass
class LowRankConfig:
    """Low-rank compression settings (see module docstring for the algorithm)."""

    rank: int = 4  #: initial and maximum rank per matrix
    min_rank: int = 1  #: the adaptive rule never goes below this
    adaptive: bool = True  #: adapt ranks from the agreed captured energy
    energy_target: float = 0.9  #: target for ||P P^T M||_F / ||M||_F
    min_numel: int = 4096  #: matrices with fewer elements (and all 1-D tensors) are sent whole
    seed: int = 0  #: seed of the shared random bases (must be equal on all peers)
    error_feedback: bool = True  #: keep (I - P P^T) M locally and add it next round

    def validate(self) -> "LowRankConfig":
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lowrank.rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.min_rank, int) or not 1 <= self.min_rank <= self.rank:
            raise ConfigError(f"lowrank.min_rank must be an integer in [1, rank={self.rank}], got {self.min_rank!r}")
        if not 0.0 < float(self.energy_target) <= 1.0:
            raise ConfigError(f"lowrank.energy_target must be in (0, 1], got {self.energy_target!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ConfigError(f"lowrank.min_numel must be an integer >= 1, got {self.min_numel!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"lowrank.seed must be an integer >= 0, got {self.seed!r}")
        return self


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of ``p``'s columns (fp64), unique: QR with ``diag(R) >= 0``."""
    q, r = torch.linalg.qr(p.double(), mode="reduced")
    d = torch.diagonal(r)
    signs = torch.where(d < 0, -torch.ones_like(d), torch.ones_like(d))
    return q * signs


def _fresh_columns(n: int, k: int, seed: int, index: int, round_: int) -> torch.Tensor:
    """``n x k`` fp32 unit-norm random columns, identical on every machine (CPU generator)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(((seed * 1_000_003 + index) * 1_000_033 + round_) % (2**63))
    q = torch.randn(n, k, generator=g, dtype=torch.float64)
    return (q / q.norm(dim=0, keepdim=True)).float()


class LowRankCompressor:
    """One peer's state for shared-basis low-rank compression (phases: begin, middle, finish).

    ``shapes``: the shapes of the tensors passed to :meth:`begin`, in order, identical on all peers.
    Outputs are fp32 on the device of the inputs. Calling phases out of order raises ``RuntimeError``;
    a vector of the wrong length raises ``ValueError``. Do not modify the input tensors between
    :meth:`begin` and :meth:`finish` (they are copied, so it is safe, but the round uses the copies).
    """

    def __init__(self, shapes: Sequence[torch.Size], cfg: Optional[LowRankConfig] = None) -> None:
        self.cfg = (cfg or LowRankConfig()).validate()
        self._shapes = [torch.Size(s) for s in shapes]
        self._lowrank: List[int] = []  # tensor index of each low-rank matrix
        self._dims: List[Tuple[int, int]] = []
        self._max_rank: List[int] = []
        self._min_rank: List[int] = []
        self._small: List[int] = []
        for i, s in enumerate(self._shapes):
            if len(s) >= 2 and s.numel() >= self.cfg.min_numel:
                m, n = s[0], s.numel() // s[0]
                rmax = min(self.cfg.rank, m, n)
                if rmax * (m + n) < m * n:
                    self._lowrank.append(i)
                    self._dims.append((m, n))
                    self._max_rank.append(rmax)
                    self._min_rank.append(min(self.cfg.min_rank, rmax))
                    continue
            self._small.append(i)
        self._ranks = list(self._max_rank)
        self._q = [_fresh_columns(n, r, self.cfg.seed, j, 0) for j, ((_, n), r) in enumerate(zip(self._dims, self._ranks))]
        self._residual: List[Optional[torch.Tensor]] = [None] * len(self._lowrank)
        self._energy: List[float] = [float("nan")] * len(self._lowrank)
        self._round = 0
        self._phase = "idle"
        # per-round scratch
        self._m: List[torch.Tensor] = []
        self._p: List[torch.Tensor] = []
        self._q_local: List[torch.Tensor] = []
        self._small_avg: List[torch.Tensor] = []

    # -- introspection -------------------------------------------------------------------------
    @property
    def ranks(self) -> List[int]:
        """Current rank of each low-rank matrix (the rank the next :meth:`begin` uses)."""
        return list(self._ranks)

    @property
    def energies(self) -> List[float]:
        """Agreed captured energy ``energy(r)`` of each low-rank matrix in the last round (NaN before)."""
        return list(self._energy)

    @property
    def lowrank_indices(self) -> List[int]:
        """Indices (into ``shapes``) of the tensors compressed as low-rank matrices."""
        return list(self._lowrank)

    @property
    def stats_numel(self) -> int:
        """Number of energy stats at the end of the second vector (0 when not adaptive)."""
        return sum(self._ranks) if self.cfg.adaptive else 0

    def wire_numel(self) -> Tuple[int, int]:
        """``(numel of begin's vector, numel of middle's vector)`` at the current ranks."""
        first = sum(m * r for (m, _), r in zip(self._dims, self._ranks))
        first += sum(self._shapes[i].numel() for i in self._small)
        second = sum(n * r for (_, n), r in zip(self._dims, self._ranks)) + self.stats_numel
        return first, second

    def dense_numel(self) -> int:
        """Number of values one uncompressed round would send (for compression ratios)."""
        return sum(s.numel() for s in self._shapes)

    def residual(self, j: int) -> Optional[torch.Tensor]:
        """Error-feedback residual of low-rank matrix ``j`` (2-D, fp32), ``None`` if none yet."""
        return self._residual[j]

    # -- phases --------------------------------------------------------------------------------
    def begin(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Add residuals, project onto the shared ``Q``; return ``[P_m ...] + [small tensors]``."""
        if self._phase != "idle":
            raise RuntimeError(f"LowRankCompressor.begin called during phase {self._phase!r}; call finish first")
        if len(tensors) != len(self._shapes):
            raise ValueError(f"expected {len(self._shapes)} tensors, got {len(tensors)}")
        for i, (t, s) in enumerate(zip(tensors, self._shapes)):
            if t.shape != s:
                raise ValueError(f"tensor {i} has shape {tuple(t.shape)}, expected {tuple(s)}")
        parts: List[torch.Tensor] = []
        self._m = []
        for j, i in enumerate(self._lowrank):
            t = tensors[i].detach()
            m = t.reshape(self._dims[j]).to(torch.float32, copy=True)
            if self._residual[j] is not None:
                m += self._residual[j].to(m.device)
            self._q[j] = self._q[j].to(m.device)
            self._m.append(m)
            parts.append((m @ self._q[j]).reshape(-1))
        for i in self._small:
            parts.append(tensors[i].detach().reshape(-1).to(torch.float32))
        self._phase = "begun"
        return torch.cat(parts) if parts else torch.zeros(0)

    def middle(self, avg_flat: torch.Tensor) -> torch.Tensor:
        """From the mean of :meth:`begin`'s vectors: orthonormalize ``P``, return ``[Q_m ...] + stats``."""
        if self._phase != "begun":
            raise RuntimeError(f"LowRankCompressor.middle called during phase {self._phase!r}; call begin first")
        first, _ = self.wire_numel()
        avg_flat = avg_flat.detach().reshape(-1)
        if avg_flat.numel() != first:
            raise ValueError(f"first all-reduced vector has {avg_flat.numel()} values, expected {first}")
        offset = 0
        self._p, self._q_local = [], []
        parts: List[torch.Tensor] = []
        stats: List[torch.Tensor] = []
        for j, m in enumerate(self._m):
            rows, cols = self._dims[j]
            r = self._ranks[j]
            p_avg = avg_flat[offset : offset + rows * r].reshape(rows, r).to(m.device)
            offset += rows * r
            p = _orthonormalize(p_avg)
            q_local = m.t() @ p.to(torch.float32)
            self._p.append(p)
            self._q_local.append(q_local)
            parts.append(q_local.reshape(-1))
            if self.cfg.adaptive:
                total = m.double().pow(2).sum()
                if float(total) > 0:
                    rho = (q_local.double().pow(2).sum(dim=0) / total).clamp(0.0, 1.0)
                else:
                    rho = torch.zeros(r, dtype=torch.float64, device=m.device)
                    rho[0] = 1.0
                stats.append(rho.float())
        self._small_avg = []
        for i in self._small:
            k = self._shapes[i].numel()
            self._small_avg.append(avg_flat[offset : offset + k].clone())
            offset += k
        self._phase = "middle"
        out = parts + stats
        return torch.cat(out) if out else torch.zeros(0)

    def finish(self, avg_q_flat: torch.Tensor) -> List[torch.Tensor]:
        """From the mean of :meth:`middle`'s vectors: return averaged tensors (original shapes, fp32)."""
        if self._phase != "middle":
            raise RuntimeError(f"LowRankCompressor.finish called during phase {self._phase!r}; call middle first")
        _, second = self.wire_numel()
        avg_q_flat = avg_q_flat.detach().reshape(-1)
        if avg_q_flat.numel() != second:
            raise ValueError(f"second all-reduced vector has {avg_q_flat.numel()} values, expected {second}")
        q_avgs: List[torch.Tensor] = []
        offset = 0
        for j, (_, cols) in enumerate(self._dims):
            r = self._ranks[j]
            q_avgs.append(avg_q_flat[offset : offset + cols * r].reshape(cols, r))
            offset += cols * r
        rhos: List[List[float]] = []
        if self.cfg.adaptive:
            for r in self._ranks:
                rhos.append([float(v) for v in avg_q_flat[offset : offset + r].tolist()])
                offset += r

        results: List[Optional[torch.Tensor]] = [None] * len(self._shapes)
        for j, i in enumerate(self._lowrank):
            p = self._p[j]
            q_avg = q_avgs[j].to(p.device)
            results[i] = (p @ q_avg.double().t()).float().reshape(self._shapes[i])
            if self.cfg.error_feedback:
                self._residual[j] = self._m[j] - (p @ self._q_local[j].double().t()).float()
            self._next_basis(j, q_avg, rhos[j] if rhos else None)
        for i, avg in zip(self._small, self._small_avg):
            results[i] = avg.reshape(self._shapes[i])

        self._round += 1
        self._m, self._p, self._q_local, self._small_avg = [], [], [], []
        self._phase = "idle"
        return [t for t in results if t is not None]

    # -- adaptive rank and warm start ------------------------------------------------------------
    def _next_basis(self, j: int, q_avg: torch.Tensor, rho: Optional[List[float]]) -> None:
        """Choose next round's rank of matrix ``j`` and its warm-start ``Q`` from agreed values."""
        r = self._ranks[j]
        order = list(range(r))
        new_r = r
        if rho is not None:
            order.sort(key=lambda c: (-rho[c], c))
            cum, energies = 0.0, []
            for c in order:
                cum += max(rho[c], 0.0)
                energies.append(min(cum, 1.0) ** 0.5)
            self._energy[j] = energies[-1]
            target = self.cfg.energy_target
            if energies[-1] < target and r < self._max_rank[j]:
                new_r = r + 1
            else:
                new_r = next((k for k in range(self._min_rank[j], r + 1) if energies[k - 1] >= target), r)
        keep = order[: min(new_r, r)]
        q = q_avg[:, keep].double()
        norms = q.norm(dim=0)
        good = torch.isfinite(norms) & (norms > 0)
        q = (q / torch.where(good, norms, torch.ones_like(norms))).float()
        n = self._dims[j][1]
        n_fresh = new_r - len(keep)
        if not bool(good.all()) or n_fresh:
            fresh = _fresh_columns(n, len(keep) + n_fresh, self.cfg.seed, j, self._round + 1).to(q.device)
            q = torch.where(good, q, fresh[:, : len(keep)])
            q = torch.cat([q, fresh[:, len(keep) :]], dim=1)
        self._q[j] = q
        self._ranks[j] = new_r

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Ranks, round counter, warm-start bases and residuals (CPU tensors)."""
        if self._phase != "idle":
            raise RuntimeError("state_dict during a round; call it between finish and begin")
        return {
            "shapes": [list(s) for s in self._shapes],
            "ranks": list(self._ranks),
            "round": self._round,
            "energy": list(self._energy),
            "q": [q.detach().cpu().clone() for q in self._q],
            "residual": [None if r is None else r.detach().cpu().clone() for r in self._residual],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if [list(s) for s in self._shapes] != [list(s) for s in state["shapes"]]:
            raise ValueError("low-rank state was saved for different tensor shapes")
        ranks = [int(r) for r in state["ranks"]]
        if len(ranks) != len(self._lowrank) or any(
            not lo <= r <= hi for r, lo, hi in zip(ranks, self._min_rank, self._max_rank)
        ):
            raise ValueError(f"low-rank state has ranks {ranks}, incompatible with this config")
        for j, q in enumerate(state["q"]):
            if tuple(q.shape) != (self._dims[j][1], ranks[j]):
                raise ValueError(f"low-rank state: basis {j} has shape {tuple(q.shape)}")
        self._ranks = ranks
        self._round = int(state["round"])
        self._energy = [float(e) for e in state["energy"]]
        self._q = [q.detach().float().clone() for q in state["q"]]
        self._residual = [None if r is None else r.detach().float().clone() for r in state["residual"]]
        self._phase = "idle"
