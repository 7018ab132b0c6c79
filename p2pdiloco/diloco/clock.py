"""Rounds by the swarm's samples (``inner.round_samples``, issue 23): the swarm clock.

With ``inner.round_samples = 0`` a round is ``H = inner.sync_every`` inner steps on *every* peer, so the
swarm moves at its slowest member's pace: a peer 5x slower makes every other peer wait for it at every
sync. With ``round_samples = N > 0`` the schedule (fragments' send points, tau, prepare lead; all of
:class:`~p2pdiloco.diloco.fragments.Schedule`) runs on a *swarm clock* instead of the peer's own step
count: one position is ``N / H`` sequences processed by the whole swarm, so a round is ``N``
sequences whoever processed them. A fast peer takes many inner steps in a round, a slow one few; the
average stays weighted by the samples each member contributed, as hivemind's ``Optimizer`` does with
``target_batch_size`` and Decoupled DiLoCo with token-weighted merging. The rules, in full:

* **Advance.** After each inner step of ``b`` sequences that took ``dt`` seconds (waits included),
  ``pos += (b + R_others * dt) / (N / H)``, where ``R_others`` is the sum of the other live peers'
  published sample rates (sequences/s over the last seconds). Alone, the clock is the peer's own
  sample count.
* **Agreement.** Every step the peer also moves to the median of its own position and the other live
  peers' positions (each extrapolated from its record's time at the clock's speed), so clocks that
  started apart (a peer that joined late, a stall) converge instead of making the group wait each
  round. Nothing exact depends on the clock: the members of a round and their weights come from
  matchmaking and the all-reduce, as always; the clock only decides *when* a peer sends.
* **Send early, never late.** A peer sends a fragment at the last step boundary *before* the swarm
  reaches the send point: when its next step would carry the clock past it (``pos + lookahead`` where
  ``lookahead`` is the positions the swarm moves during one of this peer's steps). A fast peer sends
  within one of its short steps of the point; a slow one up to one of its long steps early, and it is
  then the one that waits in matchmaking (with overlap, it keeps training meanwhile). So nobody waits
  for a slow peer's step to end. The lookahead is capped below ``H`` so one step never sends two
  rounds of one fragment early.
* **No samples, no membership.** A peer whose clock passes a send point with no sample of that
  fragment since its last round (one inner step longer than a whole round: slower than
  ``1 / (round_samples / batch_size)`` of the swarm's rate) is not a member of that round: it reports
  the round as missed and catches up from the swarm's verified state, like any peer that missed a
  round. It still contributes to every round in which it finished a step.

``H`` stays in the run's fingerprint as the schedule's granularity (fragments stagger by ``H / P``
positions, tau counts positions); the budget ``N`` is in the fingerprint too; a peer's batch size and
speed are its own.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable, Deque, Iterable, Tuple

__all__ = ["SwarmClock", "RATE_WINDOW"]

#: seconds of history behind a peer's published sample rate
RATE_WINDOW = 10.0


class SwarmClock:
    """Where the swarm is on the schedule, in positions of ``round_samples / H`` sequences (see the module
    docstring). Times are ``time.time()`` seconds (records from other machines carry theirs)."""

    def __init__(self, H: int, round_samples: int, window: float = RATE_WINDOW):
        if round_samples < H:
            raise ValueError("round_samples must be >= H")
        self.H = H
        self.unit = round_samples / H
        self.pos = 0.0
        self.window = window
        self._last: float = math.nan            # time of the last step (or of start())
        self._steps: Deque[Tuple[float, int]] = deque()   # (end time, samples) of recent steps
        self.step_seconds = 0.0                 # our recent compute time per inner step (EMA)
        self.others_rate = 0.0                  # the other live peers' samples/s, as last read

    def start(self, now: float) -> None:
        """Training starts (or resumes) now: the first step's time counts from here."""
        self._last = now

    def rate(self) -> float:
        """Our samples per second over the last ``window`` seconds (waits included): what others add for us."""
        if len(self._steps) < 2:
            return 0.0
        span = self._steps[-1][0] - self._steps[0][0]
        return sum(s for _, s in list(self._steps)[1:]) / span if span > 0 else 0.0

    def speed(self) -> float:
        """Positions per second of the whole swarm (ours plus the others' rate)."""
        return (self.rate() + self.others_rate) / self.unit

    def observe(self, samples: int, now: float, compute_seconds: float) -> None:
        """One inner step of ``samples`` sequences ended at ``now``; ``compute_seconds`` of it were our own
        work (the rest waited on syncs)."""
        dt = 0.0 if math.isnan(self._last) else max(0.0, now - self._last)
        self._last = now
        self.pos += (samples + self.others_rate * dt) / self.unit
        if not self._steps:
            self._steps.append((now - dt, 0))
        self._steps.append((now, samples))
        while len(self._steps) > 2 and now - self._steps[1][0] > self.window:
            self._steps.popleft()
        a = 0.3
        self.step_seconds = compute_seconds if self.step_seconds == 0 else (1 - a) * self.step_seconds + a * compute_seconds

    def align(self, others: Iterable[Tuple[float, float]], now: float) -> None:
        """Move to the median of our position and the others' (``(pos, at_time)`` pairs, extrapolated to
        ``now`` at the clock's speed; a record from the future counts as now)."""
        speed = self.speed()
        points = [p + speed * max(0.0, now - t) for p, t in others]
        if points:
            self.pos = statistics.median([self.pos, *points])

    def lookahead(self) -> float:
        """Positions the swarm moves during one of our steps, capped below H (see the module docstring)."""
        return min(self.speed() * self.step_seconds, self.H - 1)

    def target(self, processed: int, next_send: Callable[[int], int]) -> int:
        """The schedule position to advance to now, from ``processed`` (positions already run):
        where the clock is, and on to every send point our next step would carry it past (send early,
        never late). ``next_send(t)``: the first send position after ``t``."""
        target = max(processed, math.floor(self.pos))
        limit = self.pos + self.lookahead()
        while (s := next_send(target)) <= limit:
            target = s
        return target

    def jump_to(self, position: float) -> None:
        """A downloaded state put us at ``position``: never behind it."""
        self.pos = max(self.pos, float(position))

    def state_dict(self) -> dict:
        return {"pos": self.pos, "step_seconds": self.step_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.pos = float(state.get("pos", self.pos))
        self.step_seconds = float(state.get("step_seconds", self.step_seconds))
