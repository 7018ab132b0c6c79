"""Error feedback: carry what lossy compression dropped into the next round.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, arXiv:1901.09847) keeps,
per tensor, the residual between what this peer meant to send and what was actually applied, and
adds it to the next round's input. Nothing is lost, only delayed.

Invariant (per key, exact up to fp32 rounding), for inputs ``x_1..x_T`` and applied outputs
``a_1..a_T`` when every round calls ``s_t = compensate(key, x_t)`` then ``update(key, s_t, a_t)``::

    sum_t a_t + residual(key) == sum_t x_t

because ``residual_t = s_t - a_t = x_t + residual_{t-1} - a_t`` telescopes.
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-key fp32 residuals of a lossy channel (a codec round trip, a low-rank projection, ...).

    Residuals live on the device of the tensors given to :meth:`update`; ``state_dict`` holds CPU
    copies. A key's shape is fixed by its first ``update``; a mismatch raises ``ValueError``.
    """

    def __init__(self) -> None:
        self._residual: Dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Return ``x + residual(key)`` as a new fp32 tensor (``x`` as fp32 if there is none yet)."""
        r = self._residual.get(key)
        x = x.detach().float()
        if r is None:
            return x.clone()
        if r.shape != x.shape:
            raise ValueError(f"error feedback {key!r}: residual has shape {tuple(r.shape)}, input {tuple(x.shape)}")
        return x + r.to(x.device)

    def update(self, key: str, sent_input: torch.Tensor, applied_output: torch.Tensor) -> None:
        """Store ``residual = sent_input - applied_output``.

        ``sent_input`` is what :meth:`compensate` returned this round; ``applied_output`` is this
        peer's share of what was really applied (e.g. ``codec.roundtrip(sent_input)``).
        """
        if sent_input.shape != applied_output.shape:
            raise ValueError(
                f"error feedback {key!r}: sent {tuple(sent_input.shape)} vs applied {tuple(applied_output.shape)}"
            )
        self._residual[key] = sent_input.detach().float() - applied_output.detach().float().to(sent_input.device)

    def residual(self, key: str) -> Optional[torch.Tensor]:
        """The current residual of ``key`` (``None`` before its first update)."""
        return self._residual.get(key)

    def reset(self, key: Optional[str] = None) -> None:
        """Forget one key's residual, or every residual when ``key`` is ``None``."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def norm(self) -> float:
        """L2 norm over all residuals (for logging)."""
        return float(sum(float(r.double().pow(2).sum()) for r in self._residual.values()) ** 0.5)

    def __contains__(self, key: object) -> bool:
        return key in self._residual

    def __iter__(self) -> Iterator[str]:
        return iter(self._residual)

    def __len__(self) -> int:
        return len(self._residual)

    def state_dict(self, copy: bool = True) -> Dict[str, torch.Tensor]:
        """CPU copies of the residuals; ``copy=False``: the tensors themselves (never modified in
        place: :meth:`update` replaces them), a cheap consistent view to copy later."""
        if not copy:
            return dict(self._residual)
        return {k: v.detach().cpu().clone() for k, v in self._residual.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._residual = {str(k): v.detach().float().clone() for k, v in state.items()}
