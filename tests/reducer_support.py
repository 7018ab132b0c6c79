"""One all-reduce round of in-process nodes, for tests/test_allreduce_chunks.py and tests/test_capped.py."""
from __future__ import annotations

import itertools

from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import Group, make_group_id

_runs = itertools.count()


def run_allreduce(nodes, vecs, weights, codec, *, reducers=None, cap=0, timeout=30.0, covered=False):
    """Every node whose vector is not None runs one round of one group of all ``nodes`` (sorted ids), with
    fresh reducers of a fresh run unless ``reducers`` are given. Returns (results in the nodes' order,
    SyncFailed and the like as results; the sorted ids; the reducers). ``covered``: each result is
    ``allreduce_covered``'s (mean, coverage)."""
    run = reducers[0].run_id if reducers else f"reduce{next(_runs)}"
    reducers = reducers or [AllReducer(n, run, timeout=timeout, cap=cap) for n in nodes]
    ids = sorted(n.peer_id_str for n in nodes)
    gid = make_group_id(run, 0, 1, ids)
    futs = []
    for n, r, v, w in zip(nodes, reducers, vecs, weights):
        if v is not None:
            group = Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, 1)
            futs.append(n.submit((r.allreduce_covered if covered else r.allreduce)(group, "d", v, w, codec)))
    out = []
    for f in futs:
        try:
            out.append(f.result(120))
        except Exception as e:  # noqa: BLE001 - SyncFailed is a result here
            out.append(e)
    return out, ids, reducers
