"""Rounds by the swarm's samples (``inner.round_samples``): the swarm clock.

With ``inner.round_samples = 0`` a round is ``H = inner.sync_every`` inner steps on *every* peer, so the
swarm moves at its slowest member's pace: a peer 5x slower makes every other peer wait for it at every
sync. With ``round_samples = N > 0`` the schedule (fragments' send points, tau, prepare lead; all of
:class:`~p2pdiloco.diloco.fragments.Schedule`) runs on a *swarm clock* instead of the peer's own step
count: one position is ``N / H`` sequences processed by the whole swarm, so a round is ``N``
sequences whoever processed them. A fast peer takes many inner steps in a round, a slow one few; the
average stays weighted by the samples each member contributed, as hivemind's ``Optimizer`` does with
``target_batch_size`` and Decoupled DiLoCo with token-weighted merging. The rules, in full:

* **Advance.** After each inner step of ``b`` sequences that took ``c`` seconds of computing (time
  blocked on syncs excluded: in a blocking sync every member waits alike, and nobody's samples grow),
  ``pos += (b + R_others * c) / (N / H)``, where ``R_others`` is the sum of the other live peers'
  published rates (sequences per second of computing, over the last seconds). Alone, the clock is
  the peer's own sample count.
* **Agreement.** Every step the peer compares each other live peer's published position with its
  *own* position at the time that record was made (it remembers its recent positions), and moves by
  the median of those offsets and 0. A record's age, or a sync that everyone waited in, is therefore
  no difference; clocks that started apart (a peer that joined late, one that was stalled) converge
  instead of making the group wait each round. Nothing exact depends on the clock: the members of a round and their weights come from
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
* **A blocking sync sets the clock.** When a sync nobody trained through (``tau = 0``) ends, every
  member of its group waited for it and finished it at about the same moment: each sets its clock to
  the round's send point. Members that sent early (a slow peer, by up to one of its long steps) or
  whose clocks had drifted apart start the next round in agreement, without waiting for records.

``H`` stays in the run's fingerprint as the schedule's granularity (fragments stagger by ``H / P``
positions, tau counts positions); the budget ``N`` is in the fingerprint too; a peer's batch size and
speed are its own.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable, Deque, Dict, Iterable, Optional, Tuple

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
        self._steps: Deque[Tuple[float, int, float]] = deque()   # (end time, samples, compute s) of recent steps
        self._history: Deque[Tuple[float, float]] = deque()      # (time, pos) at our recent step ends
        self.step_seconds = 0.0                 # our recent compute time per inner step (EMA)
        self.others_rate = 0.0                  # the other live peers' samples per compute second, as last read
        self._seen: Dict[str, float] = {}       # peer -> time of its record last used by align()

    def start(self, now: float) -> None:
        """Training starts (or resumes) now."""
        self._history.append((now, self.pos))

    def rate(self) -> float:
        """Our samples per second of computing over the last ``window`` seconds (time blocked on syncs is
        not counted: in a blocking sync every member waits alike). What the others add for us."""
        busy = sum(c for _, _, c in self._steps)
        return sum(s for _, s, _ in self._steps) / busy if busy > 0 else 0.0

    def speed(self) -> float:
        """Positions per second of computing of the whole swarm (ours plus the others' rate)."""
        return (self.rate() + self.others_rate) / self.unit

    def observe(self, samples: int, now: float, compute_seconds: float) -> None:
        """One inner step of ``samples`` sequences ended at ``now`` after ``compute_seconds`` of our work
        (waits on syncs excluded: the swarm computes while we compute)."""
        busy = max(0.0, compute_seconds)
        self.pos += (samples + self.others_rate * busy) / self.unit
        self._steps.append((now, samples, busy))
        while len(self._steps) > 1 and now - self._steps[0][0] > self.window:
            self._steps.popleft()
        self._remember(now)
        a = 0.3
        self.step_seconds = busy if self.step_seconds == 0 else (1 - a) * self.step_seconds + a * busy

    def step(self, samples: int, now: float, compute_seconds: float, others: Dict[str, dict]) -> None:
        """One inner step of ours ended: read the other live peers' published records (``rate``, and
        ``pos`` read at ``pt``), advance (:meth:`observe`) and agree with them (:meth:`align`). Values
        that are missing or not finite are skipped."""
        rates = [float(v["rate"]) if isinstance(v.get("rate"), (int, float)) and 0 < v["rate"] < 1e9 else None
                 for v in others.values()]
        # a peer whose rate we do not know yet (its first records) counts as fast as we are
        self.others_rate = sum(r if r is not None else self.rate() for r in rates)
        self.observe(samples, now, compute_seconds)
        self.align([(pid, float(v["pos"]), float(v["pt"])) for pid, v in others.items()
                    if isinstance(v.get("pos"), (int, float)) and isinstance(v.get("pt"), (int, float))
                    and math.isfinite(v["pos"]) and math.isfinite(v["pt"])], now)

    def _remember(self, now: float) -> None:
        self._history.append((now, self.pos))
        while len(self._history) > 2 and now - self._history[1][0] > 3 * self.window:
            self._history.popleft()

    def _shift(self, move: float) -> None:
        """Move the clock by ``move`` positions, our remembered positions with it (so a record compared
        later with our history sees the moved clock)."""
        if move:
            self.pos += move
            self._history = deque((t, p + move) for t, p in self._history)

    def _pos_at(self, t: float) -> Optional[float]:
        """Our position at time ``t`` (linear between our step ends), None outside what we remember."""
        h = self._history
        if not h or t < h[0][0]:
            return None
        for (t0, p0), (t1, p1) in zip(h, list(h)[1:]):
            if t0 <= t <= t1:
                return p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)
        return h[-1][1]

    def align(self, others: Iterable[Tuple[str, float, float]], now: float) -> float:
        """Agree with the others: each ``(peer, pos, at_time)`` record not used before is compared with
        *our* position at that same time (so a record's age, or a sync everyone waited in, is no
        difference), and we move by the median of those offsets and 0 (our own). A record counts once:
        read again before its peer publishes anew it would pull us twice. Returns the move."""
        offsets = []
        for peer, p, t in others:
            if self._seen.get(peer) == t:
                continue
            self._seen[peer] = t
            if (mine := self._pos_at(min(t, now))) is not None:
                offsets.append(p - mine)
        if not offsets:
            return 0.0
        move = statistics.median([0.0, *offsets])
        self._shift(move)
        return move

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

    def settle(self, position: float) -> None:
        """A blocking sync of the send point ``position`` just ended: every member of its group waited for
        it and finished it together, so every member's clock reads ``position`` now (see the module
        docstring). Moves either way, our remembered positions with it."""
        self._shift(float(position) - self.pos)

    def jump_to(self, position: float) -> None:
        """A downloaded state put us at ``position``: never behind it."""
        self._shift(max(0.0, float(position) - self.pos))

    def state_dict(self) -> dict:
        return {"pos": self.pos, "step_seconds": self.step_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.pos = float(state.get("pos", self.pos))
        self.step_seconds = float(state.get("step_seconds", self.step_seconds))
