"""The values matchmaking hands to the all-reduce: a group, whose parts an all-reduce covered, and
how reachable a peer is (its tier, which decides who may lead a group and own a shard).

A group is decided by its leader alone and sent to every member (:mod:`.matchmaking`), so every
member holds the same :class:`Group`; its id commits to everything that must agree.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

__all__ = ["Group", "Coverage", "make_group_id", "TIER_PUBLIC", "TIER_RELAYED",
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
        gid = hashlib.sha256("\n".join([self.gid, "redo", *kept]).encode()).hexdigest()[:24]
        owners = None if self.owners is None else tuple(o for o in self.owners if o in kept)
        return Group(gid=gid, members=kept, my_index=kept.index(me), frag=self.frag, round=self.round,
                     owners=owners)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def shard_owners(self) -> Tuple[str, ...]:
        return self.members if self.owners is None else self.owners


@dataclass(frozen=True)
class Coverage:
    """Whose parts a finished all-reduce averaged, the same on every member that applies it.

    ``members``: peer ids every shard's mean covers (sorted, as in the group); ``left_out``: the
    group's other members; ``weight``: their total sample weight (Σ w_i over ``members``);
    ``redone``: the first exchange's shards covered different members and the round was re-done
    over ``members``. Complete when ``left_out`` is empty, else degraded.
    """

    members: Tuple[str, ...]
    left_out: Tuple[str, ...] = ()
    weight: float = 0.0
    redone: bool = False

    @property
    def complete(self) -> bool:
        return not self.left_out

    @property
    def kind(self) -> str:
        """``full``, ``degraded`` (applied over fewer members) or ``redone`` (re-done over fewer)."""
        return "full" if self.complete else ("redone" if self.redone else "degraded")
