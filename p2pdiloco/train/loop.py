"""The training loop behind ``p2pdiloco join``: read it top to bottom.

    join the swarm → check the run fingerprint → build the model from the run's seed (so every peer
    starts from the same θ) → inner AdamW steps on this peer's data shard → every H steps the
    fragment syncs (DiLoCo.after_inner_step) → metrics, validation loss, checkpoint → repeat until
    a budget is reached or SIGINT/SIGTERM → say goodbye → print a summary.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import faults
from ..addresses import listen_maddrs
from ..checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from ..config import RunConfig
from ..data import BatchStream, evaluate, load_corpus
from ..metrics import MetricsWriter, format_bytes
from ..run_identity import fingerprint_fields, fingerprint_of, run_fingerprint
from ..model import count_parameters, seeded_model
from ..errors import JoinFailed, SyncFailed
from ..swarm.relay import RelayLimits
from ..swarm.standing import in_minority, pick_target, rival_lineage
from ..swarm.state_sync import StateServer, download_state
from ..diloco.core import DiLoCo, SyncReport
from .inner import inner_optimizer, inner_step, local_stream

__all__ = ["run_peer"]

logger = logging.getLogger(__name__)

#: in its first progress_period of training (before its first sync) a peer publishes its record this often
EARLY_PUBLISH_PERIOD = 2.0


def run_peer(cfg: RunConfig, *, stop_flag: Optional[list] = None, local=None) -> Dict[str, Any]:
    """Run one volunteer until a budget is reached or SIGINT/SIGTERM; return its summary.

    The peer's life, as named steps (:class:`_Peer`): ``connect`` (DHT node, swarm, fingerprint
    check, run folder) → ``build`` (model from the run's seed, data shard, optimiser, DiLoCo; resume
    from a checkpoint) → ``join_run`` (a run in progress: its verified state) → ``announce`` (start
    event, first progress record, wait for peers) → ``train`` (inner steps; syncs, catch-ups and
    divergence checks between them) → ``finish`` (syncs in flight applied, checkpoint, summary).
    ``close`` releases everything, whatever happened.

    ``local`` (a :class:`~p2pdiloco.local.group.LocalGroup` of rank 0, ``join --local-workers K``):
    this process is the swarm member of a machine of K local workers (:mod:`p2pdiloco.local`); one
    more step, ``brief_workers``, hands them the start, and every inner step ends with a message to
    them (``_tell_workers``).
    """
    faults.install_from_env()  # P2PDILOCO_FAULTS: fault injection for tests (p2pdiloco/faults.py)
    stop = stop_flag if stop_flag is not None else []
    # from the start: a SIGTERM while starting up still leaves cleanly. With local workers the launcher
    # passes its signals on, and a terminal's Ctrl-C reaches us directly too: a repeat within 1 s is one
    _install_signal_handlers(stop, repeat_s=1.0 if local is not None else 0.0)
    if local is not None:
        local.set_threads(cfg.train.threads)
        local.sharded = cfg.local.sharding == "fsdp"
        local.connect()
    elif cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    peer = _Peer(cfg, stop, local)
    try:
        peer.connect()
        peer.build()
        peer.join_run()
        peer.announce()
        peer.brief_workers()
        peer.train()
        return peer.finish()
    finally:
        peer.close()


class _Peer:
    """One volunteer's state between the steps of :func:`run_peer` (one training thread owns it)."""

    def __init__(self, cfg: RunConfig, stop: list, local=None):
        from ..swarm.node import SwarmNode

        self.cfg, self.stop = cfg, stop
        #: local workers (issue 20): our LocalGroup (rank 0) and, once briefed, our side of the protocol
        self.local, self.leader = local, None
        self.world = local.world if local is not None else 1
        self.device = local.device if local is not None else cfg.train.resolved_device()
        #: local.sharding = "fsdp": ``model`` (what DiLoCo syncs, validates and checkpoints) is a full copy on
        #: our CPU and the inner steps train our shard (``train_model``, ``train_opt``; :mod:`p2pdiloco.local.fsdp`)
        self.sharded = local is not None and local.sharded
        self.eval_device = "cpu" if self.sharded else self.device
        self.shards = None
        self.node = SwarmNode(cfg.swarm.initial_peers,
                              host_maddrs=listen_maddrs(cfg.swarm.host_maddrs, cfg.swarm.initial_peers),
                              announce_maddrs=cfg.swarm.announce_maddrs, identity_path=cfg.swarm.identity_path,
                              bootstrap_timeout=cfg.swarm.bootstrap_timeout, reachability=cfg.swarm.reachability,
                              relay=RelayLimits() if cfg.swarm.relay else None)
        self.me = self.node.short_id
        self.swarm = None
        self.metrics: Optional[MetricsWriter] = None
        self.dashboard = None
        # the training loop's counters (summary, progress records)
        self.losses: List[float] = []
        self.val = self.val0 = float("nan")
        self.syncs = self.failed = self.samples = self.steps = 0
        self.t_start = time.time()
        self._published_early_at = time.time()  # when our record was last published early (_publish_early)

    # ---- connect -------------------------------------------------------------------------------------
    def connect(self) -> None:
        """The swarm facade, the optional dashboard, the fingerprint check, the run folder and metrics."""
        from ..swarm.swarm import Swarm

        cfg, node = self.cfg, self.node
        self.swarm = swarm = Swarm(node, cfg.swarm.run_id, matchmaking_timeout=cfg.swarm.matchmaking_timeout,
                                   allreduce_timeout=cfg.swarm.allreduce_timeout,
                                   min_group_size=cfg.swarm.min_group_size,
                                   progress_period=cfg.swarm.progress_period, robust=cfg.robust)
        if cfg.train.dashboard_port:  # join --dashboard-port: this peer serves the swarm's dashboard (issue 21)
            from ..dashboard import serve_for_node

            self.dashboard = serve_for_node(node, cfg.swarm.run_id, host=cfg.train.dashboard_host,
                                            port=cfg.train.dashboard_port, period=cfg.swarm.progress_period)
        swarm.allreducer.round_samples = cfg.inner.round_samples  # weights differ as speeds do (robust.screen)
        fields = fingerprint_fields(cfg)
        swarm.check_fingerprint(fingerprint_of(fields), fields)
        swarm.timeouts.configure(min_link_mbit=cfg.swarm.min_link_mbit, adaptive=cfg.swarm.adaptive_timeouts)
        swarm.matchmaker.adaptive = cfg.swarm.adaptive_timeouts
        self.run_dir = cfg.train.run_dir or os.path.join("runs", cfg.swarm.run_id, self.me)
        os.makedirs(self.run_dir, exist_ok=True)
        _save_run_config(cfg, self.run_dir)
        self.metrics = metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
        faults.set_sink(lambda **event: metrics.write("fault", **event))  # tests assert faults fired

    # ---- build -----------------------------------------------------------------------------------------
    def build(self) -> None:
        """Model, data, inner optimiser and DiLoCo; resume from this peer's checkpoint if there is one."""
        cfg, me = self.cfg, self.me
        # Same seed on every peer: everyone starts from the same global parameters without a download.
        self.model = seeded_model(cfg.model, cfg.train.seed).to(self.eval_device)
        self.corpus = load_corpus(cfg.data)
        ckpt_path = find_checkpoint(self.run_dir)
        ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None
        self.shard = _data_shard(cfg, self.node.peer_id_str, ckpt)
        # our slice of the shard: the whole shard alone, the first of K slices with local workers
        self.stream = local_stream(cfg, self.corpus, self.shard, 0, self.world)
        self.inner_opt = inner_optimizer(cfg, self.model.parameters())
        self.train_model, self.train_opt = self.model, self.inner_opt
        if self.sharded:  # our shard; self.inner_opt only carries a resumed state to the workers' shards
            from ..local.fsdp import FsdpShards, build_sharded

            self.train_model = build_sharded(cfg, self.device)
            self.shards = FsdpShards(self.local, self.train_model)
            self.train_opt = inner_optimizer(cfg, self.train_model.parameters())
        self.diloco = diloco = DiLoCo(self.model, cfg, self.swarm)
        StateServer(self.node, cfg.swarm.run_id, diloco.snapshot)
        logger.info(f"[{me}] peer {self.node.peer_id_str} joined run {cfg.swarm.run_id} (fingerprint "
                    f"{run_fingerprint(cfg)}); model {count_parameters(self.model):,} params on {self.device}; data shard "
                    f"{self.shard}/{cfg.data.num_shards} of {self.corpus.description}")
        for line in diloco.layout.describe().splitlines():
            logger.info(f"[{me}] {line}")
        for line in cfg.advice():
            logger.warning(f"[{me}] {line}")
        if ckpt is not None:
            saved_world = _local_workers_of(ckpt)
            _restore(ckpt, self.model, self.inner_opt, diloco, self.stream if saved_world == self.world else None)
            if saved_world != self.world:
                self._reshard(ckpt, saved_world)
            logger.info(f"[{me}] resumed from {ckpt_path} at inner step {diloco.position}")
            self.metrics.write("resume", step=diloco.position, synced_step=diloco.synced_step,
                               digest=diloco.digest(), outer_step=diloco.outer_round())
        self.numels = [o.numel for o in diloco.outer]
        self.recent = 2 * diloco.num_fragments + 2  # how many of our lineage's latest groups identify our side
        self.swarm.matchmaker.give_way = lambda peers: (
            f"{len(found)} peer(s) of another history outnumber ours: adopting their state instead"
            if (found := self.rivals(peers)) else None)

    def _reshard(self, ckpt: Dict[str, Any], saved_world: int) -> None:
        """Resuming with another number of local workers: the model, the inner optimiser, the global
        copies and the schedule resume as saved; the data is re-sliced into the new K sub-shards of
        our shard, each stream drawing on from the saved count (the exact batches of the old slicing
        cannot carry over)."""
        drawn = int((ckpt.get("stream") or {}).get("batches_drawn", 0))
        for _ in range(drawn):
            self.stream.next_starts()
        logger.warning(f"[{self.me}] the checkpoint was written by {saved_world} local worker(s), this peer has "
                       f"{self.world}: resuming the model, optimiser and global state, with the data re-sliced "
                       f"into {self.world} sub-shard(s) of shard {self.shard}")
        self.metrics.write("reshard", local_workers=self.world, saved_local_workers=saved_world,
                           step=self.diloco.position, batches_drawn=drawn)

    # ---- catching up, giving way -------------------------------------------------------------------------
    def rivals(self, peers: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Dict[str, Any]]]:
        """The peers of a rival history that outnumbers ours (a healed partition), or None
        (standing.rival_lineage). Our synced step and digest as last published: this also runs
        on the network thread (Matchmaker.give_way), never waiting on a background sync."""
        swarm = self.swarm
        own = swarm.own_progress()
        step, digest = own.get("synced_step"), own.get("digest")
        if not isinstance(step, int) or not step or not isinstance(digest, str):
            return None  # nothing synced yet: a fresh run, or a joiner that catches up at its first sync
        return rival_lineage(peers, self.node.peer_id_str, swarm.matchmaker.lineage(self.recent), step, digest,
                             swarm.matchmaker.companions, trusted=swarm.matchmaker.voters(peers))

    def adopt_rivals(self) -> bool:
        """Give way to the rival history: adopt its verified state, even if our step count is ahead."""
        return self.catch_up(wait=0, min_step=-1, peers=lambda: self.rivals(self.swarm.live_peers()) or {})

    def _announce_target(self, target_step: int) -> None:
        # before the download: the next round's group waits for us (our first contribution lands there)
        self.swarm.update_progress(step=target_step, next_sync=_next_sync_after(self.diloco, target_step), sps=0.0)
        self.swarm.publish_progress()

    def _report_mismatch(self, got) -> None:
        """A verified state of our own synced step with another digest: every peer of a step should
        hold the same bits, so this is a bug. Say where the states first differ before adopting."""
        diloco = self.diloco
        diff = diloco.first_difference(got.meta, got.payload)
        if diff is None:
            return
        logger.warning(f"[{self.me}] digest mismatch at step {diloco.synced_step} (ours {diloco.digest()}, the "
                       f"swarm's {got.digest}); this is a bug, please report it with this line: first differing "
                       f"tensor: fragment {diff['fragment']} {diff['tensor']} ({diff['kind']}), "
                       f"{diff['differing']} of {diff['numel']} elements differ, max |diff| "
                       f"{diff['max_abs_diff']:.3g}; adopting the majority's state")
        self.metrics.write("digest_mismatch", step=diloco.synced_step, ours=diloco.digest(), theirs=got.digest,
                           **diff)

    def catch_up(self, wait: float, min_step: Optional[int] = None, joining: bool = False, peers=None) -> bool:
        """Adopt the swarm's verified state if it is ahead of ours; poll up to ``wait`` seconds.
        A failed download while ``joining`` stops the peer (JoinFailed); later it keeps our state."""
        cfg, swarm, diloco, metrics = self.cfg, self.swarm, self.diloco, self.metrics
        deadline = time.time() + wait
        read: Dict[str, Dict[str, Any]] = {}  # the records the target was picked from

        def source() -> Dict[str, Dict[str, Any]]:
            view = (peers or swarm.live_peers)()
            read.clear()
            read.update(view)
            return view

        while True:
            t_try = time.time()
            try:
                got = download_state(self.node, cfg.swarm.run_id, source, self.numels,
                                     timeout=swarm.timeouts.transfer(8 * sum(self.numels)),
                                     min_step=diloco.synced_step if min_step is None else min_step,
                                     on_target=self._announce_target,
                                     # a rival lineage (peers given) was already judged by majority
                                     companions=() if peers else swarm.matchmaker.companions,
                                     partners=swarm.matchmaker.partners.current(),
                                     # donors publish their record right after a sync; a failed store
                                     # is retried within a progress period
                                     record_wait=swarm.progress_period + 5.0)
            except SyncFailed as e:
                metrics.write("catch_up_failed", step=diloco.position, error=str(e),
                              seconds=round(time.time() - t_try, 3))
                if joining:
                    raise JoinFailed(f"could not join run {cfg.swarm.run_id!r}: {e}") from None
                logger.warning(f"[{self.me}] {e}; keeping our own state for now")
                got = None
            if got is not None:
                self._adopt(got, read)
                return True
            if time.time() >= deadline:
                return False
            time.sleep(0.5)

    def _adopt(self, got, read: Dict[str, Dict[str, Any]]) -> None:
        """Load a verified download and take the donors' history as ours."""
        swarm, diloco, metrics = self.swarm, self.diloco, self.metrics
        for donor, why in got.rejected:
            metrics.write("state_rejected", donor=donor, reason=why, step=got.step)
        self._report_mismatch(got)
        diloco.load_snapshot(got.meta, got.payload)
        # we left our history for the donors': their last group is our lineage now (else the lineage
        # rule would see them as rivals again and again), they are our side
        gids = [g for g in dict.fromkeys(read.get(d, {}).get("gid") for d in got.donors) if isinstance(g, str) and g]
        swarm.matchmaker.adopt_lineage(gids)
        swarm.matchmaker.set_companions(got.donors)
        logger.info(f"[{self.me}] caught up with the swarm: step {diloco.position}, digest {diloco.digest()} "
                    f"from {len(got.donors)} donor(s) in {got.seconds:.1f} s")
        metrics.write("catch_up", step=diloco.position, digest=diloco.digest(), outer_step=diloco.outer_round(),
                      donors=got.donors, seconds=round(got.seconds, 3), rejected=len(got.rejected))
        swarm.update_progress(step=diloco.position, synced_step=diloco.synced_step, gid=gids[0] if gids else "",
                              round=diloco.outer_round(), digest=diloco.digest(), next_sync=diloco.next_sync_step())
        swarm.publish_progress()

    def val_loss(self) -> float:
        cfg = self.cfg
        return evaluate(self.model, self.corpus.val, batch_size=cfg.inner.batch_size, seq_len=cfg.model.seq_len,
                        max_batches=cfg.train.eval_batches, device=self.eval_device)

    # ---- join_run, announce ------------------------------------------------------------------------------
    def join_run(self) -> None:
        """Joining a run in progress: start from the swarm's verified state, not from scratch.
        For a moment the live peers' records can disagree (one published its latest sync, the other
        not yet: no corroborated target) or not be visible yet to our fresh DHT node; keep looking
        for a bounded time while the run has clearly started without us."""
        swarm, diloco = self.swarm, self.diloco
        # every live peer re-publishes its record each progress_period: one period (and a margin for the
        # store) shows them all; waiting a whole record lifetime (3 periods + 5 s) only delayed peers that
        # start together, each seeing the others' fingerprint claim but no progress record yet
        window = min(swarm.matchmaker.record_lifetime, swarm.progress_period + 5.0)
        deadline = time.time() + window
        while not self.catch_up(wait=0, joining=True):
            peers = {pid: v for pid, v in swarm.live_peers().items() if pid != self.node.peer_id_str}
            counted = swarm.matchmaker.voters(peers)  # claims of identities without a say delay nobody
            ahead = [v for pid, v in peers.items() if pid in counted
                     and isinstance(v.get("synced_step"), int) and v["synced_step"] > diloco.synced_step]
            if not ahead and (peers or not swarm.run_existed):
                return  # a fresh run (or we are level with it): nothing to fetch
            if not peers and swarm.only_recent_claims(window):
                # every other claimant started within the window and none has a progress record: peers
                # starting together (a record of a peer that trained would show within it)
                logger.info(f"[{self.me}] run {self.cfg.swarm.run_id!r}: the other peers that claimed it started "
                            "with us; starting it afresh together")
                return
            if time.time() >= deadline:
                if ahead:
                    logger.warning(f"[{self.me}] the run is in progress but its peers do not agree on one state "
                                   "yet; starting from our own and catching up at the first sync")
                else:
                    logger.info(f"[{self.me}] run {self.cfg.swarm.run_id!r} has no live peer; starting it afresh")
                return
            time.sleep(0.5)

    def announce(self) -> None:
        """The start event and our first progress record; then wait for swarm.min_peers_to_start."""
        cfg, swarm, diloco = self.cfg, self.swarm, self.diloco
        self.val = self.val0 = self.val_loss()
        self.metrics.write("start", peer=self.node.peer_id_str, shard=self.shard,
                           params=count_parameters(self.model), val_loss=self.val0, fingerprint=run_fingerprint(cfg),
                           digest=diloco.digest(), step=diloco.position, device=str(self.device),
                           cpu_capability=torch.backends.cpu.get_cpu_capability(),
                           # rounds by the swarm's samples: tokens of the whole swarm per schedule position
                           tokens_per_position=(cfg.inner.round_samples / cfg.inner.sync_every * cfg.model.seq_len
                                                if cfg.inner.round_samples else None))
        swarm.update_progress(step=diloco.position, round=diloco.outer_round(), samples=0, sent=0, recv=0,
                              loss=None, val_loss=self.val0, digest=diloco.digest(), last_sync=None, sps=0.0,
                              next_sync=diloco.next_sync_step(), synced_step=diloco.synced_step)
        swarm.update_progress(lw=self.world)  # local workers training this replica (status)
        swarm.note_val_loss(diloco.outer_round(), self.val0)  # the dashboard's history (issue 21)
        swarm.publish_progress(wait=True)  # visible before we wait for peers
        swarm.start_publishing()
        _wait_for_peers(swarm, cfg, self.me)

    # ---- brief the local workers -------------------------------------------------------------------------------
    def brief_workers(self) -> None:
        """With local workers: hand them the start (our run folder, data shard, stream position and
        inner optimiser state; the parameters and global copies follow with the first message)."""
        if self.local is None:
            return
        from ..local.group import LocalLeader

        self.leader = LocalLeader(self.local, self.model, self.diloco, self.shards, self.train_opt)
        self.leader.brief(dict(run_dir=self.run_dir, me=self.me, peer=self.node.peer_id_str, shard=self.shard,
                               batches_drawn=self.stream.batches_drawn), self.inner_opt)
        held = self.shards.local_numel() if self.shards is not None else count_parameters(self.model)
        logger.info(f"[{self.me}] {self.world} local workers train this replica (data sub-shards "
                    f"{self.stream.shard}..{self.stream.shard + self.world - 1} of {self.stream.num_shards}; "
                    f"{self.cfg.local.sharding}: {held:,} of {count_parameters(self.model):,} parameter elements "
                    "on this worker)")
        self.metrics.write("local_shard", rank=0, world=self.world, sharding=self.cfg.local.sharding, param_numel=held,
                           params=count_parameters(self.model))

    def _tell_workers(self, final: bool = False) -> None:
        """After each inner step (and at the start and the end): tell the local workers whether to go on
        and send them what our DiLoCo changed since our step (:mod:`p2pdiloco.local.group`)."""
        if self.leader is None:
            return
        ctl = self.leader.tell(self.go and not final, self.diloco.lr_step, final)
        if ctl.event is not None:
            self.metrics.write("local_sync", **ctl.event)

    # ---- train ---------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Inner steps until a budget is reached or a signal arrives; after each, the syncs that are due
        (DiLoCo.after_inner_step), the catch-up a failed or missed round calls for, and now and then a
        check against the swarm's records (behind, or diverged)."""
        cfg, diloco = self.cfg, self.diloco
        self.t_start = self._published_early_at = time.time()
        self.bar = _ProgressLine(cfg, self.me, self.metrics)
        self.last_check = time.time()
        diloco.on_sync = self.on_sync
        self.model.train()
        self.train_model.train()
        diloco.start_clock()
        self.go = self._keep_going()
        self._tell_workers()  # local workers: the parameters and global copies to start from
        while self.go:
            t0 = time.perf_counter()
            loss, batch = self._inner_step()
            faults.set_step(diloco.position + 1)
            # fault-injection hook: after this step's update, before its syncs (``slow``: a slower machine)
            faults.fire("step", busy=time.perf_counter() - t0)
            self._after_syncs(diloco.after_inner_step(batch))
            self._check_against_swarm()
            self._update_progress()
            self._publish_early()
            self.bar.update(diloco, loss, self.val, *self.node.traffic.snapshot())
            self.go = self._keep_going()
            self._tell_workers()

    def _keep_going(self) -> bool:
        """No signal, and no budget (outer steps, seconds) reached."""
        cfg = self.cfg
        if self.stop:
            return False
        if cfg.train.max_outer_steps and self.diloco.outer_round() >= cfg.train.max_outer_steps:
            return False
        return not (cfg.train.max_seconds and time.time() - self.t_start >= cfg.train.max_seconds)

    def _update_progress(self) -> None:
        """Our progress record between publications: position, speed (``sps``: schedule positions per
        second, what matchmaking's waits are derived from), samples/s and, with the swarm clock, its
        position and when it was read (:mod:`.clock`)."""
        diloco, now = self.diloco, time.time()
        sent, recv = self.node.traffic.snapshot()
        rate = self.samples / max(now - self.t_start, 1e-9)  # this session's
        fields = dict(step=diloco.position, samples=self.samples, sent=sent, recv=recv, rate=rate,
                      sps=self.steps / max(now - self.t_start, 1e-9))
        if diloco.clock is not None:
            fields.update(sps=diloco.clock.speed(), rate=diloco.clock.rate(), pos=diloco.clock.pos, pt=now)
        self.swarm.update_progress(**fields)

    def _publish_early(self) -> None:
        """During our first ``progress_period`` of training and before our first sync, publish our record
        every ``EARLY_PUBLISH_PERIOD`` seconds (the first time after that long) instead of waiting for the
        period: a few more records, once. Until a peer's measured rate arrives the others count it as fast
        as themselves (:meth:`DiLoCo._clock_target`), and a first rate measured over the first, slower steps
        is off; in the first round that sent a slow peer late and the fast ones early, as their clocks agree
        only through the records (``pos``, ``pt``). Matchmaking derives its waits from the published speeds
        too. Afterwards the periodic publisher and every sync keep the records fresh."""
        now = time.time()
        if (self.syncs or now - self.t_start > self.swarm.progress_period
                or now - self._published_early_at < EARLY_PUBLISH_PERIOD):
            return
        self._published_early_at = now
        self.swarm.publish_progress()

    def _inner_step(self) -> Tuple[float, int]:
        """One AdamW step on the next batch of our shard; returns (loss, batch size). With local workers,
        the machine's step: gradients and loss averaged over the workers, the batch their sum."""
        value, batch = inner_step(self.cfg, self.train_model, self.train_opt, self.stream, self.diloco.lr_step,
                                  self.device, local=self.local)
        if self.leader is not None:
            batch *= self.world
            self.leader.after_step()  # a parameter changed after this is DiLoCo's doing: the workers need it
        self.losses.append(value)
        self.samples += batch
        self.steps += 1
        return value, batch

    def _after_syncs(self, reports: List[SyncReport]) -> None:
        """A missed round: catch up with our history, or give way to one that outnumbers ours. A failed
        round that may have completed for the others: adopt their θ rather than build on a stale one."""
        cfg = self.cfg
        if any(r.missed for r in reports):
            if self.rivals(self.swarm.live_peers()) is not None:
                logger.warning(f"[{self.me}] peers of another history outnumber ours; adopting their state")
                self.adopt_rivals()
            elif not self.catch_up(wait=cfg.swarm.allreduce_timeout):
                logger.warning(f"[{self.me}] missed a round and found no verified state to catch up to yet")
        elif any(not r.ok and not r.missed for r in reports):
            # A failed round may have completed for the others (a reply lost on its way to us only).
            # Then our θ is stale: adopt theirs rather than contribute against an old base.
            self.catch_up(wait=3 * cfg.swarm.progress_period)

    def _check_against_swarm(self) -> None:
        """Every progress_period, from the records read in the background (no DHT wait here): are we
        behind the swarm, in a rival history that is outnumbered, or diverged at the same step?"""
        diloco, me = self.diloco, self.me
        if not (time.time() - self.last_check >= self.cfg.swarm.progress_period and diloco.synced_step
                and (peers := self.swarm.peers_view()) is not None):
            return
        self.last_check = time.time()
        trusted = self.swarm.matchmaker.voters(peers)
        if pick_target(peers, self.node.peer_id_str, diloco.next_sync_step() - 1, len(self.numels),
                       companions=self.swarm.matchmaker.companions, trusted=trusted) is not None:
            # Behind (we were stopped, or slow): the swarm already did our next sync without us.
            # Re-sync now instead of training on, and never send a contribution for a past round.
            logger.warning(f"[{me}] the swarm is past our next sync (step {diloco.next_sync_step()}); catching up")
            self.catch_up(wait=0)
        elif (found := self.rivals(peers)) is not None:
            # They trained in groups we were not in (a healed partition) and outnumber us: we are
            # the minority history. Adopt theirs, even if our step count is ahead.
            logger.warning(f"[{me}] {len(found)} peer(s) trained in other groups and outnumber ours; "
                           "adopting their state")
            self.adopt_rivals()
        elif in_minority(peers, self.node.peer_id_str, *diloco.sync_point(), trusted=trusted):
            logger.warning(f"[{me}] our state at step {diloco.synced_step} differs from the majority's; "
                           "adopting theirs")
            self.catch_up(wait=0, min_step=diloco.synced_step - 1)

    def on_sync(self, rep: SyncReport) -> None:
        """DiLoCo's callback when a sync's result reached the model: metrics, progress record, lineage,
        validation loss, and a checkpoint once the last fragment of an outer step is in."""
        swarm, diloco = self.swarm, self.diloco
        sent, recv = self.node.traffic.snapshot()
        # null, not 0.0, when no inner step happened since the last event (overlapped modes)
        train_loss = sum(self.losses) / len(self.losses) if self.losses else None
        self.losses.clear()
        if rep.ok:
            self.syncs += 1
            group = swarm.matchmaker.groups.get((rep.fragment, rep.round))
            if group is not None:  # published: peers that trained in other groups are a rival lineage
                swarm.matchmaker.add_lineage(group.gid)
                swarm.update_progress(gid=group.gid)
                swarm.matchmaker.set_companions(group.members)
            self.val = self.val_loss()
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
        if rep.ok and rep.extra.get("round_samples"):  # our share of the round's samples (status, dashboard)
            swarm.update_progress(share=rep.samples / float(rep.extra["round_samples"]))
        synced_step, digest = diloco.sync_point()  # read together: a background sync may land any time
        swarm.update_progress(round=diloco.outer_round(), digest=digest, last_sync=time.time(),
                              synced_step=synced_step, val_loss=self.val, loss=train_loss,
                              next_sync=diloco.next_sync_step())
        if rep.ok:  # the dashboard's history (issue 21): loss per outer step, failed rounds and why
            swarm.note_val_loss(diloco.outer_round(), self.val)
        else:
            swarm.note_failure(rep.round + 1, rep.fragment, rep.error or "failed")
        swarm.publish_progress()  # at once: peers matchmaking for our next sync count on it
        logger.info(f"[{self.me}] sync frag {rep.fragment} round {rep.round} {'ok' if rep.ok else 'FAILED'} "
                    f"group {rep.group_size} {rep.seconds:.2f}s val_loss {self.val:.4f} digest {rep.digest}")
        if rep.ok and rep.fragment == diloco.num_fragments - 1:
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        opt = self.inner_opt
        if self.sharded:  # the workers gathered the full optimiser state to us after this step (or not)
            opt = self.leader.optimizer_state() if self.leader is not None else None
            if opt is None:
                logger.debug(f"[{self.me}] no checkpoint at step {self.diloco.position}: optimiser state not gathered")
                return
        with self.diloco.state_lock:  # not while a background sync writes a global copy
            snap = _snapshot(self.model, opt, self.diloco, self.stream, local_workers=self.world)
        save_checkpoint(self.run_dir, snap)

    # ---- finish, close -------------------------------------------------------------------------------------
    def finish(self) -> Dict[str, Any]:
        """Syncs still in flight (streaming overlap) are waited for and applied, then kept: checkpoint,
        summary event. Returns the summary."""
        diloco = self.diloco
        diloco.finish()
        self._tell_workers(final=True)  # the model as finish() left it: every local worker ends with it
        diloco.close()
        self._save_checkpoint()
        self.bar.close()
        sent, recv = self.node.traffic.snapshot()
        summary = {"peer": self.node.peer_id_str, "short_id": self.me, "val_loss_start": self.val0,
                   "val_loss_end": self.val, "outer_steps": diloco.outer_round(), "inner_steps": diloco.local_steps,
                   "schedule_position": diloco.position,
                   "syncs": self.syncs, "failed_syncs": self.failed, "bytes_sent": sent, "bytes_received": recv,
                   "reachability": self.node.reachability, "relayed_bytes": self.node.relay_stats["bytes"],
                   "seconds": round(time.time() - self.t_start, 2), "digest": diloco.digest(),
                   "run_dir": self.run_dir, "streaming_mode": diloco.mode,
                   "network_wait_seconds": round(diloco.wait_seconds, 3),
                   "peak_bytes_per_s": round(diloco.meter.peak if diloco.meter else 0.0, 1)}
        dht = self.node.dht_ledger()
        if dht:
            summary["dht_ledger"] = dht
        self.metrics.write("summary", **summary)
        return summary

    def close(self) -> None:
        """Stop serving, close the metrics, say goodbye to the swarm, stop the node (in that order)."""
        if self.dashboard is not None:
            self.dashboard.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.swarm is not None:
            self.swarm.shutdown()
        self.node.shutdown()
        if self.local is not None:
            self.local.close()


def _save_run_config(cfg: RunConfig, run_dir: str) -> None:
    """run_config.json (plus copies of the tokenizer and an HF config.json) in the run folder, so
    ``p2pdiloco export`` and ``sample`` rebuild the model and its tokenizer from the folder alone."""
    import json
    import shutil

    d = cfg.to_dict()
    if cfg.data.tokenizer:
        shutil.copyfile(cfg.data.tokenizer, os.path.join(run_dir, "tokenizer.json"))
    if cfg.model.kind == "hf" and cfg.model.hf_config.endswith(".json"):
        shutil.copyfile(cfg.model.hf_config, os.path.join(run_dir, "hf_config.json"))
        d["model"]["hf_config"] = os.path.abspath(os.path.join(run_dir, "hf_config.json"))
    tmp = os.path.join(run_dir, ".run_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, "run_config.json"))


def _data_shard(cfg: RunConfig, peer_id: str, ckpt: Optional[Dict[str, Any]]) -> int:
    """data.shard if set; else the shard of the checkpoint we resume (a restarted peer without a
    persistent identity has a new id, which would pick another shard); else derived from our id."""
    stream = ckpt.get("stream") if ckpt is not None else None
    if cfg.data.shard < 0 and isinstance(stream, dict) and isinstance(stream.get("shard"), int):
        return stream["shard"] // _local_workers_of(ckpt)  # rank 0's stream is sub-shard shard·K + 0
    return cfg.data.shard_for(peer_id)


def _local_workers_of(ckpt: Dict[str, Any]) -> int:
    """How many local workers wrote a checkpoint (1 before issue 20)."""
    k = ckpt.get("local_workers", 1)
    return k if isinstance(k, int) and k >= 1 else 1


def _next_sync_after(diloco: DiLoCo, step: int) -> int:
    """The first inner step after ``step`` at which some fragment syncs."""
    t = step + 1
    while not diloco.due(t):
        t += 1
    return t


def _wait_for_peers(swarm, cfg: RunConfig, me: str) -> None:
    """Hold the first step until swarm.min_peers_to_start peers are live (or start_timeout passes)."""
    want = cfg.swarm.min_peers_to_start
    if want > 1:
        n = swarm.wait_for_peers(want, cfg.swarm.start_timeout)
        if n >= want:
            logger.info(f"[{me}] {n} peers live; starting")
        else:
            logger.warning(f"[{me}] only {n} of {want} peers after {cfg.swarm.start_timeout:.0f} s; starting anyway")


def _snapshot(model, inner_opt, diloco: DiLoCo, stream: BatchStream, local_workers: int = 1) -> Dict[str, Any]:
    opt_state = inner_opt if isinstance(inner_opt, dict) else inner_opt.state_dict()  # a dict: gathered shards
    return {"format": 1, "local_workers": local_workers, "model": model.state_dict(), "inner_opt": opt_state,
            "outer": [o.state_dict() for o in diloco.outer], "inner_step": diloco.position,
            "samples_since": list(diloco.samples_since), "steps_since": list(diloco.steps_since),
            "stream": stream.state_dict(),
            "torch_rng": torch.get_rng_state(), "reducers": [r.state_dict() for r in diloco.reducers],
            "synced_step": diloco.synced_step, "digest": diloco.digest(), "overlap": diloco.overlap_state_dict(),
            "local_steps": diloco.local_steps, "clock": diloco.clock.state_dict() if diloco.clock else None}


def _restore(state: Dict[str, Any], model, inner_opt, diloco: DiLoCo, stream: Optional[BatchStream]) -> None:
    """Load a checkpoint; ``stream`` None: the data stream's position is not restored (re-sliced)."""
    from ..errors import CheckpointError

    try:
        model.load_state_dict(state["model"])
        inner_opt.load_state_dict(state["inner_opt"])
        for o, s in zip(diloco.outer, state["outer"], strict=True):
            o.load_state_dict(s)
        diloco.position = int(state["inner_step"])
        diloco.synced_step = int(state.get("synced_step", state["inner_step"]))
        diloco.samples_since = [int(x) for x in state["samples_since"]]
        # a checkpoint without step counts: the next round of each fragment is sent unscaled (step_scale 1)
        diloco.steps_since = [int(x) for x in state.get("steps_since") or [0] * len(diloco.fragments)]
        diloco.local_steps = int(state.get("local_steps", diloco.position))
        if diloco.clock is not None:
            diloco.clock.load_state_dict(state.get("clock") or {"pos": diloco.position})
        if "reducers" in state:  # error-feedback residuals, low-rank bases and ranks
            for r, s in zip(diloco.reducers, state["reducers"], strict=True):
                r.load_state_dict(s)
        diloco.load_overlap_state(state.get("overlap"))  # delay/eager: where each inner phase started
        if stream is not None:
            stream.load_state_dict(state["stream"])
        torch.set_rng_state(state["torch_rng"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"checkpoint does not match this configuration ({e}); "
                              "use the configuration it was written with, or delete it to start fresh") from None


def _install_signal_handlers(stop: list, repeat_s: float = 0.0) -> None:
    """SIGINT/SIGTERM: stop after the current step; a second one (later than ``repeat_s`` seconds after
    the first): at once."""
    import threading

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


class _ProgressLine:
    """A tqdm bar when stderr is a terminal (or asked for), else a status line every 10 s; either way a
    ``progress`` event in the metrics every 10 s (the demo's status line reads it before the first sync)."""

    def __init__(self, cfg: RunConfig, me: str, metrics=None):
        self.me, self.metrics = me, metrics
        self.total = cfg.train.max_outer_steps * cfg.inner.sync_every or None
        self.last = 0.0
        self.bar = None
        if cfg.train.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

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
