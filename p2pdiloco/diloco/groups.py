"""Group formation ahead of the send: the groups of upcoming syncs, formed on their own thread.

A sync's group is agreed before its pseudo-gradient is ready, so that at the send step only the
all-reduce is left, the slowest member's drift included. Formation for the syncs of the next
``lead`` schedule positions is queued on a worker of its own (network and DHT only), never behind
an all-reduce in flight. A prepared group is about a (fragment, round), not about our state: it stays
valid across a state download for rounds still ahead.
"""
from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

from .background import SyncWorker
from .fragments import Schedule

__all__ = ["PreparedGroups"]


class _SoloGroup:
    size = 1


class PreparedGroups:
    """Group futures by (fragment, round), formed ``lead`` positions before their send step.

    :param swarm: forms groups (``swarm.form_group(fragment, round, send_step)``); None trains alone,
        where every group is a group of one and nothing is prepared ahead.
    :param prepare_steps: positions ahead (``streaming.prepare_steps``), capped at H/P − 1 so formation
        never starts before the previous fragment's send.
    :param prepare_seconds: or this many seconds ahead, in units of the measured step time (same cap).
    """

    def __init__(self, swarm, schedule: Schedule, prepare_steps: int, prepare_seconds: float):
        self.swarm = swarm
        self.schedule = schedule
        self.cap = schedule.H // schedule.P - 1
        self.lead = min(prepare_steps, self.cap)
        self.lead_seconds = float(prepare_seconds)
        self.step_seconds: Optional[float] = None   # moving average of the wall time of one inner step
        self._last_step_at: Optional[float] = None
        #: (fragment, round) -> future of its Group (or of the SyncFailed matchmaking raised)
        self.prepared: Dict[Tuple[int, int], concurrent.futures.Future] = {}
        #: False once we leave: no formation starts for rounds ahead any more
        self.preparing = True
        self._worker = SyncWorker("p2pdiloco-groups", torch_work=False)

    def observe_step(self) -> None:
        """One inner step ended now: a step and whatever the loop did around it (validation too)."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        self._last_step_at = now

    def lead_steps(self) -> int:
        """Positions ahead that formation starts: ``prepare_steps``, or ``prepare_seconds`` of measured
        step time if that is more, never more than H/P − 1."""
        lead = self.lead
        if self.lead_seconds > 0 and self.step_seconds:
            lead = max(lead, math.ceil(self.lead_seconds / max(self.step_seconds, 1e-3)))
        return max(0, min(lead, self.cap))

    def prepare(self, t: int, has_samples: Callable[[int], bool]) -> None:
        """Queue formation for the syncs of the next ``lead_steps()`` positions after ``t`` (after this
        position's sends). A fragment without samples gets no group: a member with no sample is no member."""
        lead = self.lead_steps() if self.swarm is not None and self.preparing else 0
        for s in range(t + 1, t + lead + 1):
            for p in self.schedule.due(s):
                if not has_samples(p):
                    continue
                key = (p, self.schedule.round_of(p, s))
                if key not in self.prepared:
                    self.prepared[key] = self.form(p, key[1], s)

    def ensure(self, p: int, round_: int, send_step: int) -> concurrent.futures.Future:
        """The group of (p, round_), formed now if it was not prepared; it stays listed (see
        :meth:`forming_send_steps`) until :meth:`discard` or :meth:`take`."""
        key = (p, round_)
        if key not in self.prepared:
            self.prepared[key] = self.form(p, round_, send_step)
        return self.prepared[key]

    def take(self, p: int, round_: int, send_step: int) -> concurrent.futures.Future:
        """The group of (p, round_), no longer listed: the prepared one, or one formed now."""
        fut = self.prepared.pop((p, round_), None)
        return fut if fut is not None else self.form(p, round_, send_step)

    def discard(self, p: int, round_: int) -> None:
        self.prepared.pop((p, round_), None)

    def drop_through(self, position: int) -> None:
        """Forget the groups of send steps up to ``position`` (a download moved us past them)."""
        for key in [k for k in self.prepared if self.schedule.send_step(*k) <= position]:
            del self.prepared[key]

    def agreed_send_steps(self) -> List[int]:
        """Send steps of the prepared rounds other peers count on us for: a group still forming (its
        leader may seal it with us in it) or formed with other members. Matchmaking that failed, or a
        group of one, commits us to nobody."""
        out = []
        for (p, r), fut in self.prepared.items():
            if fut.done() and (fut.exception() is not None or getattr(fut.result(), "size", 1) <= 1):
                continue
            out.append(self.schedule.send_step(p, r))
        return out

    def forming_send_steps(self) -> List[int]:
        """Send steps of the prepared groups still forming."""
        return [self.schedule.send_step(p, r) for (p, r), fut in self.prepared.items() if not fut.done()]

    def form(self, p: int, round_: int, send_step: int) -> concurrent.futures.Future:
        if self.swarm is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(_SoloGroup())
            return fut
        return self._worker.submit(self.swarm.form_group, p, round_, send_step)

    def close(self) -> None:
        self._worker.close()
