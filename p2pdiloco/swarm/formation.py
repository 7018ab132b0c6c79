"""Group formation's rules: deterministic functions of what a peer knows (records read, reports
received), no network and no state. Who is waited for and until when, who is asked to lead and in
which order (rank: tier, then the round's draw), which members own shards, who is left out before the round, and
whether a group that closed without us was our round. :mod:`.matchmaking` applies them; the table
in :meth:`~p2pdiloco.swarm.matchmaking.Matchmaker.form_group` lists them.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..ids import short_id
from .group import TIER_PRIVATE, Group

__all__ = ["draw", "expected_peers", "derived_deadline", "candidates", "gather_buckets", "gather_bucket", "gather_heads",
           "gather_head", "shard_owners", "left_out", "authoritative", "latest_partners"]

Peers = Dict[str, Dict[str, Any]]
#: a peer's rank in one round: (tier, draw, peer id); the smallest leads
Rank = Tuple[int, bytes, str]


def draw(round_key: str, peer: str) -> bytes:
    """``peer``'s draw for the round whose ready records live under ``round_key`` (run, fragment and
    round): 8 bytes of BLAKE2b over both. Leadership goes by it after the tier, so each round has
    another presumable leader: a peer id is the hash of a key anyone can grind, and ranking by the id
    itself let one ground identity be every round's first choice; a draw that changes with the round
    puts a given identity first only in about its share of the rounds, and spreads the leaders' work
    over the swarm. Every peer computes the same draw from what it already knows."""
    return hashlib.blake2b(f"{round_key}\n{peer}".encode(), digest_size=8).digest()


def expected_peers(peers: Peers, me: str, sync_step: int) -> Set[str]:
    """Live peers other than ``me`` due at ``sync_step`` or earlier: those the group waits for."""
    return {pid for pid, v in peers.items()
            if pid != me and not v.get("gone") and isinstance(v.get("next_sync"), int) and v["next_sync"] <= sync_step}


def derived_deadline(peers: Peers, missing: Set[str], sync_step: int, first_seen: Dict[Tuple[str, Any], float],
                     start: float, hard_deadline: float, eta_slack: float, eta_margin: float) -> float:
    """When to stop waiting for the ``missing`` peers: each one's expected arrival from its speed,
    ``eta_slack * (sync_step - step) / sps + eta_margin`` after we first saw that record (a fresh
    record restarts that peer's clock; ``first_seen`` keeps them). Never past ``hard_deadline``; a
    missing peer without a measurement is waited for up to it."""
    now = time.monotonic()
    latest = start
    for pid in missing:
        v = peers.get(pid, {})
        version = (pid, v.get("t"))
        seen = first_seen.setdefault(version, now)
        step, sps = v.get("step"), v.get("sps")
        if not isinstance(step, int) or not isinstance(sps, (int, float)) or sps <= 0:
            return hard_deadline
        eta = eta_slack * max(0, sync_step - step) / sps + eta_margin
        latest = max(latest, seen + eta)
    return min(hard_deadline, latest)


def candidates(ready: Set[str], unseen: Set[str], me: str, rank: Callable[[str], Rank],
               tier: Callable[[str], int]) -> List[str]:
    """The peers to ask to lead us, in rank order: the ready ones, plus unseen peers (due now, or
    absent partners) ranked better than us (DHT views differ: they may be leading already). A private
    peer cannot be led by another private peer (neither can dial the other)."""
    found = sorted(ready | {u for u in unseen if rank(u) < rank(me)}, key=rank)
    if tier(me) == TIER_PRIVATE:
        found = [c for c in found if c == me or tier(c) != TIER_PRIVATE]
    return found


def gather_buckets(peers: int, cap: int) -> int:
    """How many gathering buckets a round of ``peers`` peers due (us included) has under ``swarm.group_cap`` =
    ``cap``: 2^floor(log2(peers / cap)), so each bucket holds about cap to 2 cap peers; 1 (no gathering)
    without a cap or below 2 cap peers. A power of two moves only when the count doubles, so peers whose
    views differ by a few peers agree on it."""
    if cap <= 0 or peers < 2 * cap:
        return 1
    return 1 << ((peers // cap).bit_length() - 1)


def gather_bucket(round_key: str, peer: str, buckets: int) -> int:
    """``peer``'s gathering bucket in the round under ``round_key`` (of ``buckets``)."""
    digest = hashlib.blake2b(f"{round_key}\ngather\n{peer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % buckets


def gather_heads(due: Set[str], round_key: str, cap: int, rank: Callable[[str], Rank], tier: Callable[[str], int],
                exclude: Set[str] = frozenset()) -> Tuple[int, Dict[int, str]]:
    """The gathering buckets of a round (matchmaking item 13): (how many, bucket -> its head). The peers due
    (``due``) fall into :func:`gather_buckets` buckets by a hash of the round's key and their id
    (:func:`gather_bucket`); a bucket's head is its best-ranked peer that others can dial, ``exclude`` left
    out (peers that left our request unanswered this round). The round's leader (the best rank of all)
    heads its own bucket. One bucket (no gathering) without a cap or below 2 caps of peers."""
    buckets = gather_buckets(len(due), cap)
    heads: Dict[int, str] = {}
    if buckets == 1:
        return 1, heads
    for peer in sorted(set(due) - set(exclude), key=rank):
        if tier(peer) != TIER_PRIVATE:
            heads.setdefault(gather_bucket(round_key, peer, buckets), peer)
    return buckets, heads


def gather_head(due: Set[str], me: str, round_key: str, cap: int, rank: Callable[[str], Rank],
               tier: Callable[[str], int], exclude: Set[str] = frozenset()) -> Optional[str]:
    """The peer that carries our join request to the round's leader (:func:`gather_heads`, ``due`` with us),
    or None: we ask the leader ourselves (no gathering, we head our bucket, or it has no dialable peer)."""
    buckets, heads = gather_heads(set(due) | {me}, round_key, cap, rank, tier, exclude)
    head = heads.get(gather_bucket(round_key, me, buckets)) if buckets > 1 else None
    return None if head == me else head


def shard_owners(members: Tuple[str, ...], tier: Callable[[str], int]) -> Optional[Tuple[str, ...]]:
    """The shard owners (None: all members, or a group of one): the members of the best tier, so the
    members others dial directly; when there is none, the relayed ones (their relay carries every
    part and result: a relayed member never owns a shard a direct member could); never a private one."""
    best = min((tier(m) for m in members), default=TIER_PRIVATE)
    owners = tuple(m for m in members if tier(m) == best) if best < TIER_PRIVATE else None
    return None if owners == members or len(members) == 1 else owners


def left_out(members: Sequence[str], reports: Dict[str, Optional[Set[str]]], me: str,
             rank: Callable[[str], Rank]) -> Dict[str, str]:
    """Who leaves the group before the round (member -> why), from the members' link reports (the
    owners each could not reach; None: no report): joiners that did not report, then, while a pair
    (reporter, owner) stayed unconnected, the member in the most such pairs (ties: the larger rank);
    never ``me``, the leader. Deterministic for given reports."""
    left = {m: "it did not answer the link check in time" for m, r in reports.items() if r is None and m != me}
    pairs = {(a, b) for a, r in reports.items() if r for b in r
             if b in members and a != b and a not in left and b not in left}
    while pairs:
        count: Dict[str, int] = {}
        for pair in pairs:
            for p in pair:
                if p != me:
                    count[p] = count.get(p, 0) + 1
        worst = max(count, key=lambda p: (count[p], rank(p)))
        others = sorted({a if b == worst else b for a, b in pairs if worst in (a, b)})
        left[worst] = f"no connection between it and {', '.join(short_id(o) for o in others)}"
        pairs = {pair for pair in pairs if worst not in pair}
    return left


def latest_partners(groups: Iterable[Group], me: str) -> Set[str]:
    """The other members of our latest group of each fragment: our current history's peers."""
    latest: Dict[int, Group] = {}
    for g in groups:
        if g.frag not in latest or g.round > latest[g.frag].round:
            latest[g.frag] = g
    return {m for g in latest.values() for m in g.members} - {me}


def authoritative(members: Sequence[str], due: Optional[int], base: Any, lineage: Set[str], partners: Set[str],
                  live_count: int) -> bool:
    """Does a group that formed without us mean we missed the round? When it names its ``base`` and we
    have a ``lineage``: yes exactly if the base is in it (our history went on without us); a group
    from another history (the other side of a partition, or its records left from before the heal:
    round numbers repeat) is not our round. Otherwise (a fresh run, a peer that joined from scratch):
    yes if it holds one of our latest groups' ``partners``, or, with none, at least half of the live
    peers (``due`` or ``live_count``, whichever is more). Requiring half of our last group instead
    would split a pair of survivors into two lone peers that never pair again."""
    if isinstance(base, str) and base and lineage:
        return base in lineage
    if partners:
        return bool(partners & set(members))
    return due is None or 2 * len(members) >= max(due, live_count)
