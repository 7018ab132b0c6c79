"""Reducers: how one fragment's pseudo-gradient becomes the group's average.

A reducer gets the flat fp32 pseudo-gradient Δ_m and an ``allreduce(vec, phase, codec=None)``
callable bound to the sync's group (weights, group and the default codec already applied; ``phase``
names one all-reduce within the sync). It returns the averaged Δ, identical on every member: it may
only derive the result from all-reduced values. A compressing reducer (low-rank, error feedback)
keeps its own state per fragment and may call ``allreduce`` several times.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence

import torch

from ..compression import Codec

__all__ = ["Reducer", "PlainReducer", "make_reducer", "AllReduceFn"]

AllReduceFn = Callable[..., torch.Tensor]


class Reducer(Protocol):
    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor: ...

    def state_dict(self) -> Dict[str, object]: ...

    def load_state_dict(self, state: Dict[str, object]) -> None: ...


class PlainReducer:
    """One all-reduce of Δ with the run's codec (fp32 = OpenDiLoCo-style DiLoCo)."""

    def reduce(self, delta: torch.Tensor, allreduce: AllReduceFn) -> torch.Tensor:
        return allreduce(delta, "delta")

    def state_dict(self) -> Dict[str, object]:
        return {}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        pass


def make_reducer(cfg, params: Sequence[torch.Tensor]) -> Reducer:
    """The reducer the configuration asks for, for one fragment's parameters."""
    return PlainReducer()
