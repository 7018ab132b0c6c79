"""Shared-basis low-rank compression of pseudo-gradients (PowerSGD-style), transport-agnostic.

PowerSGD: Vogels, Karimireddy, Jaggi 2019, arXiv:1905.13648; adaptive, diminishing rank in the
manner of DiLoCoX (arXiv:2506.21263), whose exact rule is not public: ours is documented below.

Each peer holds a :class:`LowRankCompressor` built from the same shapes and config. One sync round
is local phases with all-reduce-means between them, done by the caller::

    h  = comp.header()              # adaptive only: rank vote + last round's energy stats, fp32
    ah = allreduce_mean(h)          #   (send it losslessly: a few numbers per matrix)
    comp.agree(ah)                  #   this round's ranks and warm-start bases, identical everywhere
    v1 = comp.begin(tensors)        # [P_m for each low-rank matrix] + [small tensors], fp32
    a1 = allreduce_mean(v1)         # identical on every peer
    v2 = comp.middle(a1)            # [Q_m for each low-rank matrix], fp32
    a2 = allreduce_mean(v2)         # identical on every peer
    while comp.iterations_left:     # power_iterations > 1 only
        a2 = allreduce_mean(comp.middle(allreduce_mean(comp.again(a2))))
    out = comp.finish(a2)           # averaged tensors, original shapes, fp32

If an all-reduce fails, call :meth:`abort`: the round is dropped, residuals are kept.

For a low-rank matrix (``M_m`` = this peer's tensor reshaped to ``(shape[0], rest)`` plus its
error-feedback residual; ``Q`` is the warm-start basis, ``n x r``):

1. ``begin``:  ``P_m = M_m Q``.
2. ``middle``: ``P = orth(mean P_m)`` (Gram–Schmidt in fp64 with a positive diagonal, as QR with
   ``diag(R) >= 0``: a function of the identical mean, so identical on every peer); ``Q_m = M_m^T P``.
3. ``finish``: applied update ``P (mean Q_m)^T = P P^T mean(M_m)`` -- the same on every peer because
   it is computed only from all-reduced values (fp64, then rounded to fp32).

Bitwise identity across machines: ``P`` and the applied update are computed with
:mod:`p2pdiloco.exact` (Gram–Schmidt with fixed-order dot products instead of LAPACK's QR, and the
product as a sum of exact outer products instead of a BLAS matmul), so peers on different CPUs,
kernel builds, thread counts or a GPU agree bit for bit. The local products ``M_m Q`` and
``M_m^T P`` use BLAS: they are this peer's own contribution and need not agree.

``Q`` itself need not be identical on all peers: it only steers which subspace ``P`` finds, and
``P``, the applied update and the residuals are functions of all-reduced values and local data. A
peer that joined late or missed rounds (fresh ``Q``) therefore takes part correctly at once. The
*ranks* must agree (they fix the vector sizes); the header phase makes them agree every round.

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
instead, which feeds other peers' disagreement into each residual.) When ``Q_m`` crosses the wire
through a lossy codec, pass what the owners decoded as ``finish(a2, contributed=...)``: the residual
is then ``M_m - P Q^_m^T`` and covers that quantization error too. The owner's one re-quantization
of the *mean* is not fed back (no peer knows the exact mean); it is bounded by the codec.

Adaptive rank (``cfg.adaptive``): in ``middle`` each peer measures, per matrix and per column ``j``
of ``P``, its captured energy fraction ``rho_j = ||Q_m[:, j]||^2 / ||M_m||_F^2`` (these add up to
``||P P^T M_m||^2 / ||M_m||^2 <= 1`` because ``P`` is orthonormal; a zero matrix reports
``rho = (1, 0, ...)``). It keeps them, with the averaged ``Q``, until the next round's header::

    header per matrix = [ one-hot of the rank r it used (max_rank values), has stats (0/1),
                          has * rho_1 .. rho_r, 0 .. 0 (max_rank values) ]

(one-hot rather than the integer, so every peer's header has about the same norm and no robust
screen mistakes a stale peer's vote for an outlier). From the all-reduced header every peer
computes the same: the agreed previous rank ``r`` = the rank with the largest (sample-weighted)
vote, ties to the larger rank (peers that shared the last round all vote alike; a newcomer with
another rank is outvoted), the mean ``rho = mean(has*rho)/mean(has)``
and, with the columns sorted by it (descending, ties by index), ``energy(k) = sqrt(sum of the top
k)`` which estimates ``||P_k P_k^T M||_F / ||M||_F``. This round's rank per matrix:

* ``energy(r) < energy_target`` and ``r < max rank``: grow by one (a fresh seeded random column);
* otherwise: the smallest ``k >= min_rank`` with ``energy(k) >= energy_target`` ("rank
  diminishment": the rank falls as soon as fewer columns suffice; the top ``k`` columns of the
  averaged ``Q`` are kept as the warm start);
* nobody has stats (the first round, or only newcomers): ``r``.

Every decision uses only all-reduced values, so ranks agree on all peers of the round, including
peers whose own state was stale (a restart, a missed round): the vote heals them in one round.

Which matrices and which rank: a matrix's largest rank is ``cfg.rank``, or with ``rank_fraction``
``f > 0`` the share ``floor(f * min(rows, cols))`` of its smaller side (at least 1), so the factors'
bytes keep the same proportion to the matrix as models grow. Tensors listed in the constructor's
``dense`` (the reducer passes the parameters named by ``compression.dense_params``, e.g. the
embeddings, whose pseudo-gradients are far from low-rank) are sent whole like the small ones.

Power iterations (``power_iterations = k > 1``): after :meth:`middle`, :meth:`again` takes the
all-reduced ``mean Q_m`` as the new ``Q`` (unit-norm columns) and returns ``[M_m Q]`` for one more
all-reduce, whose mean goes to :meth:`middle` again; :meth:`finish` follows the k-th. ``P``, the
applied update, the residual and the energy stats come from the last iteration. Measured in DiLoCo
(docs/compression.md): at equal bytes, a higher rank with one iteration did better.

``feedback_decay`` (error feedback only) keeps that share of the residual.

Tensors that are 1-D, smaller than ``min_numel``, or whose factors would not be smaller than the
matrix (``max_rank * (rows + cols) >= rows * cols``) are sent whole, averaged exactly by the first
all-reduce. Warm start (``cfg.warm_start``): ``"mean"``: the next round's ``Q`` is the averaged ``Q``
with unit-norm columns (PowerSGD's); ``"ritz"``: the left singular vectors of the averaged ``Q``
(``cols x r``, largest first), i.e. the right singular vectors of the applied update
``P (mean Q_m)^T`` (``P`` is orthonormal): a Rayleigh-Ritz step within the same subspace. With
``"mean"`` the columns of ``Q`` stay mixtures of the singular directions, so every column of the
factors carries a share of the strongest one and a 4-bit codec's per-column scale still drowns the
weak directions (they sort out only at the slow rate ``s_(j+1)/s_j`` per round); Ritz vectors make
column j of ``P_m`` and ``Q_m`` carry about singular value j alone, so the columns layout quantizes
each direction at its own scale. ``Q`` only steers (see above), so its SVD need not agree bitwise
across peers. A zero column is replaced by a fresh one; fresh columns come from a CPU
``torch.Generator`` seeded by ``(cfg.seed, matrix index, round)``, so they are the same on every
peer that saw the same rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError
from ..exact import exact_orthonormalize, exact_outer_sum

__all__ = ["LowRankConfig", "LowRankCompressor", "FACTOR_LAYOUTS", "WARM_STARTS", "pack_factor", "unpack_factor", "factor_numel"]

#: the layouts of a factor in the all-reduced vector (see :func:`pack_factor`)
FACTOR_LAYOUTS = ("columns", "rows")
#: how the next round's basis comes from the averaged Q (see the module docstring)
WARM_STARTS = ("ritz", "mean")


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
    #: > 0: each matrix's largest rank is ``max(1, floor(rank_fraction * min(rows, cols)))`` instead of
    #: ``rank`` (the same share of every matrix, so bytes scale with the model); 0: ``rank`` for all
    rank_fraction: float = 0.0
    #: power iterations per round (each one more ``p``/``q`` all-reduce pair); 1 is PowerSGD's warm start
    power_iterations: int = 1
    #: error feedback keeps ``feedback_decay`` times the residual (1: all of it)
    feedback_decay: float = 1.0
    #: how a factor (``P_m``, ``Q_m``: n x r) is laid out in the all-reduced vector: ``"columns"`` (each
    #: column contiguous, padded to the codec's block, so a block never mixes columns) or ``"rows"``
    #: (row-major: every block mixes all r columns, whose sizes follow the singular values)
    factor_layout: str = "columns"
    #: next round's ``Q``: ``"ritz"`` (the averaged Q's left singular vectors, strongest first) or
    #: ``"mean"`` (the averaged Q, unit-norm columns; PowerSGD's warm start)
    warm_start: str = "ritz"

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
        if not 0.0 <= float(self.rank_fraction) <= 1.0:
            raise ConfigError(f"lowrank.rank_fraction must be in [0, 1] (0: use rank), got {self.rank_fraction!r}")
        if not isinstance(self.power_iterations, int) or self.power_iterations < 1:
            raise ConfigError(f"lowrank.power_iterations must be an integer >= 1, got {self.power_iterations!r}")
        if not 0.0 <= float(self.feedback_decay) <= 1.0:
            raise ConfigError(f"lowrank.feedback_decay must be in [0, 1], got {self.feedback_decay!r}")
        if self.factor_layout not in FACTOR_LAYOUTS:
            raise ConfigError(f"lowrank.factor_layout must be one of {', '.join(FACTOR_LAYOUTS)}, "
                              f"got {self.factor_layout!r}")
        if self.warm_start not in WARM_STARTS:
            raise ConfigError(f"lowrank.warm_start must be one of {', '.join(WARM_STARTS)}, got {self.warm_start!r}")
        return self

    def max_rank(self, rows: int, cols: int) -> int:
        """Largest rank of a ``rows x cols`` matrix (``rank``, or ``rank_fraction`` of the smaller side)."""
        if self.rank_fraction > 0:
            return max(1, int(self.rank_fraction * min(rows, cols)))
        return min(self.rank, rows, cols)


def factor_numel(n: int, r: int, layout: str, align: int) -> int:
    """Values an ``n x r`` factor takes in the wire vector (``columns``: each column padded to ``align``)."""
    return r * (-(-n // align) * align) if layout == "columns" else n * r


def pack_factor(f: torch.Tensor, layout: str, align: int) -> torch.Tensor:
    """An ``n x r`` factor as its flat wire vector.

    ``columns``: column after column, each zero-padded to a multiple of ``align`` (the codec's block
    size), so every block of a blockwise codec holds one column's values and is scaled by that column's
    own absmax; a factor's columns differ in size like the singular values, and row-major blocks let the
    largest column set every block's scale, crushing the weak ones to a few levels. Zero padding stays
    zero through the mean and every codec. ``rows``: ``f`` row-major, unpadded.
    """
    if layout != "columns":
        return f.reshape(-1)
    n, r = f.shape
    pad = -(-n // align) * align - n
    t = f.t()
    if pad:
        t = torch.cat([t, torch.zeros(r, pad, dtype=f.dtype, device=f.device)], dim=1)
    return t.reshape(-1)


def unpack_factor(flat: torch.Tensor, n: int, r: int, layout: str, align: int) -> torch.Tensor:
    """The ``n x r`` factor of :func:`pack_factor`'s vector (padding dropped)."""
    if layout != "columns":
        return flat.reshape(n, r)
    return flat.reshape(r, -1)[:, :n].t()


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of ``p``'s columns (fp64), the same bits on every machine (see module docstring)."""
    return exact_orthonormalize(p)


def _fresh_columns(n: int, k: int, seed: int, index: int, round_: int) -> torch.Tensor:
    """``n x k`` fp32 unit-norm random columns, identical on every machine (CPU generator)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(((seed * 1_000_003 + index) * 1_000_033 + round_) % (2**63))
    q = torch.randn(n, k, generator=g, dtype=torch.float64)
    return (q / q.norm(dim=0, keepdim=True)).float()


class LowRankCompressor:
    """One peer's state for shared-basis low-rank compression (phases: header/agree, begin, middle, finish).

    ``shapes``: the shapes of the tensors passed to :meth:`begin`, in order, identical on all peers.
    Outputs are fp32 on the device of the inputs. Calling phases out of order raises ``RuntimeError``;
    a vector of the wrong length raises ``ValueError``. Do not modify the input tensors between
    :meth:`begin` and :meth:`finish` (they are copied, so it is safe, but the round uses the copies).
    """

    def __init__(self, shapes: Sequence[torch.Size], cfg: Optional[LowRankConfig] = None,
                 dense: Sequence[int] = (), align: int = 1) -> None:
        self.cfg = (cfg or LowRankConfig()).validate()
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"align must be an integer >= 1, got {align!r}")
        self._align = align  # the codec's block size: factor columns start on block boundaries
        dense_set = set(int(i) for i in dense)
        self._shapes = [torch.Size(s) for s in shapes]
        self._lowrank: List[int] = []  # tensor index of each low-rank matrix
        self._dims: List[Tuple[int, int]] = []
        self._max_rank: List[int] = []
        self._min_rank: List[int] = []
        self._small: List[int] = []
        for i, s in enumerate(self._shapes):
            if len(s) >= 2 and s.numel() >= self.cfg.min_numel and i not in dense_set:
                m, n = s[0], s.numel() // s[0]
                rmax = self.cfg.max_rank(m, n)
                if rmax * (m + n) < m * n:
                    self._lowrank.append(i)
                    self._dims.append((m, n))
                    self._max_rank.append(rmax)
                    self._min_rank.append(min(self.cfg.min_rank, rmax))
                    continue
            self._small.append(i)
        L = len(self._lowrank)
        self._ranks = list(self._max_rank)
        self._q = [_fresh_columns(n, r, self.cfg.seed, j, 0) for j, ((_, n), r) in enumerate(zip(self._dims, self._ranks))]
        self._residual: List[Optional[torch.Tensor]] = [None] * L
        self._energy: List[float] = [float("nan")] * L
        # adaptive: last round's averaged Q (raw) and local energy stats, until the next header
        self._pending_q: List[Optional[torch.Tensor]] = [None] * L
        self._pending_rho: List[Optional[List[float]]] = [None] * L
        self._round = 0
        self._phase = "idle"
        # per-round scratch
        self._m: List[torch.Tensor] = []
        self._p: List[torch.Tensor] = []
        self._q_local: List[torch.Tensor] = []
        self._rho: List[List[float]] = []
        self._small_avg: List[torch.Tensor] = []
        self._iter = 0  # power iterations done in this round (middle calls)

    # -- introspection -------------------------------------------------------------------------
    @property
    def ranks(self) -> List[int]:
        """Rank of each low-rank matrix in the current (or, between rounds, the last) round."""
        return list(self._ranks)

    @property
    def energies(self) -> List[float]:
        """Agreed captured energy ``energy(r)`` of each low-rank matrix, as of the last agreed stats
        (those of the round before the current one); NaN before any."""
        return list(self._energy)

    @property
    def lowrank_indices(self) -> List[int]:
        """Indices (into ``shapes``) of the tensors compressed as low-rank matrices."""
        return list(self._lowrank)

    @property
    def small_indices(self) -> List[int]:
        """Indices (into ``shapes``) of the tensors sent whole, at the end of :meth:`begin`'s vector."""
        return list(self._small)

    @property
    def header_numel(self) -> int:
        """Length of :meth:`header`'s vector (0 when not adaptive or nothing is low-rank)."""
        return sum(2 * r + 1 for r in self._max_rank) if self.cfg.adaptive else 0

    def wire_numel(self) -> Tuple[int, int]:
        """``(numel of begin's vector, numel of middle's vector)`` at the current ranks."""
        first = sum(self._fnumel(m, r) for (m, _), r in zip(self._dims, self._ranks))
        first += sum(self._shapes[i].numel() for i in self._small)
        second = sum(self._fnumel(n, r) for (_, n), r in zip(self._dims, self._ranks))
        return first, second

    def _fnumel(self, n: int, r: int) -> int:
        return factor_numel(n, r, self.cfg.factor_layout, self._align)

    def _pack(self, f: torch.Tensor) -> torch.Tensor:
        return pack_factor(f, self.cfg.factor_layout, self._align)

    def _unpack(self, flat: torch.Tensor, offset: int, n: int, r: int) -> Tuple[torch.Tensor, int]:
        """The ``n x r`` factor at ``offset`` of a wire vector (contiguous) and the offset after it."""
        k = self._fnumel(n, r)
        f = unpack_factor(flat[offset: offset + k], n, r, self.cfg.factor_layout, self._align)
        return f.contiguous(), offset + k

    def dense_numel(self) -> int:
        """Number of values one uncompressed round would send (for compression ratios)."""
        return sum(s.numel() for s in self._shapes)

    def residual(self, j: int) -> Optional[torch.Tensor]:
        """Error-feedback residual of low-rank matrix ``j`` (2-D, fp32), ``None`` if none yet."""
        return self._residual[j]

    def residual_norm(self) -> float:
        """L2 norm over all low-rank residuals (for logging)."""
        return float(sum(float(r.double().pow(2).sum()) for r in self._residual if r is not None) ** 0.5)

    # -- phases --------------------------------------------------------------------------------
    def header(self) -> torch.Tensor:
        """This peer's rank vote and last round's local energy stats (see module docstring), fp32."""
        if self._phase != "idle":
            raise RuntimeError(f"LowRankCompressor.header called during phase {self._phase!r}; finish or abort first")
        parts: List[torch.Tensor] = []
        if self.cfg.adaptive:
            for j, rmax in enumerate(self._max_rank):
                h = torch.zeros(2 * rmax + 1, dtype=torch.float32)
                h[self._ranks[j] - 1] = 1.0
                rho = self._pending_rho[j]
                if rho is not None:
                    h[rmax] = 1.0
                    h[rmax + 1: rmax + 1 + len(rho)] = torch.tensor(rho, dtype=torch.float32)
                parts.append(h)
        return torch.cat(parts) if parts else torch.zeros(0)

    def agree(self, avg_header: torch.Tensor) -> None:
        """Adopt this round's ranks and warm-start bases from the all-reduced :meth:`header`."""
        if self._phase != "idle":
            raise RuntimeError(f"LowRankCompressor.agree called during phase {self._phase!r}; finish or abort first")
        avg_header = avg_header.detach().reshape(-1).to("cpu", torch.float64)
        if avg_header.numel() != self.header_numel:
            raise ValueError(f"all-reduced header has {avg_header.numel()} values, expected {self.header_numel}")
        if self.cfg.adaptive:
            off = 0
            for j, rmax in enumerate(self._max_rank):
                h = avg_header[off: off + 2 * rmax + 1].tolist()
                off += 2 * rmax + 1
                self._agree_one(j, h[:rmax], h[rmax], h[rmax + 1:])
            self._phase = "agreed"

    def _agree_one(self, j: int, votes: List[float], has: float, rho_sum: List[float]) -> None:
        rmax, rmin = self._max_rank[j], self._min_rank[j]
        votes = [v if math.isfinite(v) else 0.0 for v in votes]
        r = max(range(rmin, rmax + 1), key=lambda k: (votes[k - 1], k))  # most votes, ties to the larger
        order = list(range(r))
        new_r = r
        if math.isfinite(has) and has > 0:
            rho = [max(v / has, 0.0) if math.isfinite(v) else 0.0 for v in rho_sum[:r]]
            order.sort(key=lambda c: (-rho[c], c))
            cum, energies = 0.0, []
            for c in order:
                cum += rho[c]
                energies.append(math.sqrt(min(cum, 1.0)))  # correctly rounded everywhere
            self._energy[j] = energies[-1]
            target = self.cfg.energy_target
            if energies[-1] < target and r < rmax:
                new_r = r + 1
            else:
                new_r = next((k for k in range(rmin, r + 1) if energies[k - 1] >= target), r)
        mine = self._pending_q[j]
        if mine is not None and mine.shape[1] == r:
            base = mine[:, order[: min(new_r, r)]]  # the averaged Q, best columns first
        else:  # a stale or fresh peer: its own basis, trimmed (it only steers P; see module docstring)
            base = self._q[j][:, : min(new_r, self._q[j].shape[1])]
        self._q[j] = self._warm_basis(j, base, new_r)
        self._ranks[j] = new_r
        self._pending_q[j] = None
        self._pending_rho[j] = None

    def _warm_basis(self, j: int, q: torch.Tensor, rank: int) -> torch.Tensor:
        """The next round's basis from ``q`` (the averaged Q, or the columns kept of it): with ``ritz``
        its left singular vectors, strongest first (the same span), then :meth:`_complete_basis`."""
        if self.cfg.warm_start == "ritz" and q.shape[1] > 0 and bool(torch.isfinite(q).all()):
            q = torch.linalg.svd(q.double(), full_matrices=False)[0]
        return self._complete_basis(j, q, rank)

    def _complete_basis(self, j: int, q: torch.Tensor, rank: int) -> torch.Tensor:
        """Unit-norm columns of ``q``, bad (zero, non-finite) ones replaced and fresh ones appended up to ``rank``."""
        q = q.double()
        norms = q.norm(dim=0)
        good = torch.isfinite(norms) & (norms > 0)
        q = (q / torch.where(good, norms, torch.ones_like(norms))).float()
        n_fresh = rank - q.shape[1]
        if not bool(good.all()) or n_fresh:
            fresh = _fresh_columns(self._dims[j][1], q.shape[1] + n_fresh, self.cfg.seed, j, self._round + 1).to(q.device)
            q = torch.where(good, q, fresh[:, : q.shape[1]])
            q = torch.cat([q, fresh[:, q.shape[1]:]], dim=1)
        return q

    def begin(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Add residuals, project onto the shared ``Q``; return ``[P_m ...] + [small tensors]``."""
        expected = "agreed" if self.cfg.adaptive else "idle"
        if self._phase != expected:
            raise RuntimeError(f"LowRankCompressor.begin called during phase {self._phase!r}; "
                               + ("call header/agree first" if self.cfg.adaptive else "call finish first"))
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
            parts.append(self._pack(m @ self._q[j]))
        for i in self._small:
            parts.append(tensors[i].detach().reshape(-1).to(torch.float32))
        self._phase = "begun"
        return torch.cat(parts) if parts else torch.zeros(0)

    def middle(self, avg_flat: torch.Tensor) -> torch.Tensor:
        """From the mean of :meth:`begin`'s vectors: orthonormalize ``P``, return ``[Q_m ...]``."""
        if self._phase != "begun":
            raise RuntimeError(f"LowRankCompressor.middle called during phase {self._phase!r}; call begin first")
        first, _ = self.wire_numel()
        if self._iter > 0:  # a later power iteration: the small tensors were averaged in the first
            first -= sum(self._shapes[i].numel() for i in self._small)
        avg_flat = avg_flat.detach().reshape(-1)
        if avg_flat.numel() != first:
            raise ValueError(f"first all-reduced vector has {avg_flat.numel()} values, expected {first}")
        offset = 0
        self._p, self._q_local, self._rho = [], [], []
        parts: List[torch.Tensor] = []
        for j, m in enumerate(self._m):
            rows, cols = self._dims[j]
            r = self._ranks[j]
            p_avg, offset = self._unpack(avg_flat, offset, rows, r)
            p_avg = p_avg.to(m.device)
            p = _orthonormalize(p_avg)
            q_local = m.t() @ p.to(torch.float32)
            self._p.append(p)
            self._q_local.append(q_local)
            parts.append(self._pack(q_local))
            if self.cfg.adaptive:
                total = m.double().pow(2).sum()
                if float(total) > 0:
                    rho = (q_local.double().pow(2).sum(dim=0) / total).clamp(0.0, 1.0)
                else:
                    rho = torch.zeros(r, dtype=torch.float64, device=m.device)
                    rho[0] = 1.0
                self._rho.append([float(v) for v in rho.tolist()])
        if self._iter == 0:
            self._small_avg = []
            for i in self._small:
                k = self._shapes[i].numel()
                self._small_avg.append(avg_flat[offset: offset + k].clone())
                offset += k
        self._iter += 1
        self._phase = "middle"
        return torch.cat(parts) if parts else torch.zeros(0)

    @property
    def iterations_left(self) -> int:
        """Power iterations still to run in this round before :meth:`finish` (0 when it may finish)."""
        return self.cfg.power_iterations - self._iter if self._phase == "middle" else 0

    def again(self, avg_q_flat: torch.Tensor) -> torch.Tensor:
        """Another power iteration (``power_iterations > 1``): from the mean of :meth:`middle`'s vectors,
        ``Q = mean Q_m`` (unit-norm columns) and return ``[M_m Q ...]`` (no small tensors) for the next
        all-reduce, whose mean goes to :meth:`middle` again."""
        if self._phase != "middle" or self.iterations_left <= 0:
            raise RuntimeError(f"LowRankCompressor.again called during phase {self._phase!r} with "
                               f"{self.iterations_left} power iterations left")
        _, second = self.wire_numel()
        avg_q_flat = avg_q_flat.detach().reshape(-1)
        if avg_q_flat.numel() != second:
            raise ValueError(f"second all-reduced vector has {avg_q_flat.numel()} values, expected {second}")
        parts: List[torch.Tensor] = []
        offset = 0
        for j, m in enumerate(self._m):
            cols, r = self._dims[j][1], self._ranks[j]
            q_avg, offset = self._unpack(avg_q_flat, offset, cols, r)
            q = self._complete_basis(j, q_avg.to(m.device), r)
            parts.append(self._pack(m @ q.to(m.device)))
        self._phase = "begun"
        return torch.cat(parts) if parts else torch.zeros(0)

    def finish(self, avg_q_flat: torch.Tensor, contributed: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """From the mean of :meth:`middle`'s vectors: return averaged tensors (original shapes, fp32).

        ``contributed``: :meth:`middle`'s vector as the owners decoded it (``codec.roundtrip``), when
        it crossed the wire lossily; error feedback then also carries that quantization error.
        """
        if self._phase != "middle":
            raise RuntimeError(f"LowRankCompressor.finish called during phase {self._phase!r}; call middle first")
        if self.iterations_left > 0:
            raise RuntimeError(f"LowRankCompressor.finish called with {self.iterations_left} power iterations left; "
                               "call again first")
        _, second = self.wire_numel()
        avg_q_flat = avg_q_flat.detach().reshape(-1)
        if avg_q_flat.numel() != second:
            raise ValueError(f"second all-reduced vector has {avg_q_flat.numel()} values, expected {second}")
        if contributed is not None and contributed.numel() != second:
            raise ValueError(f"contributed vector has {contributed.numel()} values, expected {second}")
        results: List[Optional[torch.Tensor]] = [None] * len(self._shapes)
        offset = 0
        for j, i in enumerate(self._lowrank):
            cols, r = self._dims[j][1], self._ranks[j]
            p = self._p[j]
            q_sent = (self._q_local[j] if contributed is None
                      else self._unpack(contributed.detach().reshape(-1), offset, cols, r)[0].to(p.device))
            q_avg, offset = self._unpack(avg_q_flat, offset, cols, r)
            q_avg = q_avg.to(p.device)
            results[i] = exact_outer_sum(p, q_avg, torch.float32).reshape(self._shapes[i])  # agreed: exact
            if self.cfg.error_feedback:
                self._residual[j] = self._m[j] - (p @ q_sent.double().t()).float()
                if self.cfg.feedback_decay != 1.0:
                    self._residual[j] = self._residual[j] * self.cfg.feedback_decay
            if self.cfg.adaptive:  # the next header decides the rank and which columns to keep
                self._pending_q[j] = q_avg.float().clone()
                self._pending_rho[j] = self._rho[j]
            else:
                self._q[j] = self._warm_basis(j, q_avg, r)
        for i, avg in zip(self._small, self._small_avg):
            results[i] = avg.reshape(self._shapes[i])

        self._round += 1
        self._clear_scratch()
        return [t for t in results if t is not None]

    def abort(self) -> None:
        """Drop the round in progress (an all-reduce failed): residuals and bases stay as they were
        before :meth:`begin`; ranks agreed by :meth:`agree` stay agreed."""
        self._clear_scratch()

    def _clear_scratch(self) -> None:
        self._m, self._p, self._q_local, self._rho, self._small_avg = [], [], [], [], []
        self._iter = 0
        self._phase = "idle"

    def reset_residuals(self) -> None:
        """Forget error-feedback residuals (the peer adopted another peer's state)."""
        self._residual = [None] * len(self._lowrank)

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> Dict[str, Any]:
        """Ranks, round counter, warm-start bases, pending stats and residuals (CPU tensors).

        ``copy=False`` returns the tensors themselves: the compressor never modifies them in place
        (every phase assigns new ones), so this is a cheap, consistent view to copy later.
        """
        if self._phase != "idle":
            raise RuntimeError("state_dict during a round; call it between finish and begin")
        cpu = (lambda t: None if t is None else t.detach().cpu().clone()) if copy else (lambda t: t)  # noqa: E731
        return {
            "shapes": [list(s) for s in self._shapes],
            "ranks": list(self._ranks),
            "round": self._round,
            "energy": list(self._energy),
            "q": [cpu(q) for q in self._q],
            "residual": [cpu(r) for r in self._residual],
            "pending_q": [cpu(q) for q in self._pending_q],
            "pending_rho": [None if r is None else list(r) for r in self._pending_rho],
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
        L = len(self._lowrank)
        pending_q = list(state.get("pending_q", [None] * L))
        pending_rho = list(state.get("pending_rho", [None] * L))
        for j, (q, rho) in enumerate(zip(pending_q, pending_rho)):
            if (q is None) != (rho is None) or (q is not None and (tuple(q.shape) != (self._dims[j][1], ranks[j])
                                                                   or len(rho) != ranks[j])):
                raise ValueError(f"low-rank state: pending stats of matrix {j} do not match its rank")
        for j, r in enumerate(state["residual"]):
            if r is not None and tuple(r.shape) != self._dims[j]:
                raise ValueError(f"low-rank state: residual {j} has shape {tuple(r.shape)}")
        self._ranks = ranks
        self._round = int(state["round"])
        self._energy = [float(e) for e in state["energy"]]
        self._q = [q.detach().float().clone() for q in state["q"]]
        self._residual = [None if r is None else r.detach().float().clone() for r in state["residual"]]
        self._pending_q = [None if q is None else q.detach().float().clone() for q in pending_q]
        self._pending_rho = [None if r is None else [float(v) for v in r] for r in pending_rho]
        self._clear_scratch()
