"""Network timeouts derived from what this peer measures, bounded by the configuration.

A fixed timeout is wrong twice: too short on a slow link (every round fails) and too long when a
peer crashes (everyone waits for nothing). So the waits are derived, and the ``[swarm]`` settings
are upper bounds (``swarm.adaptive_timeouts = false`` makes them fixed again):

* **Matchmaking** (how long a group waits for a live peer that is not ready yet): from that peer's
  own measured speed, published in its progress record: ``eta_slack · (steps it still has to
  take) / (its steps per second) + eta_margin``, capped by ``swarm.matchmaking_timeout``.
  Implemented in :mod:`p2pdiloco.swarm.matchmaking`; a peer that leaves or crashes stops being
  waited for as soon as its goodbye arrives or its record expires.
* **All-reduce and state download** (how long one transfer may take before it is abandoned):
  ``margin + slack · bytes · seconds_per_byte``, at least ``floor`` and at most
  ``swarm.allreduce_timeout``. ``seconds_per_byte`` is the slowest of the last few measured
  all-reduces of this peer (wall-clock, so CPU-bound encoding counts too); before anything was
  measured it is the configured slowest link, ``swarm.min_link_mbit``.

Defaults (documented in docs/reliability-notes.md): slack 4, margin 5 s, floor 10 s, cap 60 s,
min link 10 Mbit/s; matchmaking eta_slack 2, eta_margin 3 s, cap 30 s.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Optional

__all__ = ["Timeouts", "allreduce_bytes"]


def allreduce_bytes(encoded_size: int, group_size: int) -> int:
    """Bytes one member moves in a butterfly all-reduce of a vector that encodes to ``encoded_size``
    bytes: it sends (M-1)/M of its vector and receives as much back, and as an owner receives
    M-1 parts of its shard and sends M-1 means: about 4·(M-1)/M·encoded_size in all."""
    m = max(1, group_size)
    return int(4 * (m - 1) / m * encoded_size)


class Timeouts:
    """Thread-safe estimator. ``cap`` is ``swarm.allreduce_timeout``; ``min_link_mbit`` the assumed
    slowest link before any measurement; ``adaptive=False`` returns ``cap`` always."""

    def __init__(self, cap: float = 60.0, *, min_link_mbit: float = 10.0, adaptive: bool = True,
                 slack: float = 4.0, margin: float = 5.0, floor: float = 10.0, window: int = 5):
        self.cap = cap
        self.min_link_mbit = min_link_mbit
        self.adaptive = adaptive
        self.slack = slack
        self.margin = margin
        self.floor = floor
        self._spb: Deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def configure(self, *, cap: Optional[float] = None, min_link_mbit: Optional[float] = None,
                  adaptive: Optional[bool] = None) -> None:
        with self._lock:
            if cap is not None:
                self.cap = cap
            if min_link_mbit is not None:
                self.min_link_mbit = min_link_mbit
            if adaptive is not None:
                self.adaptive = adaptive

    def observe(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` completed in ``seconds`` (wall clock)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._spb.append(seconds / nbytes)

    def seconds_per_byte(self) -> float:
        with self._lock:
            measured = max(self._spb) if self._spb else None
        assumed = 8.0 / (self.min_link_mbit * 1e6)
        return measured if measured is not None else assumed

    def transfer(self, nbytes: int) -> float:
        """Timeout for moving ``nbytes``, seconds."""
        if not self.adaptive:
            return self.cap
        derived = self.margin + self.slack * nbytes * self.seconds_per_byte()
        return min(self.cap, max(self.floor, derived))
