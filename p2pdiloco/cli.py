"""The ``p2pdiloco`` command: bootstrap, join, status, dashboard, demo, tokenizer, export, sample.

Every user error (bad address, unreachable bootstrap peer, missing config file, unknown key,
impossible value, mismatched run configuration, corrupt checkpoint) is printed as one line
``error: ...`` and exits with status 2; no traceback. Set P2PDILOCO_LOG=DEBUG for details.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

from .errors import LocalWorkerLost, UserError

__all__ = ["main"]

logger = logging.getLogger("p2pdiloco")


def _setup_logging() -> None:
    level = os.environ.get("P2PDILOCO_LOG", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # hivemind is chatty at INFO and installs its own handler; keep its warnings only
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    for name in ("hivemind",):
        logging.getLogger(name).setLevel(logging.WARNING)


def _add_swarm_args(p: argparse.ArgumentParser, peers_required: bool) -> None:
    p.add_argument("--initial-peers", nargs="+", default=[], required=peers_required, metavar="MULTIADDR",
                   help="multiaddr(s) of any live peer, with /p2p/<peer id> (the bootstrap peer prints them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pdiloco", description="Peer-to-peer DiLoCo training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bootstrap", help="run a long-lived DHT peer that helps others find each other")
    b.add_argument("--identity", default=None,
                   help="private key file giving a stable peer id (default bootstrap.key; created 0600 if missing)")
    b.add_argument("--host-maddrs", nargs="+", default=None, metavar="MULTIADDR",
                   help="addresses to listen on (default: /ip4/127.0.0.1/tcp/0, loopback only)")
    b.add_argument("--announce-maddrs", nargs="+", default=None, metavar="MULTIADDR",
                   help="public addresses to announce (behind NAT / port forwarding)")
    b.add_argument("--config", help="bootstrap TOML config (see bootstrap/bootstrap.toml)")
    b.add_argument("--no-relay", dest="relay", action="store_false", default=None,
                   help="do not relay for volunteers behind NAT (bootstrap.relay = false)")
    b.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                   help="other bootstrap peers to connect to (optional)")

    j = sub.add_parser("join", help="join a swarm and train until stopped or a budget is reached")
    _add_swarm_args(j, peers_required=False)
    j.add_argument("--config", help="peer TOML config, e.g. peers/tiny-cpu.toml")
    j.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set inner.sync_every=20 (repeatable)")
    j.add_argument("--summary-json", help="also write the final summary to this JSON file")
    j.add_argument("--dashboard-port", type=int, default=None, metavar="PORT",
                   help="also serve the swarm's web dashboard on 127.0.0.1:PORT (train.dashboard_port)")
    j.add_argument("--local-workers", type=int, default=1, metavar="K",
                   help="train this peer's replica with K local processes (one per GPU on CUDA; gloo on CPU), "
                        "data-parallel inside the machine; still one swarm member (default 1)")

    s = sub.add_parser("status", help="list the live peers of a run, read from the DHT")
    _add_swarm_args(s, peers_required=True)
    s.add_argument("--run-id", default="p2pdiloco-demo")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")

    w = sub.add_parser("dashboard", help="serve a live web page of a run's peers, read from the DHT")
    _add_swarm_args(w, peers_required=True)
    w.add_argument("--run-id", default="p2pdiloco-demo")
    w.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    w.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0: any free port)")

    d = sub.add_parser("demo", help="a bootstrap peer plus volunteers on 127.0.0.1 training together")
    d.add_argument("--peers", type=int, default=3)
    d.add_argument("--config", default=None, help="peer config (default: peers/tiny-cpu.toml settings)")
    d.add_argument("--outer-steps", type=int, default=8)
    d.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    d.add_argument("--out", default="runs/demo", help="directory for run dirs, logs and the plot")

    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer locally (tokenizers library)")
    tsub = t.add_subparsers(dest="tokenizer_command", required=True)
    tt = tsub.add_parser("train", help="train a BPE tokenizer on a data source and save it as JSON")
    tt.add_argument("--data", default="stdlib",
                    help='"stdlib" (the embedded corpus), a text file or directory, or .jsonl/.parquet files or a glob')
    tt.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary (e.g. 4096)")
    tt.add_argument("--out", required=True, help="where to write the tokenizer (tokenizers JSON), e.g. tok.json")
    tt.add_argument("--text-field", default="text", help="the text field of JSONL/Parquet records")
    tt.add_argument("--max-bytes", type=int, default=8_000_000, help="train on at most this many bytes of text")

    e = sub.add_parser("export", help="write a run's global model as a Hugging Face model directory")
    e.add_argument("--run-dir", required=True, help="a peer's train.run_dir (holds checkpoint.pt, run_config.json)")
    e.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")

    m = sub.add_parser("sample", help="print a short generation of a run's global model")
    m.add_argument("--run-dir", required=True, help="a peer's train.run_dir")
    m.add_argument("--prompt", default="def ", help="text to continue")
    m.add_argument("--max-new-tokens", type=int, default=80)
    m.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    m.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    _setup_logging()
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # join --local-workers: the workers' command
    try:
        if args.command == "bootstrap":
            return _cmd_bootstrap(args)
        if args.command == "join":
            return _cmd_join(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "dashboard":
            from .dashboard import run_dashboard

            return run_dashboard(args.initial_peers, args.run_id, args.host, args.port)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "tokenizer":
            return _cmd_tokenizer_train(args)
        if args.command == "export":
            from .export import export_run

            print(export_run(args.run_dir, args.out), flush=True)
            return 0
        if args.command == "sample":
            from .export import sample_run

            prompt, text = sample_run(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.seed)
            print(prompt + text, flush=True)
            return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LocalWorkerLost as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1  # pragma: no cover


def _relay_limits(cfg):
    """The bootstrap's relay limits (swarm/relay.py), or None when relaying is off."""
    from .swarm.relay import RelayLimits

    if not cfg.relay:
        return None
    return RelayLimits(max_reservations=cfg.relay_max_reservations, max_circuits=cfg.relay_max_circuits,
                       max_circuit_bytes=int(cfg.relay_max_mb_per_stream * 1e6),
                       max_bytes_per_hour=int(cfg.relay_max_gb_per_hour * 1e9))


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from .addresses import with_quic
    from .config import load_bootstrap_config
    from .metrics import format_bytes
    from .swarm.node import SwarmNode

    cfg = load_bootstrap_config(args.config, identity=args.identity, host_maddrs=args.host_maddrs,
                                announce_maddrs=args.announce_maddrs, initial_peers=args.initial_peers,
                                relay=args.relay)
    node = SwarmNode(cfg.initial_peers, host_maddrs=with_quic(cfg.host_maddrs), announce_maddrs=cfg.announce_maddrs,
                     identity_path=cfg.identity, bootstrap_timeout=cfg.bootstrap_timeout, relay=_relay_limits(cfg))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"bootstrap peer {node.peer_id_str} is up; give volunteers one of these addresses:", file=sys.stderr)
        for maddr in node.visible_maddrs():
            print(maddr, flush=True)
        if node.relay_server is not None:
            lim = node.relay_server.limits
            print(f"relaying for peers behind NAT: up to {lim.max_reservations} peers, {lim.max_circuits} streams at "
                  "once (bootstrap.relay = false turns it off)", file=sys.stderr, flush=True)
        last, shown = time.monotonic(), None
        while not stop.wait(1.0):
            if node.relay_server is not None and time.monotonic() - last >= 60:
                last = time.monotonic()
                st = node.relay_server.stats
                now = (len(node.relay_server.reserved()), st["circuits"], st["bytes"])
                if now != shown:
                    shown = now
                    print(f"relay: {now[0]} peer(s) reserved, {now[1]} stream(s) forwarded, "
                          f"{format_bytes(now[2])} carried", file=sys.stderr, flush=True)
        print("shutting down", file=sys.stderr, flush=True)
    finally:
        node.shutdown()
    return 0


def _cmd_join(args: argparse.Namespace) -> int:
    from .config import load_config
    from .train.loop import run_peer

    overrides = list(args.set)
    if args.initial_peers:
        overrides.append("swarm.initial_peers=" + ",".join(args.initial_peers))
    if args.dashboard_port is not None:
        overrides.append(f"train.dashboard_port={args.dashboard_port}")
    cfg = load_config(args.config, overrides)
    local = _local_workers(args, cfg)
    if isinstance(local, int):
        return local  # the launcher's exit status, or a local worker 1..K-1's
    summary = run_peer(cfg, local=local)
    print(json.dumps(summary), flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _local_workers(args: argparse.Namespace, cfg):
    """``join --local-workers K`` (:mod:`p2pdiloco.local`). The command the user ran starts K
    workers (this same command line, each told its rank by the environment) and returns their exit
    status; a worker of rank 0 gets its LocalGroup back and runs the peer; ranks 1..K-1 run their inner
    steps and return their exit status. None: a one-process peer."""
    from .local.group import LocalGroup
    from .local.launch import check_local_workers, launch, watch_parent

    device = cfg.train.resolved_device()
    local = LocalGroup.from_env(device)
    if local is None:
        check_local_workers(args.local_workers, device)
        if args.local_workers == 1:
            return None
        return launch([sys.executable, "-m", "p2pdiloco.cli", *args.argv], args.local_workers,
                      heartbeat_timeout=cfg.local.heartbeat_timeout)
    watch_parent(local.rank)
    if local.rank == 0:
        return local
    from .local.worker import run_worker

    try:
        run_worker(cfg, local)
    except (UserError, LocalWorkerLost) as e:  # rank 0 says it (once) for the machine; ours is a detail
        logger.info(f"local worker {local.rank}: stopping: {e}")
        return 1
    return 0


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from .data import DataConfig
    from .tokenized import iter_training_text
    from .tokenizer import train_bpe

    from .errors import ConfigError

    try:
        data = DataConfig(source=args.data, text_field=args.text_field, max_bytes=args.max_bytes).validate()
        n = train_bpe(iter_training_text(data), args.vocab_size, args.out)
    except ConfigError as e:  # name this command's flags, not the [data] keys they fill
        msg = str(e).replace("data.source", "--data").replace("data.text_field", "--text-field")
        raise ConfigError(msg.replace("data.max_bytes", "--max-bytes")) from None
    print(f"wrote {args.out}: byte-level BPE, {n} ids (set model.vocab_size = {n} and data.tokenizer = "
          f"\"{args.out}\")", flush=True)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from .dashboard.status import status_json, status_table
    from .swarm.keys import progress_key
    from .swarm.node import SwarmNode

    node = SwarmNode(args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=10,
                     client_mode=True)
    try:
        peers = node.get_subkeys(progress_key(args.run_id))
    finally:
        node.shutdown()
    peers = {pid: v for pid, v in peers.items() if not v.get("gone")}
    if args.json:
        print(status_json(peers))
        return 0
    if not peers:
        print(f"no live peers in run {args.run_id!r}")
        return 0
    print("\n".join(status_table(peers, time.time())))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
