"""Train any torch.nn.Module with p2pdiloco: here a small GRU language model on the embedded corpus.

Alone (no network):            python examples/custom_module.py
In a swarm (two terminals):    p2pdiloco bootstrap            # prints /ip4/127.0.0.1/tcp/.../p2p/...
                               python examples/custom_module.py --initial-peers <that address> --shard 0
                               python examples/custom_module.py --initial-peers <that address> --shard 1

Your loop stays yours: p2pdiloco only needs `diloco.after_inner_step(samples)` after each optimizer
step, and the loop runs to a schedule position (`diloco.position`). Every H steps the pseudo-gradients
are averaged across the swarm and the outer Nesterov step is applied; the returned SyncReport says
what happened. At the end, `diloco.finish()` applies the syncs
still in flight (the default scheme overlaps each sync with the next inner steps).
"""
import argparse

import torch
from torch import nn

import p2pdiloco
from p2pdiloco import DiLoCo, RunConfig, join_swarm, leave_swarm


class GRULanguageModel(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--min-peers", type=int, default=1, help="wait for this many peers before training")
    args = ap.parse_args()

    cfg = RunConfig()
    cfg.swarm.run_id = "gru-example"
    cfg.swarm.initial_peers = args.initial_peers
    cfg.swarm.min_peers_to_start = args.min_peers
    cfg.inner.sync_every = 20          # H
    cfg.outer.lr, cfg.outer.momentum = 0.7, 0.9
    # the default scheme streams 4 fragments of whole blocks (parameters under blocks.<i>.); a GRU has
    # none, so it syncs as one fragment (tau overlap and the 4-bit codec of the default stay on)
    cfg.streaming.fragments = 1
    cfg.validate()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)               # same initial weights on every peer
    model = GRULanguageModel().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)

    corpus = p2pdiloco.load_corpus(p2pdiloco.DataConfig(max_bytes=1_000_000))
    batches = p2pdiloco.BatchStream(corpus.train, shard=args.shard, num_shards=4, batch_size=8, seq_len=64, seed=0)

    swarm = join_swarm(cfg, model) if args.initial_peers else None
    try:
        diloco = DiLoCo(model, cfg, swarm)
        # train to a schedule position, not a count of this loop's steps: a peer that missed a round
        # adopts the swarm's state and position (the steps it took meanwhile are not the swarm's), and
        # peers that stop at the same position sync their last round together
        while diloco.position < args.steps:
            x, y = batches.next_batch(device)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            for report in diloco.after_inner_step(samples=x.shape[0]):
                show(diloco.position, report, loss.item())
        for report in diloco.finish():  # syncs still in flight (tau overlap): wait, apply, report
            show(diloco.position, report, loss.item())
        # the global model every peer of the last group holds (after a missed round, the swarm's state
        # this peer downloaded: see p2pdiloco.DiLoCo)
        print(f"done: synced step {diloco.synced_step}, digest {diloco.digest()}")
        diloco.close()
    finally:
        leave_swarm(swarm)


def show(step: int, report, loss: float) -> None:
    print(f"step {step}: outer step {report.round + 1} {'ok' if report.ok else 'failed'} with "
          f"{report.group_size} peer(s), loss {loss:.3f}, digest {report.digest}")


if __name__ == "__main__":
    main()
