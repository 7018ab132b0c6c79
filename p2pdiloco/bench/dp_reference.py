"""Data parallelism's loss curve computed in one process: ``python -m p2pdiloco.bench.dp_reference``.

Synchronous data parallelism over M peers is, step for step, one model trained on the global batch:
each peer computes the gradient of its own batch (peer ``i`` reads shard ``i`` of ``M``, as in the
WAN benchmark), the all-reduce averages the M gradients, every replica clips the averaged gradient
and takes the same AdamW step (the same warm-up, weight decay and clipping as the DiLoCo peers'
inner optimiser: :func:`p2pdiloco.train.inner.inner_step`). Here the M gradients are computed one
after the other and averaged in fp32 in peer order, then the one model steps. This is the math
hivemind's ``Optimizer`` does in the networked baseline (``bench.hivemind_dp``), minus the network:
the long-horizon matrix of ``bench.run`` takes data parallelism's loss curve from here and its wall
time from a measured networked run over a shorter span (per-step time x steps), and checks this curve
against the networked one over the span both ran (``check_against``).

    python -m p2pdiloco.bench.dp_reference --config peers/tiny-cpu.toml --peers 4 --steps 1800 \\
        --eval-every 10 --set inner.sync_every=60 --set data.max_bytes=8000000 --set train.eval_batches=8 \\
        --json dp.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..errors import UserError

__all__ = ["dp_curve", "check_against", "identity", "main"]


def identity(cfg: Any, peers: int) -> str:
    """What the curve depends on (model, data, inner optimiser, seed, peers), as one hash: a curve saved
    with ``--json`` is reused only for the same."""
    import hashlib

    d = cfg.to_dict()
    inner = dict(d["inner"])
    if inner.get("lr_schedule", "constant") == "constant":  # the cosine's keys change nothing then (older curves stay valid)
        for k in ("lr_schedule", "decay_steps", "min_lr_ratio"):
            inner.pop(k, None)
    blob = json.dumps({"model": d["model"], "data": {k: v for k, v in d["data"].items() if k not in ("shard", "num_shards")},
                       "inner": inner, "seed": cfg.train.seed, "eval_batches": cfg.train.eval_batches,
                       "peers": peers}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dp_curve(cfg: Any, peers: int, steps: int, eval_every: int, *,
             status: Optional[Callable[[str], None]] = None, device: Optional[str] = None) -> Dict[str, Any]:
    """Train data parallelism over ``peers`` shards for ``steps`` global steps; validation loss (the
    same fixed windows as the peers' ``evaluate``) at step 0 and every ``eval_every`` steps.

    Returns ``{"steps", "peers", "tokens_per_step", "curve": [{"step", "tokens", "val"}...],
    "seconds"}``; ``tokens`` counts every peer's tokens (peers * batch * seq_len per step), as
    the benchmark counts a DiLoCo mode's tokens. ``device`` (default ``train.device``, resolved) is
    where the model trains; the forward runs under ``train.autocast`` as the peers' inner step does.
    """
    from ..data import BatchStream, evaluate, load_corpus
    from ..train.inner import _inner_lr, forward_loss, inner_setup

    if peers < 1 or steps < 1 or eval_every < 1:
        raise UserError(f"dp_curve: peers ({peers}), steps ({steps}) and eval_every ({eval_every}) must be >= 1")
    cfg = copy.deepcopy(cfg)
    device = device or cfg.train.resolved_device()
    cfg.data.num_shards = peers  # peer i trains on shard i of peers, as in the benchmark
    corpus = load_corpus(cfg.data)
    model, opt, _ = inner_setup(cfg, corpus, 0, device)
    # each peer's data stream, as inner_setup builds it (without building a model per peer)
    streams = [BatchStream(corpus.train, shard=i, num_shards=peers, batch_size=cfg.inner.batch_size,
                           seq_len=cfg.model.seq_len, seed=cfg.data.seed) for i in range(peers)]
    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = peers * cfg.inner.batch_size * cfg.model.seq_len
    nb = cfg.train.eval_batches

    def val() -> float:
        return evaluate(model, corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                        max_batches=nb, device=device)

    curve = [{"step": 0, "tokens": 0, "val": round(val(), 4)}]
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _inner_lr(cfg, step)
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for s in streams:  # each peer's gradient, summed in peer order (the owners' order) in fp32
            x, y = s.next_batch(device)
            loss = forward_loss(cfg, model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for acc, p in zip(total, params):
                acc.add_(p.grad.float())
        for acc, p in zip(total, params):
            p.grad = acc.div_(peers).to(p.dtype)
        if cfg.inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "val": round(val(), 4)})
            if status:
                el = time.time() - t0
                status(f"data parallel (in process): step {step + 1}/{steps}, val {curve[-1]['val']:.4f}, "
                       f"{el:.0f} s, ~{el / (step + 1) * (steps - step - 1):.0f} s left")
    return {"steps": steps, "peers": peers, "tokens_per_step": tokens_per_step, "identity": identity(cfg, peers),
            "eval_every": eval_every, "curve": curve, "seconds": round(time.time() - t0, 1)}


def check_against(curve: Sequence[Dict[str, Any]], measured: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Compare the in-process curve with a networked run's validation points at the same step.

    ``measured`` holds ``{"step", "val"}`` points (mean over peers) of the networked run. Returns
    the matched steps, the largest absolute and relative difference, and the points themselves."""
    by_step = {p["step"]: p["val"] for p in curve}
    pairs = [(m["step"], by_step[m["step"]], m["val"]) for m in measured if m["step"] in by_step and m["val"] is not None]
    if not pairs:
        return {"matched": 0, "note": "no validation point of the networked run at a step of the in-process curve"}
    diffs = [abs(a - b) for _, a, b in pairs]
    rel = [abs(a - b) / b for _, a, b in pairs]
    return {"matched": len(pairs), "max_abs_diff": round(max(diffs), 4), "max_rel_diff": round(max(rel), 5),
            "points": [{"step": s, "in_process": a, "networked": b} for s, a, b in pairs]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..config import load_config
    from ..errors import ConfigError

    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.dp_reference", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="peer TOML config (e.g. peers/tiny-cpu.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, required=True, help="global steps")
    ap.add_argument("--eval-every", type=int, default=0, help="steps between validations (default inner.sync_every)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        torch.set_num_threads(args.threads)
        res = dp_curve(cfg, args.peers, args.steps, args.eval_every or cfg.inner.sync_every,
                       status=lambda s: print(s, flush=True))
    except (ConfigError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({"final_val": res["curve"][-1]["val"], "seconds": res["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
