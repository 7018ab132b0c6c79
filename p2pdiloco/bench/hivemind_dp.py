"""The baseline: synchronous data parallelism with hivemind's own ``hivemind.Optimizer``.

One process = one peer, started like ``p2pdiloco join`` and configured from the same TOML file and
``--set`` overrides (model, data, inner optimiser, train.run_dir, swarm.run_id/host_maddrs), so the
benchmark compares like with like::

    python -m p2pdiloco.bench.hivemind_dp --initial-peers <maddr> --config peers/tiny-cpu.toml \
        --peers 4 --steps 200 --set data.shard=0 --set data.num_shards=4 --summary-json s.json

hivemind.Optimizer is configured as plain synchronous data parallelism (the "vanilla all-reduce"
reference of the DiLoCo papers): ``use_local_updates=False`` and ``target_batch_size = peers *
batch_size``, and the loop runs in lockstep, so every global step (hivemind "epoch") all-reduces
the gradients of exactly one batch per peer and applies one AdamW step. (Left alone, hivemind keeps
accumulating batches until its progress tracker, which polls the DHT, notices that the target was
reached: on 2 cores that was 2-3 batches per peer per step, a different algorithm with a larger
batch. So after its batch a peer waits until ``tracker.ready_to_update_epoch`` and then calls
``step(batch_size=0)``, with a gradient averager whose zero-sample accumulation is a no-op.) Each
step uses the same hyper-parameters, warm-up and gradient clipping as our inner
optimiser (clipping applies to the averaged gradient, as in ordinary DDP). Parameter/state
averaging is switched off (``average_state_every`` huge): with identical averaged gradients the
replicas stay equal. Matchmaking uses ``target_group_size = peers`` (without it hivemind always
waits the full ``min_matchmaking_time``, 5 s by default). hivemind 1.1.12 forwards ``averager_opts``
to the state averager only, not to the gradient averager (despite its docstring), so the group size
reaches the gradient averager through ``grad_averager_factory``. Every peer waits before its first
batch until all ``--peers`` have announced themselves in the DHT; its first batch is accumulated
and reported without ``step()``, and it waits until hivemind's progress tracker sees every peer (a
peer is only visible there once it has accumulated samples) before finishing the step. Otherwise
the tracker's first time-based estimate lets a peer that believes it is alone step on its local
gradients, and with parameter averaging off its replica would never rejoin the others. Gradients go uncompressed (fp32) or as
fp16 (``--grad-compression fp16``); hivemind's 8-bit codecs are avoided (broken with numpy >= 2.4).

It writes ``<train.run_dir>/metrics.jsonl`` in the format of ``p2pdiloco join``:

* ``start``: ``val_loss``, ``params``, ``shard``, ``step`` = 0, ``mode`` = "hivemind-dp".
* ``sync``: one per global step. ``step`` = batches this peer has processed, ``outer_step`` =
  hivemind epoch, ``samples`` = samples this peer contributed to that step, ``loss`` = mean train
  loss of those batches, ``val_loss`` = validation loss (measured every ``--eval-every`` steps and
  at the end, ``null`` in between), ``sync_seconds`` = time blocked in ``opt.step()`` since the
  previous event (accumulation, matchmaking, all-reduce, the optimiser step; also as
  ``wait_seconds``, the name ``p2pdiloco join`` uses for time blocked on a sync), ``compute_seconds``
  = forward/backward time, ``eval_seconds``, ``group_size`` = peers in hivemind's progress
  tracker when the step began, ``ok`` = false (with ``error``) when hivemind fell back to local
  gradients (failed or skipped all-reduce) or averaged only part of the gradient (it keeps
  local values for the parts that did not arrive and warns "Averaging: received NN% results");
  both count as ``failed_syncs``. ``bytes_sent``/``bytes_received`` are **interface** bytes (``/proc/net/dev`` of
  ``--iface`` in this process's network namespace, everything: gradients, DHT, framing, TCP/IP
  and Ethernet headers) since the start event; hivemind has no counter of its own. The same values
  are also under ``iface_bytes_sent``/``iface_bytes_received``; ``null`` when the interface is missing.
* ``summary``: as ``p2pdiloco join`` (``val_loss_end``, ``inner_steps``, ``outer_steps``, bytes,
  ``seconds``, ``network_wait_seconds`` = total ``sync_seconds``) plus ``compute_seconds``,
  ``eval_seconds``.

When its last step is done a peer waits (up to ``--linger`` seconds) until every peer has reported
done in the DHT before it shuts down, so it does not cut off a group-mate's last all-reduce
(a hivemind peer that shuts down right after its step can cut off its group-mates' results).
SIGINT/SIGTERM stop after the current batch (twice: at once).
Exit status: 0 done, 2 configuration error (one ``error: ...`` line), 130 interrupted.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["read_iface_bytes", "run_dp", "main"]

logger = logging.getLogger(__name__)

_NEVER = 1 << 40  # average_state_every: never average parameters (plain DP keeps replicas equal)


def read_iface_bytes(iface: str, path: str = "/proc/net/dev") -> Optional[Tuple[int, int]]:
    """(tx bytes, rx bytes) of ``iface`` from ``path``, or None when the interface is not there.

    ``/proc/net/dev`` shows the network namespace of the reading process; ``/proc/<pid>/net/dev``
    that of process ``pid``.
    """
    try:
        with open(path) as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            fields = rest.split()
            return int(fields[8]), int(fields[0])
    return None


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pdiloco.bench.hivemind_dp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MULTIADDR")
    p.add_argument("--config", help="peer TOML config, e.g. peers/tiny-cpu.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--peers", type=int, required=True, help="peers in the run (target_batch_size = peers * batch)")
    p.add_argument("--steps", type=int, default=0,
                   help="global steps to train (default: train.max_outer_steps * inner.sync_every)")
    p.add_argument("--eval-every", type=int, default=0, help="validate every this many steps (default: inner.sync_every)")
    p.add_argument("--grad-compression", choices=("none", "fp16"), default="none")
    p.add_argument("--matchmaking-time", type=float, default=15.0,
                   help="hivemind matchmaking_time, s: how long a late peer may still join a step's group (the group "
                        "starts as soon as all --peers are in; hivemind suggests 10-15 s over the internet)")
    p.add_argument("--averaging-timeout", type=float, default=120.0, help="hivemind averaging_timeout, s")
    p.add_argument("--next-chunk-timeout", type=float, default=0.0,
                   help="hivemind next_chunk_timeout, s: a peer silent this long is dropped from the average "
                        "(default: averaging timeout / 2; hivemind's default, matchmaking_time, is too short for a "
                        "10 Mbit/s link shared by 3 senders on a busy machine)")
    p.add_argument("--refresh-period", type=float, default=0.2,
                   help="hivemind progress tracker min_refresh_period, s (its default 0.5 adds latency to every step)")
    p.add_argument("--iface", default="eth0", help="interface whose counters are the byte counts")
    p.add_argument("--linger", type=float, default=30.0, help="at most this long wait for the others at the end, s")
    p.add_argument("--summary-json", help="also write the summary to this JSON file")
    return p


def _lockstep_averager_class() -> type:
    from hivemind.optim.grad_averager import GradientAverager

    class LockstepGradientAverager(GradientAverager):
        """hivemind's GradientAverager where ``accumulate_grads_(0)`` is a no-op.

        The stock one counts a zero-sample accumulation as one more batch in the mean it divides
        by, so ``Optimizer.step(batch_size=0)`` (used to finish a step without a new batch)
        would shrink the gradient.
        """

        def accumulate_grads_(self, batch_size: int) -> None:
            if batch_size > 0:
                super().accumulate_grads_(batch_size)

    return LockstepGradientAverager


def _LockstepGradientAverager(*args: Any, **kwargs: Any) -> Any:
    return _lockstep_averager_class()(*args, **kwargs)


class _ClippedAdamW:
    """Factory of AdamW whose ``step`` first clips the (averaged) gradient norm, like our inner loop."""

    def __init__(self, max_norm: float, **kwargs: Any):
        self.max_norm, self.kwargs = max_norm, kwargs

    def __call__(self, params: Any):
        import torch

        max_norm = self.max_norm

        class ClippedAdamW(torch.optim.AdamW):
            def step(self, closure=None):  # type: ignore[override]
                if max_norm:
                    torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], max_norm)
                return super().step(closure)

        return ClippedAdamW(params, **self.kwargs)


def run_dp(cfg: Any, args: argparse.Namespace, stop: List[int]) -> Dict[str, Any]:
    """Train as one data-parallel peer until ``args.steps`` global steps or ``stop``; return the summary."""
    import hivemind
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    from ..data import BatchStream, evaluate, load_corpus
    from ..ids import short_id
    from ..train.inner import lr_factor
    from ..metrics import MetricsWriter
    from ..model import count_parameters, seeded_model

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = cfg.train.resolved_device()
    steps = args.steps or cfg.train.max_outer_steps * cfg.inner.sync_every
    eval_every = args.eval_every or cfg.inner.sync_every
    run_id = f"{cfg.swarm.run_id}-dp"

    dht = hivemind.DHT(initial_peers=list(cfg.swarm.initial_peers) or None, host_maddrs=list(cfg.swarm.host_maddrs),
                       start=True)
    opt = None
    metrics = None
    try:
        me = short_id(dht.peer_id)
        run_dir = cfg.train.run_dir or os.path.join("runs", run_id, me)
        os.makedirs(run_dir, exist_ok=True)
        metrics = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))

        model = seeded_model(cfg.model, cfg.train.seed).to(device)  # the same θ on every peer, as in join
        corpus = load_corpus(cfg.data)
        shard = cfg.data.shard_for(str(dht.peer_id))
        stream = BatchStream(corpus.train, shard=shard, num_shards=cfg.data.num_shards,
                             batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len, seed=cfg.data.seed)
        compression = Float16Compression() if args.grad_compression == "fp16" else NoCompression()
        partial = _count_partial_averages()  # before the averagers fork, so they inherit the handler
        opt = hivemind.Optimizer(
            dht=dht,
            run_id=run_id,
            params=model.parameters(),
            optimizer=_ClippedAdamW(cfg.inner.grad_clip, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                                    betas=(cfg.inner.beta1, cfg.inner.beta2)),
            # hivemind steps the scheduler once per epoch (= one global step here): same schedule as ours
            scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: lr_factor(cfg.inner, e)),
            target_batch_size=args.peers * cfg.inner.batch_size,
            batch_size_per_step=cfg.inner.batch_size,
            use_local_updates=False,
            delay_grad_averaging=False,
            delay_optimizer_step=False,
            average_state_every=_NEVER,
            matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout,
            next_chunk_timeout=args.next_chunk_timeout or args.averaging_timeout / 2,
            grad_compression=compression,
            grad_averager_factory=functools.partial(_LockstepGradientAverager, target_group_size=args.peers),
            tracker_opts=dict(min_refresh_period=args.refresh_period),
            averager_opts=dict(target_group_size=args.peers),
            verbose=False,
        )

        def val_loss() -> float:
            return evaluate(model, corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                            max_batches=cfg.train.eval_batches, device=device)

        def iface() -> Tuple[Optional[int], Optional[int]]:
            got = read_iface_bytes(args.iface)
            if got is None or base is None:
                return None, None
            return got[0] - base[0], got[1] - base[1]

        val0 = val_loss()
        _barrier(dht, f"{run_id}_ready", args.peers, args.averaging_timeout, stop)
        # hivemind falls back to local gradients when an all-reduce fails or it sees no other peer;
        # count those steps (they are failed syncs for a data-parallel baseline)
        fallbacks = [0]
        load_local = opt._load_local_gradients_into_optimizer

        def counting_fallback() -> None:
            fallbacks[0] += 1
            load_local()

        opt._load_local_gradients_into_optimizer = counting_fallback
        base = read_iface_bytes(args.iface)
        params = count_parameters(model)
        metrics.write("start", peer=str(dht.peer_id), shard=shard, params=params, val_loss=val0, step=0,
                      mode="hivemind-dp", digest=None)
        logger.info(f"[{me}] hivemind DP peer of {run_id}: {params:,} params, shard {shard}/{cfg.data.num_shards}, "
                    f"target batch {args.peers}x{cfg.inner.batch_size}, {steps} steps")
        t_start = time.time()
        last_status = t_start
        batches = failed = 0
        totals = {"compute": 0.0, "sync": 0.0, "eval": 0.0}
        window = {"compute": 0.0, "sync": 0.0, "losses": [], "samples": 0}
        val = val0
        model.train()
        while opt.local_epoch < steps and not stop:
            x, y = stream.next_batch(device)
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            t1 = time.perf_counter()
            epoch_before, fallbacks_before, partial_before = opt.local_epoch, fallbacks[0], partial.value
            group_size = opt.tracker.global_progress.num_peers
            if batches == 0:
                # The first batch is only accumulated and reported: hivemind's epoch-time estimate is
                # meaningless before any step and would let step() finish the epoch alone, unaveraged.
                opt._check_and_accumulate_gradients(x.shape[0], None)
                _await_tracker(opt, args.peers, args.averaging_timeout, stop)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            # lockstep: one batch per peer per step. Wait until hivemind says the global batch is
            # complete, then let it average and step without accumulating anything new (batch_size=0).
            while opt.local_epoch == epoch_before and not stop:
                if opt.tracker.ready_to_update_epoch:
                    opt.step(batch_size=0)
                else:
                    time.sleep(0.01)
            t2 = time.perf_counter()
            batches += 1
            window["compute"] += t1 - t0
            window["sync"] += t2 - t1
            window["losses"].append(loss.item())
            window["samples"] += x.shape[0]
            if opt.local_epoch == epoch_before:
                continue
            # a global step happened (or this peer was re-synchronised to a later epoch)
            epoch = opt.local_epoch
            fresh = epoch % eval_every == 0 or epoch >= steps
            t_eval = time.perf_counter()
            if fresh:
                val = val_loss()
            eval_s = time.perf_counter() - t_eval
            sent, recv = iface()
            error = None
            if fallbacks[0] != fallbacks_before:
                error = "all-reduce failed or skipped: hivemind stepped with this peer's local gradients"
            elif partial.value != partial_before:
                error = "partial average: hivemind kept local values for the parts that did not arrive"
            ok = error is None
            failed += not ok
            metrics.write("sync", step=batches, fragment=0, outer_step=epoch, ok=ok,
                          loss=sum(window["losses"]) / len(window["losses"]), val_loss=val if fresh else None,
                          group_size=group_size, sync_seconds=round(window["sync"], 4),
                          wait_seconds=round(window["sync"], 4),
                          compute_seconds=round(window["compute"], 4), eval_seconds=round(eval_s, 4),
                          samples=window["samples"], bytes_sent=sent, bytes_received=recv,
                          iface_bytes_sent=sent, iface_bytes_received=recv, digest=None, error=error)
            totals["compute"] += window["compute"]
            totals["sync"] += window["sync"]
            totals["eval"] += eval_s
            window = {"compute": 0.0, "sync": 0.0, "losses": [], "samples": 0}
            if time.time() - last_status >= 10 or epoch >= steps:
                last_status = time.time()
                print(f"[{me}] step {epoch}/{steps} batches {batches} val {val:.3f} sent {sent}", file=sys.stderr,
                      flush=True)
        seconds = time.time() - t_start
        sent, recv = iface()
        summary = {"peer": str(dht.peer_id), "short_id": me, "mode": "hivemind-dp", "val_loss_start": val0,
                   "val_loss_end": val, "outer_steps": opt.local_epoch, "inner_steps": batches,
                   "syncs": opt.local_epoch - failed, "failed_syncs": failed, "bytes_sent": sent, "bytes_received": recv,
                   "iface_bytes_sent": sent, "iface_bytes_received": recv, "seconds": round(seconds, 2),
                   "compute_seconds": round(totals["compute"], 2), "sync_seconds": round(totals["sync"], 2),
                   "network_wait_seconds": round(totals["sync"], 3),
                   "eval_seconds": round(totals["eval"], 2), "digest": None, "run_dir": run_dir}
        metrics.write("summary", **summary)
        if _barrier(dht, f"{run_id}_done", args.peers, args.linger, stop):
            time.sleep(1.0)  # the last one to arrive may still be sending its final parts
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        if opt is not None:
            try:
                opt.shutdown()
            except Exception as e:  # shutting down: report, do not mask the real outcome
                logger.warning(f"hivemind.Optimizer shutdown failed: {e!r}")
        dht.shutdown()


def _count_partial_averages() -> Any:
    """A shared counter of hivemind's "Averaging: received NN% results" warnings.

    hivemind's averagers run in forked processes and report a partial average (some parts missing,
    local values kept for them, yet ``step()`` reports success) only as that warning, so a handler
    on its logger increments a counter in shared memory that this process can read.
    """
    import multiprocessing

    counter = multiprocessing.get_context("fork").Value("i", 0)

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Averaging: received"):
                with counter.get_lock():
                    counter.value += 1

    logging.getLogger("hivemind.averaging.partition").addHandler(_Handler(logging.WARNING))
    return counter


def _await_tracker(opt: Any, peers: int, timeout: float, stop: List[int]) -> None:
    """Wait until hivemind's progress tracker sees ``peers`` peers (after the first batch is accumulated).

    A peer reports its progress only once it has accumulated samples, so this cannot be done before
    the first batch; without it, a peer that thinks it is alone takes its first steps unaveraged.
    """
    deadline = time.monotonic() + timeout
    while opt.tracker.global_progress.num_peers < peers and time.monotonic() < deadline and not stop:
        if opt.local_epoch > 0:
            return  # the swarm already moved on: nothing to wait for
        time.sleep(0.1)  # the tracker refreshes itself in its own thread


def _barrier(dht: Any, key: str, peers: int, timeout: float, stop: List[int]) -> bool:
    """Announce ourselves under DHT ``key`` and wait until ``peers`` peers have; False on timeout."""
    from hivemind.utils import get_dht_time

    dht.store(key, True, expiration_time=get_dht_time() + 3600, subkey=str(dht.peer_id))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(stop) < 2:
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict) and len(found.value) >= peers:
            return True
        time.sleep(0.25)
    logger.warning(f"only some of the {peers} peers reached {key!r} within {timeout:.0f} s; going on")
    return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=os.environ.get("P2PDILOCO_LOG", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    args = _build_parser().parse_args(argv)
    from ..config import load_config
    from ..errors import ConfigError, UserError

    stop: List[int] = []

    def handler(signum: int, frame: Any) -> None:
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        if args.peers < 1:
            raise ConfigError(f"--peers ({args.peers}) must be at least 1")
        overrides = list(args.set)
        if args.initial_peers:
            overrides.append("swarm.initial_peers=" + ",".join(args.initial_peers))
        cfg = load_config(args.config, overrides)
        if not (args.steps or cfg.train.max_outer_steps):
            raise ConfigError("give --steps N (or train.max_outer_steps): data-parallel training needs a budget")
        summary = run_dp(cfg, args, stop)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(json.dumps(summary), flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 130 if stop else 0


if __name__ == "__main__":
    sys.exit(main())
