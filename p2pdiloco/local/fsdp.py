"""``local.sharding = "fsdp"``: the K local workers hold the replica in shards (torch FSDP2).

For a model that does not fit one device. Every worker builds the model on the ``meta`` device (no
memory), shards it with :func:`torch.distributed.fsdp.fully_shard` (each decoder layer of every
``nn.ModuleList``, then the root: embeddings, final norm, head), and allocates only its shard of
each parameter (dimension 0 cut in K pieces, ``torch.chunk``'s). The inner step is FSDP's: each
worker gathers a layer's parameters for its forward and backward, the gradients are
reduce-scattered (each worker gets the mean of the K workers' gradients for its own shard) and
AdamW steps the shard, so the inner optimiser's state is sharded too.

Worker 0 stays the only swarm member, and its DiLoCo needs the replica's full parameters (the
pseudo-gradient θ − θ_m, the merge of a sync result, validation, the checkpoint). It keeps them in
a **mirror** on its CPU (a plain model, as the global copy already is) that is refreshed from the
shards, one parameter at a time (:meth:`FsdpShards.gather`: each worker holds one gathered parameter
on its device at a time, never the model), at the inner steps where DiLoCo reads or writes it
(:func:`.group.fragments_needed`); what DiLoCo writes into the mirror goes back to the shards, one parameter at a
time from worker 0 (:meth:`FsdpShards.scatter`: each worker receives only its shard). Checkpoints stay
one per machine: the full inner optimiser state is gathered to worker 0's CPU
(:meth:`FsdpShards.gather_optimizer`) in the format of an unsharded AdamW, so a checkpoint resumes with
either sharding and any K.

All of this is collective: every worker calls the same methods in the same order, told by worker
0's messages (:mod:`.group`). The mirror costs worker 0 one model of CPU memory (fp32), like the
global copy.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..model import build_model
from ..digest import tensors_digest
from .group import LocalGroup

__all__ = ["SHARDINGS", "build_sharded", "FsdpShards"]

#: ``local.sharding`` values: ``replicate`` (every worker holds the whole model, DDP-style) or ``fsdp``
SHARDINGS = ("replicate", "fsdp")


def build_sharded(cfg, device: str) -> nn.Module:
    """The run's model, built on ``meta`` and sharded over the local group (which must be connected):
    this worker allocates only its shard of each parameter on ``device``, uninitialised (worker 0's
    :meth:`FsdpShards.scatter` fills it)."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = build_model(cfg.model)
    _tie_hf(model)
    for m in list(model.modules()):  # one FSDP unit per decoder layer: gathered for its forward only
        if isinstance(m, nn.ModuleList):
            for child in m:
                fully_shard(child)
    fully_shard(model)
    model.to_empty(device=device)
    return model


def _tie_hf(model: nn.Module) -> None:
    """A Hugging Face model built on ``meta`` skips ``tie_weights()``: tie the LM head to the embedding
    as the CPU build does, so both have the same parameters in the same order."""
    lm = getattr(model, "lm", None)
    if lm is None or not getattr(lm.config, "tie_word_embeddings", False):
        return
    out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
    if out is not None and inp is not None and out.weight is not inp.weight:
        out.weight = inp.weight


class FsdpShards:
    """This worker's shard of the replica, and the collectives between the shards and worker 0's CPU."""

    def __init__(self, group: LocalGroup, model: nn.Module):
        self.group, self.model = group, model
        self.params: List[torch.Tensor] = list(model.parameters())  # DTensors, sharded on dim 0
        self.buffers: List[torch.Tensor] = list(model.buffers())

    # ---- what this worker holds -----------------------------------------------------------------------
    def local_numel(self) -> int:
        """Parameter elements this worker holds (about 1/K of the model)."""
        return sum(p.to_local().numel() for p in self.params)

    def digest(self) -> str:
        """Digest of this worker's shards, in parameter order (see :func:`shard_of`)."""
        return tensors_digest([p.to_local() for p in self.params])

    # ---- worker 0's CPU <-> the shards ----------------------------------------------------------------
    def scatter(self, indices: Sequence[int], full: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Parameters ``indices`` from worker 0's full tensors ``full`` (worker 0 only; the others pass
        None) into every worker's shard, one parameter at a time."""
        from torch.distributed.tensor import distribute_tensor

        for i in indices:
            p = self.params[i]
            src = self._source(p, full[i] if full is not None else None)
            d = self.group.collective("received a parameter's shard", distribute_tensor, src, p.device_mesh,
                                      p.placements, src_data_rank=0)
            with torch.no_grad():
                p.to_local().copy_(d.to_local())
            del src, d

    def gather(self, indices: Sequence[int], into: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Parameters ``indices`` from the shards into worker 0's full tensors ``into`` (worker 0; the
        others pass None), one parameter at a time."""
        for i in indices:
            full = self.group.collective("gathered a parameter", self.params[i].full_tensor)
            if into is not None:
                with torch.no_grad():
                    into[i].copy_(full.detach())
            del full

    def broadcast_buffers(self, full: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Buffers (rotary tables, masks: not sharded, left uninitialised by ``to_empty``) from worker 0."""
        if not self.buffers:
            return
        if full is not None:
            with torch.no_grad():
                for b, f in zip(self.buffers, full):
                    b.copy_(f)
        self.group.broadcast(self.buffers, "received the buffers")

    def _source(self, like: torch.Tensor, full: Optional[torch.Tensor]) -> torch.Tensor:
        device = like.to_local().device
        if full is not None:
            return full.detach().to(device, like.dtype).contiguous()
        return torch.empty(like.shape, dtype=like.dtype, device=device)

    # ---- the inner optimiser's state -------------------------------------------------------------------
    def gather_optimizer(self, opt: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
        """The sharded optimiser's state as an unsharded one's (full tensors on the CPU) on worker 0;
        None on the others. Collective."""
        sd = opt.state_dict()
        out: Dict[Any, Dict[str, Any]] = {}
        for i in sorted(sd["state"]):
            entry = {}
            for k, v in sd["state"][i].items():
                if _is_dtensor(v):
                    v = self.group.collective("gathered the optimiser state", v.full_tensor).cpu()
                elif isinstance(v, torch.Tensor):
                    v = v.cpu()
                entry[k] = v
            out[i] = entry
        if self.group.rank:
            return None
        return {"state": out, "param_groups": sd["param_groups"]}

    def load_optimizer(self, opt: torch.optim.Optimizer, skeleton: Dict[str, Any],
                       tensors: Optional[List[torch.Tensor]] = None) -> None:
        """Load an unsharded optimiser state into the sharded optimiser: ``skeleton`` (from
        :func:`.group._split_state`, every worker has it) and, on worker 0, its tensors in order. A
        tensor of its parameter's shape is scattered into shards like the parameter; the others
        (AdamW's step count) are broadcast."""
        it = iter(tensors) if tensors is not None else None
        state: Dict[Any, Dict[str, Any]] = {}
        for i, entry in skeleton["state"].items():
            p = self.params[int(i)]
            loaded = {}
            for k, v in entry.items():
                if not (isinstance(v, tuple) and len(v) == 4 and v[0] == "__tensor__"):
                    loaded[k] = v
                    continue
                shape, dtype = tuple(v[1]), getattr(torch, v[2])
                full = next(it) if it is not None else None
                if shape == tuple(p.shape) and len(shape):
                    from torch.distributed.tensor import distribute_tensor

                    src = self._source(p, full) if full is not None else torch.empty(
                        shape, dtype=dtype, device=p.to_local().device)
                    loaded[k] = self.group.collective("received the optimiser state", distribute_tensor, src,
                                                      p.device_mesh, p.placements, src_data_rank=0)
                else:
                    t = full.detach().clone() if full is not None else torch.zeros(shape, dtype=dtype)
                    self.group.broadcast([t], "received the optimiser state")
                    loaded[k] = t
            state[i] = loaded
        opt.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The piece of a full parameter that worker ``rank`` of ``world`` holds (FSDP2: dimension 0 cut by
    ``torch.chunk``; a worker past the last chunk holds an empty piece). Tests rebuild the workers'
    digests with it."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]
