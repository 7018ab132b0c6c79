"""What trains on this machine: the replica (model, inner optimiser, data stream, DiLoCo) and the
machine it trains on (devices, local workers); the replica's checkpoint and run folder.

Every peer builds its model from the run's seed, so all start from the same θ without a download.
A checkpoint holds the model, the inner optimiser, the global copies and the schedule, the data
stream's position and torch's RNG: a resumed peer continues bit for bit where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..checkpoint import CheckpointWriter, find_checkpoint, load_checkpoint
from ..config import RunConfig
from ..data import BatchStream, evaluate, load_corpus
from ..diloco.core import DiLoCo
from ..errors import CheckpointError
from ..local.group import LocalGroup, LocalLeader
from ..local.fsdp import FsdpShards, build_sharded
from ..metrics import MetricsWriter
from ..model import count_parameters, seeded_model
from ..run_identity import run_fingerprint
from ..swarm.node import SwarmNode
from ..swarm.state_sync import StateServer
from ..swarm.swarm import Swarm
from .inner import inner_optimizer, inner_step, local_stream

__all__ = ["Machine", "Replica", "build_replica", "snapshot", "restore", "save_run_config"]

logger = logging.getLogger(__name__)


class Machine:
    """This process's devices and, with ``join --local-workers K``, the K-1 local workers that train
    our replica with us: we are their rank 0 (:mod:`p2pdiloco.local.group`), they get the start from
    us (:meth:`brief`) and a message after each inner step (:meth:`tell`)."""

    def __init__(self, cfg: RunConfig, local: Optional[LocalGroup] = None):
        self.cfg, self.local = cfg, local
        self.leader: Optional[LocalLeader] = None  # once briefed: our side of the local protocol
        if local is not None:
            local.set_threads(cfg.train.threads)
            local.sharded = cfg.local.sharding == "fsdp"
            local.connect()
        elif cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.world = local.world if local is not None else 1
        self.device = local.device if local is not None else cfg.train.resolved_device()
        #: local.sharding = "fsdp": the replica's ``model`` (what DiLoCo syncs, validates and checkpoints) is a
        #: full copy on our CPU and the inner steps train our shard (:mod:`p2pdiloco.local.fsdp`)
        self.sharded = local is not None and local.sharded
        self.eval_device = "cpu" if self.sharded else self.device

    def brief(self, replica: "Replica", start: Dict[str, Any], metrics: MetricsWriter, me: str) -> None:
        """With local workers: hand them the start (``start``: our run folder, ids and data shard; plus
        the stream position and the inner optimiser state; the parameters and global copies follow
        with the first message)."""
        if self.local is None:
            return
        cfg, model, stream = self.cfg, replica.model, replica.stream
        self.leader = LocalLeader(self.local, model, replica.diloco, replica.shards, replica.train_opt)
        self.leader.brief(dict(start, batches_drawn=stream.batches_drawn), replica.inner_opt)
        held = replica.shards.local_numel() if replica.shards is not None else count_parameters(model)
        logger.info(f"[{me}] {self.world} local workers train this replica (data sub-shards "
                    f"{stream.shard}..{stream.shard + self.world - 1} of {stream.num_shards}; "
                    f"{cfg.local.sharding}: {held:,} of {count_parameters(model):,} parameter elements "
                    "on this worker)")
        metrics.write("local_shard", rank=0, world=self.world, sharding=cfg.local.sharding, param_numel=held,
                      params=count_parameters(model))

    def tell(self, keep_going: bool, lr_step: int, metrics: MetricsWriter, final: bool = False) -> None:
        """After each inner step (and at the start and the end): tell the local workers whether to go on
        and send them what our DiLoCo changed since our step (:mod:`p2pdiloco.local.group`)."""
        if self.leader is None:
            return
        ctl = self.leader.tell(keep_going and not final, lr_step, final)
        if ctl.event is not None:
            metrics.write("local_sync", **ctl.event)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


@dataclass
class Replica:
    """The model this peer trains and what trains it. ``model`` is what DiLoCo syncs, validates and
    checkpoints; the inner steps train ``train_model`` with ``train_opt``: the same objects, or with
    FSDP local workers our shard of the model (``inner_opt`` then only carries a resumed state to the
    workers' shards)."""
    cfg: RunConfig
    machine: Machine
    model: torch.nn.Module
    corpus: Any
    shard: int  # our data shard
    stream: BatchStream  # our slice of it: the whole shard alone, the first of K slices with local workers
    inner_opt: torch.optim.Optimizer
    train_model: torch.nn.Module
    train_opt: torch.optim.Optimizer
    shards: Optional[FsdpShards]
    diloco: DiLoCo
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)

    def step(self) -> Tuple[float, int]:
        """One AdamW step on the next batch of our shard; returns (loss, batch size). With local workers,
        the machine's step: gradients and loss averaged over the workers, the batch their sum."""
        machine = self.machine
        value, batch = inner_step(self.cfg, self.train_model, self.train_opt, self.stream, self.diloco.lr_step,
                                  machine.device, local=machine.local)
        if machine.leader is not None:
            batch *= machine.world
            machine.leader.after_step()  # a parameter changed after this is DiLoCo's doing: the workers need it
        return value, batch

    def val_loss(self) -> float:
        cfg = self.cfg
        return evaluate(self.model, self.corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                        max_batches=cfg.train.eval_batches, device=self.machine.eval_device)

    def save_checkpoint(self, run_dir: str, me: str, last: bool = False) -> None:
        """A checkpoint of this moment: written in the background (train.background_checkpoints; skipped
        while the previous one is being written), or on this thread; ``last``: the run's last one, on
        this thread after any in flight, a failure raised."""
        opt = self.inner_opt
        if self.machine.sharded:  # the workers gathered the full optimiser state to us after this step (or not)
            leader = self.machine.leader
            opt = leader.optimizer_state() if leader is not None else None
            if opt is None:
                logger.debug(f"[{me}] no checkpoint at step {self.diloco.position}: optimiser state not gathered")
                return
        with self.diloco.state_lock:  # not while a background sync writes a global copy
            snap = snapshot(self.model, opt, self.diloco, self.stream, local_workers=self.machine.world)
            # the state holds live tensors: copied (background) or written (here) before a sync may change them
            if self.cfg.train.background_checkpoints and not last:
                self.writer.submit(run_dir, snap, snap["inner_step"])
            else:
                self.writer.save_now(run_dir, snap, snap["inner_step"])


def build_replica(cfg: RunConfig, machine: Machine, node: SwarmNode, swarm: Swarm, run_dir: str,
                  metrics: MetricsWriter) -> Replica:
    """Model, data, inner optimiser and DiLoCo (its state served to joiners); resumed from this peer's
    checkpoint in ``run_dir`` if there is one."""
    me = node.short_id
    # Same seed on every peer: everyone starts from the same global parameters without a download.
    model = seeded_model(cfg.model, cfg.train.seed).to(machine.eval_device)
    corpus = load_corpus(cfg.data)
    ckpt_path = find_checkpoint(run_dir)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None
    shard = data_shard(cfg, node.peer_id_str, ckpt)
    stream = local_stream(cfg, corpus, shard, 0, machine.world)
    inner_opt = inner_optimizer(cfg, model.parameters())
    train_model, train_opt, shards = model, inner_opt, None
    if machine.sharded:
        train_model = build_sharded(cfg, machine.device)
        shards = FsdpShards(machine.local, train_model)
        train_opt = inner_optimizer(cfg, train_model.parameters())
    diloco = DiLoCo(model, cfg, swarm)
    StateServer(node, cfg.swarm.run_id, diloco.snapshot)
    replica = Replica(cfg, machine, model, corpus, shard, stream, inner_opt, train_model, train_opt, shards, diloco)
    logger.info(f"[{me}] peer {node.peer_id_str} joined run {cfg.swarm.run_id} (fingerprint "
                f"{run_fingerprint(cfg)}); model {count_parameters(model):,} params on {machine.device}; data shard "
                f"{shard}/{cfg.data.num_shards} of {corpus.description}")
    for line in diloco.layout.describe().splitlines():
        logger.info(f"[{me}] {line}")
    for line in cfg.advice():
        logger.warning(f"[{me}] {line}")
    if ckpt is not None:
        _resume(replica, ckpt, ckpt_path, metrics, me)
    return replica


def _resume(replica: Replica, ckpt: Dict[str, Any], path: str, metrics: MetricsWriter, me: str) -> None:
    """Load our checkpoint. Written by another number of local workers: the model, the inner optimiser,
    the global copies and the schedule resume as saved; the data is re-sliced into the new K
    sub-shards of our shard, each stream drawing on from the saved count (the exact batches of the old
    slicing cannot carry over)."""
    diloco, world = replica.diloco, replica.machine.world
    saved_world = saved_local_workers(ckpt)
    restore(ckpt, replica.model, replica.inner_opt, diloco, replica.stream if saved_world == world else None)
    if saved_world != world:
        drawn = int((ckpt.get("stream") or {}).get("batches_drawn", 0))
        for _ in range(drawn):
            replica.stream.next_starts()
        logger.warning(f"[{me}] the checkpoint was written by {saved_world} local worker(s), this peer has "
                       f"{world}: resuming the model, optimiser and global state, with the data re-sliced "
                       f"into {world} sub-shard(s) of shard {replica.shard}")
        metrics.write("reshard", local_workers=world, saved_local_workers=saved_world,
                      step=diloco.position, batches_drawn=drawn)
    logger.info(f"[{me}] resumed from {path} at inner step {diloco.position}")
    metrics.write("resume", step=diloco.position, synced_step=diloco.synced_step,
                  digest=diloco.digest(), outer_step=diloco.outer_round())


def save_run_config(cfg: RunConfig, run_dir: str) -> None:
    """run_config.json (plus copies of the tokenizer and an HF config.json) in the run folder, so
    ``p2pdiloco export`` and ``sample`` rebuild the model and its tokenizer from the folder alone."""
    d = cfg.to_dict()
    if cfg.data.tokenizer:
        shutil.copyfile(cfg.data.tokenizer, os.path.join(run_dir, "tokenizer.json"))
    if cfg.model.kind == "hf" and cfg.model.hf_config.endswith(".json"):
        shutil.copyfile(cfg.model.hf_config, os.path.join(run_dir, "hf_config.json"))
        d["model"]["hf_config"] = os.path.abspath(os.path.join(run_dir, "hf_config.json"))
    tmp = os.path.join(run_dir, ".run_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, "run_config.json"))


def data_shard(cfg: RunConfig, peer_id: str, ckpt: Optional[Dict[str, Any]]) -> int:
    """data.shard if set; else the shard of the checkpoint we resume (a restarted peer without a
    persistent identity has a new id, which would pick another shard); else derived from our id."""
    stream = ckpt.get("stream") if ckpt is not None else None
    if cfg.data.shard < 0 and isinstance(stream, dict) and isinstance(stream.get("shard"), int):
        return stream["shard"] // saved_local_workers(ckpt)  # rank 0's stream is sub-shard shard·K + 0
    return cfg.data.shard_for(peer_id)


def saved_local_workers(ckpt: Dict[str, Any]) -> int:
    """How many local workers wrote a checkpoint (a checkpoint without the field: one)."""
    k = ckpt.get("local_workers", 1)
    return k if isinstance(k, int) and k >= 1 else 1


def snapshot(model, inner_opt, diloco: DiLoCo, stream: BatchStream, local_workers: int = 1) -> Dict[str, Any]:
    """The checkpoint of a replica (``inner_opt``: an optimiser, or the state dict gathered from shards)."""
    opt_state = inner_opt if isinstance(inner_opt, dict) else inner_opt.state_dict()
    return {"format": 1, "local_workers": local_workers, "model": model.state_dict(), "inner_opt": opt_state,
            "outer": [o.state_dict() for o in diloco.outer], "inner_step": diloco.position,
            "samples_since": list(diloco.samples_since), "steps_since": list(diloco.steps_since),
            "stream": stream.state_dict(),
            "torch_rng": torch.get_rng_state(), "reducers": [r.state_dict() for r in diloco.reducers],
            "synced_step": diloco.synced_step, "digest": diloco.digest(), "overlap": diloco.overlap_state_dict(),
            "local_steps": diloco.local_steps, "clock": diloco.clock.state_dict() if diloco.clock else None}


def restore(state: Dict[str, Any], model, inner_opt, diloco: DiLoCo, stream: Optional[BatchStream]) -> None:
    """Load a checkpoint; ``stream`` None: the data stream's position is not restored (re-sliced)."""
    try:
        model.load_state_dict(state["model"])
        inner_opt.load_state_dict(state["inner_opt"])
        for o, s in zip(diloco.outer, state["outer"], strict=True):
            o.load_state_dict(s)
        diloco.position = int(state["inner_step"])
        diloco.synced_step = int(state.get("synced_step", state["inner_step"]))
        diloco.samples_since = [int(x) for x in state["samples_since"]]
        # a checkpoint without step counts: the next round of each fragment is sent unscaled (step_scale 1)
        diloco.steps_since = [int(x) for x in state.get("steps_since") or [0] * len(diloco.fragments)]
        diloco.local_steps = int(state.get("local_steps", diloco.position))
        if diloco.clock is not None:
            diloco.clock.load_state_dict(state.get("clock") or {"pos": diloco.position})
        if "reducers" in state:  # error-feedback residuals, low-rank bases and ranks
            for r, s in zip(diloco.reducers, state["reducers"], strict=True):
                r.load_state_dict(s)
        diloco.load_overlap_state(state.get("overlap"))  # delay/eager: where each inner phase started
        if stream is not None:
            stream.load_state_dict(state["stream"])
        torch.set_rng_state(state["torch_rng"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"checkpoint does not match this configuration ({e}); "
                              "use the configuration it was written with, or delete it to start fresh") from None
