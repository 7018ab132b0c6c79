"""The training loop behind ``p2pdiloco join``: read it top to bottom.

    join the swarm → check the run fingerprint → build the model from the run's seed (so every peer
    starts from the same θ) → inner AdamW steps on this peer's data shard → every H steps the
    fragment syncs (DiLoCo.after_inner_step) → metrics, validation loss, checkpoint → repeat until
    a budget is reached or SIGINT/SIGTERM → say goodbye → print a summary.

The peer's state lives in a few objects: the :class:`~.replica.Machine` (devices, local workers),
the :class:`Network` (DHT node, swarm facade, dashboard), the :class:`~.replica.Replica` (model,
inner optimiser, data stream, DiLoCo), :class:`~.events.Events` (metrics, progress record, the
counters behind them) and :class:`~.recovery.Recovery` (joining, catching up, rivals, minority).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Dict, Optional

from .. import faults
from ..addresses import listen_maddrs
from ..config import RunConfig
from ..dashboard import serve_for_node
from ..diloco.core import DiLoCo, SyncReport
from ..metrics import MetricsWriter
from ..run_identity import fingerprint_fields, fingerprint_of
from ..swarm.node import SwarmNode
from ..swarm.relay import RelayLimits
from ..swarm.swarm import Swarm
from .events import Events
from .recovery import Recovery
from .replica import Machine, Replica, build_replica, save_run_config

__all__ = ["run_peer", "Network"]

logger = logging.getLogger(__name__)


def run_peer(cfg: RunConfig, *, stop_flag: Optional[list] = None, local=None) -> Dict[str, Any]:
    """Run one volunteer until a budget is reached or SIGINT/SIGTERM; return its summary.

    ``local`` (a :class:`~p2pdiloco.local.group.LocalGroup` of rank 0, ``join --local-workers K``):
    this process is the swarm member of a machine of K local workers (:mod:`p2pdiloco.local`): it
    briefs them before training, and every inner step ends with a message to them.
    """
    faults.install_from_env()  # P2PDILOCO_FAULTS: fault injection for tests (p2pdiloco/faults.py)
    stop = stop_flag if stop_flag is not None else []
    # from the start: a SIGTERM while starting up still leaves cleanly. With local workers the launcher
    # passes its signals on, and a terminal's Ctrl-C reaches us directly too: a repeat within 1 s is one
    _install_signal_handlers(stop, repeat_s=1.0 if local is not None else 0.0)
    machine = Machine(cfg, local)
    net = Network(cfg)
    metrics: Optional[MetricsWriter] = None
    try:
        net.connect()  # the swarm facade, the dashboard, the fingerprint check
        run_dir = _open_run_dir(cfg, net.me)
        metrics = _open_metrics(run_dir)
        replica = build_replica(cfg, machine, net.node, net.swarm, run_dir, metrics)
        events = Events(cfg, net.node, net.swarm, metrics)
        recovery = Recovery(cfg, net.node, net.swarm, replica.diloco, metrics)
        recovery.join_run()  # a run in progress: start from its verified state
        events.announce(replica, machine)
        _wait_for_peers(net.swarm, cfg, net.me)
        machine.brief(replica, dict(run_dir=run_dir, me=net.me, peer=net.node.peer_id_str, shard=replica.shard),
                      metrics, net.me)
        _train(cfg, stop, replica, machine, events, recovery, run_dir)
        return _finish(replica, machine, events, run_dir)
    finally:  # stop serving, close the metrics, say goodbye to the swarm, stop the node (in that order)
        net.close_dashboard()
        if metrics is not None:
            metrics.close()
        net.close()
        machine.close()


def _train(cfg: RunConfig, stop: list, replica: Replica, machine: Machine, events: Events, recovery: Recovery,
           run_dir: str) -> None:
    """Inner steps until a budget is reached or a signal arrives; after each, the syncs that are due
    (DiLoCo.after_inner_step), the catch-up a failed or missed round calls for, and now and then a
    check against the swarm's records (behind, or diverged)."""
    diloco = replica.diloco
    events.start_training()
    recovery.start_watching()

    def on_sync(rep: SyncReport) -> None:  # a sync's result reached the model
        events.synced(rep, diloco, replica.val_loss)
        if rep.ok and rep.fragment == diloco.num_fragments - 1:  # the last fragment of an outer step is in
            replica.save_checkpoint(run_dir, events.me)

    diloco.on_sync = on_sync
    replica.model.train()
    replica.train_model.train()
    diloco.start_clock()
    keep_going = _keep_going(cfg, stop, diloco, events.t_start)
    # local workers: the parameters and global copies to start from
    machine.tell(keep_going, diloco.lr_step, events.metrics)
    while keep_going:
        t0 = time.perf_counter()
        loss, batch = replica.step()
        events.stepped(loss, batch)
        faults.set_step(diloco.position + 1)
        # fault-injection hook: after this step's update, before its syncs (``slow``: a slower machine)
        faults.fire("step", busy=time.perf_counter() - t0)
        recovery.after_syncs(diloco.after_inner_step(batch))
        recovery.check_against_swarm()
        events.after_step(diloco, loss)
        keep_going = _keep_going(cfg, stop, diloco, events.t_start)
        machine.tell(keep_going, diloco.lr_step, events.metrics)


def _keep_going(cfg: RunConfig, stop: list, diloco: DiLoCo, t_start: float) -> bool:
    """No budget of outer steps reached, and no signal nor time budget, or one but rounds already
    agreed with other peers ahead: those are trained to and synced first (a few steps), so that
    leaving fails no one else's round. Every peer of a run stops at the same outer step, so that
    budget ends training at once."""
    if cfg.train.max_outer_steps and diloco.outer_round() >= cfg.train.max_outer_steps:
        return False
    if not (stop or (cfg.train.max_seconds and time.time() - t_start >= cfg.train.max_seconds)):
        return True
    return diloco.steps_to_agreed_rounds() > 0


def _finish(replica: Replica, machine: Machine, events: Events, run_dir: str) -> Dict[str, Any]:
    """Syncs still in flight (streaming overlap) are waited for and applied, and the model ends on the
    global copies in every mode (:meth:`DiLoCo.finish`); then checkpoint and summary event, whose
    ``val_loss_end`` measures that model. Returns the summary."""
    diloco = replica.diloco
    if not any(r.ok for r in diloco.finish()):
        # no sync applied at the end, so no sync event validated the model finish() left (with fragments
        # the last validation saw local steps on the fragments synced before the last): measure it now
        events.validated_at_end(replica.val_loss())
    # the model as finish() left it: every local worker ends with it
    machine.tell(False, diloco.lr_step, events.metrics, final=True)
    diloco.close()
    replica.save_checkpoint(run_dir, events.me, last=True)
    events.close_bar()
    return events.summary(diloco, run_dir)


class Network:
    """Our DHT node, the swarm facade over it and, with ``join --dashboard-port``, the dashboard we serve."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.node = SwarmNode(cfg.swarm.initial_peers,
                              host_maddrs=listen_maddrs(cfg.swarm.host_maddrs, cfg.swarm.initial_peers),
                              announce_maddrs=cfg.swarm.announce_maddrs, identity_path=cfg.swarm.identity_path,
                              bootstrap_timeout=cfg.swarm.bootstrap_timeout, reachability=cfg.swarm.reachability,
                              relay=RelayLimits() if cfg.swarm.relay else None)
        self.me = self.node.short_id
        self.swarm: Optional[Swarm] = None
        self.dashboard = None

    def connect(self) -> None:
        """The swarm facade, the optional dashboard, the settings of our rounds, the fingerprint check."""
        cfg, node = self.cfg, self.node
        self.swarm = swarm = Swarm(node, cfg.swarm.run_id, matchmaking_timeout=cfg.swarm.matchmaking_timeout,
                                   allreduce_timeout=cfg.swarm.allreduce_timeout,
                                   min_group_size=cfg.swarm.min_group_size,
                                   progress_period=cfg.swarm.progress_period, robust=cfg.robust,
                                   group_cap=cfg.swarm.group_cap)
        if cfg.train.dashboard_port:
            self.dashboard = serve_for_node(node, cfg.swarm.run_id, host=cfg.train.dashboard_host,
                                            port=cfg.train.dashboard_port, period=cfg.swarm.progress_period)
        swarm.configure(round_samples=cfg.inner.round_samples, min_link_mbit=cfg.swarm.min_link_mbit,
                        adaptive_timeouts=cfg.swarm.adaptive_timeouts)
        fields = fingerprint_fields(cfg)
        swarm.check_fingerprint(fingerprint_of(fields), fields)

    def close_dashboard(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()

    def close(self) -> None:
        """Say goodbye to the swarm, then stop the node."""
        if self.swarm is not None:
            self.swarm.shutdown()
        self.node.shutdown()


def _open_run_dir(cfg: RunConfig, me: str) -> str:
    """The run folder (``runs/<run id>/<short peer id>`` unless train.run_dir), with the run's configuration."""
    run_dir = cfg.train.run_dir or os.path.join("runs", cfg.swarm.run_id, me)
    os.makedirs(run_dir, exist_ok=True)
    save_run_config(cfg, run_dir)
    return run_dir


def _open_metrics(run_dir: str) -> MetricsWriter:
    metrics = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
    faults.set_sink(lambda **event: metrics.write("fault", **event))  # tests assert faults fired
    return metrics


def _wait_for_peers(swarm: Swarm, cfg: RunConfig, me: str) -> None:
    """Hold the first step until swarm.min_peers_to_start peers are live (or start_timeout passes)."""
    want = cfg.swarm.min_peers_to_start
    if want > 1:
        n = swarm.wait_for_peers(want, cfg.swarm.start_timeout)
        if n >= want:
            logger.info(f"[{me}] {n} peers live; starting")
        else:
            logger.warning(f"[{me}] only {n} of {want} peers after {cfg.swarm.start_timeout:.0f} s; starting anyway")


def _install_signal_handlers(stop: list, repeat_s: float = 0.0) -> None:
    """SIGINT/SIGTERM: stop after the current step (and the rounds ahead other peers count on us for,
    see :func:`_keep_going`); a second one (later than ``repeat_s`` seconds after
    the first): at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    first = []

    def handler(signum, frame):
        if stop:
            if first and time.time() - first[0] < repeat_s:
                return
            raise KeyboardInterrupt
        first.append(time.time())
        stop.append(signum)
        logger.info("stopping after the current step (signal again to stop immediately)")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
