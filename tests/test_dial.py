"""A first dial that fails must not fail the round.

libp2p refuses to dial an address for ~5 s after a dial to it failed ("dial backoff"), so a round that
retried within it (at 0.3 and 0.6 s) would fail on every member. Each scenario runs three real SwarmNodes in
a fresh network namespace (tests/dial_support.py) where nftables breaks links; every fault asserts
that it fired (its rule's counter, the refused dial's error).

* backoff: a member's only address for an owner is in dial backoff when the round starts (shown by
  a plain dial right before it): the round waits it out and completes on every member.
* warm: a private member's first dial to an owner is refused while the group forms: the warm step
  waits out the backoff, the group forms with everyone and its round opens no cold connection.
* unreachable: two members cannot connect to each other: the larger one is left out *before* the round
  (one clear RoundMissed), the round completes for the others.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = [pytest.mark.netem]

HERE = os.path.dirname(os.path.abspath(__file__))
_missing = [tool for tool in ("ip",) if subprocess.run(["which", tool], capture_output=True).returncode]
needs_netns = pytest.mark.skipif(os.geteuid() != 0 or bool(_missing),
                                 reason="needs root and iproute2 (a network namespace of its own)")


@pytest.fixture(scope="module")
def nftables():
    """nftables, installed with apt-get when missing (root): CI starts from a fresh machine."""
    from nat_support import ensure_nft

    return ensure_nft()


def _run(scenario: str, tmp_path) -> dict:
    ns = f"p2pdd-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    err = tmp_path / f"{scenario}.err"
    try:
        with open(err, "w") as e:
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "dial_support.py"),
                                  scenario], stdout=subprocess.PIPE, stderr=e, text=True, timeout=150)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"scenario {scenario} failed (rc {out.returncode}):\n{err.read_text()[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = err.read_text()
    return result


def test_the_leader_leaves_out_the_member_in_most_unconnected_pairs_never_itself():
    from types import SimpleNamespace

    from p2pdiloco.swarm.matchmaking import Matchmaker

    node = SimpleNamespace(peer_id_str="a", add_handler=lambda *a: None, gate=SimpleNamespace(banned=lambda p: False))
    mm = Matchmaker(node, "t", matchmaking_timeout=5)
    mm._draw = lambda key, peer: b""  # rank by id alone here
    members = ("a", "b", "c", "d")
    mm._left_out = functools.partial(mm._left_out, round_key="t:mm:0:1")
    assert mm._left_out(members, {"a": set(), "b": set(), "c": set(), "d": set()}) == {}
    # d reaches nobody: only d goes (3 pairs), not the peers it names
    assert set(mm._left_out(members, {"a": set(), "b": set(), "c": set(), "d": {"a", "b", "c"}})) == {"d"}
    # b and c cannot reach each other: a tie, the worse rank (here: id) goes; the leader is never removed
    assert set(mm._left_out(members, {"a": set(), "b": {"c"}, "c": {"b"}, "d": set()})) == {"c"}
    assert set(mm._left_out(members, {"a": {"b"}, "b": set(), "c": set(), "d": set()})) == {"b"}
    # a joiner that sent no report is out; its pairs do not count against others
    left = mm._left_out(members, {"a": set(), "b": None, "c": {"b"}, "d": set()})
    assert set(left) == {"b"} and "did not answer" in left["b"]
    # a private member loses a tie against a public owner
    mm._reach.update(b="private")
    assert set(mm._left_out(members, {"a": set(), "b": {"c"}, "c": set(), "d": set()})) == {"b"}


@pytest.mark.timeout(200, func_only=True)
@needs_netns
def test_a_round_that_starts_with_an_owner_in_dial_backoff_completes(tmp_path, nftables):
    r = _run("backoff", tmp_path)
    assert r["hits"] >= 1 and "connection refused" in r["first"], r["first"]  # the fault fired
    assert "dial backoff" in r["second"], r["second"]  # and the round starts with the address in backoff
    outs = r["outs"]
    assert all(o["ok"] for o in outs), outs
    assert len({o["sum"] for o in outs}) == 1 and all(o["members"] == 3 for o in outs), outs
    assert r["b_stats"].get("dial_retries", 0) >= 1 and r["b_dials"].get("dial_recovered", 0) >= 1, r
    assert r["seconds"] < 15, r["seconds"]  # one backoff (~5 s), well within the round's 20 s timeout
    assert "dial backoff (libp2p refuses to dial an address" in r["log"]  # the cause is logged


@pytest.mark.timeout(200, func_only=True)
@needs_netns
def test_the_group_warms_its_links_before_the_round_and_waits_out_a_refused_first_dial(tmp_path, nftables):
    r = _run("warm", tmp_path)
    assert r["fired"], "the refusing rule never fired"
    groups = r["groups"]
    assert all(isinstance(g, list) and len(g) == 3 for g in groups) and len({tuple(g) for g in groups}) == 1, groups
    assert all(r["x"] not in o for o in r["owners"])  # the private member owns nothing
    x = r["ids"].index(r["x"])  # the scenario's node order (dial stats are in it), not the members'
    assert r["dials"][x].get("dial_failed", 0) >= 1 and r["dials"][x].get("dial_recovered", 0) >= 1, r["dials"]
    outs = r["outs"]
    assert all(o["ok"] for o in outs) and len({o["sum"] for o in outs}) == 1, outs
    # the round started on open connections: no stream open of the all-reduce had to wait for a dial
    assert all(s.get("dial_retries", 0) == 0 for s in r["stats"]), r["stats"]
    assert r["formed"] < 15, r["formed"]


@pytest.mark.timeout(200, func_only=True)
@needs_netns
def test_a_member_the_others_cannot_reach_is_left_out_before_the_round(tmp_path, nftables):
    r = _run("unreachable", tmp_path)
    assert r["hits"] >= 1, "the dropping rules never fired"
    ids, groups = r["ids"], r["groups"]
    leader, x, y = ids  # by rank: the leader reaches both, x and y cannot reach each other
    assert groups[0] == groups[1] == sorted([leader, x]), groups  # the worse-ranked of the tied pair is left out
    assert isinstance(groups[2], str) and groups[2].startswith("RoundMissed: left out of the group"), groups[2]
    assert x[-6:] in groups[2]  # it says whom it could not be connected with
    outs = r["outs"]
    assert len(outs) == 2 and all(o["ok"] and o["members"] == 2 for o in outs) and outs[0]["sum"] == outs[1]["sum"]
    assert all(s.get("dial_retries", 0) == 0 for s in r["stats"]), r["stats"]
    assert r["formed"] < 20, r["formed"]  # the link check is bounded (warm_timeout 3 s here)


def _simultaneous_dials(tmp_path, reuseport: str, trials: int = 3) -> dict:
    """Two SwarmNodes on an emulated WAN link (50 ms each way) dial each other at the same instant,
    ``trials`` times (tests/simdial_support.py); LIBP2P_TCP_REUSEPORT as given ("" = our default)."""
    from p2pdiloco.bench.wan import EmulatedWAN, LinkSpec

    env = dict(os.environ)
    env.pop("LIBP2P_TCP_REUSEPORT", None)
    if reuseport:
        env["LIBP2P_TCP_REUSEPORT"] = reuseport
    folder = tmp_path / f"sim-{reuseport or 'default'}"
    folder.mkdir()
    script = os.path.join(HERE, "simdial_support.py")
    with EmulatedWAN(2, LinkSpec(10, 50, 0, 0)) as wan:
        a, b = wan.hosts
        procs = [h.popen([sys.executable, script, me, other, h.address, str(folder), str(trials)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
                 for h, me, other in ((a, "A", "B"), (b, "B", "A"))]
        outs = [p.communicate(timeout=150) for p in procs]
    results = []
    for (out, err), p in zip(outs, procs):
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"simultaneous-dial peer failed (rc {p.returncode}):\n{err[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return {"ok": sum(r["ok"] for r in results), "failed": [f for r in results for f in r["failed"]]}


@pytest.mark.timeout(400, func_only=True)
@needs_netns
def test_two_peers_dialing_each_other_at_once_both_connect(tmp_path):
    """The first-dial failure of the emulated WAN benchmark: both ends of a pair dial each other at the
    same moment (keeping links open, warming a group), and with libp2p's TCP reuseport the two SYNs
    join into one TCP connection in which both daemons start the handshake as initiator: both dials
    fail ("failed to negotiate security protocol") and leave both addresses in dial backoff. Shown
    with reuseport forced on (the fault: it must fire), then with our default (node.no_tcp_reuseport)."""
    forced = _simultaneous_dials(tmp_path, "true")
    assert forced["failed"], f"with reuseport every simultaneous dial connected: the fault did not fire {forced}"
    assert any("security protocol" in f or "backoff" in f for f in forced["failed"]), forced["failed"]
    ours = _simultaneous_dials(tmp_path, "")
    print(f"\nsimultaneous dials: with reuseport {len(forced['failed'])} of "
          f"{forced['ok'] + len(forced['failed'])} failed; ours {len(ours['failed'])} of {ours['ok'] + len(ours['failed'])}")
    assert not ours["failed"] and ours["ok"] == 6, ours


def test_a_peer_that_answers_without_the_protocol_is_not_a_failed_dial():
    """A reachable peer without the handler (an old version, a fake identity serving nothing) says so at
    once: open_stream must not wait it out as if the dial had failed (a joiner facing identities that
    claim a state nobody serves would lose the stream timeout on each)."""
    from p2pdiloco.swarm.dialing import _is_dial_error

    assert not _is_dial_error(Exception("Connect failed. msg=failed to negotiate protocol: protocols not supported: "
                                        "[p2pdiloco.run.state]"))
    assert _is_dial_error(Exception("Connect failed. msg=all dials failed [/ip4/10.0.0.2/tcp/1] dial backoff"))
    assert _is_dial_error(Exception("failed to dial: no addresses"))
