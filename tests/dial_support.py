"""Scenarios of tests/test_dial.py, run inside a fresh network namespace (``ip netns exec``).

Three SwarmNodes listen on 127.0.0.1, .2 and .3 of the namespace's loopback (the daemon dials from
its listen address, so nftables can tell the peers apart by IP). nftables rules in a table of our
own break the links; every rule counts the packets it hit, and the scenario reports the counts so
the test can assert that its fault fired. Prints one JSON line (``RESULT {...}``) and exits.

    backoff      B's address book has C in libp2p's dial backoff when the round starts
    warm         the first connection to one member is refused while the group forms
    unreachable  two members cannot connect to each other: one is left out before the round
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from p2pdiloco.compression import get_codec  # noqa: E402
from p2pdiloco.swarm.allreduce import AllReducer  # noqa: E402
from p2pdiloco.swarm.formation import draw  # noqa: E402
from p2pdiloco.swarm.group import Group, make_group_id  # noqa: E402
from p2pdiloco.swarm.matchmaking import Matchmaker  # noqa: E402
from p2pdiloco.swarm.keys import ready_key  # noqa: E402
from p2pdiloco.swarm.node import SwarmNode  # noqa: E402

TABLE = "p2pdiloco_dial"


def nft(*args: str) -> str:
    out = subprocess.run(["nft", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"nft {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def rule_hits(chain: str = "out") -> int:
    """Packets matched by the rules of one of our chains so far (the rules' counters)."""
    text = nft("list", "chain", "inet", TABLE, chain)
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", text))


def block(rule: str, chain: str = "out") -> None:
    nft("add", "rule", "inet", TABLE, chain, *rule.split())


def unblock() -> None:
    nft("flush", "chain", "inet", TABLE, "out")


def ip_of(node: SwarmNode) -> str:
    return node.visible_maddrs()[0].split("/")[2]


def port_of(node: SwarmNode) -> str:
    return node.visible_maddrs()[0].split("/")[4]


def cut(a: SwarmNode, b: SwarmNode) -> None:
    """Close every connection between a and b (the DHT may have opened one)."""
    for x, y in ((a, b), (b, a)):
        try:
            x.call(x.p2p._client.disconnect(y.peer_id), timeout=10)
        except Exception:
            pass


def plain_dial(src: SwarmNode, dst: SwarmNode, handler: str) -> str:
    """One stream open at once, with no wait for a dial backoff: 'ok' or the daemon's error."""
    async def go():
        try:
            _, _, w = await src.p2p.call_binary_stream_handler(dst.peer_id, handler)
            w.close()
            return "ok"
        except Exception as e:
            return " ".join(str(e).split())
    return src.call(go(), timeout=30)


def allreduce(nodes, reducers, group_of, run):
    codec = get_codec("fp32")
    vecs = [torch.full((4096,), float(i + 1)) for i in range(len(nodes))]
    futs = [n.submit(r.allreduce_covered(group_of(n), "d", v, 1.0, codec))
            for n, r, v in zip(nodes, reducers, vecs)]
    outs = []
    for f in futs:
        try:
            out, cov = f.result(90)
            outs.append({"ok": True, "sum": float(out.sum()), "members": len(cov.members)})
        except Exception as e:
            outs.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return outs


def scenario_backoff(nodes):
    """B (private: owns nothing, only dials) has C's only address in dial backoff when the round of
    {A, B, C} starts (owners A and C). The old round retried at 0.3 and 0.6 s and failed everywhere."""
    a, b, c = nodes
    run = "backoff"
    reducers = [AllReducer(n, run, timeout=20) for n in nodes]
    ids = sorted(n.peer_id_str for n in nodes)
    owners = tuple(p for p in ids if p != b.peer_id_str)
    gid = make_group_id(run, 0, 0, ids, "", owners)
    block(f"ip daddr {ip_of(c)} tcp dport {port_of(c)} tcp flags & (syn|ack) == syn counter reject with tcp reset")
    cut(b, c)
    first = plain_dial(b, c, reducers[2].handler_name)
    hits = rule_hits()
    unblock()
    second = plain_dial(b, c, reducers[2].handler_name)  # the network is fine again: the backoff refuses
    t0 = time.monotonic()
    outs = allreduce(nodes, reducers, lambda n: Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, 0, owners=owners),
                     run)
    return {"first": first, "second": second, "outs": outs, "seconds": time.monotonic() - t0,
            "b_stats": dict(reducers[1].stats), "b_dials": dict(getattr(b, "dial_stats", {})),
            "hits": hits}


def by_rank(nodes, run, frag=0, round_=1):
    """``nodes`` in their order of leadership for that round, tiers aside (formation.draw, then the id)."""
    return sorted(nodes, key=lambda n: (draw(ready_key(run, frag, round_), n.peer_id_str), n.peer_id_str))


def _form(nodes, mms, frag=0, round_=1):
    futs = [n.submit(m.form_group(frag, round_, len(nodes))) for n, m in zip(nodes, mms)]
    out = []
    for f in futs:
        try:
            out.append(f.result(60))
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def scenario_warm(nodes):
    """The member X second in the round's rank is private (it only dials out, owns no shard, so nobody
    dials it back); connections to the owner T last in rank are refused until X's first dial to it
    failed (then the rule goes), which leaves T's address in X's dial backoff. The group must still form with all three, and
    its round must start on open connections (no dial in the all-reduce fails)."""
    run = "warm"
    nodes = by_rank(nodes, run)
    x, target = nodes[1], nodes[2]
    x.reachability = "private"  # and nobody can dial it, as behind NAT:
    block(f"ip daddr {ip_of(x)} tcp dport {port_of(x)} tcp flags & (syn|ack) == syn counter reject with tcp reset",
          chain="private")
    mms = [Matchmaker(n, run, matchmaking_timeout=10, join_grace=1.0, warm_timeout=8.0) for n in nodes]
    reducers = [AllReducer(n, run, timeout=20) for n in nodes]
    block(f"ip daddr {ip_of(target)} tcp dport {port_of(target)} tcp flags & (syn|ack) == syn counter "
          "reject with tcp reset")  # (not by source: the daemon retries a refused dial from another port)
    for other in nodes:
        if other is not x:
            cut(x, other)  # the connections the DHT opened before X went private
    stop = threading.Event()
    fired = []

    def watch():  # lift the rule once X's first dial to T was refused: only that dial fails
        while not stop.is_set():
            if getattr(x, "dial_stats", {}).get("dial_failed") and rule_hits() >= 1:
                fired.append(time.monotonic())
                unblock()
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    groups = _form(nodes, mms)
    formed = time.monotonic() - t0
    stop.set()
    watcher.join(5)
    if not fired:
        unblock()
    dials = [dict(getattr(n, "dial_stats", {})) for n in nodes]
    ok = all(isinstance(g, Group) for g in groups)
    outs = allreduce(nodes, reducers, lambda n: groups[nodes.index(n)], run) if ok else []
    return {"groups": [g.members if isinstance(g, Group) else g for g in groups], "fired": bool(fired),
            "owners": [g.owners if isinstance(g, Group) else None for g in groups], "x": x.peer_id_str,
            "ids": [n.peer_id_str for n in nodes],
            "formed": formed, "dials": dials, "outs": outs, "stats": [dict(r.stats) for r in reducers]}


def scenario_unreachable(nodes):
    """The two members ranked after the leader cannot open a connection to each other (nobody can dial
    them; they dial out); the leader reaches both on the connections they opened to join. The group is
    formed without the worse-ranked one before the round, which then completes for the other two."""
    run = "unreach"
    nodes = by_rank(nodes, run)
    x, y = nodes[1], nodes[2]
    mms = [Matchmaker(n, run, matchmaking_timeout=10, join_grace=1.0, warm_timeout=3.0) for n in nodes]
    reducers = [AllReducer(n, run, timeout=20) for n in nodes]
    # New connections to x and y are dropped (by destination: a refused dial from the listen address is
    # retried from another source address); they still dial the leader, so it reaches both
    for n in (x, y):
        block(f"ip daddr {ip_of(n)} tcp dport {port_of(n)} tcp flags & (syn|ack) == syn counter drop")
    cut(x, y)
    t0 = time.monotonic()
    groups = _form(nodes, mms)
    formed = time.monotonic() - t0
    hits = rule_hits()
    kept = [n for n, g in zip(nodes, groups) if isinstance(g, Group)]
    outs = allreduce(kept, [reducers[nodes.index(n)] for n in kept], lambda n: groups[nodes.index(n)], run)
    unblock()
    return {"groups": [g.members if isinstance(g, Group) else g for g in groups], "formed": formed, "hits": hits,
            "ids": [n.peer_id_str for n in nodes], "outs": outs,
            "stats": [dict(reducers[nodes.index(n)].stats) for n in kept]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    nft("add", "table", "inet", TABLE)
    nft("add", "chain", "inet", TABLE, "out", "{ type filter hook output priority 0 ; }")
    nft("add", "chain", "inet", TABLE, "private", "{ type filter hook output priority 1 ; }")
    nodes = []
    try:
        first = SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        nodes.append(first)
        for ip in ("127.0.0.2", "127.0.0.3"):
            nodes.append(SwarmNode(first.visible_maddrs(), host_maddrs=[f"/ip4/{ip}/tcp/0"]))
        result = {"backoff": scenario_backoff, "warm": scenario_warm,
                  "unreachable": scenario_unreachable}[sys.argv[1]](nodes)
        print("RESULT " + json.dumps(result, default=list), flush=True)
    finally:
        for n in nodes:
            n.shutdown()
        nft("delete", "table", "inet", TABLE)


if __name__ == "__main__":
    main()
