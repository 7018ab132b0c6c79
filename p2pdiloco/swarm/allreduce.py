"""Butterfly all-reduce of a flat fp32 vector within a group, on our own wire protocol.

Why not hivemind's ``DecentralizedAverager``: it reports success when part of a tensor was not
averaged, its results differ by an ULP between peers, and it cannot carry a new codec. Here:

* The vector is cut into one contiguous shard per *owner*, shard ``k`` owned by ``owners[k]``
  (members are sorted peer ids, so every peer cuts identically). The owners are every member,
  except the members nobody can dial directly (peers behind NAT, ``swarm/reachability.py``; those a
  relay reaches own shards only when no member can be dialed directly, ``swarm/relay.py``): the
  group's leader lists the owners in the group it sends to every member (``Group.owners``), so
  every member cuts the same shards. A private member owns nothing: it dials each owner, sends its
  part and reads the mean back on the same stream (outbound connections work through NAT), and
  its part carries its sample weight like everyone's.
* Every member sends its part of shard ``k`` to its owner (one stream per pair, all concurrently),
  encoded with the group's codec. The owner decodes each part (its own part goes through the same
  encode/decode round trip), aggregates them (sample-weighted mean summed **in fp32 in member
  order**, or CenteredClip: :mod:`p2pdiloco.compression.robust`), encodes the result *once* and
  replies with the same bytes to everyone. Every peer therefore decodes identical bytes: results
  are bitwise identical.
* **Pipelined.** Parts and results travel in chunks of :data:`CHUNK_VALUES` values (whole codec
  blocks; each chunk encoded on its own, which for blockwise codecs is the same bytes as encoding
  the part at once). Once every member's weight is in (headers) the weight screen runs; then the
  owner reduces chunk ``j`` as soon as every member's chunk ``j`` is in and streams its encoded mean
  to every member at once, while chunk ``j+1`` is still arriving; a member sends its chunks and reads
  the result chunks on the same stream concurrently, decoding each into place. The mean is
  element-wise, so a chunk's result is bitwise the whole shard's. The norm screen and CenteredClip
  need whole parts: CenteredClip sends nothing before every part is in, and if the norm screen (or a
  chunk that fails its checks after results went out) drops a part whose chunks were already
  averaged, the owner recomputes the shard without it and sends it again, preceded by ``again``
  (members discard what they had; only a bad part costs this). A reply ends with a trailer (``avg``)
  naming the members the mean covers: nothing counts before it.
* If a part is missing when the timeout expires (a peer died or stalls) or a member's stream breaks
  mid-part (killed after half its chunks), the owner replies ``abort`` to everyone and every member
  raises :class:`SyncFailed` for the whole vector: a partial average is never returned. A member
  whose part is incomplete at the timeout while another member's part came in full is counted as
  an offender (``stats["members_stalled"]``): one that stalls every round it joins gets banned.
* **Memory** (besides the input): a member holds the result (one vector) and, as an owner, the
  other members' parts of its shard ((M-1)/M of a vector; its own part is read in place, or its
  codec round trip for lossy codecs), the shard's encoded result, and a few chunks in flight: about
  two vectors of fp32 for the lossless codec, less for 4-bit ones (the chunked all-reduce's
  memory test measures it at 100M values). The owner keeps the parts until the round ends because a late drop
  recomputes the shard from them.

Hostile parts. The owner checks every part before using it, in this
order, each before anything is allocated from the sender's numbers: header types; the sender is the
group member at the index it claims; codec id and number of values equal what the owner expects
for this shard; weight finite in (0, 1e12); payload byte length exactly ``codec.encoded_size``;
decoded values finite. Once all parts are in, :func:`~p2pdiloco.compression.robust.screen` drops
parts whose weight or norm is far above the group's median. **A part that fails is dropped, not
the round**: the owner aggregates the parts that passed and sends that result to every member, so
the round still ends identically on every honest peer (each shard's result is decided by its owner
alone and sent as one set of bytes). The offender gets ``abort`` with the reason (it applies
nothing and will re-sync from the swarm), is logged with its full peer id and counted as an
offence (:class:`~p2pdiloco.swarm.protocol.PeerGate`; repeat offenders are banned, and a banned
member's part is dropped up front). The owner's own part is never dropped.

No silent partial average. Every owner's reply names the members its mean covers and their total
weight (``cov``, ``w``), so every member learns, for every shard, whose parts are in it
(:class:`Coverage`). Then, identically on every member (they all read the same replies):

* every shard covers the whole group: the round is complete;
* every shard covers the same subset ``S`` (a member's own part was not finite, so it left itself
  out and every owner dropped it): the round is applied over ``S`` and reported as **degraded**,
  naming who was left out (``Coverage.left_out``; a warning on every member, ``coverage`` and
  ``left_out`` in the sync event);
* shards cover different subsets (an owner dropped a member that other owners kept: a peer that
  sent a bad part to some owners only, a norm screen that fired in one shard, different ban lists):
  the round is **re-done** at once over ``S`` = the members every shard covers, as a group of its
  own (id derived from the first group's and ``S``), so every shard of the applied result averages
  the same members. If the re-done round's shards differ again, the round fails everywhere.

A multi-phase reducer (low-rank) keeps the member set of its first phase for the later ones
(:class:`~p2pdiloco.diloco.core.DiLoCo` runs them on the restricted group), and fails the round if
a later phase covers fewer members.

Capped groups (``swarm.group_cap`` = G > 0, a group of N > G members). One butterfly of all members
would have every member open a stream to every owner (N − 1) and every owner take N parts. Instead
the group is cut into m = ⌈N/G⌉ *subgroups* (:func:`~.group.capped_plan`: the owners dealt round-
robin, then the other members; sizes within one of each other; the same on every member, a function
of the group alone), each with S = ⌊owners/m⌋ owners, so every subgroup cuts the vector into the
same S shards. A member sends its parts to its subgroup's owners only, exactly as above (the
subgroup is a group of its own, its id derived from the group's); the owner of shard ``k`` screens
and averages its subgroup's parts as any owner does, then averages that mean with the other
subgroups' owners of shard ``k`` (its *column*, one per subgroup) in a second exchange: a butterfly
over the column in the group's codec, each subgroup's mean weighted by its total weight, summed in
the column's member order, unscreened (each owner screened its own members). Every owner of the
column decodes the same result bytes and encodes them once for its subgroup's replies. So every
member of every subgroup decodes the same bytes: Q(Q(Σ_i W_i·Q(m_i) / Σ_i W_i)), with m_i each
subgroup's mean in member order, W_i its total weight, the sum in the column's order, and Q the
codec's round trip (the documented order; with fp32, Q is the identity and the result is the exact
weighted mean of the subgroups' means, whose bits differ from an uncapped round's, which sums in
another order; a lossy codec's error is about √(1 + 1/m) times a flat round's). Beside it, in fp32,
the column averages a 0/1 mark per member of the whole group (1 where a subgroup kept that member's
part, exact through the weighted mean); the reply's trailer names the members marked (``gcov``), and
the coverage rules above run on the whole group: a member dropped in one subgroup's shard is left
out or the round re-done over the common members (a capped group again). A column that cannot
complete (an owner or a member died, stalled) fails the shard in every subgroup it serves, so the
round fails on every member: never a partial mean. A member opens streams to S owners and, as an
owner, takes its subgroup's parts and talks to m − 1 column peers: O(G + N/G) per round instead of
N. The column costs an owner (m − 1)/m of its shard in the codec out and as much back, plus 4·N
bytes of marks: when every member owns a shard (S = G), a member sends 2(1 − 1/G) + 2(1 − 1/m)/G =
2(1 − 1/N) encoded vectors per round, exactly a flat butterfly's bytes. Results of a subgroup's
shard leave once its column is done (no pipelining of chunks), and a member waits up to three
timeouts instead of 1.5. Codecs that relay parts (sparse) do not cap (refused by the config). A
Byzantine owner's column part reaches every subgroup, as its result reaches every member of a flat
group.

Members check the owner's reply too: exact size, finite values, and a norm plausible next to their
own part (at most ``norm_bound·√M`` times it); an implausible result is an offence of the owner and
fails the round for that member (a Byzantine *owner* can still hand different members different
bytes; divergence repair by majority digest, standing.in_minority, is the backstop).
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from typing import Deque, Dict, List, Optional, Tuple

import torch

from .. import faults
from ..compression import Codec
from ..compression.robust import RobustConfig
from ..errors import SyncFailed, WireError
from .allreduce_member import OwnerExcludedUs, PartSender
from .allreduce_owner import ShardOwner, ShardRound
from .group import Coverage, Group, Level
from .keys import handler_name
from .partition import shard_bounds, squared_norm

# Group and Coverage are what callers of the all-reduce hand it and get back
__all__ = ["AllReducer", "Group", "Coverage"]

logger = logging.getLogger(__name__)


class AllReducer(ShardOwner, PartSender):
    """Runs all-reduce rounds: as a member (:class:`~.allreduce_member.PartSender`) of every shard
    owned by another member, as the owner (:class:`~.allreduce_owner.ShardOwner`, the ``part``
    handler) of ours. Lives on the node's event loop.

    Counters for tests and operators: ``stats`` (``parts_dropped``, ``dropped:<check>``,
    ``replies_rejected``, ``rounds``, ``rounds_resent`` (results sent again after a late drop),
    ``members_stalled`` (members counted as offenders for a part incomplete at the timeout),
    ``parts_cut`` (a member's stream broke mid-part: its round aborted),
    ``dial_retries``: streams to an owner whose dial failed first and was waited out, see
    :mod:`.dialing`) and ``dropped_log`` (the last 256 ``(peer, gid, phase, reason)``).
    """

    def __init__(self, node, run_id: str, timeout: float, robust: Optional[RobustConfig] = None, cap: int = 0):
        self.node = node
        self.run_id = run_id
        self.timeout = timeout
        self.robust = robust or RobustConfig()
        #: groups larger than this reduce in two levels (module docstring, "Capped groups"); 0: never
        self.cap = cap
        #: inner.round_samples of the run (rounds by the swarm's samples): the weight screen's budget
        self.round_samples = 0
        self.handler_name = handler_name(run_id, "part")
        self._rounds: Dict[Tuple[str, str], ShardRound] = {}
        self.stats: Counter = Counter()
        self.dropped_log: Deque[Tuple[str, str, str, str]] = deque(maxlen=256)
        #: fault-injection hook: called with (group, phase) before parts are sent; tests use it
        self.before_send = None
        node.add_handler(self.handler_name, self._handle_part)

    async def allreduce(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec) -> torch.Tensor:
        """Weighted mean of ``vec`` over the group; identical bytes on every member, or SyncFailed."""
        return (await self.allreduce_covered(group, phase, vec, weight, codec))[0]

    async def allreduce_covered(self, group: Group, phase: str, vec: torch.Tensor, weight: float, codec: Codec,
                                redo: bool = True) -> Tuple[torch.Tensor, Coverage]:
        """(weighted mean, whose parts it covers): the same member set on every shard (see module
        docstring: a round whose shards differ is re-done over the common members once, when ``redo``)."""
        # stays on its device: a GPU encodes its parts there (the codecs are torch ops); what comes
        # off the wire is decoded and reduced on CPU, and the mean is returned on CPU
        vec = vec.detach().to(dtype=torch.float32).contiguous().view(-1)
        out, covers = await self._exchange(group, phase, vec, weight, codec)
        sets = {cov for cov, _ in covers}
        common = sorted(set.intersection(*(set(c) for c in sets)))
        members = tuple(group.members[i] for i in common)
        left = tuple(m for m in group.members if m not in members)
        if len(sets) == 1:
            if left:
                self.stats["rounds_degraded"] += 1
                logger.warning(f"[{self.node.short_id}] group {group.gid} (fragment {group.frag}, round {group.round}, "
                               f"{phase}) is degraded: its means cover {len(members)} of {group.size} members; "
                               f"left out: {', '.join(left)}")
            gate = getattr(self.node, "gate", None)
            if gate is not None:  # every shard averaged their parts: members here (quotas, protocol.py)
                gate.vouch(members)
            plan = group.capped(self.cap)
            return out, Coverage(members=members, left_out=left, weight=covers[0][1],
                                 subgroups=len(plan.subgroups) if plan else 0)
        if not redo:
            raise SyncFailed(f"the shards of group {group.gid} cover different members "
                             f"({sorted(sets)}); not applied")
        self.stats["rounds_redone"] += 1
        logger.warning(f"[{self.node.short_id}] the shards of group {group.gid} (fragment {group.frag}, round "
                       f"{group.round}, {phase}) covered different members; re-doing it without {', '.join(left)}")
        sub = group.restricted_to(members)
        out, cov = await self.allreduce_covered(sub, phase, vec, weight, codec, redo=False)
        left_out = tuple(m for m in group.members if m not in cov.members)
        return out, Coverage(members=cov.members, left_out=left_out, weight=cov.weight, redone=True,
                             subgroups=cov.subgroups)

    async def _exchange(self, group: Group, phase: str, vec: torch.Tensor, weight: float,
                        codec: Codec) -> Tuple[torch.Tensor, List[Tuple[Tuple[int, ...], float]]]:
        """One butterfly exchange: (the concatenated means, each shard's (covered indexes, weight)). A group
        larger than the cap exchanges within our subgroup, and each shard's owner averages through its
        column (:meth:`_finish_capped`); the covered indexes are the whole group's either way."""
        plan = group.capped(self.cap)
        level = None
        if plan is not None:
            if codec.relays_parts:
                raise SyncFailed(f"codec {codec.name} relays the members' parts and cannot reduce in capped "
                                 f"groups (group of {group.size}, cap {self.cap})")
            index, sub = group.subgroup(plan)
            level, group = Level(group=group, plan=plan, index=index, sub=sub), sub
        owners = group.shard_owners
        if not owners:
            raise SyncFailed(f"no member of group {group.gid} can own a shard: every member is private (behind "
                             "NAT), so none can accept the others' parts; a group needs a public peer")
        owner_idx = [group.members.index(o) for o in owners]   # shard k -> member index of its owner
        bounds = shard_bounds(vec.numel(), len(owners), codec.block_size)
        me = group.my_index
        mine = owner_idx.index(me) if me in owner_idx else None  # our shard, None: we own none (private)
        finite = math.isfinite(squared_norm(vec))  # a dot product: ~10x faster than isfinite().all()
        out = torch.empty(vec.numel(), dtype=torch.float32)      # every shard's mean lands here
        rnd = None if mine is None else self._open_own_shard(group, phase, vec, weight, codec, bounds[mine], finite,
                                                             level)
        if self.before_send is not None:
            self.before_send(group, phase)

        async def exchange(k: int) -> Tuple[Tuple[int, ...], float]:
            a, b = bounds[k]
            if k == mine:
                return await self._own_result(rnd, out[a:b])
            return await self._send_part(group, phase, owner_idx[k], vec[a:b], weight, codec, out[a:b], level)

        results = await self._run_exchanges(group, phase, [asyncio.ensure_future(exchange(k))
                                                           for k in range(len(owners))], rnd, 3.0 if level else 1.5)
        if not finite:
            raise SyncFailed("our own pseudo-gradient is not finite; this round is not applied here")
        return out, list(results)

    async def _run_exchanges(self, group: Group, phase: str, tasks: List[asyncio.Future],
                             rnd: Optional[ShardRound], timeouts: float) -> List[Tuple[Tuple[int, ...], float]]:
        """Await every shard's exchange (ours: ``rnd``) within ``timeouts`` timeouts; any failure is the
        whole round's :class:`SyncFailed` (never a partial average)."""
        deadline = asyncio.get_running_loop().time() + self.timeout * timeouts
        excluded = False
        try:
            faults.fire("allreduce.send", frag=group.frag, round=group.round)  # fault-injection hook
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=self.timeout * timeouts)
        except OwnerExcludedUs:
            excluded = True
            raise
        except asyncio.TimeoutError:
            raise SyncFailed(f"all-reduce of group {group.gid} timed out after {self.timeout:.0f} s") from None
        except SyncFailed:
            raise
        except (WireError, ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            raise SyncFailed(f"all-reduce of group {group.gid} failed: {e}") from None
        except Exception as e:  # P2P daemon errors (peer unreachable) and the like
            raise SyncFailed(f"all-reduce of group {group.gid} failed: {type(e).__name__}: {e}") from None
        finally:
            if excluded:
                # One owner dropped our part; the others may still be reading theirs. Finish sending
                # them (a stream cut mid-part aborts that owner's round for everyone), then go.
                pending = [t for t in tasks if not t.done()]
                if pending:
                    await asyncio.wait(pending, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
            for t in tasks:
                t.cancel()
            if rnd is not None:
                await self._close_own_shard(rnd, phase, excluded, deadline)
