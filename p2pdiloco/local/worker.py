"""Local workers 1..K-1 of a peer: inner steps on their own sub-shard, everything else from rank 0.

A worker never touches the network: no DHT node, no identity, no checkpoint. It builds the model
from the run's seed (as every peer does), takes rank 0's brief (run folder, data shard, stream
position, inner optimiser state), and then repeats: one inner step on the next batch of its
sub-shard, with the gradients averaged over the machine (:meth:`LocalGroup.average_gradients`), then
rank 0's message, which says whether to go on and brings what rank 0's DiLoCo changed. It logs each
change (``local_sync``: the digest of the global copy it received, the digest of its model) to
``worker<rank>.jsonl`` in the peer's run folder, and ends when rank 0 says so.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Dict

from ..config import RunConfig
from ..data import load_corpus
from ..diloco.fragments import split_fragments
from ..metrics import MetricsWriter
from ..model import seeded_model
from ..train.inner import inner_optimizer, inner_step, local_stream
from .group import LocalFollower, LocalGroup
from .fsdp import FsdpShards, build_sharded

__all__ = ["run_worker"]

logger = logging.getLogger(__name__)


def run_worker(cfg: RunConfig, group: LocalGroup) -> Dict[str, Any]:
    """Worker ``group.rank`` > 0 until rank 0's final message; returns its summary (also logged)."""
    for s in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the machine stops, and tells us
        signal.signal(s, signal.SIG_IGN)
    group.set_threads(cfg.train.threads)
    group.sharded = cfg.local.sharding == "fsdp"
    group.connect()
    name = f"local worker {group.rank}/{group.world}"
    shards = None
    if group.sharded:  # only our shard of each parameter, filled by rank 0's brief
        model = build_sharded(cfg, group.device)
        shards = FsdpShards(group, model)
    else:
        model = seeded_model(cfg.model, cfg.train.seed).to(group.device)  # rank 0 sends its own θ anyway
    corpus = load_corpus(cfg.data)
    opt = inner_optimizer(cfg, model.parameters())
    layout = split_fragments(model, cfg.streaming.fragments, cfg.streaming.pattern)
    named = dict(model.named_parameters())
    index = {n: i for i, n in enumerate(named)}
    follower = LocalFollower(group, model, [sum(named[n].numel() for n in names) for names in layout.names],
                             shards=shards, frag_params=[[index[n] for n in names] for names in layout.names])
    info = follower.brief(opt)
    stream = local_stream(cfg, corpus, info["shard"], group.rank, group.world)
    for _ in range(info["batches_drawn"]):  # the position rank 0 resumed at: every worker draws one batch a step
        stream.next_starts()
    metrics = MetricsWriter(os.path.join(info["run_dir"], f"worker{group.rank}.jsonl"))
    t0, steps = time.time(), 0
    try:
        held = shards.local_numel() if shards is not None else sum(p.numel() for p in model.parameters())
        metrics.write("start", rank=group.rank, world=group.world, shard=stream.shard, num_shards=stream.num_shards,
                      device=str(group.device), peer=info["peer"], sharding=cfg.local.sharding, param_numel=held)
        logger.info(f"[{info['me']}/{group.rank}] {name}: data sub-shard {stream.shard}/{stream.num_shards}, "
                    f"{group.device}, {held:,} parameter elements ({cfg.local.sharding})")
        model.train()
        ctl = _receive(follower, metrics, info["me"])
        while ctl.keep_going:
            inner_step(cfg, model, opt, stream, ctl.lr_step, group.device, local=group)
            follower.after_step()
            steps += 1
            ctl = _receive(follower, metrics, info["me"])
        ctl = _receive(follower, metrics, info["me"])  # the final message, after rank 0's last syncs
        summary = dict(rank=group.rank, inner_steps=steps, seconds=round(time.time() - t0, 2),
                       digest=follower.digest)
        metrics.write("summary", **summary)
        return summary
    finally:
        metrics.close()
        group.close()


def _receive(follower: LocalFollower, metrics: MetricsWriter, me: str):
    ctl = follower.recv()
    if ctl.event is not None:
        metrics.write("local_sync", **ctl.event)
        logger.info(f"[{me}/{follower.group.rank}] step {ctl.step}: global state {ctl.event['digest']}"
                    + (f", model {ctl.event['model_digest']}" if ctl.event["model_digest"] else ""))
    return ctl
