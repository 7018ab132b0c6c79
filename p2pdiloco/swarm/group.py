"""The values matchmaking hands to the all-reduce: a group, whose parts an all-reduce covered, and
how reachable a peer is (its tier, which decides who may lead a group and own a shard).

A group is decided by its leader alone and sent to every member (:mod:`.matchmaking`), so every
member holds the same :class:`Group`; its id commits to everything that must agree.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Set, Tuple

__all__ = ["Group", "Coverage", "CappedPlan", "Level", "capped_plan", "make_group_id", "TIER_PUBLIC", "TIER_RELAYED",
           "TIER_PRIVATE", "tier_of"]

#: others dial the peer directly
TIER_PUBLIC = 0
#: others reach the peer through its relay (:mod:`.relay`): every byte to it crosses the relay
TIER_RELAYED = 1
#: nobody can open a stream to the peer (behind NAT, no relay took it): it neither leads nor owns
TIER_PRIVATE = 2


def tier_of(reach: Any) -> int:
    """A peer's tier from its reachability (:data:`.reachability.REACHABILITY`); unknown counts as
    public (a peer of before reachability existed, as every peer was then)."""
    return {"relayed": TIER_RELAYED, "private": TIER_PRIVATE}.get(reach, TIER_PUBLIC)


def make_group_id(run_id: str, frag: int, round_: int, members: Sequence[str], base: str = "",
                  owners: Optional[Sequence[str]] = None) -> str:
    """The group's id. ``base`` is the id of the group the leader's state came from (its last successful
    sync): chaining ids keeps two histories that reuse a round number and members (a peer alone on each
    side of a partition) apart. ``owners`` (when not every member owns a shard) is part of it too, so
    members that were told different owners cannot meet in one round."""
    extra = [f"base:{base}"] if base else []
    if owners is not None and tuple(owners) != tuple(members):
        extra += [f"owner:{o}" for o in owners]
    blob = "\n".join([run_id, str(frag), str(round_), *members, *extra]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@dataclass(frozen=True)
class CappedPlan:
    """How a group larger than the cap reduces in two levels (:mod:`.allreduce`, "Capped groups").

    ``subgroups[i]``: the member indexes of subgroup ``i``, in member order. ``owners[i][k]``: the member
    index that owns shard ``k`` within subgroup ``i``; every subgroup has the same number of shards, cut
    at the same bounds, so shard ``k``'s owners across subgroups (its *column*) hold partial means of the
    same values."""

    subgroups: Tuple[Tuple[int, ...], ...]
    owners: Tuple[Tuple[int, ...], ...]

    @property
    def shards(self) -> int:
        return len(self.owners[0])

    def subgroup_of(self, idx: int) -> int:
        """The subgroup of member ``idx``."""
        return next(i for i, sub in enumerate(self.subgroups) if idx in sub)

    def peers_of(self, idx: int) -> Set[int]:
        """The members member ``idx`` opens part streams to: its subgroup's owners and, when it owns shard
        ``k`` there, the owners of shard ``k`` in the other subgroups (its column); itself excluded."""
        own = self.owners[self.subgroup_of(idx)]
        peers = set(own)
        if idx in own:
            k = own.index(idx)
            peers |= {other[k] for other in self.owners}
        return peers - {idx}


def capped_plan(members: Sequence[str], owners: Sequence[str], cap: int) -> Optional[CappedPlan]:
    """The two-level plan of a group of ``members`` (sorted) whose shard ``owners`` are given, capped at
    ``cap`` members per subgroup; None when the group is not larger than the cap (or ``cap`` is 0), or
    when fewer than two members can own a shard (one subgroup is then all there is).

    The same on every member (a function of the group alone). Owners are dealt round-robin first, then
    the other members, so the subgroups' sizes differ by at most one and each gets its share of the
    peers that can be dialed; each subgroup's first ``len(owners) // m`` owners own its shards. With too
    few owners for ``ceil(N / cap)`` subgroups there are as many subgroups as owners (larger than the
    cap: a private member cannot own a shard)."""
    n = len(members)
    if cap <= 0 or n <= cap:
        return None
    index = {m: i for i, m in enumerate(members)}
    owner_idx = sorted(index[o] for o in owners)
    m = min(-(-n // cap), len(owner_idx))
    if m < 2:
        return None
    taken = set(owner_idx)
    order = owner_idx + [i for i in range(n) if i not in taken]
    shards = len(owner_idx) // m
    return CappedPlan(subgroups=tuple(tuple(sorted(order[i::m])) for i in range(m)),
                      owners=tuple(tuple(owner_idx[i::m][:shards]) for i in range(m)))


def _derived_gid(*parts: Any) -> str:
    return hashlib.sha256("\n".join(str(p) for p in parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Group:
    """A finalized group: the same ``gid``, ``members`` and ``owners`` on every member.

    ``members``: sorted peer ids. ``owners``: the members that own a shard, in member order (None:
    every member). The leader leaves private members (nobody can dial them) out of it, and relayed
    ones when a member is public (:func:`.formation.shard_owners`).
    """

    gid: str
    members: Tuple[str, ...]
    my_index: int
    frag: int
    round: int
    owners: Optional[Tuple[str, ...]] = None

    def restricted_to(self, members: Sequence[str]) -> "Group":
        """This group's round restricted to ``members`` (which must include us): what a round whose
        shards covered different members is re-done with. Its id derives from this group's, so every
        member that computes the same ``members`` forms the same group without matchmaking."""
        kept = tuple(m for m in self.members if m in set(members))
        me = self.members[self.my_index]
        gid = _derived_gid(self.gid, "redo", *kept)
        owners = None if self.owners is None else tuple(o for o in self.owners if o in kept)
        return Group(gid=gid, members=kept, my_index=kept.index(me), frag=self.frag, round=self.round,
                     owners=owners)

    def capped(self, cap: int) -> Optional[CappedPlan]:
        """This group's two-level plan under ``cap`` (:func:`capped_plan`), or None: one level."""
        return capped_plan(self.members, self.shard_owners, cap)

    def subgroup(self, plan: CappedPlan) -> Tuple[int, "Group"]:
        """(i, our subgroup ``i`` of ``plan`` as a group of its own): its members send their parts to its
        owners. Its id derives from this group's, so the members of one subgroup agree on it."""
        i = plan.subgroup_of(self.my_index)
        members = tuple(self.members[j] for j in plan.subgroups[i])
        owners = tuple(self.members[j] for j in plan.owners[i])
        return i, Group(gid=_derived_gid(self.gid, "sub", i, *members), members=members,
                        my_index=members.index(self.members[self.my_index]), frag=self.frag, round=self.round,
                        owners=owners)

    def column(self, plan: CappedPlan, k: int) -> "Group":
        """The owners of shard ``k`` across the subgroups of ``plan`` (we are one), as a group whose
        members all own: they average their subgroups' partial means of that shard."""
        members = tuple(sorted(self.members[own[k]] for own in plan.owners))
        return Group(gid=_derived_gid(self.gid, "column", k, *members), members=members,
                     my_index=members.index(self.members[self.my_index]), frag=self.frag, round=self.round)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def shard_owners(self) -> Tuple[str, ...]:
        return self.members if self.owners is None else self.owners


@dataclass(frozen=True)
class Level:
    """A capped group's round as one subgroup sees it: the whole ``group``, its ``plan`` and the
    subgroup's own group (``sub``, index ``index`` in the plan). Coverage is named in the whole group."""

    group: "Group"
    plan: CappedPlan
    index: int
    sub: "Group"

    def whole_index(self, sub_idx: int) -> int:
        return self.plan.subgroups[self.index][sub_idx]


@dataclass(frozen=True)
class Coverage:
    """Whose parts a finished all-reduce averaged, the same on every member that applies it.

    ``members``: peer ids every shard's mean covers (sorted, as in the group); ``left_out``: the
    group's other members; ``weight``: their total sample weight (Σ w_i over ``members``);
    ``redone``: the first exchange's shards covered different members and the round was re-done
    over ``members``; ``subgroups``: how many subgroups the (last) exchange averaged in, 0 for one
    level (a group not larger than the cap). Complete when ``left_out`` is empty, else degraded.
    """

    members: Tuple[str, ...]
    left_out: Tuple[str, ...] = ()
    weight: float = 0.0
    redone: bool = False
    subgroups: int = 0

    @property
    def complete(self) -> bool:
        return not self.left_out

    @property
    def kind(self) -> str:
        """``full``, ``degraded`` (applied over fewer members) or ``redone`` (re-done over fewer)."""
        return "full" if self.complete else ("redone" if self.redone else "degraded")
