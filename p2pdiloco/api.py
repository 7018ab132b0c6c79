"""Library entry points for training any ``torch.nn.Module`` with p2pdiloco.

    cfg = RunConfig()                      # or load_config("peers/tiny-cpu.toml", ["inner.sync_every=20"])
    swarm = join_swarm(cfg, model)         # None of this is needed to train alone: DiLoCo(model, cfg)
    diloco = DiLoCo(model, cfg, swarm)
    for x, y in batches:
        loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
        diloco.after_inner_step(samples=len(x))   # syncs when due
    leave_swarm(swarm)

See examples/custom_module.py for a complete, runnable script.
"""
from __future__ import annotations

import hashlib
from typing import Optional

from torch import nn

from .addresses import listen_maddrs
from .config import RunConfig
from .run_identity import fingerprint_fields, fingerprint_of
from .swarm.node import SwarmNode
from .swarm.swarm import Swarm

__all__ = ["join_swarm", "leave_swarm", "model_signature"]


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
                      min_group_size=s.min_group_size, progress_period=s.progress_period, robust=cfg.robust)
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
