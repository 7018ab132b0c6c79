"""A peer of the library API (p2pdiloco.DiLoCo around a user's module and loop) for tests/test_api.py:
like examples/custom_module.py, with a pause before a chosen inner step (a peer that falls behind and
misses a round) and its reports printed one per line."""
import argparse
import logging
import time

import torch
from torch import nn

import p2pdiloco
from p2pdiloco import DiLoCo, RunConfig, join_swarm, leave_swarm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peers", nargs="+", required=True)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--min-peers", type=int, default=2)
    ap.add_argument("--pause-before", type=int, default=0, help="sleep --pause seconds before this inner step")
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--step-seconds", type=float, default=0.1, help="each inner step lasts at least this long")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)

    cfg = RunConfig()
    cfg.swarm.run_id = "library-peers"
    cfg.swarm.initial_peers = args.initial_peers
    cfg.swarm.min_peers_to_start = args.min_peers
    cfg.swarm.matchmaking_timeout = 5.0
    cfg.swarm.progress_period = 2.0
    cfg.inner.sync_every = 20
    cfg.streaming.fragments = 1
    cfg.validate()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    corpus = p2pdiloco.load_corpus(p2pdiloco.DataConfig(max_bytes=200_000))
    batches = p2pdiloco.BatchStream(corpus.train, shard=args.shard, num_shards=2, batch_size=4, seq_len=32, seed=0)
    swarm = join_swarm(cfg, model)
    try:
        diloco = DiLoCo(model, cfg, swarm)
        paused = False
        while diloco.position < args.steps:  # a schedule position, as examples/custom_module.py
            if diloco.position + 1 == args.pause_before and not paused:
                print(f"pausing {args.pause} s before step {args.pause_before}", flush=True)
                time.sleep(args.pause)
                paused = True
            t0 = time.monotonic()
            x, y = batches.next_batch("cpu")
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - t0)))
            for r in diloco.after_inner_step(samples=x.shape[0]):
                show(r)
        for r in diloco.finish():
            show(r)
        print(f"done: synced step {diloco.synced_step}, digest {diloco.digest()}", flush=True)
        diloco.close()
    finally:
        leave_swarm(swarm)


def show(r) -> None:
    print(f"sync step {r.step} round {r.round} {'ok' if r.ok else 'missed' if r.missed else 'failed'} "
          f"group {r.group_size} digest {r.digest}", flush=True)


if __name__ == "__main__":
    main()
