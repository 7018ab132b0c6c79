"""Cheap exhaustion: identities that hold streams open at a peer use up only
their own share of its requests in flight and of its pending rounds, so honest rounds go on; and a
member that stalls in a round it joined is counted as an offender like one that sends junk.

Real peers: the target and the honest peer are SwarmNodes on 127.0.0.1 running the production
all-reduce; each attacking identity is a bare libp2p daemon (an identity costs nothing) that opens
streams to the target's ``part`` handler and holds them.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from typing import Dict, List

import pytest
import torch

from conftest import loopback_nodes, reset_gates
from p2pdiloco.compression import get_codec
from p2pdiloco.swarm import allreduce_owner
from p2pdiloco.swarm import protocol
from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import Group, make_group_id
from p2pdiloco.swarm.partition import chunk_values
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.protocol import PROTOCOL_VERSION, read_frame, write_frame

LOOP = ["/ip4/127.0.0.1/tcp/0"]
_runs = itertools.count()


@pytest.fixture(scope="module")
def peers():
    with loopback_nodes(3) as ns:  # the target, an honest peer, a member that stalls
        yield ns


@pytest.fixture(autouse=True)
def _fresh_gates(request):
    if "peers" in request.fixturenames:
        reset_gates(request.getfixturevalue("peers"))
    yield


class Attackers:
    """``k`` identities (bare libp2p daemons, on their own event loop) that keep streams to the
    target's part handler open: each as many as it is let in (a refused stream retries), until stopped.

    ``kind``: "silent" (open and send nothing: held until the target's header timeout, and then
    until it stops waiting for our end to close) or "pending" (a valid part header for a group the
    target never forms: held until its all-reduce timeout)."""

    def __init__(self, target: SwarmNode, handler: str, kind: str, k: int, streams_each: int):
        from hivemind.p2p import P2P

        self.target, self.handler, self.kind, self.streams_each = target, handler, kind, streams_each
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: List[asyncio.Future] = []
        self.refusals: Dict[int, List[str]] = {i: [] for i in range(k)}  # identity -> why it was refused
        self.p2ps: List = []
        for _ in range(k):  # made up front: starting a daemon takes a while, holding streams does not
            self.p2ps.append(self.call(P2P.create(initial_peers=target.visible_maddrs(), host_maddrs=LOOP)))

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, *identities: int) -> None:
        async def spawn(i: int):
            return [asyncio.ensure_future(self._hold(i)) for _ in range(self.streams_each)]

        for i in identities:
            self.tasks += self.call(spawn(i))

    async def _hold(self, i: int) -> None:
        from hivemind.p2p import PeerID

        target = PeerID.from_base58(self.target.peer_id_str)
        while True:
            try:
                _, reader, writer = await self.p2ps[i].call_binary_stream_handler(target, self.handler)
            except Exception:
                await asyncio.sleep(0.5)
                continue
            try:
                if self.kind == "pending":
                    await write_frame(writer, {"t": "part", "v": PROTOCOL_VERSION, "gid": uuid.uuid4().hex[:24],
                                               "phase": "d", "idx": 0, "w": 1.0, "codec": 0, "numel": 4,
                                               "chunk": chunk_values(get_codec("fp32"))})
                reply, _ = await read_frame(reader, 0)  # a refusal at once, or the target giving up on us
                reason = str(reply.get("reason"))
                if "busy" in reason or "too many parts" in reason:
                    self.refusals[i].append(reason)
                    await asyncio.sleep(0.3)
                else:
                    await reader.read()  # never close our end: the target holds the stream until it gives up
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(0.3)
            finally:
                writer.close()

    def stop(self) -> None:
        for t in self.tasks:
            self.loop.call_soon_threadsafe(t.cancel)
        for p2p in self.p2ps:
            try:
                self.call(p2p.shutdown(), timeout=30)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _pending(reducer: AllReducer) -> int:
    return sum(not r.configured.is_set() for r in list(reducer._rounds.values()))


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _honest_round(target: SwarmNode, honest: SwarmNode, reducers: Dict[str, AllReducer], run: str, round_: int):
    """A two-member round; the honest peer starts first, so its part reaches the target before the
    target has formed the group (the target's pending rounds are what it needs then)."""
    ids = sorted([target.peer_id_str, honest.peer_id_str])
    gid = make_group_id(run, 0, round_, ids)
    vecs = {target.peer_id_str: torch.ones(1000), honest.peer_id_str: torch.full((1000,), 3.0)}

    def start(node: SwarmNode):
        group = Group(gid, tuple(ids), ids.index(node.peer_id_str), 0, round_)
        return node.submit(reducers[node.peer_id_str].allreduce(group, "d", vecs[node.peer_id_str], 1.0,
                                                                 get_codec("fp32")))

    first = start(honest)
    time.sleep(1.5)
    second = start(target)
    for f in (first, second):
        assert torch.equal(f.result(60), torch.full((1000,), 2.0))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["silent", "pending"])
def test_identities_holding_streams_open_leave_room_for_honest_rounds(peers, monkeypatch, kind):
    """Identities that each hold as many streams as they are let in: four of them hold what the
    quotas give them, and an honest peer that never shared a round with the target still gets its
    round through; with the strangers' room full (six identities), a member of a round the target
    verified is still served. Limits are scaled down (the same rule as the defaults), so a handful of
    identities does what a few dozen would with the defaults."""
    target, honest, _ = peers
    run = f"quota{next(_runs)}"
    reducers = {n.peer_id_str: AllReducer(n, run, timeout=30.0) for n in (target, honest)}
    if kind == "silent":  # requests in flight (PeerGate)
        module, names = protocol, ("MAX_INFLIGHT", "MAX_INFLIGHT_PER_PEER", "MAX_INFLIGHT_STRANGERS",
                                   "MAX_INFLIGHT_PER_STRANGER")
        held = target.gate.inflight
    else:  # parts for groups the target has not formed (AllReducer)
        module, names = allreduce_owner, ("MAX_PENDING_ROUNDS", "MAX_PENDING_PER_PEER", "MAX_PENDING_STRANGERS",
                                        "MAX_PENDING_PER_STRANGER")
        held = lambda: _pending(reducers[target.peer_id_str])  # noqa: E731
    for name, value in zip(names, (16, 4, 8, 4)):  # total, per member, strangers' room, per stranger
        monkeypatch.setattr(module, name, value, raising=False)
    attackers = Attackers(target, f"p2pdiloco.{run}.part", kind, k=6, streams_each=6)
    try:
        # one identity first, up to its own limit (4, half the strangers' room), then three more: past
        # half of the room each gets only one. Started together, the first four places could go to any
        # of them (4 + 0 + 0 + 0 down to 1 + 1 + 1 + 1, then one more each for those with none), so the
        # total would be anything from 4 to 7; in this order it is the most they can hold.
        attackers.start(0)
        _wait(lambda: held() >= 4 and attackers.refusals[0], 60, "the first attacker's streams")
        attackers.start(1, 2, 3)
        # the attack fired: every identity asked for more than it got, and together they hold the
        # strangers' room but one place (4 + 1 + 1 + 1)
        _wait(lambda: held() >= 7 and all(attackers.refusals[i] for i in range(4)), 60, "the attackers' streams")
        _honest_round(target, honest, reducers, run, 1)  # the honest peer is a stranger to the target here
        assert held() <= 8, held()
        assert target.gate.member(honest.peer_id_str)  # a round the target verified: a member now

        attackers.start(4, 5)  # two more identities: the strangers' room is full
        _wait(lambda: any("hold all" in r for i in (4, 5) for r in attackers.refusals[i]), 60,
              "a stranger refused because strangers hold all their places")
        _honest_round(target, honest, reducers, run, 2)  # members' room is untouched
        assert held() <= 8 + 1, held()  # the honest member's own stream may still be closing
    finally:
        attackers.stop()
    assert target.gate.errors == 0
    assert not any(target.gate.offences[p.peer_id.to_base58()] for p in attackers.p2ps)  # holding is no offence


class StallingAllReducer(AllReducer):
    """The real all-reducer of a member that joins a round and stalls: it sends its parts' headers
    and then nothing (its own shard it serves as usual)."""

    async def _send_chunks(self, group, writer, part, codec, chunk) -> None:
        await asyncio.sleep(3600)


@pytest.mark.timeout(240)
def test_a_member_that_stalls_is_an_offender_and_banned_after_repeats(peers):
    """A member whose part never comes within the all-reduce timeout, while the other members' parts
    did, is counted as an offender (as a member sending junk is) in every round it stalls: by the
    owner whose timeout fires first (its abort ends the round for the others). Owners that banned it
    drop its part up front, so the next owner's timeout fires first and it counts too: after a few
    rounds every honest owner has banned it, and the honest members' round goes through without it."""
    target, honest, staller = peers
    run = f"quota{next(_runs)}"
    timeout = 3.0
    reducers = {target.peer_id_str: AllReducer(target, run, timeout=timeout),
                honest.peer_id_str: AllReducer(honest, run, timeout=timeout),
                staller.peer_id_str: StallingAllReducer(staller, run, timeout=timeout)}
    nodes = (target, honest, staller)
    owners = (target, honest)
    ids = sorted(n.peer_id_str for n in nodes)
    vecs = {n.peer_id_str: torch.full((3000,), float(i + 1)) for i, n in enumerate(nodes)}

    def round_(r: int):
        gid = make_group_id(run, 0, r, ids)
        futs = {n.peer_id_str: n.submit(reducers[n.peer_id_str].allreduce_covered(
            Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, r), "d", vecs[n.peer_id_str], 1.0,
            get_codec("fp32"))) for n in nodes}
        out = {}
        for peer, f in futs.items():
            try:
                out[peer] = f.result(60)
            except Exception as e:
                out[peer] = e
        return out

    bad = staller.peer_id_str
    counted = lambda: sum(n.gate.offences[bad] for n in owners)  # noqa: E731
    r = 0
    while not all(n.gate.banned(bad) for n in owners):
        r += 1
        assert r <= 3 * len(owners), "the staller is still not banned everywhere"
        before = counted()
        out = round_(r)
        assert all(isinstance(out[n.peer_id_str], Exception) for n in owners), out
        assert counted() > before, f"round {r}: the stall was not counted"
        assert sum(reducers[n.peer_id_str].stats["members_stalled"] for n in owners) == counted()
        assert target.gate.offences[honest.peer_id_str] == 0 and honest.gate.offences[target.peer_id_str] == 0

    out = round_(r + 1)  # its part is dropped up front everywhere: the others' round is re-done without it
    for n in owners:
        mean, cov = out[n.peer_id_str]
        assert set(cov.members) == {target.peer_id_str, honest.peer_id_str} and bad in cov.left_out
        assert torch.equal(mean, (vecs[target.peer_id_str] + vecs[honest.peer_id_str]) / 2)


def test_a_few_dozen_identities_cannot_fill_the_strangers_room_and_never_the_members():
    """The quota rule with the default limits: greedy identities, each taking every place it is let
    in, in turn. 48 of them leave room for another stranger; filling the strangers' room takes 160;
    members' room is never touched."""
    for limits in [protocol.inflight_limits(),
                   (allreduce_owner.MAX_PENDING_ROUNDS, allreduce_owner.MAX_PENDING_PER_PEER,
                    allreduce_owner.MAX_PENDING_STRANGERS, allreduce_owner.MAX_PENDING_PER_STRANGER)]:
        total, per_member, strangers_room, per_stranger = limits
        held: Dict[int, int] = {}

        def take(peer: int, member: bool = False) -> bool:
            ok = protocol.quota_refusal(held.get(peer, 0), member, sum(held.values()),
                                        sum(v for p, v in held.items() if p >= 0), limits) is None
            if ok:
                held[peer] = held.get(peer, 0) + 1
            return ok

        identities = 0
        while take(identities):
            while take(identities):
                pass
            identities += 1
            if identities == 48:
                assert protocol.quota_refusal(0, False, sum(held.values()), sum(held.values()), limits) is None
        assert identities == 160 and sum(held.values()) == strangers_room, (identities, held)
        assert protocol.quota_refusal(0, False, strangers_room, strangers_room, limits) is not None
        # members (negative ids here) still have all the rest, per_member each
        members = 0
        while take(-1 - members, member=True):
            while take(-1 - members, member=True):
                pass
            members += 1
        assert sum(held.values()) == total and members == -(-(total - strangers_room) // per_member)
