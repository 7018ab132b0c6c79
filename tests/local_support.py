"""Two local workers as spawned processes joined over gloo (tests/test_local_workers.py, test_local_fsdp.py)."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Tuple

#: a complete brief (every field a worker reads) for the tests that drive LocalLeader.brief themselves
BRIEF_INFO = dict(run_dir="x", me="me", peer="peer", shard=0, batches_drawn=0)


def run_two_ranks(target: Callable, tmp_path, *args: Any, timeout: float = 90) -> Tuple[Dict, Dict]:
    """Run ``target(rank, store_port, out_json, *args)`` in two spawned processes sharing one TCPStore;
    each must exit 0 within ``timeout`` and write its JSON report; returns (rank 0's, rank 1's)."""
    import multiprocessing as mp

    from p2pdiloco.local.launch import loopback_store

    store = loopback_store(3, timeout=300)
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=target, args=(r, store.port, str(tmp_path / f"r{r}.json"), *args)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        for p in ps:
            p.join(timeout)
            assert p.exitcode == 0
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
                p.join()
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    return r0, r1
