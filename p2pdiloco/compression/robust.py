"""Robust aggregation of the parts of one shard, and the checks that screen them first.

The owner of a shard holds every member's part of it (fp32, decoded and finite). Before
aggregating it *screens* the parts (:func:`screen`): a part whose sample weight is more than
``max_weight_ratio`` times the median weight, or whose L2 norm is more than ``norm_bound`` times
the median norm of the shard's parts, is dropped (the owner's own part is never dropped: the owner
trusts itself). Then it aggregates what is left:

* ``aggregator = "mean"``: the sample-weighted mean, summed in fp32 in member order (bitwise
  reproducible; exactly what DiLoCo prescribes). **Known weakness**: one Byzantine part that passes
  the screen still moves the mean by up to ``norm_bound / M`` times a typical part's norm (e.g. a
  sign-flipped update scaled just under the bound), and with ``norm_bound = 0`` by any amount.
* ``aggregator = "centered_clip"``: CenteredClip (Karimireddy, He & Jaggi 2021, "Learning from
  History for Byzantine Robust Optimization", arXiv 2012.10333), the aggregator BTARD uses per
  shard (Gorbunov et al. 2021, "Secure Distributed Training at Scale", arXiv 2106.11257)::

      v_0     = coordinate-wise median of the parts
      v_{l+1} = v_l + Σ_i w_i (x_i − v_l) · min(1, τ / ‖x_i − v_l‖) / Σ_i w_i

  Each iteration moves every part's pull to at most τ, so a part far from the honest cluster
  shifts the result by at most ``w_bad · τ / Σ w`` per iteration however large it is, while parts
  within τ of the centre count exactly as in the mean. τ is ``clip_radius`` when set, otherwise
  ``clip_factor`` times the median distance of the parts from v_0 (scale-free: it follows the
  size of the pseudo-gradients over training). **Stated bound** (tests/test_security.py): with one
  arbitrary part out of 5, equal weights and the automatic τ, the result is within
  ``0.5 · max_i ‖h_i − μ‖`` of the honest mean μ (the honest parts' own spread; measured ≈ 0.25–0.3),
  however large the bad part; the plain mean is off by ``‖bad − μ‖ / 5``. With all parts honest
  and within τ of the centre it equals the weighted mean up to fp32 rounding (with τ at the median
  distance about half the honest parts are clipped a little: measured ≈ 5 % of the spread). With
  two parts or fewer there is no majority to protect: the weighted mean is used.

Both run on CPU in fp32 and depend only on the parts, their order and the config, so the owner's
result (encoded once, sent to every member) is the same bytes for everyone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from ..errors import ConfigError

__all__ = ["RobustConfig", "aggregate", "centered_clip", "weighted_mean", "screen", "AGGREGATORS"]

AGGREGATORS = ("mean", "centered_clip")
#: shards smaller than this skip the norm screen (a handful of scalars legitimately differ by large
#: ratios, e.g. per-matrix energies a compressor all-reduces); finiteness and weights still apply
NORM_SCREEN_MIN_NUMEL = 64


@dataclass
class RobustConfig:
    """Defences of the shard owner against bad parts (non-finite or absurd values, scaled or
    sign-flipped updates). Part of the run's fingerprint: every owner must apply the same rules to
    everyone's parts."""

    #: "mean" (sample-weighted mean, DiLoCo) or "centered_clip" (CenteredClip, robust to a minority
    #: of arbitrary parts)
    aggregator: str = "mean"
    #: CenteredClip radius τ in the units of the pseudo-gradient (0 = automatic, see clip_factor)
    clip_radius: float = 0.0
    #: automatic τ = clip_factor × median distance of the parts from their coordinate-wise median
    clip_factor: float = 1.0
    #: CenteredClip iterations
    clip_iterations: int = 10
    #: drop a part whose L2 norm exceeds norm_bound × the median part norm of the shard (0 = off)
    norm_bound: float = 10.0
    #: drop a part whose sample weight exceeds max_weight_ratio × the median weight (0 = off)
    max_weight_ratio: float = 10.0
    #: offences (invalid parts or messages) within ban_seconds that get a peer banned (0 = never ban)
    ban_after: int = 3
    #: how long a ban lasts (seconds): the peer is refused by every handler and left out of groups
    ban_seconds: float = 600.0

    def validate(self) -> None:
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(f"robust.aggregator ({self.aggregator!r}) must be one of {', '.join(AGGREGATORS)}")
        for name in ("clip_radius", "norm_bound", "max_weight_ratio"):
            v = getattr(self, name)
            if not v >= 0 or v == float("inf"):
                raise ConfigError(f"robust.{name} ({v!r}) must be a finite number >= 0 (0 disables it)")
        if self.norm_bound and self.norm_bound < 1:
            raise ConfigError(f"robust.norm_bound ({self.norm_bound}) must be >= 1 (or 0 to disable): "
                              "below 1 it drops honest parts larger than the median")
        if self.max_weight_ratio and self.max_weight_ratio < 1:
            raise ConfigError(f"robust.max_weight_ratio ({self.max_weight_ratio}) must be >= 1 (or 0 to disable)")
        if not self.clip_factor > 0:
            raise ConfigError(f"robust.clip_factor ({self.clip_factor!r}) must be > 0")
        if not isinstance(self.clip_iterations, int) or not 1 <= self.clip_iterations <= 1000:
            raise ConfigError(f"robust.clip_iterations ({self.clip_iterations!r}) must be an integer in [1, 1000]")
        if not isinstance(self.ban_after, int) or self.ban_after < 0:
            raise ConfigError(f"robust.ban_after ({self.ban_after!r}) must be an integer >= 0 (0 = never ban)")
        if not self.ban_seconds > 0:
            raise ConfigError(f"robust.ban_seconds ({self.ban_seconds!r}) must be > 0")


def screen(weights: Sequence[float], norms: Sequence[float], own: int, cfg: RobustConfig,
           numel: int, round_samples: int = 0) -> Dict[int, str]:
    """Indexes to drop, with the reason: weight or norm too far above the group's median.

    ``own`` (the owner's index) is never dropped. Medians are lower medians over all given parts
    (the owner's included), so with an honest majority they lie inside the honest range.

    With rounds by the swarm's samples (``round_samples`` = N > 0, diloco/clock.py) peers' weights
    differ as their speeds do: a GPU among laptops honestly reports 10-50x the median. There a weight
    is absurd only above ``2 N`` (a whole round's budget twice: one peer doing all of a round, plus a
    failed round carried over), and the median ratio applies only beyond that.
    """
    dropped: Dict[int, str] = {}
    if cfg.max_weight_ratio and len(weights) > 1:
        med = _lower_median(weights)
        limit = max(cfg.max_weight_ratio * med, 2.0 * round_samples)
        for i, w in enumerate(weights):
            if i != own and w > limit:
                why = (f"more than {cfg.max_weight_ratio:g}x the median weight {med:.4g}" if not round_samples else
                       f"more than twice the round's budget ({round_samples}) and {cfg.max_weight_ratio:g}x the "
                       f"median weight {med:.4g}")
                dropped[i] = f"weight {w:.4g} is {why}"
    if cfg.norm_bound and len(norms) > 1 and numel >= NORM_SCREEN_MIN_NUMEL:
        med = _lower_median(norms)
        for i, n in enumerate(norms):
            if i != own and i not in dropped and n > cfg.norm_bound * med:
                dropped[i] = f"norm {n:.4g} is more than {cfg.norm_bound:g}x the median part norm {med:.4g}"
    return dropped


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], cfg: RobustConfig) -> torch.Tensor:
    """The shard's result from the parts that passed the screen (in member order)."""
    if cfg.aggregator == "centered_clip" and len(parts) > 2:
        return centered_clip(parts, weights, radius=cfg.clip_radius, factor=cfg.clip_factor,
                             iterations=cfg.clip_iterations)
    return weighted_mean(parts, weights)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i, accumulated in fp32 in the given order, one rounding per operation (a multiply,
    then an add; never fused: :mod:`p2pdiloco.exact`), so the same bits on any machine."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    total = 0.0
    for w, part in zip(weights, parts):
        acc.add_(torch.mul(part.to(torch.float32), w))
        total += w
    return acc.div_(total)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], *, radius: float = 0.0,
                  factor: float = 1.0, iterations: int = 10) -> torch.Tensor:
    """CenteredClip of 1-D fp32 ``parts`` with sample ``weights`` (see the module docstring).

    :param radius: clip radius τ; 0 = ``factor`` × median distance of the parts from v_0.
    """
    x = torch.stack([p.to(torch.float32) for p in parts])          # [M, n]
    w = torch.tensor([float(v) for v in weights], dtype=torch.float32)
    w = w / w.sum()
    v = x.median(dim=0).values if x.shape[0] > 2 else (x * w[:, None]).sum(0)
    if x.shape[1] == 0:
        return v
    tau = float(radius)
    if tau <= 0:
        tau = factor * float((x - v).norm(dim=1).median())
        if tau <= 0:  # at least half the parts coincide with v_0 already
            return v
    for _ in range(iterations):
        diff = x - v
        dist = diff.norm(dim=1)
        scale = torch.clamp(tau / dist.clamp_min(1e-30), max=1.0)
        step = (w * scale) @ diff
        v = v + step
        if float(step.norm()) <= 1e-7 * (float(v.norm()) + 1e-30):
            break
    return v


def _lower_median(values: Sequence[float]) -> float:
    ordered: List[float] = sorted(float(v) for v in values)
    return ordered[(len(ordered) - 1) // 2]
