"""Whose claims count: the rule behind every decision a peer takes from other peers' word.

A progress record says where its writer is: the step of its last sync, the digest of its state, the
group of that sync (``gid``). Signatures (:mod:`~p2pdiloco.swarm.signing`) prove who wrote a record,
never that it is true, and an identity costs nothing: anyone can start k of them. So "is the swarm
ahead of us", "which state do we adopt", "is ours the minority digest", "does another history
outnumber ours" and "which fingerprint is the run's" are decided by counting *voters*, not
identities:

* A peer with a history counts its **partners**: the other members of the groups whose all-reduce it
  completed itself, and the donors of a state it downloaded and verified, over the last
  :data:`PARTNER_MEMORY_S` seconds. A partner took part in a round this peer checked: its parts
  arrived in time and decoded, and every member ended with the same bits. An identity that never
  shared a verified round with us has no say, however many such identities there are.
* A peer with no live partner (it just joined, resumed from its checkpoint, or outlived all its
  partners) counts the **established** identities: those whose record names the group of their last
  sync, a history of their own. This is the joiner's rule; it counts identities, so it holds only
  while honest established peers outnumber fake identities that also fake a history (see below).

Over the voters every decision takes a majority (:func:`~p2pdiloco.swarm.state_sync.pick_target`):
a state is adopted only when at least two voters claim exactly it (one, when there is a single other
voter: two peers cannot outvote each other) *and* a strict majority of the voters are at or beyond
its step. A minority of voters claiming a far-future step, however absurd the step, moves nobody;
the joiner's download goes to the voters that claim the target, and a target whose donors all fail
is dropped with them, so claims nobody can serve cost a joiner time, never its state.

What an attacker with k identities can do (the threat model in docs/security.md):

* k identities that never took part in a verified round with an honest peer: nothing, for peers with
  a history, whatever k. A joiner ignores them unless they also fake a history (a ``gid``).
* k identities that fake a history, against a joiner whose honest established peers number h:
  with k < h nothing; with k >= h they may be its target. If they serve nothing, the joiner drops
  their target and takes the honest one; if they serve a state matching their digest, the joiner
  adopts it and trains from it until its first round with honest peers, whose members (now its
  partners, the majority of its group) hold another digest at the same step: it gives way to theirs.
* k identities that take part in verified rounds (each one holding a connection, sending well-formed
  parts in time and bearing the bandwidth) become partners; they decide for a peer only as a majority
  of its partners.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Dict, Iterable, Optional, Set

__all__ = ["Partners", "Lineage", "PARTNER_MEMORY_S", "voters", "established"]

#: how long a partner keeps its say after the last verified round we shared with it (seconds): long
#: enough that the other side of a healed partition still counts, short enough that a swarm that
#: turned over is judged by its current members
PARTNER_MEMORY_S = 1800.0
#: partners remembered at most (the oldest are forgotten first)
MAX_PARTNERS = 4096

Peers = Dict[str, Dict[str, Any]]


class Partners:
    """The identities we completed verified rounds with, and when we last did (thread-safe)."""

    def __init__(self, memory: float = PARTNER_MEMORY_S):
        self.memory = memory
        self._last: Dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, members: Iterable[str], now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for pid in members:
                if isinstance(pid, str) and pid:
                    self._last.pop(pid, None)
                    self._last[pid] = now  # re-inserted: the dict stays ordered oldest first
            while len(self._last) > MAX_PARTNERS:
                del self._last[next(iter(self._last))]

    def current(self, now: Optional[float] = None) -> Set[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return {pid for pid, t in self._last.items() if now - t <= self.memory}


def established(peers: Peers, me: str) -> Set[str]:
    """The identities among ``peers`` (live progress records) whose record names the group of their last
    sync: the joiner's voters."""
    return {pid for pid, v in peers.items()
            if pid != me and isinstance(v, dict) and isinstance(v.get("gid"), str) and v["gid"]}


def voters(peers: Peers, me: str, partners: Iterable[str] = ()) -> Set[str]:
    """Whose claims count among the live ``peers``: our live partners; without any, the established
    identities (module docstring)."""
    live = set(peers) - {me}
    ours = live & set(partners)
    return ours if ours else established(peers, me)


class Lineage:
    """Our history as group ids (thread-safe: fed by the training loop, read by matchmaking): the
    groups whose sync succeeded here or whose state we adopted (newest last), plus the groups we
    formed since we last adopted another history (a sync still in flight, or one whose reply we lost,
    is still our history). A group that names a base in it went on from our history."""

    def __init__(self, keep: int = 64):
        self._synced: deque = deque(maxlen=keep)
        self._formed: deque = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, gid: str) -> None:
        """A sync in group ``gid`` succeeded: it is now the base of the groups we lead."""
        with self._lock:
            self._synced.append(gid)

    def formed(self, gid: str) -> None:
        """We formed group ``gid`` (its sync may still fail)."""
        with self._lock:
            self._formed.append(gid)

    def adopt(self, gids: Iterable[str]) -> None:
        """We caught up with other peers' state: their groups are our history now."""
        with self._lock:
            self._synced.clear()
            self._synced.extend(g for g in gids if isinstance(g, str) and g)
            self._formed.clear()  # groups of the history we left

    def ids(self, last: Optional[int] = None) -> Set[str]:
        """Our history's group ids (the ``last`` few synced ones; all kept when None) plus every group
        we formed lately."""
        with self._lock:
            gids, formed = list(self._synced), set(self._formed)
        return set(gids[-last:] if last else gids) | formed

    @property
    def base(self) -> str:
        """The group our state came from (our last successful sync), "" before the first."""
        with self._lock:
            return self._synced[-1] if self._synced else ""
