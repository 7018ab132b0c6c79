"""The overlap modes' effect on the loss, with the network taken out: ``python -m p2pdiloco.bench.eager``.

M peers run in one process (one thread each, the real :class:`~p2pdiloco.diloco.core.DiLoCo`, real
data shards); an in-memory hub stands in for the swarm and averages their pseudo-gradients in fp32,
in member order, as the butterfly owners do. Every all-reduce therefore finishes at once; what is
compared is only *what each mode applies when* (overlap.py), on the same seeds and data, so the
final validation losses differ by the algorithm alone. (The emulated-WAN benchmark,
``python -m p2pdiloco.bench.run --matrix streaming``, measures time and bytes; its runs are too short
and too costly to tell a 1% loss difference.)

Variants (``--variants``, comma separated; ``NAME`` or ``NAME@LR`` for outer lr ``LR``):
``blocking`` (DiLoCo, no overlap), ``eager`` (Eager Updates as published,
``streaming.eager_estimate=paper``), ``eager-heuristic`` (``fresh_heuristic``: the peer's own fresh
pseudo-gradient stands in for the whole average), ``delay`` (naive one-step delay).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compression.robust import weighted_mean
from ..errors import ConfigError

__all__ = ["VARIANTS", "run_variant", "main"]

#: every variant starts from blocking DiLoCo (``scheme=diloco``: one fragment, no overlap; the hub averages
#: in fp32 whatever the codec); ``--set`` adds fragments, tau or alpha to all of them
VARIANTS: Dict[str, Tuple[str, ...]] = {
    "blocking": ("scheme=diloco",),
    "eager": ("scheme=diloco", "streaming.mode=eager", "streaming.eager_estimate=paper"),
    "eager-heuristic": ("scheme=diloco", "streaming.mode=eager", "streaming.eager_estimate=fresh_heuristic"),
    "delay": ("scheme=diloco", "streaming.mode=delay"),
}


class _Hub:
    """Weighted mean of ``m`` peers' vectors, summed in member order in fp32; blocks until all sent."""

    def __init__(self, m: int):
        self.m = m
        self.cond = threading.Condition()
        self.parts: Dict[Tuple[str, str], Dict[int, Tuple[float, torch.Tensor]]] = {}
        self.results: Dict[Tuple[str, str], torch.Tensor] = {}

    def reduce(self, idx: int, key: Tuple[str, str], vec: torch.Tensor, weight: float) -> torch.Tensor:
        with self.cond:
            self.parts.setdefault(key, {})[idx] = (weight, vec.detach().to("cpu", torch.float32).clone())
            if len(self.parts[key]) == self.m:
                parts = [self.parts[key][i] for i in range(self.m)]
                del self.parts[key]
                self.results[key] = weighted_mean([p for _, p in parts], [w for w, _ in parts])
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: key in self.results, timeout=300):
                raise RuntimeError(f"hub: all-reduce {key} incomplete (a peer thread died?)")
            return self.results[key].clone()


class _HubSwarm:
    """The two calls DiLoCo makes on a Swarm, answered by the hub."""

    def __init__(self, hub: _Hub, idx: int):
        from ..swarm.protocol import Traffic

        self.hub, self.idx = hub, idx
        self.node = SimpleNamespace(traffic=Traffic())

    def expected_group(self, sync_step: int) -> int:
        return self.hub.m

    def form_group(self, frag: int, round_: int, sync_step: int):
        from ..swarm.group import Group

        members = tuple(f"peer{i}" for i in range(self.hub.m))
        return Group(gid=f"{frag}:{round_}", members=members, my_index=self.idx, frag=frag, round=round_)

    def allreduce(self, group, phase: str, vec: torch.Tensor, weight: float, codec, on_coverage=None) -> torch.Tensor:
        self.node.traffic.add(sent=4 * vec.numel(), received=4 * vec.numel())
        return self.hub.reduce(self.idx, (group.gid, phase), vec, weight)


def _parse(spec: str) -> Tuple[str, Optional[float]]:
    name, _, lr = spec.partition("@")
    if name not in VARIANTS:
        raise ConfigError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    try:
        return name, float(lr) if lr else None
    except ValueError:
        raise ConfigError(f"variant {spec!r}: the outer lr after '@' must be a number") from None


def run_variant(config: Optional[str], sets: Sequence[str], spec: str, peers: int, outer_steps: int,
                eval_batches: int = 8, status=None) -> Dict[str, object]:
    """Train ``peers`` in-process peers for ``outer_steps`` outer steps with variant ``spec``; return
    the final validation loss of the global copy (every peer holds the same one) and the per-peer
    validation losses after each outer step of fragment 0. The peers train on ``train.device``
    (resolved: CUDA when there is one), all on that one device; the hub and the outer state stay on
    the CPU, as on a swarm peer."""
    from ..config import load_config
    from ..data import evaluate, load_corpus
    from ..diloco.core import DiLoCo
    from ..train.inner import inner_setup, inner_step

    name, lr = _parse(spec)
    cfg = load_config(config, [*sets, *VARIANTS[name], *([f"outer.lr={lr}"] if lr is not None else [])])
    corpus = load_corpus(cfg.data)
    device = cfg.train.resolved_device()
    hub = _Hub(peers)
    init_lock = threading.Lock()
    curve: List[float] = []
    out: Dict[int, torch.nn.Module] = {}
    errors: List[BaseException] = []

    def peer(i: int) -> None:
        try:
            with init_lock:  # the init draws from torch's global RNG, shared by the threads
                model, opt, stream = inner_setup(cfg, corpus, i, device)
            d = DiLoCo(model, cfg, _HubSwarm(hub, i))
            if i == 0:
                def on_sync(rep) -> None:  # the model just restarted from this round's result
                    if rep.ok and rep.fragment == 0:
                        curve.append(evaluate(model, corpus.val, batch_size=cfg.inner.batch_size,
                                              seq_len=cfg.model.seq_len, max_batches=eval_batches, device=device))
                        if status:
                            status(f"{spec}: outer step {len(curve)}/{outer_steps} val {curve[-1]:.4f}")
                d.on_sync = on_sync
            while d.outer_round() < outer_steps:
                _, batch = inner_step(cfg, model, opt, stream, d.position, device)
                d.after_inner_step(batch)
            d.finish()
            d.close()
            out[i] = model
        except BaseException as e:  # surfaced below
            errors.append(e)

    torch.set_num_threads(1)
    t0 = time.time()
    threads = [threading.Thread(target=peer, args=(i,), name=f"peer{i}") for i in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    finals = [evaluate(out[i], corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                       max_batches=eval_batches, device=device) for i in range(peers)]
    return {"variant": spec, "outer_lr": cfg.outer.lr, "final_val_loss": round(finals[0], 4),
            "peers_agree": len(set(finals)) == 1, "val_after_each_outer_step": [round(v, 4) for v in curve],
            "seconds": round(time.time() - t0, 1)}


def _plot(results: List[Dict[str, object]], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ys = r["val_after_each_outer_step"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{r['variant']} (final {r['final_val_loss']})")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("outer step")
    ax.set_ylabel("validation loss (peer 0, after the restart)")
    ax.set_title("overlap modes, network taken out")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .run import _DEFAULT_CONFIG

    ap = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.eager", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=_DEFAULT_CONFIG, help="peer configuration (default: peers/tiny-cpu.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--variants", default="blocking,eager,eager-heuristic,delay")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--outer-steps", type=int, default=10)
    ap.add_argument("--out", default="bench-eager", help="folder for results.json and the plot")
    args = ap.parse_args(argv)
    try:
        specs = [s for s in args.variants.split(",") if s]
        for s in specs:
            _parse(s)
        if args.peers < 1 or args.outer_steps < 1:
            raise ConfigError("--peers and --outer-steps must be at least 1")
        os.makedirs(args.out, exist_ok=True)
        results = []
        for spec in specs:
            r = run_variant(args.config, args.set, spec, args.peers, args.outer_steps,
                            status=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
            results.append(r)
            print(f"{spec:<16} outer lr {r['outer_lr']:<4} final val loss {r['final_val_loss']:.4f} "
                  f"({r['seconds']:.0f} s)", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": " ".join(["python -m p2pdiloco.bench.eager", *(argv if argv is not None else sys.argv[1:])]),
                   "peers": args.peers, "outer_steps": args.outer_steps, "results": results}, f, indent=1)
    plot = _plot(results, os.path.join(args.out, "eager_val_per_outer_step.png"))
    print(f"results: {os.path.join(args.out, 'results.json')}" + (f", plot: {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
