"""k fake identities attacking a run, as a separate process (tests/test_adversary.py).

    python tests/adversary_support.py <bootstrap multiaddr> <run id> <k> <report.json>

Each identity is a real SwarmNode (its own key, DHT process and libp2p daemon). Every second, each one
publishes a signed, schema-valid progress record claiming a far-future synced step with a made-up
digest and a made-up group history (``gid``), and a fingerprint claim of another configuration; and
it opens streams to the honest peers' handlers (state, join, part) that never send a byte (each held
until the peer drops it). The report, rewritten every round, counts what was done and lists the
honest peers whose records the attacker read (so the test knows the attack fired and that no honest
record disappeared from the DHT).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

FAR = 2 ** 62 - 100
FAKE_DIGEST = "f" * 16


def main(addr: str, run: str, k: int, report_path: str) -> None:
    from hivemind.p2p import PeerID

    from p2pdiloco.swarm.node import SwarmNode

    nodes = [SwarmNode([addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(k)]
    ours = {n.peer_id_str for n in nodes}
    report = {"ids": sorted(ours), "stores": 0, "streams": 0, "stream_errors": 0, "rounds": 0,
              "honest_seen": [], "own_seen": 0}
    held = []  # (opened at, writer) of the silent streams: each kept open 20 s unless the peer drops it

    async def hold(node, peer: str, handler: str):
        try:
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
            held.append((time.monotonic(), writer))
            report["streams"] += 1
        except Exception:
            report["stream_errors"] += 1

    while True:
        for i, n in enumerate(nodes):
            ok = n.store(f"{run}:progress", {"step": FAR + 1, "synced_step": FAR, "digest": FAKE_DIGEST,
                                             "round": FAR // 10, "next_sync": FAR + 10, "gid": "g-sybil",
                                             "sps": 100.0}, ttl=30, subkey=n.peer_id_str)
            ok &= n.store(f"{run}:fingerprint", {"fp": "fake", "fields": {"inner.sync_every": 99},
                                                 "since": time.time()}, ttl=60, subkey=n.peer_id_str)
            report["stores"] += int(bool(ok))
        view = nodes[0].get_subkeys(f"{run}:progress")
        honest = sorted(p for p, v in view.items() if p not in ours and not v.get("gone"))
        report["honest_seen"] = honest
        report["own_seen"] = len(set(view) & ours)
        for n in nodes:
            for peer in honest:
                for handler in ("state", "join", "part"):
                    n.call(hold(n, peer, f"p2pdiloco.{run}.{handler}"), timeout=10)
        while held and time.monotonic() - held[0][0] > 20:
            held.pop(0)[1].close()
        report["rounds"] += 1
        tmp = report_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, report_path)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
