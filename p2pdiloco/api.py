"""Library entry points for training any ``torch.nn.Module`` with p2pdiloco.

    cfg = RunConfig()                      # or load_config("peers/tiny-cpu.toml", ["inner.sync_every=20"])
    swarm = join_swarm(cfg, model)         # None of this is needed to train alone: DiLoCo(model, cfg)
    diloco = DiLoCo(model, cfg, swarm)
    for x, y in batches:
        loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
        diloco.after_inner_step(samples=len(x))   # syncs when due
    diloco.finish(); diloco.close()
    leave_swarm(swarm)

A peer of the library keeps to the swarm's history as one of ``p2pdiloco join`` does
(:mod:`p2pdiloco.train.recovery`): it serves its state to peers that catch up, publishes its progress
record after every sync, downloads the swarm's state when it missed a round (or one failed only for it)
and when it joins a run in progress, and checks against the others' records every progress period.

See examples/custom_module.py for a complete, runnable script.
"""
from __future__ import annotations

import hashlib
import time
from typing import List, Optional

from torch import nn

from .addresses import listen_maddrs
from .config import RunConfig
from .diloco import core
from .diloco.core import SyncReport
from .metrics import NoMetrics
from .run_identity import fingerprint_fields, fingerprint_of
from .swarm.node import SwarmNode
from .swarm.state_sync import StateServer
from .swarm.swarm import Swarm
from .train.events import record_sync, speed_fields
from .train.recovery import Recovery

__all__ = ["DiLoCo", "join_swarm", "leave_swarm", "model_signature"]


class DiLoCo(core.DiLoCo):
    """The DiLoCo object of the library (:class:`p2pdiloco.diloco.core.DiLoCo`); with a swarm it also
    keeps this peer on the swarm's history, as ``p2pdiloco join`` does: the members of a round must
    send pseudo-gradients taken from one state, so a peer that missed a round adopts the swarm's state
    before its next sync instead of averaging from its own.

    With a swarm, at construction: its state is served to peers that catch up, and a run in progress
    is joined at its verified state. After each inner step: the progress record (position, speed) the
    others' matchmaking waits by; after each sync, the record of its result; after a missed round, or
    a failed one that may have completed for the others, the catch-up (a verified download, blocking
    the caller up to ``swarm.allreduce_timeout``); every progress period, the check against the
    others' records (behind, a rival history, a minority state). Catch-ups are logged (logger
    ``p2pdiloco.train.recovery``); after one, :attr:`synced_step` and :meth:`digest` are the swarm's."""

    def __init__(self, model: nn.Module, cfg: RunConfig, swarm: Optional[Swarm] = None, *,
                 outer_device: str = "cpu"):
        super().__init__(model, cfg, swarm, outer_device=outer_device)
        self.recovery: Optional[Recovery] = None
        if swarm is None:
            return
        self._samples = self._steps = 0
        self._t_start = time.time()
        StateServer(swarm.node, cfg.swarm.run_id, self.snapshot)
        self.recovery = Recovery(cfg, swarm.node, swarm, self, NoMetrics())
        self.recovery.join_run()
        synced_step, digest = self.sync_point()
        swarm.update_progress(step=self.position, synced_step=synced_step, digest=digest,
                              round=self.outer_round(), next_sync=self.next_sync_step())
        swarm.publish_progress()
        self.recovery.start_watching()

    def after_inner_step(self, samples: int) -> List[SyncReport]:
        reports = super().after_inner_step(samples)
        if self.recovery is None:
            return reports
        self._samples += samples
        self._steps += 1
        self.recovery.after_syncs(reports)
        self.recovery.check_against_swarm()
        self.swarm.update_progress(**speed_fields(self, self.swarm.node, self._samples, self._steps, self._t_start))
        return reports

    def _notify(self, report: SyncReport) -> None:
        if self.swarm is not None:  # the result is in the model: the others read it from our record
            if report.ok:
                self.swarm.follow_group(report.fragment, report.round)
            record_sync(self.swarm, self, report)
        super()._notify(report)


def model_signature(model: nn.Module) -> str:
    """Hash of the parameter names and shapes: peers training different architectures can't mix."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]


def join_swarm(cfg: RunConfig, model: Optional[nn.Module] = None) -> Swarm:
    """Start this peer's node, join ``cfg.swarm.run_id`` and check the run fingerprint.

    With ``model`` the fingerprint also covers its parameter names and shapes (for modules other than
    the built-in GPT). Raises :class:`~p2pdiloco.errors.UserError` subclasses on bad addresses, an
    unreachable bootstrap peer or a configuration that differs from the run's.
    """
    s = cfg.swarm
    node = SwarmNode(s.initial_peers, host_maddrs=listen_maddrs(s.host_maddrs, s.initial_peers),
                     announce_maddrs=s.announce_maddrs,
                     identity_path=s.identity_path, bootstrap_timeout=s.bootstrap_timeout,
                     reachability=s.reachability)
    try:
        swarm = Swarm(node, s.run_id, matchmaking_timeout=s.matchmaking_timeout, allreduce_timeout=s.allreduce_timeout,
                      min_group_size=s.min_group_size, progress_period=s.progress_period, robust=cfg.robust,
                      group_cap=s.group_cap, gather=s.gather)
        fields = fingerprint_fields(cfg)
        if model is not None:
            fields["model.signature"] = model_signature(model)
        swarm.check_fingerprint(fingerprint_of(fields), fields)
    except BaseException:
        node.shutdown()
        raise
    swarm.update_progress(step=0, round=0, samples=0, sent=0, recv=0, next_sync=cfg.inner.sync_every, synced_step=0)
    swarm.publish_progress(wait=True)  # visible before we wait for peers
    swarm.start_publishing()
    if s.min_peers_to_start > 1:
        swarm.wait_for_peers(s.min_peers_to_start, s.start_timeout)
    return swarm


def leave_swarm(swarm: Optional[Swarm]) -> None:
    """Say goodbye in the DHT and stop the node."""
    if swarm is not None:
        swarm.shutdown()
        swarm.node.shutdown()
