"""Matchmaking's rules, row by row: the table in ``Matchmaker.form_group``'s docstring.

Each row is one situation of peer "me" forming the group of fragment 0, round 5 at schedule position
100, on a DHT held in a dict (the records below), with the network calls replaced: ``_join(leader)``
answers what the row says that leader answers, ``_lead`` returns the group it would close. The row
names the outcome: the leaders asked, in order, and the group we end in, or the error raised.
"""
from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional

import pytest

from p2pdiloco.errors import MatchmakingFailed, RoundMissed
from p2pdiloco.swarm.group import Group
from test_elastic_state import _fake_matchmaker

DIGEST = "1" * 16


def _due(*peers: str, step: int = 99, next_sync: int = 100, private: str = "") -> Dict[str, Dict[str, Any]]:
    """Progress records of live peers due at position ``next_sync`` (``private``: those that are)."""
    return {p: {"step": step, "sps": 1.0, "next_sync": next_sync, "t": 1.0,
                "reach": "private" if p in private else "public"} for p in peers}


def _group(members, gid: str = "") -> Group:
    members = tuple(sorted(members))
    return Group(gid=gid or "g-" + "".join(members), members=members, my_index=members.index("me"), frag=0, round=5)


#: situation, DHT records, answers of the leaders we may ask (a tuple: their group's members, us
#: included; "hint:X": they follow X; "refuse": no hint), settings, and the outcome: the leaders asked
#: in order and the members of our group, or "lead: unseen [...]" (we lead, waiting the join grace for
#: those), or the exception raised
ROWS: List[Dict[str, Any]] = [
    dict(case="a verified sync of the swarm at or past our step: behind, nothing announced",
         records={"t:progress": {p: {"synced_step": 120, "digest": DIGEST, "next_sync": 140, "t": 1.0, "gid": "g"}
                                 for p in ("a", "b")}},
         announce=False, raises=RoundMissed),
    dict(case="identities that are not our partners claim a sync past our step: not behind, we form our own",
         records={"t:progress": dict({p: {"synced_step": 120, "digest": DIGEST, "next_sync": 140, "t": 1.0,
                                          "gid": "g-fake"} for p in ("s1", "s2")},
                                     z=dict(_due("z")["z"], synced_step=80, digest=DIGEST, gid="g-ours"))},
         partners=["z"], asked=[], result="lead: unseen ['z']"),
    dict(case="the round's group closed without us, based on our history: missed",
         records={"t:group:0:5": {"a": {"members": ["a", "b"], "base": "g-ours"}}},
         lineage=["g-ours"], raises=RoundMissed),
    dict(case="the round's group closed without us, another history: not ours, we form our own",
         records={"t:group:0:5": {"a": {"members": ["a"], "base": "g-theirs"}}},
         lineage=["g-ours"], expected=1, asked=[], result="lead: unseen []"),
    dict(case="the presumable leader (best rank among us and the peers due) is asked at once",
         records={"t:progress": _due("a", "me")}, answers={"a": ("a", "me")}, asked=["a"], result=("a", "me")),
    dict(case="we have the best rank: we lead, waiting for the due peer we did not see ready",
         records={"t:progress": _due("me", "z")}, asked=[], result="lead: unseen ['z']"),
    dict(case="a public peer leads before a private one with a smaller id",
         records={"t:progress": _due("a", "b", private="a"), "t:mm:0:5": {"a": {"t": 1.0, "reach": "private"},
                                                          "b": {"t": 1.0, "reach": "public"}}},
         answers={"b": ("a", "b", "me"), "a": ("a", "me")}, expected=3, asked=["b"], result=("a", "b", "me")),
    dict(case="we are private and so is every other ready peer: nobody can lead us",
         records={"t:progress": _due("a", private="a"), "t:mm:0:5": {"a": {"t": 1.0, "reach": "private"}}},
         me_private=True,
         raises=MatchmakingFailed),
    # (a, the best-ranked peer due, is asked at once while we poll, and again as the first candidate)
    dict(case="a candidate says it follows a peer we see ready: that peer is asked next",
         records={"t:progress": _due("a", "b"), "t:mm:0:5": {"b": {"t": 1.0}, "a": {"t": 1.0}}},
         answers={"a": "hint:b", "b": ("b", "me")}, asked=["a", "a", "b"], result=("b", "me")),
    dict(case="a candidate refuses without a hint: the next candidate (here, we lead)",
         records={"t:progress": _due("a"), "t:mm:0:5": {"a": {"t": 1.0}}}, answers={"a": "refuse"},
         asked=["a", "a"], result="lead: unseen []"),
    dict(case="alone while a partner of our last group cannot be seen at all: asked before we lead",
         records={}, companions=["a"], answers={"a": ("a", "me")}, expected=2, asked=["a"], result=("a", "me")),
]


def _run(row: Dict[str, Any]):
    records = {k: {s: dict(v) for s, v in sub.items()} for k, sub in row.get("records", {}).items()}
    mm = _fake_matchmaker(records, announce=row.get("announce", True), join_grace=0.1,
                          matchmaking_timeout=1.0)
    mm.node.reachability = "private" if row.get("me_private") else "public"
    for gid in row.get("lineage", []):
        mm.add_lineage(gid)
    if row.get("companions"):
        mm.set_companions(row["companions"] + ["me"])
    if row.get("partners"):  # peers we completed verified rounds with earlier (swarm/standing.py)
        mm.partners.add(row["partners"])
    asked: List[str] = []
    answers = row.get("answers", {})

    async def join(leader, frag, round_, due=None, timeout=None, taken=None):
        asked.append(leader)
        what = answers.get(leader, "refuse")
        if isinstance(what, tuple):
            return _group(what), None
        if what.startswith("hint:"):
            return None, what[5:]
        return None, None

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset()):
        return _group(["me"], gid=f"lead: unseen {sorted(unseen)}")

    mm._join, mm._lead = join, lead
    group: Optional[Group] = asyncio.run(mm.form_group(0, 5, row.get("expected", 2), sync_step=100))
    return asked, (group.gid if group.gid.startswith("lead:") else group.members)


@pytest.mark.parametrize("row", ROWS, ids=[r["case"] for r in ROWS])
def test_matchmaking_rule(row):
    if "raises" in row:
        with pytest.raises(row["raises"]):
            _run(row)
        return
    asked, outcome = _run(row)
    assert (asked, outcome) == (row["asked"], row["result"])


def test_a_leader_that_vanishes_after_proposing_our_group_fails_our_round(monkeypatch):
    """The leader proposed a group with us ('warm') and its stream then broke before the final answer
    (it was killed mid-round; its other members got the answer, ours was lost): joining or leading
    another group would split the round into two results, so the round fails on us too."""
    import msgpack

    from p2pdiloco.swarm import joining

    mm = _fake_matchmaker({})
    warm = {"t": "warm", "members": ["a", "me"], "owners": None}

    class Writer:
        def write(self, data): pass
        async def drain(self): pass
        def close(self): pass

    def stream(*frames):
        reader = asyncio.StreamReader()
        for f in frames:
            body = msgpack.packb(f)
            reader.feed_data(len(body).to_bytes(4, "big") + body)
        reader.feed_eof()  # then the leader is gone
        return None, reader, Writer()

    async def open_warm(node, peer, handler, deadline, stats=None):
        return stream(warm)

    async def open_silent(node, peer, handler, deadline, stats=None):
        return stream()

    monkeypatch.setattr(joining, "open_stream", open_warm)
    with pytest.raises(MatchmakingFailed, match="vanished after proposing a group with us"):
        asyncio.run(mm._join("a", 0, 5))
    # a leader that vanishes before proposing anything: we just try the next one
    monkeypatch.setattr(joining, "open_stream", open_silent)
    assert asyncio.run(mm._join("a", 0, 5)) == (None, None)


@pytest.mark.parametrize("answer", ["group", "refuse"])
def test_a_follower_reads_nothing_while_the_presumable_leader_holds_its_request(answer):
    """The presumable leader polls the round for everyone who asked it: a follower reads the live peers
    and the group record once as it enters, then nothing until the leader answers (every read would
    carry every ready or progress record of the round, per follower: the traffic that grows with the
    swarm). When the leader refuses without a hint, the follower polls the round itself again."""
    records = {"t:progress": _due("a", "me")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=3.0)
    reads: List[str] = []
    aget = mm.node.aget_subkeys

    async def counting_aget(key, why="other"):
        reads.append(key)
        return await aget(key)

    mm.node.aget_subkeys = counting_aget
    asked: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, taken=None):
        asked.append(leader)
        if len(asked) == 1:
            taken.set()  # the leader's join handler has the request
            await asyncio.sleep(1.0)  # the leader waits for its round before it answers
        return (_group(("a", "me")), None) if answer == "group" else (None, None)

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset()):
        return _group(["me"], gid="lead")

    mm._join, mm._lead = join, lead
    group = asyncio.run(mm.form_group(0, 5, 2, sync_step=100))
    first = ["t:progress", "t:group:0:5"]  # as it enters
    if answer == "group":
        assert (asked, group.members, reads) == (["a"], ("a", "me"), first)
    else:  # refused after a second: then it polls the ready and group records itself, and leads
        assert asked[0] == "a" and group.gid == "lead"
        assert reads[:2] == first and "t:mm:0:5" in reads[2:]



def test_a_follower_polls_while_the_dial_to_the_presumable_leader_is_still_tried():
    """The presumable leader "a" left right after our read of the live peers (its goodbye shows a moment
    later) and our dial to it fails only after the dial wait; meanwhile "b" leads and closes its group
    after its join grace. A request the leader never took is no reason to stop reading: the follower
    polls, sees a gone and b ready, and joins b before b closes (waiting on the dial instead, it asked b
    only after b had closed: missed the round)."""
    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": {"b": {"t": 1.0}}}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=5.0,
                          reevaluate_period=0.1)
    asked: List[str] = []
    dial_to_a: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, taken=None):
        asked.append(leader)
        if leader == "a":
            records["t:progress"]["a"]["gone"] = True  # its goodbye reaches the DHT
            try:
                await asyncio.sleep(3.0)  # the dial to a departed peer, retried for the dial wait
            except asyncio.CancelledError:
                dial_to_a.append("hung up while dialing")
                raise
            dial_to_a.append("failed")
            return None, None
        if asyncio.get_running_loop().time() - t0 > 1.0:  # b's grace is over: closed without us
            raise RoundMissed("missed the group for fragment 0, round 5 (it closed before we joined)")
        return _group(("b", "me")), None

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset()):
        return _group(["me"], gid="lead")

    mm._join, mm._lead = join, lead

    async def main():
        nonlocal t0
        t0 = asyncio.get_running_loop().time()
        return await mm.form_group(0, 5, 3, sync_step=100)

    t0 = 0.0
    group = asyncio.run(main())
    assert (asked, group.members, dial_to_a) == (["a", "b"], ("b", "me"), ["hung up while dialing"])


def test_a_follower_found_behind_after_its_wait_withdraws_its_request():
    """The presumable leader holds our request past our deadline; looking once more, we find the swarm
    synced this step already (we are behind). The request must be withdrawn as we stop: a leader that
    admitted us after we gave up would wait on a member that is not there."""
    records = {"t:progress": _due("a", "b", "me")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=1.0)
    request: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, taken=None):
        taken.set()
        # while we wait, the others sync step 100 without answering us
        records["t:progress"] = {p: {"synced_step": 120, "digest": DIGEST, "next_sync": 140, "t": 1.0, "gid": "g"}
                                 for p in ("a", "b")}
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            request.append("withdrawn")
            raise
        return None, None

    mm._join = join

    async def main():
        with pytest.raises(RoundMissed, match="behind"):
            await mm.form_group(0, 5, 3, sync_step=100)
        await asyncio.sleep(0.1)  # a cancellation lands at once (the loop's own teardown comes later)
        return list(request)

    assert asyncio.run(main()) == ["withdrawn"]

def test_a_formation_cancelled_mid_poll_leaves_no_unretrieved_read():
    """A peer shutting down cancels its formation while a poll's reads are in flight (then every task the
    node still runs): nothing may end as an exception nobody retrieves (asyncio logs a traceback for it,
    on the user's terminal as they stop)."""
    import gc

    records = {"t:progress": _due("me", "z")}  # we lead: we poll
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=30.0)
    aget = mm.node.aget_subkeys
    started = []

    async def slow_aget(key, why="other"):
        if key == "t:mm:0:5":
            started.append(key)
            await asyncio.sleep(60)  # a read that waits on an unresponsive node
        return await aget(key)

    mm.node.aget_subkeys = slow_aget
    unretrieved = []

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: unretrieved.append(context.get("message")))
        forming = asyncio.ensure_future(mm.form_group(0, 5, 2, sync_step=100))
        while not started:
            await asyncio.sleep(0.01)
        forming.cancel()
        await asyncio.gather(forming, return_exceptions=True)
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:  # as SwarmNode's shutdown cancels what is left
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert started and not unretrieved, unretrieved
