"""Whose claims count, and what a majority of them decides: the rules behind every decision a peer
takes from other peers' word (the state to adopt, being behind, in the minority, or outnumbered by a
rival history). :mod:`.state_sync` transfers the state these rules pick.

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

Over the voters every decision takes a majority (:func:`pick_target`):
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
from collections import Counter
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["Partners", "Lineage", "PARTNER_MEMORY_S", "voters", "established", "pick_target", "in_minority",
           "rival_lineage", "valid_digest"]

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



def valid_digest(digest: Any, num_frags: Optional[int]) -> bool:
    if not isinstance(digest, str) or len(digest) > 17 * 4096:
        return False
    parts = digest.split("-")
    return (num_frags is None or len(parts) == num_frags) and all(
        len(p) == 16 and all(c in "0123456789abcdef" for c in p) for p in parts)


def pick_target(peers: Peers, me: str, min_step: int = 0, num_frags: Optional[int] = None,
                companions: Iterable[str] = (), trusted: Optional[Iterable[str]] = None,
                ) -> Optional[Tuple[int, str, List[str]]]:
    """(step, digest, donors) the swarm's voters agree on beyond ``min_step``, or None when there is
    nothing trustworthy to fetch. Claims with a malformed digest (or the wrong fragment count) are
    ignored.

    Only the claims of ``trusted`` identities count (our partners, see the module docstring; None: the
    established identities among ``peers``, the joiner's rule). Of the voters (the trusted live
    peers, plus ``companions`` missing from this read: the members of our last successful group, whom
    a DHT read can miss), the target needs

    * two voters claiming exactly (step, digest), or one when there is a single other voter (two
      peers cannot outvote each other), and
    * a strict majority of the voters at or beyond its step: a minority claiming a far-future step
      moves nobody, and the furthest state a majority has passed is the one to fetch.

    The donors are the voters that claim the target."""
    live = set(peers) - {me}
    counted = (established(peers, me) if trusted is None else set(trusted)) & live
    claims: Counter = Counter()
    donors: Dict[Tuple[int, str], List[str]] = {}
    steps: List[int] = []  # every voter's valid synced step
    for pid in counted:
        v = peers[pid]
        step, digest = v.get("synced_step"), v.get("digest")
        if not isinstance(step, int) or isinstance(step, bool) or not valid_digest(digest, num_frags):
            continue
        steps.append(step)
        if step <= min_step:
            continue
        claims[(step, digest)] += 1
        donors.setdefault((step, digest), []).append(pid)
    if not claims:
        return None
    others = len(counted | (set(companions) - set(peers) - {me}))
    needed = 2 if others >= 2 else 1
    majority = others // 2 + 1
    # furthest ahead first, then most supported
    for (step, digest), count in sorted(claims.items(), key=lambda kv: (-kv[0][0], -kv[1], kv[0][1])):
        if count >= needed and sum(s >= step for s in steps) >= majority:
            return step, digest, sorted(donors[(step, digest)])
    return None


def in_minority(peers: Peers, me: str, step: int, digest: str, trusted: Optional[Iterable[str]] = None) -> bool:
    """True when more voters at our synced step hold another digest than ours (ties: the smaller digest
    string wins). Peers that diverged (a race in group formation, a healed partition) use this to give
    way and adopt the majority's state. Only ``trusted`` identities vote (None: the established ones)."""
    counted = established(peers, me) if trusted is None else set(trusted)
    counts = Counter({digest: 1})
    for pid, v in peers.items():
        if pid != me and pid in counted and v.get("synced_step") == step and isinstance(v.get("digest"), str):
            counts[v["digest"]] += 1
    best = max(counts.items(), key=lambda kv: (kv[1], [-ord(c) for c in kv[0]]))
    return best[0] != digest


def rival_lineage(peers: Peers, me: str, my_gids: Set[str], step: int, digest: str,
                  companions: Iterable[str] = (), trusted: Optional[Iterable[str]] = None) -> Optional[Peers]:
    """The live peers of a *rival lineage* we must give way to, or None.

    Every peer publishes ``gid``, the id of the group of its last successful sync. Peers whose
    ``gid`` is one of our recent groups (``my_gids``) share our history, merely a round behind or
    ahead; peers with another ``gid`` trained in groups we were not part of: after a partition heals,
    the other side. Rivals are grouped by that ``gid`` (one history each): we give way to the
    strongest rival history when it alone outnumbers our side (us included) -- or ties and holds the
    larger (step, digest) -- even if our step count is ahead (an isolated peer trains alone faster).
    Histories are never added up: two rival histories of one peer each do not outnumber a third, and
    their states differ, so no download from both could be verified (three lone peers would each
    try to adopt "the others" forever). Between rival histories the larger wins, then the larger
    (step, digest), so every peer ranks them alike and the swarm converges on one. Peers without a
    gid (just joined) count for nobody; one that caught up publishes its donors' gid. ``companions``
    (the members of our last successful group) that are missing from ``peers`` count for our side: a
    DHT read that misses a record must not hand the majority's history to the minority. Only
    ``trusted`` identities count on either side (None: the established ones; see :mod:`.standing`).
    Returns the rival history's peers (pass them to :func:`.state_sync.download_state` with
    ``min_step=-1``)."""
    counted = established(peers, me) if trusted is None else set(trusted)
    ours, histories = 1 + len(set(companions) - set(peers) - {me}), {}
    for pid, v in peers.items():
        gid = v.get("gid")
        if pid == me or pid not in counted or not isinstance(gid, str) or not gid:
            continue
        if gid in my_gids:
            ours += 1
        elif isinstance(v.get("synced_step"), int) and v.get("digest") != digest:
            histories.setdefault(gid, {})[pid] = v

    def strength(h: Peers) -> Tuple[int, Tuple[int, str]]:
        return len(h), max((v["synced_step"], str(v.get("digest"))) for v in h.values())

    if not histories:
        return None
    best = max(histories.values(), key=strength)
    size, top = strength(best)
    if size < ours or (size == ours and top <= (step, digest)):
        return None
    return best

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
