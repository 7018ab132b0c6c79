"""Matchmaking's rules, row by row: the table in ``Matchmaker.form_group``'s docstring.

Each row is one situation of peer "me" forming the group of fragment 0, round 5 at schedule position
100, on a DHT held in a dict (the records below), with the network calls replaced: ``_join(leader)``
answers what the row says that leader answers, ``_lead`` returns the group it would close. The row
names the outcome: the leaders asked, in order, and the group we end in, or the error raised.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import pytest

from p2pdiloco.errors import MatchmakingFailed, RoundMissed
from p2pdiloco.swarm.group import Group
from p2pdiloco.swarm.matchmaking import _Overdue
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
    # (a, the best-ranked peer due, is asked at once: its hint is followed at once too)
    dict(case="the presumable leader says it follows another peer: that peer is asked next, at once",
         records={"t:progress": _due("a", "b"), "t:mm:0:5": {"b": {"t": 1.0}, "a": {"t": 1.0}}},
         answers={"a": "hint:b", "b": ("b", "me")}, asked=["a", "b"], result=("b", "me")),
    dict(case="a candidate refuses without a hint: the next candidate (here, we lead)",
         records={"t:progress": _due("a"), "t:mm:0:5": {"a": {"t": 1.0}}}, answers={"a": "refuse"},
         asked=["a", "a"], result="lead: unseen []"),
    dict(case="an overdue peer (waited for, not ready when a round we completed closed) in its round without a wait",
         records={"t:progress": _due("me", "z")}, overdue=["z"], asked=[], result="lead: unseen []"),
    dict(case="an overdue peer that ranks first and is ready: asked to lead as anyone ready",
         records={"t:progress": _due("a", "me"), "t:mm:0:5": {"a": {"t": 1.0}}}, overdue=["a"],
         answers={"a": ("a", "me")}, asked=["a"], result=("a", "me")),
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
    mm._overdue.update((p, _Overdue(strikes=1, skip=1, since=time.monotonic())) for p in row.get("overdue", ()))
    asked: List[str] = []
    answers = row.get("answers", {})

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        what = answers.get(leader, "refuse")
        if isinstance(what, tuple):
            return _group(what), None
        if what.startswith("hint:"):
            return None, what[5:]
        return None, None

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
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


def test_a_group_as_proposed_is_answered_by_its_id_and_one_that_changed_by_its_lists(monkeypatch):
    """After the link check the leader names the group by its id alone when it is the one it proposed (the
    member and owner lists were most of a leader's bytes at hundreds of members: they came twice); the
    joiner takes the lists from the proposal and checks the id against them. A group that changed (a
    member left out) comes with its lists, as does every group without a proposal."""
    import msgpack

    from p2pdiloco.swarm import joining
    from p2pdiloco.swarm.group import make_group_id
    from p2pdiloco.swarm.joining import JoinRequests
    from p2pdiloco.swarm.leading import Proposal, RoundSlot

    mm = _fake_matchmaker({})
    members = ("a", "me", "z")

    async def no_links(members, owners):
        return set()

    mm._warm_links = no_links

    class Writer:
        def write(self, data): pass
        async def drain(self): pass
        def close(self): pass

    def opener(*frames):
        async def open_stream(node, peer, handler, deadline, stats=None):
            reader = asyncio.StreamReader()
            for f in frames:
                body = msgpack.packb(f)
                reader.feed_data(len(body).to_bytes(4, "big") + body)
            reader.feed_eof()
            return None, reader, Writer()
        return open_stream

    warm = {"t": "warm", "members": list(members)}
    gid = make_group_id(mm.run_id, 0, 5, members, "", None)
    monkeypatch.setattr(joining, "open_stream", opener(warm, {"t": "group", "gid": gid, "base": "", "as": "proposed"}))
    group, hint = asyncio.run(mm._join("a", 0, 5))
    assert group is not None and group.members == members and group.gid == gid and hint is None
    other = make_group_id(mm.run_id, 0, 5, ("a", "me"), "", None)  # an id that is not the proposal's
    monkeypatch.setattr(joining, "open_stream", opener(warm, {"t": "group", "gid": other, "base": "", "as": "proposed"}))
    assert asyncio.run(mm._join("a", 0, 5)) == (None, None)

    # the leader's side: the id alone for the group proposed, the lists for one that changed
    slot = RoundSlot()
    proposal = Proposal(members=members, owners=None, reports={}, final=None)
    same = Group(gid=gid, members=members, my_index=0, frag=0, round=5)
    assert JoinRequests._final_reply(same, slot, proposal) == {"t": "group", "gid": gid, "base": "", "as": "proposed"}
    fewer = Group(gid=other, members=("a", "me"), my_index=0, frag=0, round=5)
    assert JoinRequests._final_reply(fewer, slot, proposal)["members"] == ["a", "me"]
    assert JoinRequests._final_reply(same, slot)["members"] == list(members)


def _counting(mm) -> List[str]:
    """The keys ``mm`` reads from the DHT, in order."""
    reads: List[str] = []
    aget = mm.node.aget_subkeys

    async def counting_aget(key, why="other"):
        reads.append(key)
        return await aget(key)

    mm.node.aget_subkeys = counting_aget
    return reads


@pytest.mark.parametrize("answer", ["group", "refuse"])
def test_a_follower_reads_nothing_while_the_presumable_leader_holds_its_request(answer):
    """The presumable leader polls the round for everyone who asked it: a follower reads the live peers
    and the group record once as it enters, then nothing until the leader answers (every read would
    carry every ready or progress record of the round, per follower: the traffic that grows with the
    swarm), and it stores no ready record (the leader counts the request as one). When the leader refuses
    without a hint, the follower stores its ready record and polls the round itself again."""
    records = {"t:progress": _due("a", "me")}
    mm = _fake_matchmaker(records, announce=True, join_grace=3.0, matchmaking_timeout=3.0)  # answered within grace/2
    reads = _counting(mm)
    asked: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        if len(asked) == 1:
            watch.taken.set()  # the leader's join handler has the request
            await asyncio.sleep(1.0)  # the leader waits for its round before it answers
        return (_group(("a", "me")), None) if answer == "group" else (None, None)

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        return _group(["me"], gid="lead")

    mm._join, mm._lead = join, lead
    group = asyncio.run(mm.form_group(0, 5, 2, sync_step=100))
    first = ["t:progress", "t:group:0:5"]  # as it enters
    if answer == "group":  # the leader counted the request as our ready record: we stored none
        assert (asked, group.members, reads) == (["a"], ("a", "me"), first)
        assert "me" not in records.get("t:mm:0:5", {})
    else:  # refused after a second: then it polls the ready and group records itself, and leads
        assert asked[0] == "a" and group.gid == "lead"
        assert reads[:2] == first and "t:mm:0:5" in reads[2:]
        assert "me" in records["t:mm:0:5"]  # polling, it is ready for the others to see


@pytest.mark.parametrize("view", ["presumes a", "presumes us", "none"])
def test_a_follower_enters_with_its_fresh_view_and_only_the_presumable_leader_reads_the_live_peers(view):
    """Every peer of a round reading every live peer's record as it enters is the control traffic that
    grows with the swarm. A follower whose fresh background view makes another peer the presumable leader
    takes that view: it reads only the round's group record and asks that leader. A view that presumes us
    (we may lead, and a leader must know whom to wait for) or no fresh view: the network read, as before."""
    records = {"t:progress": _due("a", "me")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=2.0)
    views = {"presumes a": _due("a", "me"), "presumes us": _due("me", "z"), "none": None}
    mm.fresh_view = lambda: views[view]
    reads = _counting(mm)
    asked: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        watch.taken.set()
        return _group(("a", "me")), None

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        raise AssertionError("a leads this round")

    mm._join, mm._lead = join, lead
    group = asyncio.run(mm.form_group(0, 5, 2, sync_step=100))
    assert (asked, group.members) == (["a"], ("a", "me"))
    assert reads == ([] if view == "presumes a" else ["t:progress", "t:group:0:5"])


def test_a_follower_whose_view_missed_the_leader_reads_the_live_peers_when_refused():
    """A view is up to a read period old: here it lacks "a", the best-ranked peer due (its record came
    after the view was read), and presumes b. b follows a and refuses without a hint: the first poll
    reads the live peers over the network, and the follower asks a. A view never decides a group; it
    only spares a read to a follower whose presumable leader answers."""
    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": {"a": {"t": 1.0}, "b": {"t": 1.0}}}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=2.0)
    mm.fresh_view = lambda: _due("b", "me")
    reads = _counting(mm)
    asked: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        return (_group(("a", "b", "me")), None) if leader == "a" else (None, None)

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        raise AssertionError("a leads this round")

    mm._join, mm._lead = join, lead
    group = asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert group.members == ("a", "b", "me") and asked[0] == "b" and "a" in asked
    assert sorted(reads[:3]) == ["t:group:0:5", "t:mm:0:5", "t:progress"]  # no entry read; the first poll


def test_a_stale_view_does_not_hide_that_the_round_is_over():
    """A straggler whose view is fresh by its clock but says nothing of the swarm's sync past our step
    asks the leader it presumes, which closed the round: its refusal ("closed", our history) is the
    RoundMissed the network read would have raised at once; nothing is synced alone."""
    records = {"t:progress": {p: {"synced_step": 120, "digest": DIGEST, "next_sync": 140, "t": 1.0, "gid": "g"}
                              for p in ("a", "b")}}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=2.0)
    mm.add_lineage("g-ours")
    mm.fresh_view = lambda: _due("a", "b", "me")
    asked: List[str] = []

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        raise RoundMissed(f"missed the group for fragment {frag}, round {round_} (it closed before we joined)")

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        raise AssertionError("synced alone")

    mm._join, mm._lead = join, lead
    with pytest.raises(RoundMissed):
        asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert asked == ["a"]


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

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
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

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
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

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        watch.taken.set()
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


# ---- leaders that take requests and answer none (module docstring, item 11) -------------------------
def _ready(*peers: str) -> Dict[str, Dict[str, Any]]:
    return {p: {"t": 1.0, "reach": "public"} for p in peers}


def _silent_then(answers: Dict[str, Any], asked: List[str], withdrawn: List[str]):
    """A fake ``_join``: "a" takes the request and falls silent (the SILENT_S gap, shortened); "stall:X"
    answers hold the request, talking, for 10 s; the others answer as ``answers`` says (a list: one per ask)."""
    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        asked.append(leader)
        what = answers[leader]
        if isinstance(what, list):
            what = what.pop(0) if len(what) > 1 else what[0]
        if what in ("silent", "stall"):
            watch.taken.set()
            try:
                await asyncio.sleep(0.05 if what == "silent" else 10.0)
            except asyncio.CancelledError:
                withdrawn.append(leader)
                raise
            watch.silent = what == "silent"
            return None, None
        if isinstance(what, tuple):
            return _group(what), None
        return None, what[5:]  # "hint:X"
    return join


def _lead_recorder(led: List[Dict[str, Any]]):
    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        led.append({"grace": grace, "joiners": set(expected_joiners)})
        return _group(["me"], gid="lead")
    return lead


def test_a_presumable_leader_that_falls_silent_is_dropped_and_the_next_one_asked():
    """a (the best rank) takes our request and says nothing: we ask b, the next presumable leader, at
    once, and never ask a again this round (asking it again as a candidate would cost another SILENT_S,
    and the other honest peers have dropped it too)."""
    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": _ready("a", "b")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=3.0)
    asked: List[str] = []
    mm._join = _silent_then({"a": "silent", "b": ("b", "me")}, asked, [])
    group = asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert asked == ["a", "b"] and group.members == ("b", "me")


def test_a_presumable_leader_that_holds_our_request_with_every_peer_ready_is_dropped_after_patience():
    """a keeps our request (it talks: not silent) and proposes nothing, although every peer due is ready
    by our read when our wait ends: an honest leader closes within its join grace of the last request.
    After twice the join grace we hang up on a (withdrawn) and ask the next candidate, instead of
    waiting for the request's own timeout."""
    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": _ready("a", "b")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=1.0)
    asked: List[str] = []
    withdrawn: List[str] = []
    mm._join = _silent_then({"a": "stall", "b": ("b", "me")}, asked, withdrawn)
    group = asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert (asked, withdrawn, group.members) == (["a", "b"], ["a"], ("b", "me"))


def test_a_candidate_that_still_follows_a_dropped_leader_is_asked_until_it_leads():
    """b, like us, waits on the silent a; it answers "I follow a" until it drops a too, a little later
    than we did. We keep asking b, more often than the three bounces a hint gets, and join its group:
    leading a group of our own meanwhile would split the round."""
    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": _ready("a", "b")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=3.0)
    asked: List[str] = []
    led: List[Dict[str, Any]] = []
    mm._join = _silent_then({"a": "silent", "b": ["hint:a"] * 6 + [("b", "me")]}, asked, [])
    mm._lead = _lead_recorder(led)
    group = asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    assert group.members == ("b", "me") and not led
    assert asked[0] == "a" and asked[1:] == ["b"] * 7


@pytest.mark.parametrize("how", ["silent", "stall"])
def test_leading_in_place_of_a_dropped_peer_admits_for_longer_and_never_waits_for_it(how):
    """We are next after a, which left our request unanswered: the others drop a too, each after its own
    wait, so we admit joiners for longer than the join grace (silent: one early dial and SILENT_S more;
    stalled: up to matchmaking_timeout and the patience), and a is not among the joiners we wait for."""
    from p2pdiloco.swarm.joining import SILENT_S
    from p2pdiloco.swarm.matchmaking import EARLY_DIAL_S

    records = {"t:progress": _due("a", "b", "me"), "t:mm:0:5": _ready("a", "b")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=1.0)
    asked: List[str] = []
    led: List[Dict[str, Any]] = []
    mm._join = _silent_then({"a": how, "b": "refuse"}, asked, [])
    mm._draw = lambda key, p: {"a": b"0", "me": b"1", "b": b"2"}[p]  # a, then us, then b
    mm._lead = _lead_recorder(led)
    asyncio.run(mm.form_group(0, 5, 3, sync_step=100))
    (lead,) = led
    assert asked == ["a"] and "a" not in lead["joiners"]
    assert lead["grace"] == pytest.approx(0.1 + EARLY_DIAL_S + SILENT_S if how == "silent" else 1.0 + 0.2)


def _frames(data: bytes) -> List[Dict[str, Any]]:
    import msgpack

    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        out.append(msgpack.unpackb(data[i + 4:i + 4 + n]))
        i += 4 + n
    return out


def test_a_peer_holding_a_join_request_says_wait_until_it_answers(monkeypatch):
    """The join handler holds an admitted joiner's request until its group closes: meanwhile it writes a
    'wait' frame every WAIT_S, so the joiner can tell a leader still gathering from a silent one."""
    from p2pdiloco.swarm import joining
    from test_elastic_state import _ask_to_join

    monkeypatch.setattr(joining, "WAIT_S", 0.05)

    async def scenario():
        mm = _fake_matchmaker({})
        slot = mm._slot(0, 5)
        handler, _, reply = await _ask_to_join(mm, "j", lead=True)
        await asyncio.sleep(0.4)  # held: the group has not closed
        slot.joiners["j"].set_result(None)  # it closes without a group for j
        await asyncio.wait_for(handler, timeout=2)
        return _frames(bytes(reply.data))

    frames = asyncio.run(scenario())
    assert len(frames) >= 4 and all(f == {"t": "wait"} for f in frames[:-1])
    assert frames[-1] == {"t": "refuse", "reason": "group too small"}


def test_a_leader_that_missed_the_round_says_so_to_its_joiners():
    """A leader that finds, as it closes, that the round went on without it answers the joiners it held
    'round missed' (they try the next candidate), not 'group too small' (its answer when too few came)."""
    from p2pdiloco.errors import RoundMissed
    from p2pdiloco.swarm.joining import JoinRequests
    from p2pdiloco.swarm.leading import _answer_joiners

    async def scenario():
        mm = _fake_matchmaker({})
        slot = mm._slot(0, 5)
        slot.joiners["j"] = asyncio.get_running_loop().create_future()
        _answer_joiners(slot, RoundMissed("fragment 0 round 5 went on without us"))
        return slot.joiners["j"].result(), slot

    answer, slot = asyncio.run(scenario())
    assert JoinRequests._final_reply(answer, slot) == {"t": "refuse", "reason": "round missed"}
    assert JoinRequests._final_reply(None, slot) == {"t": "refuse", "reason": "group too small"}


def test_a_join_request_for_a_round_of_a_history_we_left_waits_for_that_round_in_ours():
    """A peer that ran ahead alone (the far side of a partition) and then adopted the swarm's state
    enters the same round numbers again. A join request for such a round is held until we enter it in
    the adopted history and answered by that formation, never with the closed group of the one we left
    (the joiner would form a group without us while we lead one without it: a split round)."""
    from p2pdiloco.swarm.group import Group
    from test_elastic_state import _admitted, _ask_to_join

    async def scenario():
        mm = _fake_matchmaker({})
        ran_alone = mm._slot(0, 5)  # the round as we ran it alone: led and closed, a group of one
        ran_alone.leading, ran_alone.closed, ran_alone.base = True, True, "g-alone"
        ran_alone.final = Group(gid="g5", members=("me",), my_index=0, frag=0, round=5)
        ran_alone.decided.set()
        mm.adopt_lineage(["g-swarm"])  # we caught up with the swarm at an earlier round
        handler, reader, reply = await _ask_to_join(mm, "j")
        await asyncio.sleep(0.3)
        held = _frames(bytes(reply.data))
        slot = mm._slot(0, 5)  # we enter round 5 again, and lead it
        slot.leading = True
        slot.decided.set()
        admitted = await _admitted(slot, "j")
        reader.feed_eof()
        await asyncio.wait_for(handler, timeout=2)
        return ran_alone, slot, held, admitted

    ran_alone, slot, held, admitted = asyncio.run(scenario())
    assert slot is not ran_alone and not held, held  # no "closed" refusal from the round we ran alone
    assert admitted  # the request waited for our entry and joined the group we lead now


def test_adopting_another_history_withdraws_our_ready_records_of_the_rounds_we_entered():
    """A peer that ran rounds alone and then adopted the swarm's state enters those round numbers again.
    Its ready records from the history it left would tell the others it is ready for them (they would
    ask it to lead, or wait on it, before it is there): adopting withdraws them, each for longer than
    it lives, and the others' ready read skips them; entering the round again makes us ready again."""
    stores, submitted = [], []
    records = {}
    mm = _fake_matchmaker(records, announce=True)
    store = mm.node.astore

    async def astore(key, value, ttl, subkey):
        stores.append((key, value, ttl))
        await store(key, value, ttl, subkey)

    mm.node.astore, mm.node.submit = astore, submitted.append

    async def scenario():
        for round_ in (6, 7):  # rounds we ran alone
            a = await mm._enter(0, round_, expected=1, sync_step=None)
            a.hang_up()
        await asyncio.sleep(0.05)
        before = [await mm._ready_read(f"t:mm:0:{r}") for r in (6, 7)]
        mm.adopt_lineage(["g-swarm"])
        assert len(submitted) == 1
        await submitted[0]
        await asyncio.sleep(0.05)
        after = [await mm._ready_read(f"t:mm:0:{r}") for r in (6, 7)]
        again = await mm._enter(0, 6, expected=1, sync_step=None)  # round 6 of the adopted history
        again.hang_up()
        await asyncio.sleep(0.05)
        return before, after, await mm._ready_read("t:mm:0:6"), await mm._ready_read("t:mm:0:7")

    before, after, six, seven = asyncio.run(scenario())
    assert before == [{"me"}, {"me"}] and after == [set(), set()], (before, after)
    withdrawn = [(k, ttl) for k, v, ttl in stores if v.get("withdrawn")]
    assert sorted(k for k, _ in withdrawn) == ["t:mm:0:6", "t:mm:0:7"]
    assert all(ttl > 3 * mm.matchmaking_timeout - 1 for _, ttl in withdrawn)  # outlives the record it replaces
    assert six == {"me"} and seven == set()  # ready again for the round we entered again, not for the other
    mm.adopt_lineage(["g-other"])  # only the records stored since the last adoption are withdrawn again
    assert len(submitted) == 2
    submitted[1].close()


def test_a_joiner_waits_on_a_talking_leader_and_drops_a_silent_one(monkeypatch):
    """Our request's reader: 'wait' frames keep it waiting past SILENT_S until the group comes; a leader
    that says nothing for SILENT_S ends the request unanswered, marked silent."""
    import msgpack

    from p2pdiloco.swarm import joining
    from p2pdiloco.swarm.group import make_group_id
    from test_elastic_state import _Sink

    monkeypatch.setattr(joining, "SILENT_S", 0.2)
    mm = _fake_matchmaker({})
    gid = make_group_id("t", 0, 5, ["a", "me"], "")

    def frame(header):
        body = msgpack.packb(header)
        return len(body).to_bytes(4, "big") + body

    async def scenario(talking: bool):
        reader = asyncio.StreamReader()

        async def leader():
            for _ in range(8):  # 0.8 s: four times SILENT_S
                await asyncio.sleep(0.1)
                if talking:
                    reader.feed_data(frame({"t": "wait"}))
            reader.feed_data(frame({"t": "group", "gid": gid, "members": ["a", "me"], "base": ""}))

        async def open_stream(node, peer, handler, deadline, stats=None):
            return None, reader, _Sink()

        monkeypatch.setattr(joining, "open_stream", open_stream)
        feeding = asyncio.ensure_future(leader())
        watch = joining.JoinWatch()
        result = await mm._join("a", 0, 5, watch=watch)
        feeding.cancel()
        return result, watch

    (group, _), watch = asyncio.run(scenario(True))
    assert group is not None and group.members == ("a", "me") and not watch.silent
    result, watch = asyncio.run(scenario(False))
    assert result == (None, None) and watch.silent


def test_a_follower_whose_request_the_presumable_leader_holds_sends_askers_there_at_once():
    """z did not see the new peer a yet and asks us (the smallest id it knows); we already asked a (the
    smallest id: our presumable leader), which holds our request until its group closes. z is sent to a
    at once ("not leader", hint a): held until a's group closed, z would miss the round (a closes after
    its join grace)."""
    from p2pdiloco.swarm.protocol import read_frame
    from test_elastic_state import _ask_to_join

    records = {"t:progress": _due("a", "me", "z"), "t:mm:0:5": _ready("a", "z")}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=3.0)

    async def join(leader, frag, round_, due=None, timeout=None, watch=None):
        watch.taken.set()
        await asyncio.sleep(1.5)  # a gathers its group
        return _group(("a", "me", "z")), None

    mm._join = join

    async def scenario():
        forming = asyncio.ensure_future(mm.form_group(0, 5, 3, sync_step=100))
        await asyncio.sleep(0.2)  # our request to a is out: we defer to it
        asked = asyncio.get_running_loop().time()
        handler, reader, reply = await _ask_to_join(mm, "z")
        while not reply.data and asyncio.get_running_loop().time() - asked < 3:
            await asyncio.sleep(0.01)
        answered, formed_by_then = asyncio.get_running_loop().time() - asked, forming.done()
        reader.feed_eof()  # z read the answer and hangs up
        await asyncio.wait_for(handler, timeout=5)
        answer = asyncio.StreamReader()
        answer.feed_data(bytes(reply.data))
        answer.feed_eof()
        frame = (await read_frame(answer, 0, None, "me"))[0]
        return frame, answered, formed_by_then, await forming

    frame, answered, formed_by_then, group = asyncio.run(scenario())
    assert frame == {"t": "refuse", "reason": "not leader", "hint": "a"}
    assert not formed_by_then and answered < 1.0  # while a still gathers: z can still join it
    assert group.members == ("a", "me", "z")


def test_the_presumable_leader_changes_with_the_round_and_a_ground_id_leads_only_its_share():
    """Leadership goes by the tier, then a per-round draw of (round key, id), the same on every peer. An
    identity with the smallest id (anyone can grind keys for one) used to be every round's presumable
    leader; now each of 10 peers due is it in about a tenth of 600 rounds, and a peer's draw is the
    same whoever computes it. Tiers still come first: a private peer leads no round."""
    from p2pdiloco.swarm.formation import draw

    peers = ["1111111" + "A" * 38] + [f"Qm{c}" + "z" * 40 for c in "abcdefgh"]  # the first: the smallest id
    records = {"t:progress": _due(*peers, "me", private=peers[8])}
    mm = _fake_matchmaker(records)
    mm._draw = draw
    other = _fake_matchmaker(records)
    other._draw = draw
    mm._note_reach(records["t:progress"])
    other._note_reach(records["t:progress"])
    led = Counter()
    for round_ in range(600):
        key = mm._key(0, round_)
        first = min(peers + ["me"], key=mm._ranking(key))
        assert first == min(peers + ["me"], key=other._ranking(key))  # every peer computes the same leader
        led[first] += 1
    assert led[peers[8]] == 0  # private: never ahead of a public peer
    assert set(led) == set(peers[:8]) | {"me"}
    assert all(30 <= n <= 100 for n in led.values()), led  # a share of 1/9 is 67 of 600 rounds
    assert draw("t:mm:0:5", "a") == draw("t:mm:0:5", "a") != draw("t:mm:0:6", "a") and len(draw("t:mm:0:5", "a")) == 8


def test_an_identity_that_claims_to_be_due_and_slow_is_waited_for_in_fewer_and_fewer_rounds():
    """z claims every round that it is one step short of the sync at a crawl (0.001 steps/s): its ETA
    reaches past matchmaking_timeout, so a round that waits for it waits to the deadline and closes
    without it. After k such rounds in a row the next 2^(k-1) rounds do not wait for it (nobody unseen
    for the leader, the wait not extended): over 10 rounds it is waited for in rounds 0, 2, 5 (3 of 10,
    not 10). Once z is a member of one of our groups it is waited for again as anyone due."""
    def slow(p):
        return {"step": 99, "sps": 0.001, "next_sync": 100, "t": 1.0, "reach": "public"}

    records = {"t:progress": {"me": slow("me"), "z": slow("z")}}
    mm = _fake_matchmaker(records, announce=True, join_grace=0.1, matchmaking_timeout=0.3)
    seen: List[Dict[str, Any]] = []

    async def lead(slot, frag, round_, expected_joiners, unseen=frozenset(), due=None, skip=frozenset(), grace=None):
        seen.append({"round": round_, "unseen": set(unseen)})
        return _group(["me"], gid=f"lead-{round_}")

    mm._lead = lead
    deadlines: List[float] = []
    evaluate = mm._evaluate

    def recorded(a, read):
        evaluate(a, read)
        deadlines.append(a.deadline - a.start)

    mm._evaluate = recorded
    waited = []
    for round_ in range(10):
        deadlines.clear()
        asyncio.run(mm.form_group(0, round_, 2, sync_step=100))
        if max(deadlines) == pytest.approx(0.3):  # the fault: z's ETA held the round to the deadline
            assert seen[-1]["unseen"] == {"z"}
            waited.append(round_)
        else:
            assert max(deadlines) < 0.05 and seen[-1]["unseen"] == set(), (round_, deadlines, seen[-1])
    assert waited == [0, 2, 5], waited
    mm.set_companions(["me", "z"])  # z synced with us
    assert "z" not in mm._overdue
    asyncio.run(mm.form_group(0, 10, 2, sync_step=100))
    assert seen[-1]["unseen"] == {"z"}
