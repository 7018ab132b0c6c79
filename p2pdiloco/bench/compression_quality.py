"""What compression costs in quality: DiLoCo with simulated peers in one process, per setting.

    python -m p2pdiloco.bench.compression_quality --config peers/tiny-cpu.toml --peers 3 --rounds 8 \\
        [--set inner.sync_every=50 ...] [--settings fp32,e3m0,nf4-lowrank-f16,mine] \\
        [--define "mine=compression.codec=e3m0;compression.lowrank=true;compression.rank=8"] [--json out.json] \\
        [--seed 1] [--plot loss.png]

Every setting runs the same experiment from the same seeds: ``--peers`` peers, each with the run's
model, its own AdamW and its own data shard (peer m reads shard m of ``--peers``), take H inner
steps; then each peer's reducer (:func:`p2pdiloco.diloco.reducers.make_reducer`, exactly what
``p2pdiloco join`` uses) averages the pseudo-gradients through an in-process butterfly that does the
arithmetic of swarm/allreduce.py (block-aligned shards, each part through the codec, fp32 sum in
member order, the mean encoded once); then the outer Nesterov step, and every peer restarts from
the new global parameters. No network, no timing noise: only what the wire format does to training.

Reported per setting and round: validation loss of the global parameters (``train.eval_batches``
fixed windows) and the payload bytes one peer sends per sync (``2 (M-1)/M`` of each all-reduced
vector, encoded: its parts out and its shard's mean back; framing excluded). A setting is a name
and ``--set``-style overrides of ``[compression]`` (see :data:`SETTINGS`, or ``--define`` one); the
table at the end gives each final loss relative to ``fp32`` and ``e3m0`` (where they ran) and the
bytes relative to an fp32 all-reduce of the same model. Progress (one line per round) goes to stderr.
The bench pins ``streaming.fragments=1`` (blocking DiLoCo over the whole model).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..compression import Codec, get_codec
from ..compression.robust import weighted_mean
from ..config import RunConfig, load_config
from ..data import BatchStream, evaluate, load_corpus
from ..train.inner import inner_optimizer, inner_step
from ..diloco.outer import OuterState
from ..diloco.overlap import merge_into, minus_residual
from ..diloco.reducers import make_reducer
from ..model import seeded_model
from ..swarm.partition import shard_bounds

__all__ = ["SETTINGS", "run_setting", "format_table", "plot_losses", "main"]

#: name -> [compression] overrides; every key the settings differ in is spelled out, so a change of the
#: run defaults does not change what a named setting measures
_PLAIN = ("compression.lowrank=false",)
_LOWRANK_R4 = ("compression.lowrank=true", "compression.rank=4", "compression.adaptive=true", "compression.rank_fraction=0",
               "compression.dense_params=", "compression.power_iterations=1", "compression.factor_layout=columns",
               "compression.warm_start=ritz")
#: rank 1/8 of each matrix's smaller side, fixed, embeddings whole: with nf4 the recommended low-rank
#: setting (docs/compression.md, "What compression costs in quality")
_LOWRANK_F16 = ("compression.lowrank=true", "compression.rank_fraction=0.125", "compression.adaptive=false",
                "compression.dense_params=emb", "compression.power_iterations=1", "compression.factor_layout=columns",
                "compression.warm_start=ritz")
#: the bench simulates blocking DiLoCo over the whole model (one fragment; the streaming mode is not used), whatever the
#: run defaults say; applied before ``--set``
_BLOCKING = ("streaming.fragments=1",)


def _sparse(k: int, bits: int = 2, chunk: int = 4096, decay: float = 0.95) -> Tuple[str, ...]:
    return ("compression.codec=sparse", "compression.error_feedback=false", *_PLAIN, f"compression.sparse_k={k}",
            f"compression.sparse_chunk={chunk}", f"compression.sparse_bits={bits}", f"compression.sparse_decay={decay}",
            "outer.lr=1", "outer.momentum=0")


SETTINGS: Dict[str, Tuple[str, ...]] = {
    "fp32": ("compression.codec=fp32", "compression.error_feedback=false", *_PLAIN),
    "fp16": ("compression.codec=fp16", "compression.error_feedback=false", *_PLAIN),
    "e3m0": ("compression.codec=e3m0", "compression.error_feedback=false", *_PLAIN),
    "e3m0-ef": ("compression.codec=e3m0", "compression.error_feedback=true", "compression.feedback_form=resend",
                *_PLAIN),
    "nf4": ("compression.codec=nf4", "compression.error_feedback=false", *_PLAIN),
    "nf4-ef": ("compression.codec=nf4", "compression.error_feedback=true", "compression.feedback_form=resend", *_PLAIN),
    "lowrank": ("compression.codec=fp32", "compression.error_feedback=false", *_LOWRANK_R4),
    "e3m0-lowrank": ("compression.codec=e3m0", "compression.error_feedback=false", *_LOWRANK_R4),
    "e3m0-lowrank-ef": ("compression.codec=e3m0", "compression.error_feedback=true", "compression.feedback_form=resend",
                        *_LOWRANK_R4),
    "e3m0-lowrank-r16-ef": ("compression.codec=e3m0", "compression.error_feedback=true",
                            "compression.feedback_form=resend", *_LOWRANK_R4[:1], "compression.rank=16",
                            *_LOWRANK_R4[2:]),
    "e3m0-lowrank-f16": ("compression.codec=e3m0", "compression.error_feedback=false", *_LOWRANK_F16),
    "nf4-lowrank-f16": ("compression.codec=nf4", "compression.error_feedback=false", *_LOWRANK_F16),
    #: the factors row-major (every 64-value block mixes all r columns): what low-rank sent before columns
    "nf4-lowrank-f16-rows": ("compression.codec=nf4", "compression.error_feedback=false", *_LOWRANK_F16[:-2],
                             "compression.factor_layout=rows", "compression.warm_start=mean"),
    #: columns layout with PowerSGD's warm start (the averaged Q)
    "nf4-lowrank-f16-mean": ("compression.codec=nf4", "compression.error_feedback=false", *_LOWRANK_F16[:-1],
                             "compression.warm_start=mean"),
    #: the same factors in fp32: truncation alone, no quantization
    "fp32-lowrank-f16": ("compression.codec=fp32", "compression.error_feedback=false", *_LOWRANK_F16),
    #: nf4-lowrank-f16 with the residual kept in each peer's model (error feedback without resending)
    "nf4-lowrank-f16-keep": ("compression.codec=nf4", "compression.error_feedback=true",
                             "compression.feedback_form=model", "compression.feedback_decay=1", *_LOWRANK_F16),
    #: SparseLoCo: top-k per chunk of a decayed error buffer, applied with outer lr 1 and no momentum
    "sparse": _sparse(64),
    "sparse-k32": _sparse(32),
    "sparse-k16": _sparse(16),
}


class _Butterfly:
    """``k`` peers' all-reduce in threads, with the owner arithmetic of swarm/allreduce.py."""

    def __init__(self, k: int, weights: Sequence[float], default: Codec):
        self.k, self.weights, self.default = k, list(weights), default
        self.barrier = threading.Barrier(k)
        self.slots: Dict[int, torch.Tensor] = {}
        self.payload = [0] * k

    def fn(self, idx: int):
        def allreduce(vec: torch.Tensor, phase: str, codec: Optional[Codec] = None) -> torch.Tensor:
            codec = codec or self.default
            n = vec.numel()  # parts out, and our shard's reply to each other member (relayed parts: one per member)
            self.payload[idx] += int((self.k - 1) / self.k * (codec.encoded_size(n) + codec.reply_size(n, self.k)))
            self.slots[idx] = vec.detach().float().cpu().reshape(-1)
            self.barrier.wait(timeout=600)
            vecs = [self.slots[i] for i in range(self.k)]
            out = []
            for a, b in shard_bounds(vecs[0].numel(), self.k, codec.block_size):
                parts = [codec.decode(codec.encode(v[a:b]), b - a) for v in vecs]
                if codec.relays_parts:  # every member averages the relayed parts itself: nothing re-encoded
                    out.append(weighted_mean(parts, self.weights))
                    continue
                acc = torch.zeros(b - a)
                for p, w in zip(parts, self.weights):
                    acc.add_(p, alpha=w)
                acc.div_(sum(self.weights))
                out.append(codec.decode(codec.encode(acc), b - a))
            self.barrier.wait(timeout=600)
            return torch.cat(out) if out else torch.zeros(0)
        return allreduce


def run_setting(cfg: RunConfig, peers: int, rounds: int, progress: bool = False) -> Dict[str, object]:
    """One setting: returns ``{"val_loss": [start, after round 1, ...], "bytes_per_sync": [...], ...}``."""
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(cfg.data)
    models, opts, streams = [], [], []
    for m in range(peers):
        model = seeded_model(cfg.model, cfg.train.seed)  # the same θ everywhere, as in the swarm
        models.append(model)
        opts.append(inner_optimizer(cfg, model.parameters()))
        streams.append(BatchStream(corpus.train, shard=m, num_shards=peers, batch_size=cfg.inner.batch_size,
                                   seq_len=cfg.model.seq_len, seed=cfg.data.seed))
    params = [list(mod.parameters()) for mod in models]
    names = [n for n, _ in models[0].named_parameters()]
    outer = OuterState(params[0], lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
    reducers = [make_reducer(cfg, ps, names) for ps in params]
    codec = reducers[0].codec if hasattr(reducers[0], "codec") else get_codec(cfg.compression.codec)

    def val() -> float:
        outer.copy_to(params[0])
        return evaluate(models[0], corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                        max_batches=cfg.train.eval_batches, device="cpu")

    losses, sent, ranks, touched_share = [val()], [], [], []
    touched: Optional[torch.Tensor] = None  # coordinates the applied update has changed at least once
    keep = cfg.compression.feedback_form == "model"
    step = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for model, opt, stream in zip(models, opts, streams):
            model.train()
            for k in range(cfg.inner.sync_every):
                inner_step(cfg, model, opt, stream, step + k)
        step += cfg.inner.sync_every
        deltas = [outer.pseudo_gradient(ps) for ps in params]
        bf = _Butterfly(peers, [1.0] * peers, codec)
        outs: List[Optional[torch.Tensor]] = [None] * peers
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, reducers[i].reduce(deltas[i], bf.fn(i))))
                   for i in range(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(o is None or not torch.equal(o, outs[0]) for o in outs):
            raise RuntimeError("peers disagree on the averaged pseudo-gradient")
        nz = outs[0] != 0
        touched = nz if touched is None else touched | nz
        touched_share.append(round(float(touched.float().mean()), 4))
        outer.step(outs[0])
        for ps, red in zip(params, reducers):
            residual = red.take_residual() if keep else None
            if residual is None:
                outer.copy_to(ps)
            else:  # feedback_form=model: the peer restarts from θ − e_m, as TauMode merges it
                merge_into(ps, minus_residual(outer, residual), 0.0)
        losses.append(val())
        sent.append(bf.payload[0])
        if progress:
            print(f"  round {len(sent)}: val_loss {losses[-1]:.4f}, {sent[-1]:,} bytes", file=sys.stderr, flush=True)
        info = reducers[0].info()
        if "ranks" in info:
            ranks.append(sum(info["ranks"]) / max(1, len(info["ranks"])))
    numel = sum(p.numel() for p in params[0])
    fp32_bytes = int(2 * (peers - 1) / peers * 4 * numel)  # PlainReducer with fp32: one all-reduce of Δ
    return {"val_loss": [round(v, 4) for v in losses], "bytes_per_sync": sent,
            "fp32_bytes_per_sync": fp32_bytes, "x_fewer_than_fp32": round(fp32_bytes / max(1, sent[-1]), 1) if sent else None,
            "mean_rank": [round(r, 2) for r in ranks], "touched": touched_share,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="TOML config (e.g. peers/tiny-cpu.toml)")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (repeatable)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--settings", default="fp32,e3m0,e3m0-ef,e3m0-lowrank,e3m0-lowrank-ef", help=f"any of {', '.join(SETTINGS)}")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=KEY=VALUE;KEY=VALUE...",
                    help="an ad-hoc setting: its name, '=', then ';'-separated --set overrides (repeatable); "
                         "run it by listing NAME in --settings")
    ap.add_argument("--json", default=None, help="write every setting's results here (rewritten after each)")
    ap.add_argument("--seed", type=int, default=0,
                    help="train.seed and data.seed of every setting (model init, batch order; --set overrides it)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw validation loss against rounds, one line per setting (rewritten after each)")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw --plot from a saved --json (its settings in its order), run nothing")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.plot:
            ap.error("--replot needs --plot")
        with open(args.replot) as f:
            saved = json.load(f)
        plot_losses(saved["results"], args.plot, _plot_title(saved))
        return 0
    torch.set_num_threads(1)
    settings = dict(SETTINGS)
    for d in args.define:
        name, _, rest = d.partition("=")
        if not name or not rest:
            ap.error(f"--define {d!r}: expected NAME=KEY=VALUE;KEY=VALUE...")
        settings[name] = tuple(x for x in rest.split(";") if x)
    names = [s for s in args.settings.split(",") if s]
    unknown = [n for n in names if n not in settings]
    if unknown:
        ap.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(settings)} or --define them")
    results: Dict[str, Dict[str, object]] = {}
    for name in names:
        seeds = (f"train.seed={args.seed}", f"data.seed={args.seed}")
        cfg = load_config(args.config, [*_BLOCKING, *seeds, *args.set, *settings[name]])
        print(f"{name}: {' '.join(settings[name])}", file=sys.stderr, flush=True)
        results[name] = r = run_setting(cfg, args.peers, args.rounds, progress=True)
        r["overrides"] = list(settings[name])
        print(f"{name:<22} val_loss {r['val_loss'][0]:.3f} -> {r['val_loss'][-1]:.4f}  "
              f"bytes/sync/peer {r['bytes_per_sync'][-1]:>10,} ({r['x_fewer_than_fp32']}x fewer than fp32)  "
              f"({r['seconds']} s)  losses {r['val_loss']}  mean rank {r['mean_rank'][-1:] }  "
              f"coordinates touched {100 * r['touched'][-1] if r['touched'] else 0:.1f}%", flush=True)
        saved = {"argv": argv if argv is not None else sys.argv[1:], "config": args.config, "set": args.set,
                 "peers": args.peers, "rounds": args.rounds, "seed": args.seed, "results": results}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(saved, f, indent=2)
        if args.plot:
            plot_losses(results, args.plot, _plot_title(saved))
    print(format_table(results))
    return 0


def _plot_title(saved: Dict[str, object]) -> str:
    extra = " ".join(str(s) for s in saved.get("set") or [])
    return (f"{saved.get('config') or 'defaults'}, {saved['peers']} peers, {saved['rounds']} rounds, "
            f"seed {saved.get('seed', 0)}" + (f"\n{extra}" if extra else ""))


def plot_losses(results: Dict[str, Dict[str, object]], path: str, title: str = "") -> None:
    """Validation loss of the global parameters against rounds (0: before the first), one line per
    setting, labelled with its final loss relative to ``fp32`` where that ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results.get("fp32")
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        losses = r["val_loss"]
        label = name
        if base and name != "fp32":
            label += f" ({100 * (losses[-1] / base['val_loss'][-1] - 1):+.1f}%)"
        if r.get("x_fewer_than_fp32"):
            label += f", {r['x_fewer_than_fp32']}x fewer bytes"
        ax.plot(range(len(losses)), losses, label=label, lw=1.3)
    finals = [r["val_loss"][-1] for r in results.values()]
    firsts = [r["val_loss"][1] for r in results.values() if len(r["val_loss"]) > 1]
    if firsts:  # round 0 (the seeded model) sits far above: keep the rounds that differ readable
        ax.set_ylim(min(finals) - 0.05, max(firsts) + 0.05)
    ax.set_xlabel("round (outer step)")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(results: Dict[str, Dict[str, object]]) -> str:
    """Final loss per setting, relative to ``fp32`` and ``e3m0`` where they ran, and bytes vs fp32."""
    base, e3 = results.get("fp32"), results.get("e3m0")
    head = f"\n{'setting':<22} {'final val':>9} {'vs fp32':>8} {'vs e3m0':>8} {'bytes/sync/peer':>16} {'x fewer':>8}"
    lines = [head]
    for name, r in results.items():
        final = r["val_loss"][-1]
        rel = lambda b: f"{100 * (final / b['val_loss'][-1] - 1):>+7.2f}%" if b else f"{'-':>8}"  # noqa: E731
        lines.append(f"{name:<22} {final:>9.4f} {rel(base)} {rel(e3)} {r['bytes_per_sync'][-1]:>16,} "
                     f"{r['x_fewer_than_fp32']:>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
