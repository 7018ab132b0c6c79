"""The outer optimiser and the global copy of one fragment.

``OuterState`` keeps the fragment's global parameters θ (fp32, on ``outer_device``, CPU by default
so GPU memory holds only the model) and the Nesterov momentum buffers. ``step(Δ)`` applies exactly
``torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)`` with the averaged pseudo-gradient Δ
in place of the gradient (DiLoCo, arXiv 2311.08105, Algorithm 1)::

    b ← μ·b + Δ             (b starts at 0, so the first step sets b = Δ, as torch does)
    θ ← θ − lr·(Δ + μ·b)     (nesterov)      or      θ ← θ − lr·b   (plain momentum)

Every operation is element-wise on identical inputs, one IEEE rounding each (a multiply by a scalar,
then an add: no ``alpha=`` form, which one CPU kernel fuses into an FMA and another does not; see
:mod:`p2pdiloco.exact`), so peers that decode identical Δ bytes hold bitwise identical θ and b
afterwards on any CPU or GPU; ``digest()`` proves it in the logs.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ..digest import fragment_digest

__all__ = ["OuterState", "nesterov_step_"]


@torch.no_grad()
def nesterov_step_(p: torch.Tensor, b: torch.Tensor, d: torch.Tensor, *, lr: float, momentum: float,
                   nesterov: bool = True) -> None:
    """``b ← μ·b + d``; ``p ← p − lr·(d + μ·b)`` (or ``p − lr·b``), in place, one rounding per operation.

    torch.optim.SGD's arithmetic, written without fused forms so every kernel gives the same bits."""
    b.mul_(momentum).add_(d)
    update = torch.add(d, torch.mul(b, momentum)) if nesterov else b
    p.sub_(torch.mul(update, lr))


class OuterState:
    """One fragment's global copy θ (fp32 on ``device``) and its momentum buffers b, stepped by the
    averaged pseudo-gradient (module docstring); ``steps`` counts the outer steps applied."""

    def __init__(self, params: Sequence[torch.Tensor], *, lr: float, momentum: float, nesterov: bool = True,
                 device: str = "cpu"):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.params: List[torch.Tensor] = [p.detach().to(device, torch.float32).clone() for p in params]
        self.buffers: List[torch.Tensor] = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def pseudo_gradient(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """Δ_m = θ − θ_m, flattened (fp32, on the outer device)."""
        return torch.cat([(g - l.detach().to(g.device, torch.float32)).view(-1) for g, l in zip(self.params, local)])

    def unflatten(self, flat: torch.Tensor) -> List[torch.Tensor]:
        out, off = [], 0
        for p in self.params:
            out.append(flat[off: off + p.numel()].view_as(p))
            off += p.numel()
        return out

    @torch.no_grad()
    def step(self, delta_flat: torch.Tensor) -> None:
        for p, b, d in zip(self.params, self.buffers, self.unflatten(delta_flat.to(self.params[0].device))):
            nesterov_step_(p, b, d, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        self.steps += 1

    @torch.no_grad()
    def copy_to(self, local: Sequence[torch.Tensor]) -> None:
        """θ_m ← θ for every local parameter (the model's device and dtype are kept)."""
        for g, l in zip(self.params, local):
            l.copy_(g.to(l.device, l.dtype))

    def digest(self) -> str:
        """The fragment's digest (:mod:`p2pdiloco.digest`: its outer step count, θ and the momentum
        buffers): equal on every peer after every sync."""
        return fragment_digest([*self.params, *self.buffers], self.steps)

    def state_dict(self) -> Dict[str, object]:
        return {"params": [p.cpu().clone() for p in self.params], "buffers": [b.cpu().clone() for b in self.buffers],
                "steps": self.steps}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        params, buffers = state["params"], state["buffers"]
        if len(params) != len(self.params) or any(a.shape != b.shape for a, b in zip(params, self.params)):
            raise ValueError("outer state does not match this fragment's parameters")
        for dst, src in zip(self.params, params):
            dst.copy_(src)
        for dst, src in zip(self.buffers, buffers):
            dst.copy_(src)
        self.steps = int(state["steps"])
