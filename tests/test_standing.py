"""Whose claims count (swarm/standing.py) and the majority rule of state_sync.pick_target, as tables."""
from __future__ import annotations

import pytest

from p2pdiloco.swarm.standing import Partners, established, in_minority, pick_target, rival_lineage, voters

D, E = "a" * 16, "b" * 16


def rec(step, digest=D, gid="g"):
    return {"synced_step": step, "digest": digest, "gid": gid}


def test_voters_are_live_partners_else_established_identities():
    peers = {"p1": rec(5), "p2": rec(5), "s1": rec(9, gid="g-fake"), "new": {"synced_step": 0, "digest": D}}
    assert voters(peers, "me", partners={"p1", "p2", "gone"}) == {"p1", "p2"}
    assert voters(peers, "me", partners={"gone"}) == {"p1", "p2", "s1"}  # no live partner: the joiner's rule
    assert established(peers, "me") == {"p1", "p2", "s1"}  # "new" names no group of its own
    assert voters(dict(peers, me=rec(5)), "me", partners={"me"}) == {"p1", "p2", "s1"}  # never ourselves


def test_partners_are_forgotten_after_the_memory_and_bounded():
    p = Partners(memory=10.0)
    p.add(["a", "b"], now=100.0)
    p.add(["b"], now=105.0)
    assert p.current(now=109.0) == {"a", "b"}
    assert p.current(now=112.0) == {"b"}  # a: last shared round 12 s ago
    p.add(["", None, 3], now=112.0)  # junk ignored
    assert p.current(now=112.0) == {"b"}


# (case, records, trusted, min_step, expected target step or None)
TARGETS = [
    ("one other voter: its claim is enough", {"a": rec(20)}, None, 10, 20),
    ("two voters agree, both ahead", {"a": rec(20), "b": rec(20)}, None, 10, 20),
    ("two of five voters far ahead: a minority moves nobody",
     {"a": rec(2 ** 60, E), "b": rec(2 ** 60, E), "c": rec(10), "d": rec(10), "e": rec(10)}, None, 10, None),
    ("three of five ahead: a strict majority",
     {"a": rec(20), "b": rec(20), "c": rec(20), "d": rec(10), "e": rec(10)}, None, 10, 20),
    ("the furthest state a majority passed, not the furthest claimed",
     {"a": rec(30, E), "b": rec(30, E), "c": rec(20), "d": rec(20), "e": rec(20)}, None, 10, 20),
    ("a lone far claim beside one agreeing pair", {"a": rec(99, E), "b": rec(20), "c": rec(20)}, None, 10, 20),
    ("non-voters claim anything: ignored",
     {"s1": rec(2 ** 60, E), "s2": rec(2 ** 60, E), "s3": rec(2 ** 60, E), "a": rec(10), "b": rec(10)},
     {"a", "b"}, 10, None),
    ("identities without a history are no joiner's voters",
     {"s1": rec(50, E, ""), "s2": rec(50, E, ""), "a": rec(20), "b": rec(20)}, None, 10, 20),
]


@pytest.mark.parametrize("case,peers,trusted,min_step,expected", TARGETS, ids=[t[0] for t in TARGETS])
def test_pick_target_follows_a_majority_of_voters(case, peers, trusted, min_step, expected):
    got = pick_target(peers, "me", min_step, trusted=trusted)
    assert (got[0] if got else None) == expected, got
    if got:  # the donors are voters that claim exactly the target
        assert all(peers[d]["synced_step"] == got[0] and peers[d]["digest"] == got[1] for d in got[2])
        assert trusted is None or set(got[2]) <= trusted


def test_companions_missing_from_a_read_still_count_against_a_minority():
    peers = {"a": rec(50, E), "b": rec(50, E), "c": rec(10)}
    assert pick_target(peers, "me", 10, trusted={"a", "b", "c"})[0] == 50  # 2 of 3 voters
    # two more partners of our last group, whose records this read missed: 2 of 5 are not a majority
    assert pick_target(peers, "me", 10, trusted={"a", "b", "c"}, companions={"d", "f"}) is None


def test_minority_digest_and_rival_histories_count_voters_only():
    peers = {"s1": rec(10, E, "g-x"), "s2": rec(10, E, "g-x"), "s3": rec(10, E, "g-x"), "a": rec(10, D, "g-us")}
    assert in_minority(peers, "me", 10, D)  # the joiner's rule counts the established fakes
    assert not in_minority(peers, "me", 10, D, trusted={"a"})
    assert rival_lineage(peers, "me", {"g-us"}, 10, D) is not None
    assert rival_lineage(peers, "me", {"g-us"}, 10, D, trusted={"a"}) is None
