"""Run in one namespace of tests/test_dial.py's simultaneous-dial test: a SwarmNode (our p2p daemon
settings) that, ``trials`` times, publishes its address in a shared folder, waits for the other
side's, and dials it at the same agreed instant as the other side dials us. Prints one JSON line
``RESULT {"ok": n, "failed": [reasons]}``."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from p2pdiloco.swarm.node import SwarmNode  # noqa: E402


def main() -> None:
    name, other, ip, folder, trials = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    ok, failed = 0, []
    for k in range(trials):
        node = SwarmNode([], host_maddrs=[f"/ip4/{ip}/tcp/0"], bootstrap_timeout=20)
        mine = {"id": node.peer_id_str, "maddrs": [str(m) for m in node.visible_maddrs()], "t": time.time()}
        tmp = os.path.join(folder, f"{name}.{k}.tmp")
        with open(tmp, "w") as f:
            json.dump(mine, f)
        os.rename(tmp, os.path.join(folder, f"{name}.{k}"))
        path = os.path.join(folder, f"{other}.{k}")
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path) as f:
            theirs = json.load(f)
        go = max(theirs["t"], mine["t"]) + 1.0  # both sides dial at this instant

        async def dial() -> None:
            await asyncio.sleep(max(0.0, go - time.time()))
            addrs = [Multiaddr(m.split("/p2p/")[0]) for m in theirs["maddrs"]]
            await node.p2p._client.connect(PeerID.from_base58(theirs["id"]), addrs)
        try:
            node.call(dial(), timeout=30)
            ok += 1
        except Exception as e:
            failed.append(" ".join(str(e).split())[-160:])
        time.sleep(1.5)  # the other side's dial finishes before our daemon goes
        node.shutdown()
    print("RESULT " + json.dumps({"ok": ok, "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
