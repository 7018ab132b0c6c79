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

The inner steps and evaluations run on ``train.device`` (``auto``: a CUDA GPU where there is one).
``--seeds 0,1`` runs every setting once per seed (named ``NAME/s0``, ``NAME/s1``, each compared with
fp32 of its seed); ``--jobs N`` runs N of them at once, each in its own process with its log under
``--work``, and ``--time-limit S`` stops the ones still going after S seconds, keeping the rounds
they finished (compared at the last round both they and their baseline reached).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..compression import Codec, get_codec
from ..compression.robust import weighted_mean
from ..config import RunConfig, load_config
from ..errors import ConfigError
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
    #: every value in 2 bits (q2) or 1 bit (q1), what the codec drops kept in each peer's model
    "q2-keep": ("compression.codec=q2", "compression.error_feedback=true", "compression.feedback_form=model",
                "compression.feedback_decay=1", *_PLAIN),
    "q1-keep": ("compression.codec=q1", "compression.error_feedback=true", "compression.feedback_form=model",
                "compression.feedback_decay=1", *_PLAIN),
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


def run_setting(cfg: RunConfig, peers: int, rounds: int, progress: bool = False,
                on_round: Optional[Callable[[Dict[str, object]], None]] = None) -> Dict[str, object]:
    """One setting: returns ``{"val_loss": [start, after round 1, ...], "bytes_per_sync": [...], ...}``;
    ``on_round`` gets the same dictionary for the rounds done so far after each round."""
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(cfg.data)
    device = cfg.train.resolved_device()  # the inner phase and the evaluation; θ, Δ and the codecs stay on the CPU
    models, opts, streams = [], [], []
    for m in range(peers):
        model = seeded_model(cfg.model, cfg.train.seed).to(device)  # the same θ everywhere, as in the swarm
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
                        max_batches=cfg.train.eval_batches, device=device)

    losses, sent, ranks, touched_share = [val()], [], [], []
    touched: Optional[torch.Tensor] = None  # coordinates the applied update has changed at least once
    keep = cfg.compression.feedback_form == "model"
    step = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for model, opt, stream in zip(models, opts, streams):
            model.train()
            for k in range(cfg.inner.sync_every):
                inner_step(cfg, model, opt, stream, step + k, device)
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
        if on_round is not None:
            on_round(_result(losses, sent, ranks, touched_share, params[0], peers, t0, device))
    return _result(losses, sent, ranks, touched_share, params[0], peers, t0, device)


def _result(losses, sent, ranks, touched_share, params, peers: int, t0: float, device: str) -> Dict[str, object]:
    """The rounds so far as the bench reports them; the bytes ratio is over the mean bytes per sync
    (an adaptive rank changes them from round to round)."""
    numel = sum(p.numel() for p in params)
    fp32_bytes = int(2 * (peers - 1) / peers * 4 * numel)  # PlainReducer with fp32: one all-reduce of Δ
    mean_sent = _mean_bytes(sent)
    return {"val_loss": [round(v, 4) for v in losses], "bytes_per_sync": list(sent),
            "fp32_bytes_per_sync": fp32_bytes,
            "x_fewer_than_fp32": round(fp32_bytes / max(1, mean_sent), 1) if sent else None,
            "mean_rank": [round(r, 2) for r in ranks], "touched": list(touched_share),
            "seconds": round(time.perf_counter() - t0, 1), "device": device}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="TOML config (e.g. peers/tiny-cpu.toml)")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (repeatable)")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--settings", default="fp32,e3m0,e3m0-ef,e3m0-lowrank,e3m0-lowrank-ef", help=f"any of {', '.join(SETTINGS)}")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=KEY=VALUE;KEY=VALUE...",
                    help="an ad-hoc setting: its name, '=', then ';'-separated --set overrides, where an item without "
                         "'=' names a setting whose overrides it includes (repeatable); run it by listing NAME in "
                         "--settings")
    ap.add_argument("--json", default=None, help="write every setting's results here (rewritten after each round)")
    ap.add_argument("--seed", type=int, default=0,
                    help="train.seed and data.seed of every setting (model init, batch order; --set overrides it)")
    ap.add_argument("--seeds", default=None, metavar="S,S,...",
                    help="run every setting once per seed instead (results named NAME/sS, each compared with fp32/sS)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs (setting, seed) at once, each in its own process with its log under --work")
    ap.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                    help="with --jobs: stop the runs still going after this long and report the rounds they finished")
    ap.add_argument("--work", default=None,
                    help="with --jobs: each run's log and JSON go here (default: a temporary folder)")
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
    if args.jobs < 1 or args.time_limit < 0:
        ap.error("--jobs must be at least 1 and --time-limit at least 0")
    if args.time_limit and args.jobs == 1:
        ap.error("--time-limit needs --jobs (a run is stopped by stopping its process)")
    torch.set_num_threads(1)
    settings = dict(SETTINGS)
    for d in args.define:
        name, _, rest = d.partition("=")
        if not name or not rest:
            ap.error(f"--define {d!r}: expected NAME=KEY=VALUE;KEY=VALUE...")
        items: List[str] = []
        for x in (x for x in rest.split(";") if x):
            if "=" in x:
                items.append(x)
            elif x in settings:  # a setting's name: its overrides, then the keys after it
                items.extend(settings[x])
            else:
                ap.error(f"--define {name}: {x!r} is neither KEY=VALUE nor a setting defined before it")
        settings[name] = tuple(items)
    names = [s for s in args.settings.split(",") if s]
    unknown = [n for n in names if n not in settings]
    if unknown:
        ap.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(settings)} or --define them")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x] if args.seeds is not None else [args.seed]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not seeds:
        ap.error("--seeds lists no seed")
    for name in names:  # every setting's config is checked before anything runs
        try:
            _config(args, settings, name, seeds[0])
        except ConfigError as e:
            ap.error(f"setting {name}: {e}")
    runs = [(n, seed, n if len(seeds) == 1 else f"{n}/s{seed}") for seed in seeds for n in names]
    saved = {"argv": argv if argv is not None else sys.argv[1:], "config": args.config, "set": args.set,
             "peers": args.peers, "rounds": args.rounds, "seed": seeds[0], "seeds": seeds, "results": {}}
    if args.jobs > 1:
        ok = _run_parallel(args, settings, runs, saved)
    else:
        ok = True
        for name, seed, key in runs:
            _run_here(args, settings, name, seed, key, saved)
    print(format_table(saved["results"]))
    return 0 if ok else 1


def _save(args, saved: Dict[str, object]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=2)
    if args.plot and saved["results"]:
        plot_losses(saved["results"], args.plot, _plot_title(saved))


def _config(args, settings, name: str, seed: int) -> RunConfig:
    return load_config(args.config, [*_BLOCKING, f"train.seed={seed}", f"data.seed={seed}", *args.set, *settings[name]])


def _run_here(args, settings, name: str, seed: int, key: str, saved: Dict[str, object]) -> None:
    """One run in this process; the JSON is rewritten after every round (a stopped run keeps its rounds)."""
    cfg = _config(args, settings, name, seed)
    print(f"{key}: {' '.join(settings[name])}", file=sys.stderr, flush=True)
    tags = {"setting": name, "seed": seed, "overrides": list(settings[name])}

    def keep(r: Dict[str, object], complete: bool) -> None:
        saved["results"][key] = {**r, **tags, "complete": complete}
        _save(args, saved)

    r = run_setting(cfg, args.peers, args.rounds, progress=True, on_round=lambda part: keep(part, False))
    keep(r, True)
    print(f"{key:<22} val_loss {r['val_loss'][0]:.3f} -> {r['val_loss'][-1]:.4f}  "
          f"bytes/sync/peer {int(_mean_bytes(r['bytes_per_sync'])):>10,} "
          f"(mean; {r['x_fewer_than_fp32']}x fewer than fp32)  "
          f"({r['seconds']} s)  losses {r['val_loss']}  mean rank {r['mean_rank'][-1:] }  "
          f"coordinates touched {100 * r['touched'][-1] if r['touched'] else 0:.1f}%", flush=True)


def _run_parallel(args, settings, runs, saved: Dict[str, object]) -> bool:
    """Each run in its own process (``--jobs`` at once), the same command with one setting and one seed;
    runs still going at ``--time-limit`` are stopped and keep the rounds they finished. False when a run
    failed (not counting the ones stopped)."""
    import os
    import subprocess
    import tempfile

    work = args.work or tempfile.mkdtemp(prefix="compression-quality-")
    os.makedirs(work, exist_ok=True)
    common = ["--peers", str(args.peers), "--rounds", str(args.rounds)]
    common += ["--config", args.config] if args.config else []
    for x in args.set:
        common += ["--set", x]
    pending, live, failed, stopped = list(runs), {}, [], []
    t0 = last = time.monotonic()
    print(f"{len(runs)} runs, {args.jobs} at once; logs in {work}", file=sys.stderr, flush=True)
    while pending or live:
        while pending and len(live) < args.jobs:
            name, seed, key = pending.pop(0)
            stem = os.path.join(work, key.replace("/", "_"))
            cmd = [sys.executable, "-m", "p2pdiloco.bench.compression_quality", *common, "--seed", str(seed),
                   "--settings", name, "--define", f"{name}={';'.join(settings[name])}", "--json", stem + ".json"]
            with open(stem + ".log", "w") as log:
                live[key] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), name, seed, stem)
        time.sleep(1.0)
        for key in [k for k, v in live.items() if v[0].poll() is not None]:
            proc, name, seed, stem = live.pop(key)
            if proc.returncode != 0:
                failed.append(key)
                print(f"{key} failed (exit {proc.returncode}); its log: {stem}.log", file=sys.stderr, flush=True)
            _collect(key, name, seed, stem, saved)
        if args.time_limit and time.monotonic() - t0 > args.time_limit:
            for key, (proc, name, seed, stem) in live.items():
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                stopped.append(key)
                _collect(key, name, seed, stem, saved)
            stopped += [f"{key} (not started)" for _, _, key in pending]
            live, pending = {}, []
        if time.monotonic() - last > 30:
            last = time.monotonic()
            print(f"[{time.monotonic() - t0:.0f} s] {len(runs) - len(pending) - len(live)} of {len(runs)} runs ended, "
                  f"{len(live)} running", file=sys.stderr, flush=True)
    if stopped:
        print(f"stopped at the time limit: {', '.join(stopped)} (their rounds so far are kept)", file=sys.stderr,
              flush=True)
    _save(args, saved)
    return not failed


def _collect(key: str, name: str, seed: int, stem: str, saved: Dict[str, object]) -> None:
    try:
        with open(stem + ".json") as f:
            r = json.load(f)["results"][name]
    except (OSError, ValueError, KeyError):
        return  # no round finished
    saved["results"][key] = {**r, "setting": name, "seed": seed}


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

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        losses = r["val_loss"]
        label = name
        base = _baseline(results, r, "fp32")
        if base is not None and base is not r:
            pct, n = _relative(losses, base["val_loss"])
            early = n < len(losses) - 1 or n < len(base["val_loss"]) - 1
            label += f" ({pct:+.1f}%" + (f" at round {n})" if early else ")")
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


def _baseline(results: Dict[str, Dict[str, object]], r: Dict[str, object], setting: str) -> Optional[Dict[str, object]]:
    """The run of ``setting`` with ``r``'s seed (results of one seed are keyed by the setting's name alone)."""
    for key, other in results.items():
        if other.get("setting", key) == setting and other.get("seed") == r.get("seed"):
            return other
    return None


def _mean_bytes(sent: Sequence[int]) -> float:
    """Mean payload bytes per sync over the rounds (0 before the first): the figure the ratios use."""
    return sum(sent) / len(sent) if sent else 0.0


def _relative(losses: Sequence[float], base: Sequence[float]) -> Tuple[float, int]:
    """Loss relative to ``base`` in percent at the last round both reached, and that round."""
    n = min(len(losses), len(base)) - 1
    return 100 * (losses[n] / base[n] - 1), n


def format_table(results: Dict[str, Dict[str, object]]) -> str:
    """Final loss per setting, relative to ``fp32`` and ``e3m0`` of the same seed where they ran (at the
    last round both finished: ``round``), and bytes vs fp32 (the mean over the rounds)."""
    head = (f"\n{'setting':<24} {'round':>5} {'val loss':>9} {'vs fp32':>8} {'vs e3m0':>8} {'bytes/sync/peer':>16} "
            f"{'x fewer':>8}")
    lines, early = [head], []
    for name, r in results.items():
        losses = r["val_loss"]

        def rel(setting: str) -> str:
            b = _baseline(results, r, setting)
            if b is None:
                return f"{'-':>8}"
            pct, n = _relative(losses, b["val_loss"])
            early.append(n < len(losses) - 1)
            return f"{pct:>+7.2f}%" + ("*" if early[-1] else "")

        lines.append(f"{name:<24} {len(losses) - 1:>5} {losses[-1]:>9.4f} {rel('fp32')} {rel('e3m0')} "
                     f"{int(_mean_bytes(r.get('bytes_per_sync') or [])):>16,} {r.get('x_fewer_than_fp32')!s:>8}")
    if any(early):
        lines.append("* compared at the baseline's last round, before this run's")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
