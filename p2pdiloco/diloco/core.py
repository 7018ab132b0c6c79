"""DiLoCo for any ``torch.nn.Module``: call :meth:`DiLoCo.after_inner_step` after each inner step.

DiLoCo (Douillard et al., arXiv 2311.08105): every peer takes H inner optimiser steps from the
global parameters θ, then the peers average their pseudo-gradients Δ_m = θ − θ_m (weighted by
samples processed) and apply an outer Nesterov step; every peer then restarts from the new θ.
With fragments (Streaming DiLoCo, arXiv 2501.18512) fragment p does the same on its own parameters
at inner steps t = p·H/P + k·H, k ≥ 1, so each fragment still takes H inner steps between syncs.

A failed sync (``SyncFailed``: a peer died, a timeout) is discarded on every peer: the global copy
stays as it was and the local parameters keep their progress, which is then part of the next
round's pseudo-gradient, so no inner step is lost.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compression import Codec, get_codec
from ..config import RunConfig
from ..errors import ConfigError, RoundMissed, SyncFailed
from .fragments import FragmentLayout, split_fragments
from .outer import OuterState
from .reducers import Reducer, make_reducer

__all__ = ["DiLoCo", "SyncReport"]

logger = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What one fragment sync did (one line of metrics.jsonl)."""

    step: int                 # inner step after which the sync ran
    fragment: int
    round: int                # the fragment's outer round (0-based)
    ok: bool
    group_size: int = 0
    seconds: float = 0.0
    samples: int = 0          # samples this peer contributed (its weight)
    bytes_sent: int = 0       # during this sync, payload and framing
    bytes_received: int = 0
    digest: str = ""          # of the fragment's θ and momentum after the sync
    error: str = ""
    missed: bool = False      # the round's group closed without us: the caller must catch up
    extra: Dict[str, object] = field(default_factory=dict)


class DiLoCo:
    """The outer loop around a user's model and inner optimiser.

    :param model: any module; with ``streaming.fragments > 1`` it needs ``blocks.<i>.`` parameters.
    :param cfg: run configuration (``inner.sync_every``, ``outer.*``, ``streaming.*``, ``compression.*``).
    :param swarm: a :class:`p2pdiloco.swarm.swarm.Swarm`, or None to train alone (the reference).
    """

    def __init__(self, model: nn.Module, cfg: RunConfig, swarm=None, *, outer_device: str = "cpu"):
        self.model = model
        self.cfg = cfg
        self.swarm = swarm
        self.H = cfg.inner.sync_every
        P = cfg.streaming.fragments
        if self.H % P:
            raise ConfigError(f"inner.sync_every ({self.H}) must be divisible by streaming.fragments ({P}) so "
                              "fragment syncs are evenly staggered")
        self.layout: FragmentLayout = split_fragments(model, P, cfg.streaming.pattern)
        named = dict(model.named_parameters())
        self.local: List[List[torch.Tensor]] = [[named[n] for n in names] for names in self.layout.names]
        self.outer: List[OuterState] = [
            OuterState(ps, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov,
                       device=outer_device)
            for ps in self.local
        ]
        self.codec: Codec = get_codec(cfg.compression.codec)
        #: one reducer per fragment: how its pseudo-gradient is averaged (plain, or compressed)
        self.reducers: List[Reducer] = [make_reducer(cfg, ps) for ps in self.local]
        self.inner_step = 0
        #: inner step of the last successful sync (the schedule position the digest belongs to)
        self.synced_step = 0
        self.samples_since = [0] * P
        self.on_sync: Optional[Callable[[SyncReport], None]] = None
        #: held while the global state changes, so snapshots served to joiners are consistent
        self.state_lock = threading.Lock()

    @property
    def num_fragments(self) -> int:
        return self.layout.num_fragments

    def offset(self, p: int) -> int:
        return p * self.H // self.num_fragments

    def due(self, t: int) -> List[int]:
        """Fragments that sync right after inner step ``t`` (1-based count of steps taken)."""
        return [p for p in range(self.num_fragments)
                if t - self.offset(p) >= self.H and (t - self.offset(p)) % self.H == 0]

    def round_of(self, p: int, t: int) -> int:
        return (t - self.offset(p)) // self.H - 1

    def next_sync_step(self) -> int:
        """Inner step after which this peer's next fragment sync happens."""
        t = self.inner_step + 1
        while not self.due(t):
            t += 1
        return t

    def outer_round(self) -> int:
        """Completed rounds of fragment 0: the run's outer step counter."""
        return self.outer[0].steps

    def after_inner_step(self, samples: int) -> List[SyncReport]:
        """Count one inner step of ``samples`` sequences; run the syncs that are due. Blocking."""
        self.inner_step += 1
        for p in range(self.num_fragments):
            self.samples_since[p] += samples
        return [self._sync(p, self.round_of(p, self.inner_step)) for p in self.due(self.inner_step)]

    def _sync(self, p: int, round_: int) -> SyncReport:
        t0 = time.perf_counter()
        sent0, recv0 = self.swarm.node.traffic.snapshot() if self.swarm else (0, 0)
        outer = self.outer[p]
        delta = outer.pseudo_gradient(self.local[p])
        report = SyncReport(step=self.inner_step, fragment=p, round=round_, ok=False, samples=self.samples_since[p])
        weight = float(self.samples_since[p])
        try:
            if self.swarm is None:
                allreduce, group_size = self._solo_allreduce, 1
            else:
                group = self.swarm.form_group(p, round_, self.inner_step)
                group_size = group.size

                def allreduce(vec: torch.Tensor, phase: str, codec: Optional[Codec] = None) -> torch.Tensor:
                    return self.swarm.allreduce(group, f"f{p}.{phase}", vec, weight, codec or self.codec)

            avg = self.reducers[p].reduce(delta, allreduce)
        except SyncFailed as e:
            report.error = str(e)
            report.missed = isinstance(e, RoundMissed)
            logger.warning(f"sync of fragment {p} round {round_} failed, keeping local progress: {e}")
        else:
            with self.state_lock:
                outer.step(avg)
                outer.copy_to(self.local[p])
                self.synced_step = self.inner_step
            self.samples_since[p] = 0
            report.ok, report.group_size, report.digest = True, group_size, outer.digest()
        sent1, recv1 = self.swarm.node.traffic.snapshot() if self.swarm else (0, 0)
        report.bytes_sent, report.bytes_received = sent1 - sent0, recv1 - recv0
        report.seconds = time.perf_counter() - t0
        if self.on_sync is not None:
            self.on_sync(report)
        return report

    def _solo_allreduce(self, vec: torch.Tensor, phase: str, codec: Optional[Codec] = None) -> torch.Tensor:
        """A group of one: what crossed the wire is what a lone peer applies too."""
        codec = codec or self.codec
        return codec.roundtrip(vec) if codec.relative_error_bound else vec.clone()

    def digest(self) -> str:
        """Digest of every fragment's global state, joined."""
        return "-".join(o.digest() for o in self.outer)

    # ---- state transfer to and from joining peers -------------------------------------------------
    def snapshot(self) -> Tuple[Dict[str, object], bytes]:
        """(meta, payload): every fragment's θ then momentum as fp32 bytes, taken under the lock."""
        with self.state_lock:
            chunks = []
            for o in self.outer:
                chunks += [t.detach().cpu().contiguous().view(-1) for t in (*o.params, *o.buffers)]
            payload = torch.cat(chunks).numpy().tobytes()
            meta = {"step": self.synced_step, "outer_steps": [o.steps for o in self.outer],
                    "numels": [o.numel for o in self.outer], "digest": self.digest()}
        return meta, payload

    def load_snapshot(self, meta: Dict[str, object], payload: bytes) -> None:
        """Adopt a verified snapshot: global state, local parameters and schedule position."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        with self.state_lock:
            off = 0
            for o, steps in zip(self.outer, meta["outer_steps"]):
                for t in (*o.params, *o.buffers):
                    t.copy_(flat[off: off + t.numel()].view_as(t))
                    off += t.numel()
                o.steps = int(steps)
            for o, local in zip(self.outer, self.local):
                o.copy_to(local)
            self.inner_step = self.synced_step = int(meta["step"])
            self.samples_since = [0] * self.num_fragments
