"""Private peers behind a real NAT train as full members, through the real CLI.

Topology (tests/nat_support.py): a bootstrap peer and two public volunteers a, b on a public bridge;
a router namespace masquerading (nftables, connection tracking, inbound dropped) for a private LAN
with volunteers c, d and, later, e. Nobody forwards a port; every peer runs ``swarm.reachability =
auto``. Shown, in order:

1. control: the NAT is in effect. A listener on a private host is up (the router reaches it from the
   LAN side), a public host with a route to the LAN cannot connect to it, a private host can connect
   out, and the public side sees the router's address (masquerading). Without the NAT this fails;
2. every peer detected its reachability (a, b public with a full DHT node; c, d private with a DHT
   client only) and ``status`` run on a public host lists all four with it;
3. a, b, c, d train together: every sync gives every peer one digest; every round a public peer
   completed was completed by each private peer alive then, with the same digest, its own samples
   as weight and full coverage (every shard's mean covers its part);
4. d is SIGKILLed (fault injection, by its own pid) after sending a part mid-round: the fault fired
   once, the others go on as a group of three and agree;
5. e joins mid-run behind the NAT: it downloads the state from public donors only, digest-verified,
   and then syncs with the others, in every later round;
6. once both public peers have left, the private peers' rounds fail at once with one clear message
   (no public peer to lead and reduce), never a hang.

Runs in about 80 s on an idle 2-core machine: in the default suite (marker ``netem``: root only).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from elastic_support import (NsPeers, digests_by_sync, faults_env, join_args, ns_cli, ok_syncs, read_events,
                             wait_for)

pytestmark = [pytest.mark.netem]

H = 20
KILL_ROUND = 7
_missing = [tool for tool in ("ip", "tc") if subprocess.run(["which", tool], capture_output=True).returncode]


def _peer_id(run_dir):
    starts = read_events(run_dir, "start")
    return starts[0]["peer"] if starts else None


@pytest.mark.timeout(420)
@pytest.mark.skipif(os.geteuid() != 0 or bool(_missing), reason="needs root and iproute2 (ip netns) for the NAT")
def test_private_peers_behind_a_real_nat_train_as_full_members(tmp_path):
    from nat_support import NatNet

    peers = NsPeers(tmp_path)
    dirs = {n: tmp_path / n for n in "abcde"}
    with NatNet(n_public=3, n_private=3) as net:
        h0, h1, h2 = net.public
        p0, p1, p2 = net.private

        # 1. control: the NAT really keeps inbound connections out
        lp = net.listen(p0, "0.0.0.0", tmp_path / "listen_private.out")
        port = int(wait_for(lambda: next((l.split()[1] for l in (tmp_path / "listen_private.out").read_text()
                                          .splitlines() if l.startswith("PORT")), None), 30, "the private listener"))
        assert net.can_connect(net.router, p0.address, port), "the private listener is not up"
        assert not net.can_connect(h1, p0.address, port, timeout=2), \
            "a public host opened a connection into the private LAN: the NAT is not in effect"
        lh = net.listen(h1, "0.0.0.0", tmp_path / "listen_public.out")
        port = int(wait_for(lambda: next((l.split()[1] for l in (tmp_path / "listen_public.out").read_text()
                                          .splitlines() if l.startswith("PORT")), None), 30, "the public listener"))
        assert net.can_connect(p0, h1.address, port), "a private host cannot connect out through the router"
        seen = wait_for(lambda: [l.split()[1] for l in (tmp_path / "listen_public.out").read_text().splitlines()
                                 if l.startswith("FROM")], 10, "the public listener to see the connection")
        assert seen == [net.router.address], f"not masqueraded: the public side saw {seen}"
        for p in (lp, lh):
            p.kill()
            p.wait(10)

        # 2. a swarm: bootstrap + a, b public, c, d private (d is killed mid-round later), all auto
        # (a bootstrap that does not relay: private peers stay private; test_relay.py has the relayed ones)
        boot = peers.start(h0, "boot", "bootstrap", "--identity", str(tmp_path / "boot.key"), "--no-relay",
                           "--host-maddrs", f"/ip4/{h0.address}/tcp/0")
        addr = wait_for(lambda: next((l.strip() for l in (tmp_path / "boot.out").read_text().splitlines()
                                      if h0.address in l and "/p2p/" in l), None), 90, "the bootstrap address")
        settings = ["swarm.run_id=nat", f"inner.sync_every={H}", "train.max_outer_steps=1000",
                    "swarm.min_peers_to_start=4"]
        kill = faults_env({"phase": "allreduce.part_sent", "action": "kill", "frag": 0, "round": KILL_ROUND})

        def start(host, name, env=None):
            return peers.start(host, name, *join_args(addr, dirs[name], *settings,
                                                      f"swarm.host_maddrs=/ip4/{host.address}/tcp/0"), env=env)

        start(h1, "a")
        start(h2, "b")
        start(p0, "c")
        d = start(p1, "d", env=kill)
        wait_for(lambda: all(len([r for r in ok_syncs(dirs[n]) if r["group_size"] == 4]) >= 3 for n in "abcd"),
                 180, "four-peer syncs", peers, list("abcd"))
        ids = {n: _peer_id(dirs[n]) for n in "abcd"}
        for n, reach, dht in (("a", "public", "node serving others"), ("b", "public", "node serving others"),
                              ("c", "private", "client only"), ("d", "private", "client only")):
            assert f"reachability: {reach}" in peers.err(n) and f"DHT {dht}" in peers.err(n), peers.err(n)[-2000:]
        # status, read on a public host from the DHT the private peers write to as clients
        t0 = time.time()
        status = h1.run(ns_cli("status", "--initial-peers", addr, "--run-id", "nat", "--json"), timeout=60,
                        cwd=str(tmp_path))
        took = time.time() - t0
        listed = {pid: v.get("reach") for pid, v in json.loads(status.stdout).items()}
        assert {ids[n]: listed.get(ids[n]) for n in "abcd"} == {
            ids["a"]: "public", ids["b"]: "public", ids["c"]: "private", ids["d"]: "private"}, listed
        assert took < 30, f"status took {took:.1f} s"
        table = h1.run(ns_cli("status", "--initial-peers", addr, "--run-id", "nat"), timeout=60, cwd=str(tmp_path))
        assert "reach" in table.stdout and "private" in table.stdout and "public" in table.stdout, table.stdout

        # 4. d is SIGKILLed mid-round (by its own pid, from its fault hook): the others go on
        assert peers.wait(d, 180) == -signal.SIGKILL, peers.err("d")[-3000:]
        t_kill = time.time()
        fired = read_events(dirs["d"], "fault")
        assert [(f["phase"], f["action"], f["round"], f["count"]) for f in fired] == [
            ("allreduce.part_sent", "kill", KILL_ROUND, 1)], fired
        assert not read_events(dirs["d"], "summary")  # it really died there
        wait_for(lambda: all(len([r for r in ok_syncs(dirs[n]) if r["time"] > t_kill and r["group_size"] == 3]) >= 2
                             for n in "abc"), 120, "syncs of a, b, c after the kill", peers, list("abc"))

        # 5. e joins mid-run from behind the NAT
        t_join = time.time()
        e = start(p2, "e")
        wait_for(lambda: len([r for r in ok_syncs(dirs["e"]) if r["group_size"] == 4]) >= 3, 180,
                 "the private joiner's syncs", peers, ["e", "a"])
        ids["e"] = _peer_id(dirs["e"])
        assert "reachability: private" in peers.err("e"), peers.err("e")[-2000:]
        # 6. the public peers leave: the private ones cannot form a group, and say so at once
        for n in ("a", "b"):
            p = peers.procs[n]
            p.send_signal(signal.SIGTERM)
            assert peers.wait(p, 60) == 0, peers.err(n)[-3000:]
        t_public_gone = time.time()

        def no_public(n):
            return [r for r in read_events(dirs[n], "sync") if r["time"] > t_public_gone and not r["ok"]
                    and "no public peer is ready" in (r.get("error") or "")]

        wait_for(lambda: no_public("c") and no_public("e"), 90, "the private peers' 'no public peer' failures",
                 peers, ["c", "e"])
        for n in ("c", "e"):
            assert all(r["sync_seconds"] < 15 for r in no_public(n)), no_public(n)  # not a timeout
            p = peers.procs[n]
            p.send_signal(signal.SIGTERM)
            assert peers.wait(p, 60) == 0, peers.err(n)[-3000:]
        boot.send_signal(signal.SIGTERM)
        boot.wait(30)

    # 3. one digest per sync, on every peer that completed it
    table = digests_by_sync(dirs.values())
    for key, per_peer in sorted(table.items()):
        assert len(set(per_peer.values())) == 1, f"peers disagree after sync (fragment, step) {key}: {per_peer}"
    # every round a public peer completed, each private peer alive then completed with it: same digest,
    # same group, its own samples in, full coverage
    a_syncs = ok_syncs(dirs["a"])
    first4 = min(r["time"] for r in a_syncs if r["group_size"] == 4)
    e_first = min(r["time"] for r in ok_syncs(dirs["e"]))
    windows = {"c": (first4, float("inf")), "d": (first4, t_kill - 1), "e": (e_first, float("inf"))}
    d_last = max((r["time"] for r in ok_syncs(dirs["d"])), default=0)
    checked = 0
    for r in a_syncs:
        for n, (lo, hi) in windows.items():
            if not lo <= r["time"] <= hi or (n == "d" and r["time"] > d_last + 1):
                continue
            mine = {(s["fragment"], s["step"]): s for s in ok_syncs(dirs[n])}.get((r["fragment"], r["step"]))
            assert mine is not None, f"{n} (private) is missing from the round at step {r['step']} that a completed"
            assert mine["digest"] == r["digest"] and mine["group_size"] == r["group_size"], (mine, r)
            assert mine["samples"] > 0 and mine.get("coverage", "full") == "full" == r.get("coverage", "full"), (mine, r)
            checked += 1
    assert checked >= 10, checked
    # the round of the kill was abandoned (or completed) alike by the survivors
    crash = {n: [s for s in read_events(dirs[n], "sync") if s["outer_step"] - 1 == KILL_ROUND] for n in "abc"}
    oks = {n: [s["ok"] for s in v] for n, v in crash.items()}
    assert len({tuple(v) for v in oks.values()}) == 1, crash
    # the joiner adopted verified state from public donors only
    caught = read_events(dirs["e"], "catch_up")
    assert caught, "the private joiner never downloaded the swarm's state"
    assert set(caught[0]["donors"]) <= {ids["a"], ids["b"]}, (caught[0]["donors"], ids)
    assert caught[0]["digest"] == {(s["fragment"], s["step"]): s["digest"] for s in a_syncs}.get(
        (0, caught[0]["step"]), caught[0]["digest"])
    e_ok = [s for s in ok_syncs(dirs["e"])]
    assert e_ok and all(s["time"] > t_join for s in e_ok)
