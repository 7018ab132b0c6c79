"""Home volunteers only: private peers behind two different NATs train together, with no public
trainer, through the real CLI: directly after a hole punch where their routers
keep a socket's port, through the bootstrap's relay where they do not.

Topology (tests/nat_support.py): a bootstrap on a public bridge; two routers, each masquerading
(nftables, connection tracking, inbound dropped) for its own LAN with one volunteer. Nobody forwards a
port, nobody sets an address or a reachability: both volunteers run ``join --initial-peers <bootstrap>``.
Shown: the NATs are in effect (neither volunteer can open a connection to the other, nor the bootstrap
to either); each volunteer is detected private and takes a slot on the bootstrap's relay (``relayed``);
every round is a group of the two with one digest after every sync. Which path their all-reduce took is
read from their metrics: the bytes their relayed streams carried stop growing once the hole is punched
(ports kept), and grow to the end when the routers pick random ports (the punch failed, logged);
``status`` shows both as relayed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from elastic_support import NsPeers, assert_agree, join_args, ns_cli, ok_syncs, read_events, wait_for

pytestmark = [pytest.mark.netem]

H = 20
_missing = [tool for tool in ("ip",) if subprocess.run(["which", tool], capture_output=True).returncode]


@pytest.mark.timeout(360)
@pytest.mark.skipif(os.geteuid() != 0 or bool(_missing), reason="needs root and iproute2 (ip netns) for the NATs")
@pytest.mark.parametrize("ports", ["kept", "random"])
def test_private_peers_behind_two_nats_train_together_punched_or_relayed(tmp_path, ports):
    from nat_support import NatNet

    peers = NsPeers(tmp_path)
    dirs = {n: tmp_path / n for n in "ab"}
    with NatNet(n_public=1, n_private=2, routers=2, ports=ports) as net:
        (h0,), (pa, pb) = net.public, net.private
        assert net.behind[0] is not net.behind[1]

        # control: each NAT keeps inbound connections out, from the other home and from the public side
        lp = net.listen(pb, "0.0.0.0", tmp_path / "listen_b.out")
        port = int(wait_for(lambda: next((l.split()[1] for l in (tmp_path / "listen_b.out").read_text()
                                          .splitlines() if l.startswith("PORT")), None), 30, "b's listener"))
        assert net.can_connect(net.behind[1], pb.address, port), "b's listener is not up"
        assert not net.can_connect(pa, pb.address, port, timeout=2), "a opened a connection into b's home"
        assert not net.can_connect(h0, pb.address, port, timeout=2), "the public side reached into b's home"
        lp.kill()
        lp.wait(10)

        boot = peers.start(h0, "boot", "bootstrap", "--identity", str(tmp_path / "boot.key"),
                           "--host-maddrs", f"/ip4/{h0.address}/tcp/31337")  # and UDP 31337: QUIC
        addr = wait_for(lambda: next((l.strip() for l in (tmp_path / "boot.out").read_text().splitlines()
                                      if h0.address in l and "/tcp/" in l and "/p2p/" in l), None), 90,
                        "the bootstrap address")
        settings = ["swarm.run_id=homes", f"inner.sync_every={H}", "train.max_outer_steps=40",
                    "swarm.min_peers_to_start=2"]
        # both peers paced 4x slower: the run must outlast the two status reads below (each starts a DHT
        # client; unpaced, 40 rounds take ~13 s on an idle machine and a peer could say goodbye before the
        # second read), and against random ports the failed punch that each peer logs only once its
        # attempt's window is over (several seconds after it was relayed)
        pace = {"P2PDILOCO_FAULTS": json.dumps({"phase": "step", "action": "slow", "factor": 4, "times": 0})}
        for host, n in ((pa, "a"), (pb, "b")):
            peers.start(host, n, *join_args(addr, dirs[n], *settings), env=pace)
        wait_for(lambda: all(len(ok_syncs(dirs[n])) >= 2 for n in "ab"), 200, "relayed syncs", peers, ["a", "b"])
        status = h0.run(ns_cli("status", "--initial-peers", addr, "--run-id", "homes", "--json"), timeout=60,
                        cwd=str(tmp_path))
        listed = {pid: v.get("reach") for pid, v in json.loads(status.stdout).items()}
        relayed_bytes = {pid: v.get("rb") for pid, v in json.loads(status.stdout).items()}
        table = h0.run(ns_cli("status", "--initial-peers", addr, "--run-id", "homes"), timeout=60, cwd=str(tmp_path))
        for n in "ab":
            assert peers.wait(peers.procs[n], 240) == 0, peers.err(n)[-3000:]
        boot.send_signal(signal.SIGTERM)
        boot.wait(30)

    ids = {n: read_events(dirs[n], "start")[0]["peer"] for n in "ab"}
    assert {ids[n]: listed.get(ids[n]) for n in "ab"} == {ids["a"]: "relayed", ids["b"]: "relayed"}, listed
    assert all(isinstance(relayed_bytes.get(ids[n]), int) and relayed_bytes[ids[n]] > 0 for n in "ab"), relayed_bytes
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert all(" relayed " in rows[ids[n][-6:]] for n in "ab") and "relayed" in table.stdout.splitlines()[0], table.stdout
    for n in "ab":
        err = peers.err(n)
        assert "reachability: private" in err and "relayed through" in err, err[-2000:]
        syncs = read_events(dirs[n], "sync")
        assert len(syncs) == 40 and all(r["ok"] and r["group_size"] == 2 for r in syncs), \
            [(r["step"], r["ok"], r["group_size"], r.get("error")) for r in syncs]
        assert "injected fault: slow at step" in err, err[-2000:]  # the pacing fired
        assert syncs[0]["relayed_bytes"] > 0, syncs[0]  # its first streams went through the relay
        half = syncs[len(syncs) // 2]["relayed_bytes"]
        if ports == "kept":  # punched: the second half of the run moved nothing through the relay
            assert "hole punched to" in err, err[-3000:]
            assert syncs[-1]["relayed_bytes"] == half, [r["relayed_bytes"] for r in syncs]
        else:  # the punch fails against random ports; every round keeps crossing the relay
            assert "hole punch to" in err and "failed" in err, err[-3000:]
            assert "hole punched to" not in err, err[-3000:]
            assert syncs[-1]["relayed_bytes"] > half, [r["relayed_bytes"] for r in syncs]
    assert assert_agree([dirs["a"], dirs["b"]], min_common=40) == 40


# ---- the relay's rules, in process (real nodes on 127.0.0.1) ---------------------------------------------
LOOP = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def relayed():
    """A relay R and two peers configured private, both holding a slot on R."""
    from p2pdiloco.swarm.node import SwarmNode
    from p2pdiloco.swarm.relay import RelayLimits

    r = SwarmNode([], host_maddrs=LOOP, relay=RelayLimits(max_reservations=3, max_circuits=2,
                                                          max_circuit_bytes=5_000_000))
    nodes = [r]
    try:
        for _ in range(2):
            nodes.append(SwarmNode(r.visible_maddrs(), host_maddrs=LOOP, reachability="private"))
        yield nodes
    finally:
        for n in nodes:
            n.shutdown()


def _echo_handler(seen):
    import asyncio

    from p2pdiloco.swarm.protocol import read_frame, write_frame

    async def echo(info, reader, writer):
        header, payload = await read_frame(reader, 1 << 28)
        seen.append(info.peer_id.to_base58())
        await write_frame(writer, {"t": "echo"}, payload)
        await asyncio.sleep(0.1)
        writer.close()
    return echo


def _call(node, peer, payload: bytes, handler="p2pdiloco.t.echo"):
    import asyncio

    from p2pdiloco.swarm.dialing import open_stream
    from p2pdiloco.swarm.protocol import read_frame, write_frame

    async def go():
        _, reader, writer = await open_stream(node, peer, handler, asyncio.get_running_loop().time() + 5)
        try:
            await write_frame(writer, {"t": "hi"}, payload)
            return (await asyncio.wait_for(read_frame(reader, 1 << 28), 10))[1]
        finally:
            writer.close()
    return node.call(go(), timeout=30)


@pytest.mark.timeout(120)
def test_a_relay_forwards_to_reserved_peers_names_the_caller_and_enforces_its_limits(relayed):
    import asyncio

    from hivemind.p2p import PeerID

    from p2pdiloco.swarm import relay
    from p2pdiloco.swarm.protocol import PROTOCOL_VERSION, read_frame, write_frame

    r, a, b = relayed
    assert (a.reachability, a.via, b.reachability, b.via) == ("relayed", r.peer_id_str, "relayed", r.peer_id_str)
    seen = []
    b.add_handler("p2pdiloco.t.echo", _echo_handler(seen))
    a.relay_routes[b.peer_id_str] = r.peer_id_str
    before = r.relay_server.stats["bytes"]
    assert _call(a, b.peer_id_str, b"x" * 1_000_000) == b"x" * 1_000_000
    assert seen == [a.peer_id_str]  # b's handler saw a as the caller, not the relay
    assert r.relay_server.stats["bytes"] - before >= 2_000_000 and b.relay_stats["inbound"] >= 1

    def ask(header):
        async def go():
            _, reader, writer = await a.p2p.call_binary_stream_handler(PeerID.from_base58(r.peer_id_str),
                                                                       relay.HANDLER)
            try:
                await write_frame(writer, dict(header, v=PROTOCOL_VERSION))
                return (await asyncio.wait_for(read_frame(reader, 0), 10))[0]
            finally:
                writer.close()
        return a.call(go(), timeout=20)

    # only to peers holding a slot, only to p2pdiloco handlers
    assert "no reservation" in ask({"t": "fwd", "to": r.peer_id_str, "h": "p2pdiloco.t.echo"})["reason"]
    assert ask({"t": "fwd", "to": b.peer_id_str, "h": "/ipfs/ping/1.0.0"})["reason"] == "malformed forward"
    # a stream over the per-stream byte limit is cut: the reply never comes back whole
    with pytest.raises((ConnectionError, EOFError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError)):
        _call(a, b.peer_id_str, b"y" * 6_000_000)
    assert r.relay_server.stats["refused: circuit over its byte limit"] >= 1
    # a renewal keeps a's slot; with the cap at the slots held, a newcomer is refused and stays private
    assert a.call(relay.reserve(a, r.peer_id_str), timeout=20) is None
    r.relay_server.limits.max_reservations = 2
    from p2pdiloco.swarm.node import SwarmNode

    c = SwarmNode(r.visible_maddrs(), host_maddrs=LOOP, reachability="private")
    try:
        assert c.reachability == "private" and not c.via  # refused: it stays private, and says so
    finally:
        c.shutdown()
        r.relay_server.limits.max_reservations = 3


@pytest.mark.timeout(60)
def test_only_our_relay_may_hand_us_a_stream(relayed):
    """The inbound side names the caller on the relay's word: a peer that is not our relay is refused."""
    import asyncio

    from hivemind.p2p import PeerID

    from p2pdiloco.swarm import relay
    from p2pdiloco.swarm.protocol import PROTOCOL_VERSION, read_frame, write_frame

    r, a, b = relayed
    seen = []
    b.add_handler("p2pdiloco.t.echo2", _echo_handler(seen))

    async def impersonate():  # a claims to be r, forwarding a stream "from" r
        _, reader, writer = await a.p2p.call_binary_stream_handler(PeerID.from_base58(b.peer_id_str), relay.INBOUND)
        try:
            await write_frame(writer, {"t": "in", "v": PROTOCOL_VERSION, "from": r.peer_id_str, "h": "p2pdiloco.t.echo2"})
            return (await asyncio.wait_for(read_frame(reader, 0), 10))[0]
        finally:
            writer.close()

    assert a.call(impersonate(), timeout=20) == {"t": "refuse", "reason": "not our relay"}
    assert seen == []


@pytest.mark.timeout(60)
def test_a_caller_holding_its_share_of_circuits_is_refused_and_others_are_not(relayed):
    """Silent streams through a relay use up their caller's share (max_circuits_per_caller), not the
    relay: while a holds its share, a's next stream is refused and b's goes through."""
    from p2pdiloco.swarm.relay import open_relayed

    r, a, b = relayed
    seen = []
    b.add_handler("p2pdiloco.t.echo3", _echo_handler(seen))
    a.add_handler("p2pdiloco.t.echo3", _echo_handler(seen))
    b.relay_routes[a.peer_id_str] = r.peer_id_str
    r.relay_server.limits.max_circuits_per_caller, r.relay_server.limits.max_circuits = 2, 8

    async def open_one():
        return await open_relayed(a, r.peer_id_str, b.peer_id_str, "p2pdiloco.t.echo3", timeout=5)

    held = [a.call(open_one(), timeout=20) for _ in range(2)]  # silent: nothing sent on them
    try:
        with pytest.raises(ConnectionError, match="relay busy for this caller"):
            a.call(open_one(), timeout=20)
        assert _call(b, a.peer_id_str, b"still served", handler="p2pdiloco.t.echo3") == b"still served"
        assert seen == [b.peer_id_str]
    finally:
        for _, _, w in held:
            w.close()
        r.relay_server.limits.max_circuits_per_caller, r.relay_server.limits.max_circuits = 16, 2


# ---- hole punching's inputs ---------------------------------------------------------------------------------
def test_quic_twins_and_punchable_addresses():
    from p2pdiloco.addresses import punchable, with_quic

    pid = "12D3KooWLAPTmwJ35V6oejXDxyodgqzi9EAn9ZChLsRTnFPkDg4E"
    assert with_quic([f"/ip4/10.0.0.1/tcp/31337/p2p/{pid}"]) == [
        f"/ip4/10.0.0.1/tcp/31337/p2p/{pid}", f"/ip4/10.0.0.1/udp/31337/quic-v1/p2p/{pid}"]
    assert with_quic(["/ip4/0.0.0.0/tcp/31337"]) == ["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1"]
    # loopback stays TCP only; a UDP address already listed is not doubled
    assert with_quic(["/ip4/127.0.0.1/tcp/5"]) == ["/ip4/127.0.0.1/tcp/5"]
    assert with_quic(["/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/udp/2/quic-v1"]) == [
        "/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/udp/2/quic-v1"]
    # a punch aims only at QUIC addresses without a relay hop, at most four, from whatever a peer sent
    got = punchable(["/ip4/1.2.3.4/udp/5/quic-v1", "/ip4/1.2.3.4/tcp/5", "junk", 7, None, "x" * 500,
                     f"/ip4/1.2.3.4/udp/5/quic-v1/p2p/{pid}/p2p-circuit",
                     *[f"/ip4/1.2.3.{k}/udp/9/quic-v1" for k in range(10, 20)]])
    assert got == ["/ip4/1.2.3.4/udp/5/quic-v1", "/ip4/1.2.3.10/udp/9/quic-v1", "/ip4/1.2.3.11/udp/9/quic-v1",
                   "/ip4/1.2.3.12/udp/9/quic-v1"]
    assert punchable("/ip4/1.2.3.4/udp/5/quic-v1") == [] and punchable({"a": 1}) == []


def test_a_punch_request_that_does_not_come_through_our_relay_is_refused(relayed):
    """The callee dials only what its relay attests (the caller's outside address): a caller that dials
    it directly cannot make it dial anything."""
    import asyncio

    from p2pdiloco.swarm import punch as punch_mod
    from p2pdiloco.swarm.protocol import PROTOCOL_VERSION, read_frame, write_frame

    r, a, b = relayed
    b.add_handler(punch_mod.HANDLER + ".t", lambda info, rd, wr: punch_mod.serve_punch(b, info, rd, wr))
    before = b.relay_stats["punched"] + b.relay_stats["punch_failed"]

    async def ask():
        from hivemind.p2p import PeerID
        _, reader, writer = await a.p2p.call_binary_stream_handler(PeerID.from_base58(b.peer_id_str),
                                                                  punch_mod.HANDLER + ".t")
        try:
            await write_frame(writer, {"t": "punch", "v": PROTOCOL_VERSION})
            return (await asyncio.wait_for(read_frame(reader, 0), 10))[0]
        finally:
            writer.close()

    reply = a.call(ask(), timeout=20)
    assert reply["t"] == "refuse" and "through our relay" in reply["reason"], reply
    assert b.relay_stats["punched"] + b.relay_stats["punch_failed"] == before  # it dialed nothing
