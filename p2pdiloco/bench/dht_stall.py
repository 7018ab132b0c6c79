"""What a frozen peer does to everyone else's DHT records.

    python -m p2pdiloco.bench.dht_stall --seconds 30

Four DHT nodes on 127.0.0.1: a bootstrap, a *publisher* (a :class:`~p2pdiloco.swarm.Swarm` that
refreshes its progress record every ``--period`` seconds, as a training peer does), a *reader*
that reads the progress records every 0.25 s, and a peer in its own process group that is
frozen with SIGSTOP (trainer, DHT and p2p daemon: a laptop lid closed, a VM paused) for
``--seconds``, then killed. Reported for each publishing mode, side by side in one run:

* ``store_s`` / ``get_s``: how long one store / one read took while the peer was frozen (the
  first call after the freeze, and the slowest);
* ``missing_s``: the total time the publisher's record was absent from the reader's view while
  the peer was frozen, and ``max_age_s``: the oldest the record was when read. A record lives
  ``3 * period + 5`` seconds; a missing record makes the others stop waiting for that peer.

Modes: ``background`` (what the peers do: :meth:`Swarm.publish_progress` stores on the network
thread, several at once) and ``blocking`` (the publisher thread waits for every store, and stores
the fingerprint record as well each time: what they did before, kept here for the comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

__all__ = ["measure", "main"]

LOOP = ["/ip4/127.0.0.1/tcp/0"]


def _hold(initial_peer: str) -> None:
    """The peer to be frozen: a DHT node that stays up until killed (run in its own process group)."""
    from ..swarm.node import SwarmNode

    node = SwarmNode([initial_peer], host_maddrs=LOOP)
    node.store("stall:progress", {"step": 0, "t": time.time()}, ttl=600, subkey=node.peer_id_str)
    print("ready", flush=True)
    while True:
        time.sleep(1)


def measure(seconds: float = 20.0, period: float = 1.0, mode: str = "background",
            progress=None) -> Dict[str, Any]:
    """Freeze one of four DHT nodes for ``seconds`` and watch another one's progress record (see
    the module docstring). ``progress``: called with a status line now and then."""
    from ..swarm.node import SwarmNode
    from ..swarm.swarm import Swarm

    if mode not in ("background", "blocking"):
        raise ValueError(f"mode must be 'background' or 'blocking', not {mode!r}")
    say = progress or (lambda line: None)
    nodes: List[SwarmNode] = []
    frozen: Optional[subprocess.Popen] = None
    stop = threading.Event()
    try:
        nodes.append(SwarmNode([], host_maddrs=LOOP))
        boot = nodes[0].visible_maddrs()
        nodes += [SwarmNode(boot, host_maddrs=LOOP) for _ in range(2)]
        pub_node, reader = nodes[1], nodes[2]
        frozen = subprocess.Popen([sys.executable, "-m", "p2pdiloco.bench.dht_stall", "--hold", boot[0]],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        if frozen.stdout.readline().strip() != b"ready":
            raise RuntimeError("the peer to be frozen did not start")
        swarm = Swarm(pub_node, "stall", matchmaking_timeout=10, allreduce_timeout=10, progress_period=period)
        swarm.update_progress(step=1)
        swarm.publish_progress(wait=True)
        if mode == "background":
            swarm.start_publishing()
        else:
            def blocking() -> None:
                while not stop.wait(period):
                    swarm.publish_progress(wait=True)
                    pub_node.store("stall:fingerprint", {"fp": "x"}, ttl=3600, subkey=pub_node.peer_id_str)

            threading.Thread(target=blocking, daemon=True).start()
        time.sleep(3 * period)

        def timed(fn) -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        def store_once() -> None:
            pub_node.store("stall:probe", {"t": time.time()}, ttl=30, subkey=pub_node.peer_id_str)

        def get_once() -> None:
            reader.get_subkeys("stall:probe")

        before = {"store_s": timed(store_once), "get_s": timed(get_once)}
        os.killpg(frozen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        say(f"[{mode}] peer frozen for {seconds:.0f} s")
        stores, gets = [timed(store_once)], [timed(get_once)]
        missing, max_age, reads, last = 0.0, 0.0, 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            records = reader.get_subkeys("stall:progress")
            now = time.monotonic()
            mine = records.get(pub_node.peer_id_str)
            if mine is None:
                missing += now - last
            else:
                max_age = max(max_age, time.time() - float(mine.get("t", 0)))
            reads, last = reads + 1, now
            time.sleep(0.25)
        stores.append(timed(store_once))
        gets.append(timed(get_once))
        return {"mode": mode, "frozen_s": round(time.monotonic() - t0, 1), "period_s": period,
                "record_lifetime_s": swarm.record_lifetime, "reads": reads,
                "missing_s": round(missing, 1), "max_age_s": round(max_age, 1),
                "store_s": {"unfrozen": round(before["store_s"], 2), "first_frozen": round(stores[0], 2),
                            "slowest_frozen": round(max(stores), 2)},
                "get_s": {"unfrozen": round(before["get_s"], 2), "first_frozen": round(gets[0], 2),
                          "slowest_frozen": round(max(gets), 2)}}
    finally:
        stop.set()
        if frozen is not None:
            try:
                os.killpg(frozen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            frozen.wait()
        for node in reversed(nodes):
            node.shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.dht_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="how long the peer stays frozen (default 30)")
    p.add_argument("--period", type=float, default=1.0, help="progress period, seconds (default 1, as in the tests)")
    p.add_argument("--modes", default="background,blocking", help="comma-separated: background, blocking")
    p.add_argument("--out", default="", help="also write the results to this JSON file")
    p.add_argument("--hold", default="", help=argparse.SUPPRESS)  # internal: the peer to be frozen
    args = p.parse_args(argv)
    if args.hold:
        _hold(args.hold)
        return 0
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        r = measure(args.seconds, args.period, mode, progress=lambda line: print(line, flush=True))
        print(json.dumps(r), flush=True)
        results.append(r)
    print(f"{'mode':<11} {'missing s':>9} {'max age s':>9} {'lifetime s':>10} {'store s (frozen)':>17} "
          f"{'get s (frozen)':>15}")
    for r in results:
        print(f"{r['mode']:<11} {r['missing_s']:>9} {r['max_age_s']:>9} {r['record_lifetime_s']:>10} "
              f"{r['store_s']['slowest_frozen']:>17} {r['get_s']['slowest_frozen']:>15}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
