"""A single-process reference for rounds by the swarm's samples (tests/test_heterogeneous.py)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.data import load_corpus
from p2pdiloco.train.inner import inner_setup, inner_step
from p2pdiloco.diloco.outer import OuterState


def replay_rounds(cfg, plan: Sequence[Sequence[Tuple[int, int]]],
                  shards: Dict[int, int]) -> Tuple[List[torch.Tensor], List[str]]:
    """DiLoCo (one fragment, blocking) in one process: ``plan[k]`` lists round k's members as (peer,
    inner steps it took in that round), in the group's member order (the order the owners sum in).
    Each peer keeps its own model, AdamW state, data stream and step count (the inner lr warm-up's)
    across rounds, restarts every round from the global θ, and the round applies the sample-weighted
    mean (weight = steps x batch) of the members' pseudo-gradients normalized to H steps (Δ_m · H / k_m,
    docs/heterogeneous.md) with the outer Nesterov step.
    Returns the final θ and the global state's digest after each round.

    The order matters beyond the last bit: AdamW's normalised steps turn a one-ulp difference in θ
    into an lr-sized one on parameters whose gradients are near zero (measured: summing the same
    parts in another order ended 3e-3 apart after 4 rounds)."""
    torch.set_num_threads(1)
    corpus = load_corpus(cfg.data)
    peers = {}
    for i, shard in shards.items():
        model, opt, stream = inner_setup(cfg, corpus, shard)
        peers[i] = {"model": model, "opt": opt, "stream": stream, "steps": 0}
    first = next(iter(peers.values()))["model"]
    outer = OuterState(list(first.parameters()), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                       nesterov=cfg.outer.nesterov)
    digests: List[str] = []
    for members in plan:
        deltas, weights = [], []
        for i, n in members:
            peer = peers[i]
            local = list(peer["model"].parameters())
            outer.copy_to(local)
            for _ in range(n):
                inner_step(cfg, peer["model"], peer["opt"], peer["stream"], peer["steps"])
                peer["steps"] += 1
            delta = outer.pseudo_gradient(local)
            scale = cfg.inner.sync_every / n
            deltas.append(delta if scale == 1.0 else delta * scale)
            weights.append(float(n * cfg.inner.batch_size))
        outer.step(weighted_mean(deltas, weights))
        digests.append(outer.digest())
    return [p.clone() for p in outer.params], digests
