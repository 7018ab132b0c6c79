"""The inner step and its pieces: the inner lr schedule, the inner AdamW, a peer's (or local
worker's) batch stream, and one inner step.

Every inner step of the package is taken here: the peer's loop (:mod:`.loop`), its local workers
(:mod:`p2pdiloco.local.worker`), the benchmarks and the tests' in-process references. So they all
follow the same schedule, clipping and optimiser settings, which the exactness tests compare bit
for bit.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Tuple

import torch

from ..config import RunConfig
from ..data import BatchStream
from ..model import seeded_model

__all__ = ["lr_factor", "inner_optimizer", "forward_loss", "inner_step", "inner_setup", "local_stream"]


def lr_factor(inner: Any, step: int) -> float:
    """The inner lr at ``step`` (steps taken before) over ``inner.lr``: linear warm-up over
    ``warmup_steps``, then 1 (``constant``) or a half cosine from 1 down to ``min_lr_ratio`` at
    ``decay_steps``, flat after it (``cosine``)."""
    w = inner.warmup_steps
    if w and step + 1 < w:
        return (step + 1) / w
    if inner.lr_schedule != "cosine":
        return 1.0
    done = min(1.0, max(0, step + 1 - w) / (inner.decay_steps - w))
    return inner.min_lr_ratio + (1.0 - inner.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


def _inner_lr(cfg: RunConfig, step: int) -> float:
    return cfg.inner.lr * lr_factor(cfg.inner, step)


def inner_optimizer(cfg: RunConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """The inner AdamW over ``params`` as ``cfg.inner`` configures it (its lr is set again by every
    :func:`inner_step`, from the schedule)."""
    return torch.optim.AdamW(params, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                             betas=(cfg.inner.beta1, cfg.inner.beta2))


def local_stream(cfg: RunConfig, corpus, shard: int, rank: int, world: int) -> BatchStream:
    """The batch stream of local worker ``rank`` of a peer on data shard ``shard``: sub-shard
    ``shard·K + rank`` of ``num_shards·K``, i.e. the ``rank``-th of K equal slices of the peer's region
    (K = 1: the peer's own stream, as without local workers)."""
    return BatchStream(corpus.train, shard=shard * world + rank, num_shards=cfg.data.num_shards * world,
                       batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len, seed=cfg.data.seed)


def forward_loss(cfg: RunConfig, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss of ``model`` on ``(x, y)``, the forward under ``torch.autocast`` in bf16 when
    ``train.autocast`` says so (on the batch's device; the parameters stay fp32, so the backward
    leaves fp32 gradients for AdamW)."""
    if cfg.train.autocast == "off":
        return model(x, y)[1]
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        return model(x, y)[1]


def inner_step(cfg: RunConfig, model, opt, stream: BatchStream, step: int, device="cpu",
               local=None) -> Tuple[float, int]:
    """One inner AdamW step on the next batch of ``stream`` (warm-up lr for ``step`` = steps taken
    before, gradient clipping); returns (loss, batch size). With ``local`` (a
    :class:`~p2pdiloco.local.group.LocalGroup`) the gradients and the loss are averaged over the
    machine's local workers before clipping and the step (data parallelism inside one peer)."""
    for group in opt.param_groups:
        group["lr"] = _inner_lr(cfg, step)
    x, y = stream.next_batch(device)
    if local is None:
        loss = forward_loss(cfg, model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return _finish_step(cfg, model, opt, loss.item()), x.shape[0]
    with local.guard("took an inner step"):  # sharded, torch's own collectives run in here
        loss = forward_loss(cfg, model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        value = local.average_gradients(list(model.parameters()), loss.item())
        return _finish_step(cfg, model, opt, value), x.shape[0]


def _finish_step(cfg: RunConfig, model, opt, loss: float) -> float:
    if cfg.inner.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
    opt.step()
    return loss


def inner_setup(cfg: RunConfig, corpus, shard: int, device="cpu"):
    """(model, AdamW, batch stream) of one peer as it starts: the model from the run's seed (the same θ
    on every peer), the inner optimiser, the stream of data shard ``shard``. The benchmarks' and the
    tests' in-process references build their peers here. (The model's init draws from torch's global
    RNG: callers that build peers in threads hold a lock around this.)"""
    model = seeded_model(cfg.model, cfg.train.seed).to(device)
    opt = inner_optimizer(cfg, model.parameters())
    return model, opt, local_stream(cfg, corpus, shard, 0, 1)
