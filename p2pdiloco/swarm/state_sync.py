"""State download: how a peer that joins mid-run, or missed a round, gets the swarm's global state.

Donor side: the ``state`` handler replies with a consistent snapshot (taken under the trainer's
state lock, between syncs): ``meta`` (inner step = schedule position, outer steps per fragment,
digest, element counts) and the payload, every fragment's θ then momentum, fp32.

Joiner side (:func:`download_state`):
  1. read the live peers' progress records; the *target* is the (step, digest) claimed by the most
     peers among those furthest ahead; with two or more live peers a claim made by a single peer
     is not enough (nobody jumps because of one unverified claim);
  2. ask the peers that claim the target, one by one, each bounded by ``timeout``;
  3. recompute the digest of what arrived; a mismatch (tampered or stale donor) is logged with the
     donor's id and the next donor is tried; if none delivers, :class:`SyncFailed` is raised and the
     caller stops rather than train on bad state.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import SyncFailed, WireError
from .protocol import (PROTOCOL_VERSION, close_after_reply, check_version, read_frame, read_header,
                       refuse_bad_request, write_frame)

__all__ = ["StateServer", "download_state", "state_digest", "pick_target", "in_minority"]

logger = logging.getLogger(__name__)

Snapshot = Tuple[Dict[str, Any], bytes]


def state_digest(payload: bytes, frag_numels: Sequence[int]) -> str:
    """The DiLoCo digest of a payload: per fragment sha256(θ bytes ‖ momentum bytes)[:16], joined by '-'."""
    out, off = [], 0
    for n in frag_numels:
        size = 2 * 4 * n
        out.append(hashlib.sha256(payload[off: off + size]).hexdigest()[:16])
        off += size
    return "-".join(out)


class StateServer:
    """Serves snapshots to joining peers. ``provider()`` returns (meta, payload) or None."""

    def __init__(self, node, run_id: str, provider: Callable[[], Optional[Snapshot]]):
        self.node = node
        self.provider = provider
        self.handler_name = f"p2pdiloco.{run_id}.state"
        #: fault-injection hook for tests: maps the payload before it is sent (e.g. tamper with it)
        self.tamper: Optional[Callable[[bytes], bytes]] = None
        self.served = 0
        node.add_handler(self.handler_name, self._handle)

    async def _handle(self, info, reader, writer) -> None:
        sender = info.peer_id.to_base58()
        try:
            header = await read_header(reader, self.node.traffic, sender)
            refusal = check_version(header) or (None if header.get("t") == "state" else "expected a state request")
            snap = None if refusal else await asyncio.get_running_loop().run_in_executor(None, self.provider)
            if refusal or snap is None:
                await write_frame(writer, {"t": "refuse", "reason": refusal or "no state yet"}, traffic=self.node.traffic)
                return
            meta, payload = snap
            if self.tamper is not None:
                payload = self.tamper(payload)
            await write_frame(writer, {"t": "state", "meta": meta}, payload, traffic=self.node.traffic)
            self.served += 1
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info(f"[{self.node.short_id}] state request from {sender[-6:]} failed: {e}")
            await refuse_bad_request(self.node, sender, e, writer)  # says why; counts toward a ban
        finally:
            await close_after_reply(reader, writer)


def pick_target(peers: Dict[str, Dict[str, Any]], me: str, min_step: int = 0) -> Optional[Tuple[int, str, List[str]]]:
    """(step, digest, donors) the swarm agrees on, or None when there is nothing trustworthy to fetch."""
    claims = Counter()
    donors: Dict[Tuple[int, str], List[str]] = {}
    for pid, v in peers.items():
        step, digest = v.get("synced_step"), v.get("digest")
        if pid == me or not isinstance(step, int) or not isinstance(digest, str) or step <= min_step:
            continue
        claims[(step, digest)] += 1
        donors.setdefault((step, digest), []).append(pid)
    if not claims:
        return None
    others = sum(1 for pid in peers if pid != me)
    needed = 2 if others >= 2 else 1
    # furthest ahead first, then most supported
    for (step, digest), count in sorted(claims.items(), key=lambda kv: (-kv[0][0], -kv[1], kv[0][1])):
        if count >= needed:
            return step, digest, donors[(step, digest)]
    return None


def in_minority(peers: Dict[str, Dict[str, Any]], me: str, step: int, digest: str) -> bool:
    """True when more live peers at our synced step hold another digest than ours (ties: the smaller
    digest string wins). Peers that diverged (a race in group formation, a healed partition) use
    this to give way and adopt the majority's state."""
    counts = Counter({digest: 1})
    for pid, v in peers.items():
        if pid != me and v.get("synced_step") == step and isinstance(v.get("digest"), str):
            counts[v["digest"]] += 1
    best = max(counts.items(), key=lambda kv: (kv[1], [-ord(c) for c in kv[0]]))
    return best[0] != digest


async def _fetch(node, run_id: str, donor: str, max_bytes: int, timeout: float) -> Tuple[Dict[str, Any], bytes]:
    from hivemind.p2p import PeerID

    async def go():
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(donor),
                                                                      f"p2pdiloco.{run_id}.state")
        try:
            await write_frame(writer, {"t": "state", "v": PROTOCOL_VERSION}, traffic=node.traffic)
            return await read_frame(reader, max_bytes, node.traffic, donor)
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout=timeout)


def download_state(node, run_id: str, peers: Dict[str, Dict[str, Any]], frag_numels: Sequence[int],
                   timeout: float, min_step: int = 0) -> Optional[Tuple[Dict[str, Any], bytes]]:
    """Fetch and verify the swarm's state newer than ``min_step``; None if there is none to catch up to."""
    target = pick_target(peers, node.peer_id_str, min_step)
    if target is None:
        return None
    step, digest, donors = target
    expected_bytes = sum(2 * 4 * n for n in frag_numels)
    for donor in donors:
        try:
            header, payload = node.call(_fetch(node, run_id, donor, expected_bytes, timeout), timeout=timeout + 5)
        except Exception as e:
            logger.warning(f"[{node.short_id}] state download from {donor[-6:]} failed ({type(e).__name__}: {e}); "
                           "trying another donor")
            continue
        meta = header.get("meta")
        if header.get("t") != "state" or not isinstance(meta, dict) or len(payload) != expected_bytes:
            logger.warning(f"[{node.short_id}] donor {donor[-6:]} sent an unusable state reply; trying another donor")
            continue
        got = state_digest(payload, frag_numels)
        if got != digest or meta.get("digest") != digest or meta.get("step") != step:
            logger.warning(f"[{node.short_id}] state from donor {donor[-6:]} does not match the swarm's digest "
                           f"{digest} at step {step} (got {got}); rejected, trying another donor")
            continue
        return meta, payload
    raise SyncFailed(f"no donor delivered the swarm's state (step {step}, digest {digest}) from "
                     f"{len(donors)} candidate(s); not training on unverified state")
