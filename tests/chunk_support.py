"""One all-reduce peer in its own process, for tests/test_allreduce_chunks.py.

    python tests/chunk_support.py DIR RANK PEERS NUMEL CODEC CHUNK [CAP]

Rank 0 writes its address to DIR/addr; every rank writes its peer id to DIR/id.<rank>, waits for
all PEERS ids, forms the group and runs one all-reduce of ``(rank + 1) * ones(NUMEL)`` with CODEC and
chunks of CHUNK values (``partition.CHUNK_VALUES``), in subgroups of CAP (swarm.group_cap; default 0, one level). It writes DIR/result.<rank>.json: the error (or
null), whether every value equals the exact mean, resident memory (MB) just before the all-reduce
(input allocated), the process's peak (``ru_maxrss``) and how many members' parts its handler
saw cut off mid-stream. Faults come from P2PDILOCO_FAULTS.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(out: str, rank: int, peers: int, numel: int, codec_name: str, chunk: int, cap: int = 0) -> None:
    import torch

    from p2pdiloco import faults
    from p2pdiloco.compression import get_codec
    from p2pdiloco.swarm import partition
    from p2pdiloco.swarm.allreduce import AllReducer
    from p2pdiloco.swarm.group import Group, make_group_id
    from p2pdiloco.swarm.node import SwarmNode

    partition.CHUNK_VALUES = chunk
    faults.install_from_env()
    loop = ["/ip4/127.0.0.1/tcp/0"]
    if rank == 0:
        node = SwarmNode([], host_maddrs=loop)
        with open(os.path.join(out, "addr.tmp"), "w") as f:
            json.dump(node.visible_maddrs(), f)
        os.rename(os.path.join(out, "addr.tmp"), os.path.join(out, "addr"))
    else:
        while not os.path.exists(os.path.join(out, "addr")):
            time.sleep(0.1)
        with open(os.path.join(out, "addr")) as f:
            node = SwarmNode(json.load(f), host_maddrs=loop)
    ar = AllReducer(node, "chunks", timeout=60.0, cap=cap)
    with open(os.path.join(out, f"id.{rank}"), "w") as f:
        f.write(node.peer_id_str)
    while len([n for n in os.listdir(out) if n.startswith("id.")]) < peers:
        time.sleep(0.1)
    ids = sorted(open(os.path.join(out, f"id.{r}")).read() for r in range(peers))
    group = Group(make_group_id("chunks", 0, 1, ids), tuple(ids), ids.index(node.peer_id_str), 0, 1)
    vec = torch.full((numel,), float(rank + 1))
    before = _rss_mb()
    error, exact = None, False
    try:
        result = node.call(ar.allreduce(group, "d", vec, 1.0, get_codec(codec_name)), timeout=120)
        exact = bool((result == (peers + 1) / 2).all())
        del result
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump({"error": error, "exact": exact, "rss_before_mb": before, "peak_mb": peak,
                   "vector_mb": numel * 4 / 2**20, "faults": faults.counters(),
                   "parts_cut": ar.stats["parts_cut"], "rounds_capped": ar.stats["rounds_capped"],
                   "subgroups": len(plan.subgroups) if (plan := group.capped(cap)) else 0}, f)
    node.shutdown()


if __name__ == "__main__":
    d, r, p, n, c, k = sys.argv[1:7]
    main(d, int(r), int(p), int(n), c, int(k), int(sys.argv[7]) if len(sys.argv) > 7 else 0)
