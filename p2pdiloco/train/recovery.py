"""Keeping a peer on the swarm's history: joining a run in progress, catching up when it fell behind
or a round failed, giving way to a rival history that outnumbers ours (a healed partition), and
adopting the majority's state when ours differs at the same step.

Every state adopted here is a verified download (:func:`p2pdiloco.swarm.state_sync.download_state`);
the rules that pick whom to download from (behind, rival lineage, minority) are in
:mod:`p2pdiloco.swarm.standing`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

from ..config import RunConfig
from ..diloco.core import DiLoCo, SyncReport
from ..errors import JoinFailed, SyncFailed
from ..metrics import MetricsWriter
from ..swarm.node import SwarmNode
from ..swarm.swarm import Swarm
from ..swarm.standing import in_minority, pick_target, rival_lineage
from ..swarm.state_sync import download_state

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)

Peers = Dict[str, Dict[str, Any]]


class Recovery:
    """The catch-up, rival and minority rules of one peer, over its DiLoCo and the swarm facade."""

    def __init__(self, cfg: RunConfig, node: SwarmNode, swarm: Swarm, diloco: DiLoCo, metrics: MetricsWriter):
        self.cfg, self.node, self.swarm, self.diloco, self.metrics = cfg, node, swarm, diloco, metrics
        self.me = node.short_id
        self.numels = [o.numel for o in diloco.outer]
        self.recent = 2 * diloco.num_fragments + 2  # how many of our lineage's latest groups identify our side
        self.last_check = time.time()
        swarm.set_give_way(self._give_way)

    def _give_way(self, peers: Peers) -> Optional[str]:
        """Matchmaking's question before a round: do we stop to adopt a rival history instead?"""
        if not (found := self.rivals(peers)):
            return None
        return f"{len(found)} peer(s) of another history outnumber ours: adopting their state instead"

    # ---- joining ---------------------------------------------------------------------------------------
    def join_run(self) -> None:
        """Joining a run in progress: start from the swarm's verified state, not from scratch.
        For a moment the live peers' records can disagree (one published its latest sync, the other
        not yet: no corroborated target) or not be visible yet to our fresh DHT node; keep looking
        for a bounded time while the run has clearly started without us."""
        swarm, diloco = self.swarm, self.diloco
        # every live peer re-publishes its record each progress_period: one period (and a margin for the
        # store) shows them all; waiting a whole record lifetime (3 periods + 5 s) only delays peers that
        # start together, each seeing the others' fingerprint claim but no progress record yet
        window = min(swarm.record_lifetime, swarm.progress_period + 5.0)
        deadline = time.time() + window
        while not self.catch_up(wait=0, joining=True):
            peers = {pid: v for pid, v in swarm.live_peers(why="start").items() if pid != self.node.peer_id_str}
            counted = swarm.voters(peers)  # claims of identities without a say delay nobody
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

    # ---- between inner steps ---------------------------------------------------------------------------
    def start_watching(self) -> None:
        """Training starts: the first check against the swarm is one progress_period away."""
        self.last_check = time.time()

    def after_syncs(self, reports: List[SyncReport]) -> None:
        """A missed round: catch up with our history, or give way to one that outnumbers ours. A failed
        round that may have completed for the others: adopt their θ rather than build on a stale one."""
        cfg = self.cfg
        if any(r.missed for r in reports):
            if self.rivals(self.swarm.live_peers(why="catch-up")) is not None:
                logger.warning(f"[{self.me}] peers of another history outnumber ours; adopting their state")
                self.adopt_rivals()
            elif not self.catch_up(wait=cfg.swarm.allreduce_timeout):
                logger.warning(f"[{self.me}] missed a round and found no verified state to catch up to yet")
        elif failed := [r for r in reports if not r.ok and not r.missed]:
            # A failed round may have completed for the others (a reply lost on its way to us only).
            # Then our θ is stale: adopt theirs rather than contribute against an old base. Once
            # every other live peer says it did not complete it either, there is nothing to wait for.
            self.catch_up(wait=3 * cfg.swarm.progress_period, settled=lambda view: self._failed_for_all(view, failed))

    def _failed_for_all(self, view: Peers, failed: List[SyncReport]) -> Optional[str]:
        """Why waiting for a newer state is over: every other live peer's record says the round(s) in
        ``failed`` did not complete for it either (its ``failed`` is at or past them, its synced step
        before them), so no one holds a state to catch up to. None while one has not said so (an
        older record, an older version, a straggler not there yet). A claim only ends our wait: a
        lying peer can make us keep our own state until the next check against the swarm's records,
        never adopt another one (that takes a verified download)."""
        if not view:  # nothing read (not even our own record): no evidence either way
            return None
        first, last = min(r.step for r in failed), max(r.step for r in failed)
        others = [rec for pid, rec in view.items() if pid != self.node.peer_id_str]
        for rec in others:
            gave_up, synced = rec.get("failed"), rec.get("synced_step")
            if not isinstance(gave_up, int) or gave_up < last or (isinstance(synced, int) and synced >= first):
                return None
        return f"the round at step {last} failed for every live peer ({len(others) + 1})"

    def check_against_swarm(self) -> None:
        """Every progress_period, from the records read in the background (no DHT wait here): are we
        behind the swarm, in a rival history that is outnumbered, or diverged at the same step?"""
        diloco, swarm, me = self.diloco, self.swarm, self.me
        if not (time.time() - self.last_check >= self.cfg.swarm.progress_period and diloco.synced_step
                and (peers := swarm.peers_view()) is not None):
            return
        self.last_check = time.time()
        trusted = swarm.voters(peers)
        if pick_target(peers, self.node.peer_id_str, diloco.next_sync_step() - 1, len(self.numels),
                       companions=swarm.companions, trusted=trusted) is not None:
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

    # ---- rivals ----------------------------------------------------------------------------------------
    def rivals(self, peers: Peers) -> Optional[Peers]:
        """The peers of a rival history that outnumbers ours (a healed partition), or None
        (standing.rival_lineage). Our synced step and digest as last published: this also runs
        on the network thread (matchmaking's give-way question), never waiting on a background sync."""
        swarm = self.swarm
        own = swarm.own_progress()
        step, digest = own.get("synced_step"), own.get("digest")
        if not isinstance(step, int) or not step or not isinstance(digest, str):
            return None  # nothing synced yet: a fresh run, or a joiner that catches up at its first sync
        return rival_lineage(peers, self.node.peer_id_str, swarm.lineage(self.recent), step, digest,
                             swarm.companions, trusted=swarm.voters(peers))

    def adopt_rivals(self) -> bool:
        """Give way to the rival history: adopt its verified state, even if our step count is ahead."""
        return self.catch_up(wait=0, min_step=-1,
                             peers=lambda: self.rivals(self.swarm.live_peers(why="catch-up")) or {})

    # ---- catching up -----------------------------------------------------------------------------------
    def catch_up(self, wait: float, min_step: Optional[int] = None, joining: bool = False, peers=None,
                 settled: Optional[Callable[[Peers], Optional[str]]] = None) -> bool:
        """Adopt the swarm's verified state if it is ahead of ours; poll up to ``wait`` seconds, or
        until ``settled`` of the records just read gives a reason to stop (logged, and the
        ``catch_up_settled`` event). A failed download while ``joining`` stops the peer (JoinFailed);
        later it keeps our state."""
        cfg, swarm, diloco, metrics = self.cfg, self.swarm, self.diloco, self.metrics
        t_start = time.time()
        deadline = t_start + wait
        read: Peers = {}  # the records the target was picked from

        def source() -> Peers:
            view = peers() if peers else swarm.live_peers(why="start" if joining else "catch-up")
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
                                     companions=() if peers else swarm.companions,
                                     partners=swarm.partners(),
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
            if settled is not None and (why := settled(read)):
                metrics.write("catch_up_settled", step=diloco.position, reason=why,
                              seconds=round(time.time() - t_start, 3), peers=len(read))
                logger.info(f"[{self.me}] {why}: keeping our state")
                return False
            if time.time() >= deadline:
                return False
            time.sleep(0.5)

    def _announce_target(self, target_step: int) -> None:
        # before the download: the next round's group waits for us (our first contribution lands there)
        self.swarm.update_progress(step=target_step, next_sync=_next_sync_after(self.diloco, target_step), sps=0.0)
        self.swarm.publish_progress()

    def _adopt(self, got, read: Peers) -> None:
        """Load a verified download and take the donors' history as ours."""
        swarm, diloco, metrics = self.swarm, self.diloco, self.metrics
        for donor, why in got.rejected:
            metrics.write("state_rejected", donor=donor, reason=why, step=got.step)
        self._report_mismatch(got, read)
        diloco.load_snapshot(got.meta, got.payload)
        # we left our history for the donors': their last group is our lineage now (else the lineage
        # rule would see them as rivals again and again), they are our side
        gids = [g for g in dict.fromkeys(read.get(d, {}).get("gid") for d in got.donors) if isinstance(g, str) and g]
        swarm.adopt_history(gids, got.donors)
        logger.info(f"[{self.me}] caught up with the swarm: step {diloco.position}, digest {diloco.digest()} "
                    f"from {len(got.donors)} donor(s) in {got.seconds:.1f} s")
        metrics.write("catch_up", step=diloco.position, digest=diloco.digest(), outer_step=diloco.outer_round(),
                      donors=got.donors, seconds=round(got.seconds, 3), rejected=len(got.rejected))
        swarm.update_progress(step=diloco.position, synced_step=diloco.synced_step, gid=gids[0] if gids else "",
                              round=diloco.outer_round(), digest=diloco.digest(), next_sync=diloco.next_sync_step())
        swarm.publish_progress()

    def _report_mismatch(self, got, read: Peers) -> None:
        """A verified state of our own synced step with another digest. Peers of one group hold the same
        bits: when the donor of the differing fragment was in the group of our last sync of that fragment,
        after as many syncs of it as ours, and the donors' last group is one of ours, this is a bug.
        Otherwise our groups were not theirs, for that fragment or for all (a split history: a peer that
        synced alone after its matchmaking timeout, a partition; the majority's is adopted, as designed).
        Either way, say where the states first differ before adopting."""
        diloco = self.diloco
        diff = diloco.first_difference(got.meta, got.payload)
        if diff is None:
            return
        where = (f"first differing tensor: fragment {diff['fragment']} {diff['tensor']} ({diff['kind']}), "
                 f"{diff['differing']} of {diff['numel']} elements differ, max |diff| {diff['max_abs_diff']:.3g}")
        theirs = {read.get(d, {}).get("gid") for d in got.donors} - {None, ""}
        frag = diff["fragment"]
        served = {d for d, frags in got.donors.items() if frag in frags}
        same_group = (bool(served & self.swarm.last_members(frag))
                      and int(got.meta["outer_steps"][frag]) == diloco.outer[frag].steps)
        split = not same_group or (bool(theirs) and not theirs & self.swarm.lineage(self.recent))
        if split:
            logger.warning(f"[{self.me}] our state at step {diloco.synced_step} comes from groups the donors were "
                           f"not in (ours {diloco.digest()}, theirs {got.digest}): a split history; adopting the "
                           f"majority's ({where})")
        else:
            logger.warning(f"[{self.me}] digest mismatch at step {diloco.synced_step} (ours {diloco.digest()}, the "
                           f"swarm's {got.digest}); this is a bug, please report it with this line: {where}; "
                           "adopting the majority's state")
        self.metrics.write("digest_mismatch", step=diloco.synced_step, ours=diloco.digest(), theirs=got.digest,
                           cause="split history" if split else "same group", **diff)


def _next_sync_after(diloco: DiLoCo, step: int) -> int:
    """The first inner step after ``step`` at which some fragment syncs."""
    t = step + 1
    while not diloco.due(t):
        t += 1
    return t
