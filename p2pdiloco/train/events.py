"""What a training peer reports, and the counters behind it: its events in ``metrics.jsonl`` (start,
sync, progress, summary), its progress record in the DHT (what the other peers' matchmaking, catch-up
and the dashboard read), its log lines and its progress line on the terminal."""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Dict, List

import torch
from tqdm import tqdm

from ..config import RunConfig
from ..diloco.core import DiLoCo, SyncReport
from ..metrics import MetricsWriter, format_bytes
from ..model import count_parameters
from ..run_identity import run_fingerprint
from ..swarm.node import SwarmNode
from ..swarm.swarm import Swarm
from .replica import Machine, Replica

__all__ = ["Events", "ProgressLine", "EARLY_PUBLISH_PERIOD", "record_sync", "speed_fields"]

logger = logging.getLogger(__name__)

#: in its first progress_period of training (before its first sync) a peer publishes its record this often
EARLY_PUBLISH_PERIOD = 2.0


def speed_fields(diloco: DiLoCo, node: SwarmNode, samples: int, steps: int, t_start: float) -> Dict[str, Any]:
    """Our progress record's fields between syncs: position, speed (``sps``: schedule positions per
    second since ``t_start``, what the others' matchmaking derives its waits from), samples/s, traffic
    and, with the swarm clock, its position and when it was read (:mod:`p2pdiloco.diloco.clock`)."""
    now = time.time()
    sent, recv = node.traffic.snapshot()
    fields = dict(step=diloco.position, samples=samples, sent=sent, recv=recv,
                  rate=samples / max(now - t_start, 1e-9), sps=steps / max(now - t_start, 1e-9))
    if diloco.clock is not None:
        fields.update(sps=diloco.clock.speed(), rate=diloco.clock.rate(), pos=diloco.clock.pos, pt=now)
    return fields


def record_sync(swarm: Swarm, diloco: DiLoCo, rep: SyncReport, **fields: Any) -> None:
    """A sync's result reached the model: our progress record says so at once (peers matchmaking for our
    next sync count on it; a peer catching up picks its donors by synced step and digest; a failed
    round's step tells peers waiting for it that we did not complete it either). ``fields`` (losses) go
    in the same record. Call :meth:`Swarm.follow_group` for an ok sync first (our lineage)."""
    if rep.ok and rep.extra.get("round_samples"):  # our share of the round's samples (status, dashboard)
        swarm.update_progress(share=rep.samples / float(rep.extra["round_samples"]))
    synced_step, digest = diloco.sync_point()  # read together: a background sync may land any time
    swarm.update_progress(round=diloco.outer_round(), digest=digest, last_sync=time.time(),
                          synced_step=synced_step, next_sync=diloco.next_sync_step(), **fields)
    if not rep.ok:  # the dashboard's history: failed rounds and why
        swarm.note_failure(rep.round + 1, rep.fragment, rep.error or "failed")
        swarm.update_progress(failed=rep.step)
    swarm.publish_progress()


class Events:
    """A peer's reports: the metrics writer, its progress record (through the swarm facade) and the
    training counters they carry (losses since the last sync, validation loss, syncs, samples)."""

    def __init__(self, cfg: RunConfig, node: SwarmNode, swarm: Swarm, metrics: MetricsWriter):
        self.cfg, self.node, self.swarm, self.metrics = cfg, node, swarm, metrics
        self.me = node.short_id
        self.losses: List[float] = []  # inner losses since the last sync event
        self.val = self.val0 = float("nan")
        self.syncs = self.failed = self.samples = self.steps = 0
        self.t_start = time.time()
        self._published_early_at = time.time()  # when our record was last published early (publish_early)
        self.bar = None

    def announce(self, replica: Replica, machine: Machine) -> None:
        """The start event and our first progress record, published before we wait for peers."""
        cfg, swarm, diloco = self.cfg, self.swarm, replica.diloco
        self.val = self.val0 = replica.val_loss()
        self.metrics.write("start", peer=self.node.peer_id_str, shard=replica.shard,
                           params=count_parameters(replica.model), val_loss=self.val0, fingerprint=run_fingerprint(cfg),
                           digest=diloco.digest(), step=diloco.position, device=str(machine.device),
                           cpu_capability=torch.backends.cpu.get_cpu_capability(),
                           # rounds by the swarm's samples: tokens of the whole swarm per schedule position
                           tokens_per_position=(cfg.inner.round_samples / cfg.inner.sync_every * cfg.model.seq_len
                                                if cfg.inner.round_samples else None))
        swarm.update_progress(step=diloco.position, round=diloco.outer_round(), samples=0, sent=0, recv=0,
                              loss=None, val_loss=self.val0, digest=diloco.digest(), last_sync=None, sps=0.0,
                              next_sync=diloco.next_sync_step(), synced_step=diloco.synced_step)
        swarm.update_progress(lw=machine.world)  # local workers training this replica (status)
        swarm.note_val_loss(diloco.outer_round(), self.val0)  # the dashboard's history
        swarm.publish_progress(wait=True)  # visible before we wait for peers
        swarm.start_publishing()

    def start_training(self) -> None:
        """The clock of this session's rates starts now, and the progress line."""
        self.t_start = self._published_early_at = time.time()
        self.bar = ProgressLine(self.cfg, self.me, self.metrics)

    def stepped(self, loss: float, batch: int) -> None:
        self.losses.append(loss)
        self.samples += batch
        self.steps += 1

    def after_step(self, diloco: DiLoCo, loss: float) -> None:
        """After an inner step and its syncs: our progress record, an early publication, the progress line."""
        self.update_progress(diloco)
        self.publish_early()
        self.bar.update(diloco, loss, self.val, *self.node.traffic.snapshot())

    def update_progress(self, diloco: DiLoCo) -> None:
        """Our progress record between publications (:func:`speed_fields`)."""
        self.swarm.update_progress(**speed_fields(diloco, self.node, self.samples, self.steps, self.t_start))

    def publish_early(self) -> None:
        """During our first ``progress_period`` of training and before our first sync, publish our record
        every ``EARLY_PUBLISH_PERIOD`` seconds (the first time after that long) instead of waiting for the
        period: a few more records, once. Until a peer's measured rate arrives the others count it as fast
        as themselves (:meth:`DiLoCo._clock_target`), and a first rate measured over the first, slower steps
        is off; a slow peer would be sent late and the fast ones early in the first round, as their clocks
        agree only through the records (``pos``, ``pt``). Matchmaking derives its waits from the published
        speeds too. Afterwards the periodic publisher and every sync keep the records fresh."""
        now = time.time()
        if (self.syncs or now - self.t_start > self.swarm.progress_period
                or now - self._published_early_at < EARLY_PUBLISH_PERIOD):
            return
        self._published_early_at = now
        self.swarm.publish_progress()

    def synced(self, rep: SyncReport, diloco: DiLoCo, val_loss: Callable[[], float]) -> None:
        """A sync's result reached the model: the sync event, our progress record (published at once:
        peers matchmaking for our next sync count on it), our lineage, the validation loss."""
        swarm = self.swarm
        sent, recv = self.node.traffic.snapshot()
        # null, not 0.0, when no inner step happened since the last event (overlapped modes)
        train_loss = sum(self.losses) / len(self.losses) if self.losses else None
        self.losses.clear()
        if rep.ok:
            self.syncs += 1
            swarm.follow_group(rep.fragment, rep.round)
            self.val = val_loss()
            if self.syncs == 1 and (dht := self.node.dht_ledger()):
                # the start's DHT traffic (joining, waiting for peers, the first formation): benchmarks
                # subtract it from the summary's for the traffic per sync of a running swarm
                self.metrics.write("dht_ledger", dht_ledger=dht, dht_reads=dict(self.node.read_counts))
        else:
            self.failed += 1
        self.metrics.write("sync", step=rep.step, fragment=rep.fragment, outer_step=rep.round + 1, ok=rep.ok,
                           loss=train_loss, val_loss=self.val, group_size=rep.group_size,
                           sync_seconds=round(rep.seconds, 4), samples=rep.samples, bytes_sent=sent,
                           bytes_received=recv, sync_bytes_sent=rep.bytes_sent,
                           sync_bytes_received=rep.bytes_received, digest=rep.digest, error=rep.error or None,
                           applied_step=rep.applied_step, wait_seconds=round(rep.wait_seconds, 4),
                           overlapped_steps=rep.overlapped_steps, sync_bytes=rep.bytes_sent + rep.bytes_received,
                           peak_bytes_per_s=round(rep.peak_bytes_per_s, 1),
                           relayed_bytes=self.node.relay_stats["bytes"], **rep.extra)
        if rep.ok:  # the dashboard's history: loss per outer step
            swarm.note_val_loss(diloco.outer_round(), self.val)
        record_sync(swarm, diloco, rep, val_loss=self.val, loss=train_loss)
        logger.info(f"[{self.me}] sync frag {rep.fragment} round {rep.round} {'ok' if rep.ok else 'FAILED'} "
                    f"group {rep.group_size} {rep.seconds:.2f}s val_loss {self.val:.4f} digest {rep.digest}")

    def validated_at_end(self, val: float) -> None:
        """The validation loss of the model at the end of training (the global model), when no sync
        event measured it: the summary's ``val_loss_end`` and our progress record carry it."""
        self.val = val
        self.swarm.update_progress(val_loss=val)

    def summary(self, diloco: DiLoCo, run_dir: str) -> Dict[str, Any]:
        """The peer's summary, also written as the ``summary`` event."""
        node = self.node
        sent, recv = node.traffic.snapshot()
        summary = {"peer": node.peer_id_str, "short_id": self.me, "val_loss_start": self.val0,
                   "val_loss_end": self.val, "outer_steps": diloco.outer_round(), "inner_steps": diloco.local_steps,
                   "schedule_position": diloco.position,
                   "syncs": self.syncs, "failed_syncs": self.failed, "bytes_sent": sent, "bytes_received": recv,
                   "reachability": node.reachability, "relayed_bytes": node.relay_stats["bytes"],
                   "seconds": round(time.time() - self.t_start, 2), "digest": diloco.digest(),
                   "run_dir": run_dir, "streaming_mode": diloco.mode,
                   "network_wait_seconds": round(diloco.wait_seconds, 3),
                   "peak_bytes_per_s": round(diloco.meter.peak if diloco.meter else 0.0, 1)}
        dht = node.dht_ledger()
        if dht:
            summary["dht_ledger"] = dht
            summary["dht_reads"] = dict(node.read_counts)
        self.metrics.write("summary", **summary)
        return summary

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ProgressLine:
    """A tqdm bar when stderr is a terminal (or asked for), else a status line every 10 s; either way a
    ``progress`` event in the metrics every 10 s (the demo's status line reads it before the first sync)."""

    def __init__(self, cfg: RunConfig, me: str, metrics=None):
        self.me, self.metrics = me, metrics
        self.total = cfg.train.max_outer_steps * cfg.inner.sync_every or None
        self.last = 0.0
        self.bar = None
        if cfg.train.progress_bar and sys.stderr.isatty():
            self.bar = tqdm(total=self.total, desc=f"peer {me}", unit="step", dynamic_ncols=True)

    def update(self, diloco: DiLoCo, loss: float, val: float, sent: int, recv: int) -> None:
        now = time.time()
        due = now - self.last >= 10
        if due:
            self.last = now
            if self.metrics is not None:
                self.metrics.write("progress", step=diloco.position, outer_step=diloco.outer_round(), loss=loss,
                                   bytes_sent=sent, bytes_received=recv)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(outer=diloco.outer_round(), loss=f"{loss:.3f}", val=f"{val:.3f}",
                                 sent=format_bytes(sent), refresh=False)
            return
        if due:
            print(f"[{self.me}] step {diloco.position}{'/' + str(self.total) if self.total else ''} "
                  f"outer {diloco.outer_round()} loss {loss:.3f} val {val:.3f} sent {format_bytes(sent)} "
                  f"recv {format_bytes(recv)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
