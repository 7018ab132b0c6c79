"""One fragment's state: its model parameters, global copy, reducer and overlap bookkeeping.

:class:`DiLoCo` holds one :class:`FragmentState` per fragment (:mod:`.fragments` decides which
parameters each holds and when it syncs). The model parameters are the live tensors of the user's
module (θ_m, trained by the inner optimiser); the global copy is an :class:`~.outer.OuterState`
(θ and the outer momentum b, identical on every peer after every round). The start point and the
eager offset belong to the ``delay``/``eager`` modes (:mod:`.overlap`) and stay ``None`` in ``tau``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .outer import OuterState
from .reducers import Reducer

__all__ = ["FragmentState"]


class FragmentState:
    """Fragment ``index``: ``names`` (parameter names, in the module's order) and the tensors behind them.

    Thread ownership: ``model_params``, ``samples_since_send``, ``steps_since_send``, ``start``, ``offset`` and ``own_term``
    belong to the training thread; ``outer`` is written by the background worker under
    ``DiLoCo.state_lock``; ``reducer`` is used by the worker (and guards itself).
    """

    def __init__(self, index: int, names: Sequence[str], model_params: Sequence[torch.Tensor], outer: OuterState,
                 reducer: Reducer):
        self.index = index
        self.names: Tuple[str, ...] = tuple(names)
        #: the model's own parameters of this fragment (θ_m), trained in place by the inner optimiser
        self.model_params: List[torch.Tensor] = list(model_params)
        #: the global copy θ and its outer momentum b
        self.outer = outer
        #: how this fragment's pseudo-gradient is averaged (plain, quantized with error feedback, low-rank)
        self.reducer = reducer
        #: sequences trained since this fragment's last send: the weight of its next pseudo-gradient
        self.samples_since_send = 0
        #: inner steps taken since this fragment's last send: with the swarm clock its pseudo-gradient is
        #: normalized to H steps (``DiLoCo.step_scale``)
        self.steps_since_send = 0
        #: delay/eager: the point W_m the current inner phase started from (None in tau)
        self.start: Optional[List[torch.Tensor]] = None
        #: eager ``paper``: this peer's offset (f, e) from the agreed (θ, b); None means zero
        self.offset: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None
        #: eager ``paper``: the own term last added to the offset, as (share ρ, Δ'_m) with term = Δ'_m·ρ
        #: (None: nothing). The next round subtracts exactly this product, so the offset holds the
        #: latest own term alone.
        self.own_term: Optional[Tuple[float, torch.Tensor]] = None

    def take_samples(self) -> int:
        """The weight of a pseudo-gradient taken now; the count starts again from zero."""
        weight, self.samples_since_send = self.samples_since_send, 0
        return weight

    def take_steps(self) -> int:
        """The inner steps behind a pseudo-gradient taken now; the count starts again from zero."""
        steps, self.steps_since_send = self.steps_since_send, 0
        return steps

    def start_from_global(self) -> None:
        """The next inner phase starts from the global copy θ (delay/eager bookkeeping)."""
        self.start = [t.clone() for t in self.outer.params]

    def forget_offset(self) -> None:
        """Back on the agreed trajectory: no offset and no own term in it."""
        self.offset = None
        self.own_term = None
