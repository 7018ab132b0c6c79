"""State download: how a peer that joins mid-run, resumes, or fell behind gets the swarm's global state.

What is transferred: every fragment's global parameters θ and Nesterov momentum (fp32), the outer
step count of each fragment, and the inner step of the last sync (the schedule position: from it
the joiner knows which fragment syncs next and in which round). Inner optimiser state is local by
design (DiLoCo) and is never transferred.

Donor side (:class:`StateServer`): the ``state`` handler replies with a consistent snapshot (taken
under the trainer's state lock, between syncs): ``meta`` (``step``, ``outer_steps`` per fragment,
``numels``, ``digest``, ``frags``) and the payload of the requested fragments, each θ then momentum.

Joiner side (:func:`download_state`):
  1. Read the live peers' progress records; the *target* is the furthest (step, digest) that the
     voters (our partners, or for a joiner the established peers: :mod:`.standing`) agree on: two of
     them claim it (one when there is a single other voter) and a strict majority of them are at or
     beyond it. Identities without a say and a minority of voters move nobody, whatever they claim.
  2. Fragments are spread over the voters that claim the target and can be dialed: public peers,
     private ones only when no public peer claims it (several donors when there are several,
     fetched concurrently; the donor order is rotated by our id so joiners spread out).
     Every request is bounded by ``timeout`` seconds.
  3. Each fragment is verified against its part of the agreed digest (one sha256 per fragment over
     its outer step count, θ and momentum, :mod:`p2pdiloco.digest`: a fragment is checked on its own). A donor that sends a wrong fragment
     (tampered, stale), a malformed reply, or nothing in time (stalled) is dropped and its fragments
     go to the next donor. If the donors moved on to a newer sync meanwhile, the target is picked
     again (at most ``max_targets`` times), from records newer than the one they moved past: a
     donor's record lags its state by a DHT store and read, so the re-pick waits for it (up to
     ``record_wait`` seconds) instead of picking the old target again at once.
  4. When every donor of a target failed, the target is picked again without them (fake identities
     that claim a state nobody serves cost time, never our state). If no donor is left,
     :class:`SyncFailed` is raised naming every donor and why it was
     rejected: the caller stops rather than train on unverified state.

Nothing is unpickled: the reply header is msgpack, the payload raw fp32 bytes of a known size.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from .. import faults
from ..digest import fragment_digest
from ..snapshot import fragment_bounds
from ..errors import SyncFailed, WireError
from ..ids import short_id
from .dialing import open_stream
from .keys import handler_name
from .protocol import (PROTOCOL_VERSION, check_version, close_after_reply, read_frame, read_header,
                       refuse_bad_request, write_frame)
from . import standing
from .standing import pick_target, valid_digest
from .reachability import is_private

__all__ = ["StateServer", "Download", "download_state", "state_digest", "dialable_first"]

logger = logging.getLogger(__name__)

#: how often the records are re-read while waiting for a claim newer than the target the donors moved past
RECORD_POLL_S = 0.5

Snapshot = Tuple[Dict[str, Any], bytes]
Peers = Dict[str, Dict[str, Any]]


def state_digest(payload: bytes, frag_numels: Sequence[int], outer_steps: Sequence[int]) -> str:
    """The DiLoCo digest of a payload (:mod:`p2pdiloco.digest`): per fragment sha256(outer step count ‖
    θ bytes ‖ momentum bytes)[:16], joined by '-'."""
    return "-".join(fragment_digest(payload[a:b], steps)
                    for (a, b), steps in zip(fragment_bounds(frag_numels), outer_steps))


class StateServer:
    """Serves snapshots to joining peers. ``provider()`` returns (meta, payload) or None.

    Fault-injection phase ``state.serve`` (see :mod:`p2pdiloco.faults`): ``stall`` holds the reply
    (a very slow donor), ``tamper`` flips a bit of the payload, ``fail`` refuses.
    """

    def __init__(self, node, run_id: str, provider: Callable[[], Optional[Snapshot]]):
        self.node = node
        self.provider = provider
        self.handler_name = handler_name(run_id, "state")
        #: fault-injection hook for tests: maps the payload before it is sent (e.g. tamper with it)
        self.tamper: Optional[Callable[[bytes], bytes]] = None
        self.served = 0
        node.add_handler(self.handler_name, self._handle)

    async def _handle(self, info, reader, writer) -> None:
        sender = info.peer_id.to_base58()
        traffic = self.node.state_traffic
        try:
            header = await read_header(reader, traffic, sender)
            refusal = check_version(header) or (None if header.get("t") == "state" else "expected a state request")
            snap = None if refusal else await asyncio.get_running_loop().run_in_executor(None, self.provider)
            if refusal is None and snap is None:
                refusal = "no state yet"
            if refusal is None:
                meta, payload = snap
                bounds = fragment_bounds(meta["numels"])
                frags = header.get("frags", list(range(len(bounds))))
                if (not isinstance(frags, list) or not frags or len(frags) > len(bounds)
                        or any(not isinstance(f, int) or not 0 <= f < len(bounds) for f in frags)
                        or len(set(frags)) != len(frags)):
                    refusal = "malformed fragment list"
            if refusal is not None:
                await write_frame(writer, {"t": "refuse", "reason": refusal}, traffic=traffic)
                return
            payload = b"".join(payload[a:b] for a, b in (bounds[f] for f in frags))
            try:
                rule = await faults.afire("state.serve")
            except SyncFailed as e:
                await write_frame(writer, {"t": "refuse", "reason": str(e)}, traffic=traffic)
                return
            if rule is not None and rule.action == "tamper":
                payload = faults.tamper_bytes(payload)
            if self.tamper is not None:
                payload = self.tamper(payload)
            await write_frame(writer, {"t": "state", "meta": dict(meta, frags=frags)}, payload, traffic=traffic)
            self.served += 1
        except (WireError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info(f"[{self.node.short_id}] state request from {short_id(sender)} failed: {e}")
            await refuse_bad_request(self.node, sender, e, writer)  # says why; counts toward a ban
        finally:
            await close_after_reply(reader, writer)


@dataclass
class Download:
    """A verified state: ``meta`` and ``payload`` as a donor's snapshot, plus how it was obtained."""

    meta: Dict[str, Any]
    payload: bytes
    step: int
    digest: str
    #: donor id -> fragments it delivered (verified)
    donors: Dict[str, List[int]] = field(default_factory=dict)
    #: (donor id, why it was dropped), in order
    rejected: List[Tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    targets: int = 1  # how many times the target was (re)picked


async def _fetch(node, run_id: str, donor: str, frags: List[int], max_bytes: int,
                 timeout: float) -> Tuple[Dict[str, Any], bytes]:
    async def request():
        _, reader, writer = await open_stream(node, donor, handler_name(run_id, "state"),
                                              asyncio.get_running_loop().time() + timeout)
        try:
            await write_frame(writer, {"t": "state", "v": PROTOCOL_VERSION, "frags": frags}, traffic=node.state_traffic)
            return await read_frame(reader, max_bytes, node.state_traffic, donor)
        finally:
            writer.close()

    return await asyncio.wait_for(request(), timeout=timeout)


class _DonorsMovedOn(Exception):
    """The donor already serves a newer sync than the target (honest: the swarm moved on)."""

    def __init__(self, meta: Dict[str, Any]):
        super().__init__(f"serves step {meta.get('step')}, newer than the target")
        self.meta = meta


def _check_reply(header: Dict[str, Any], payload: bytes, frags: List[int], step: int, digest: str,
                 numels: Sequence[int]) -> Dict[str, Any]:
    """The reply's meta when every requested fragment matches the target digest; else raises
    ValueError (bad donor) or _DonorsMovedOn (honest donor that synced again since the target was picked)."""
    if header.get("t") == "refuse":
        raise ValueError(f"refused: {str(header.get('reason'))[:200]}")
    meta = header.get("meta")
    if header.get("t") != "state" or not isinstance(meta, dict):
        raise ValueError("not a state reply")
    if list(meta.get("numels", [])) != list(numels):
        raise ValueError("its model layout differs")
    if meta.get("frags") != frags:
        raise ValueError("sent other fragments than asked")
    bounds = fragment_bounds(numels)
    expected = sum(b - a for a, b in (bounds[f] for f in frags))
    if len(payload) != expected:
        raise ValueError(f"sent {len(payload)} bytes, expected {expected}")
    outer_steps = meta.get("outer_steps")
    if (not isinstance(outer_steps, list) or len(outer_steps) != len(numels)
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in outer_steps)):
        raise ValueError("malformed outer step counters")
    m_step = meta.get("step")
    moved = (isinstance(m_step, int) and not isinstance(m_step, bool) and m_step > step
             and valid_digest(meta.get("digest"), len(numels)))
    if not moved and (m_step != step or meta.get("digest") != digest):
        raise ValueError(f"serves step {m_step!r} digest {meta.get('digest')!r}, not the swarm's")
    # a newer sync's fragments are checked against the digest the donor claims for it now (a bad copy
    # is caught here, not silently dropped later), and against the swarm's digest if that sync is used
    parts = meta["digest"].split("-") if moved else digest.split("-")
    whose = "the digest it claims" if moved else "the swarm's digest"
    off = 0
    for f in frags:
        size = bounds[f][1] - bounds[f][0]
        if fragment_digest(payload[off: off + size], outer_steps[f]) != parts[f]:
            raise ValueError(f"fragment {f} does not match {whose} (tampered or corrupt)")
        off += size
    if moved:
        raise _DonorsMovedOn(meta)
    return meta


def _split(payload: bytes, frags: List[int], bounds: List[Tuple[int, int]]) -> Dict[int, bytes]:
    out, off = {}, 0
    for f in frags:
        size = bounds[f][1] - bounds[f][0]
        out[f] = payload[off: off + size]
        off += size
    return out


class _NewerSyncFragments:
    """Fragments an honest donor sent for a *newer* sync than our target; reused (after checking them
    against that sync's agreed digest) if the re-picked target is that sync. Only the newest is kept."""

    def __init__(self) -> None:
        self.key: Optional[Tuple[int, str]] = None
        self.outer_steps: Optional[List[int]] = None
        self.frags: Dict[int, Tuple[str, bytes]] = {}  # fragment -> (donor, bytes)

    def add(self, donor: str, meta: Dict[str, Any], frags: Dict[int, bytes]) -> None:
        key = (meta["step"], meta["digest"])
        if self.key is None or key[0] > self.key[0]:
            self.key, self.outer_steps, self.frags = key, list(meta["outer_steps"]), {}
        if key == self.key and list(meta["outer_steps"]) == self.outer_steps:
            self.frags.update({f: (donor, blob) for f, blob in frags.items()})


async def _fetch_checked(node, run_id: str, donor: str, frags: List[int], bounds: List[Tuple[int, int]], step: int,
                         digest: str, numels: Sequence[int], timeout: float) -> Tuple[Optional[Dict[str, Any]], bytes,
                                                                                      Optional[str]]:
    """Ask ``donor`` for ``frags`` and check its reply against the target: (meta, payload, None) when
    verified, (meta, payload, "moved") when it serves a newer sync, (None, b"", why) when it failed."""
    size = sum(bounds[f][1] - bounds[f][0] for f in frags)
    t0 = time.monotonic()
    try:
        header, payload = await _fetch(node, run_id, donor, frags, size, timeout)
        return _check_reply(header, payload, frags, step, digest, numels), payload, None
    except asyncio.TimeoutError:
        return None, b"", f"no reply within {timeout:.1f} s (stalled)"
    except _DonorsMovedOn as e:
        return e.meta, payload, "moved"
    except ValueError as e:
        return None, b"", str(e)
    except Exception as e:  # unreachable, stream reset, wire error
        return None, b"", f"{type(e).__name__}: {str(e)[:200]} after {time.monotonic() - t0:.1f} s"


def _assign(pending: Iterable[int], order: List[str], tasks: Dict[asyncio.Task, Tuple[str, List[int], float]],
            unusable: Set[str], asked: Dict[int, Set[str]], delivered: Dict[str, List[int]],
            hedge_after: float, now: float) -> Dict[str, List[int]]:
    """The next requests (donor -> fragments): each pending fragment not in flight (or in flight on one
    donor for ``hedge_after`` seconds already) goes to a free donor that was not asked for it yet,
    spread so that the donors that delivered fewest, a stash's share included, are asked first."""
    busy = {d for d, _, _ in tasks.values()}
    assign: Dict[str, List[int]] = {}
    for f in pending:
        inflight = [t0 for d, fs, t0 in tasks.values() if f in fs]
        if len(inflight) >= 2 or (inflight and now - min(inflight) < hedge_after):
            continue
        free = [d for d in order if d not in unusable and d not in busy and d not in asked[f]]
        if not free:
            continue
        donor = min(free, key=lambda d: (len(assign.get(d, [])) + len(delivered.get(d, [])), order.index(d)))
        assign.setdefault(donor, []).append(f)
    return assign


def _from_stash(stash: "_NewerSyncFragments", step: int, digest: str, result: Download) -> Tuple[Dict[int, bytes], Dict[int, int]]:
    """The stashed fragments of the target (step, digest) that match its digest: (fragment -> bytes,
    fragment -> outer step count); their donors are credited in ``result``."""
    got: Dict[int, bytes] = {}
    outer_steps: Dict[int, int] = {}
    if stash.key == (step, digest):
        parts = digest.split("-")
        for f, (donor, blob) in stash.frags.items():
            if fragment_digest(blob, stash.outer_steps[f]) == parts[f]:
                got[f], outer_steps[f] = blob, stash.outer_steps[f]
                result.donors[donor] = sorted(result.donors.get(donor, []) + [f])
    return got, outer_steps


async def _download_target(node, run_id: str, step: int, digest: str, donors: List[str], numels: Sequence[int],
                           timeout: float, hedge_after: float, result: Download, bad: Dict[str, str],
                           stash: _NewerSyncFragments) -> Optional[bytes]:
    """Fetch every fragment of the target. Returns the payload; None when no usable donor is left
    (``bad`` says why); raises _DonorsMovedOn when the donors moved on to a newer sync meanwhile.

    Scheduling: each pending fragment is asked of one donor (donors rotated by our id; one request
    in flight per donor, fragments batched per donor, spread so that the donors that delivered
    fewest, the stash's share included, are asked first). A fragment with no answer after
    ``hedge_after`` seconds is asked of one more donor too (a stalled donor costs ``hedge_after``,
    not ``timeout``); the first verified copy wins. A donor that fails once is not asked again.
    """
    P = len(numels)
    bounds = fragment_bounds(numels)
    got, outer_steps = _from_stash(stash, step, digest, result)  # fragment -> verified bytes, outer step count
    shift = int(hashlib.sha256(node.peer_id_str.encode()).hexdigest(), 16) % max(1, len(donors))
    order = donors[shift:] + donors[:shift]
    moved: Set[str] = set()
    asked: Dict[int, Set[str]] = {f: set() for f in range(P)}
    tasks: Dict[asyncio.Task, Tuple[str, List[int], float]] = {}
    try:
        while len(got) < P:
            now = time.monotonic()
            assign = _assign([f for f in range(P) if f not in got], order, tasks, set(bad) | moved, asked,
                             result.donors, hedge_after, now)
            for donor, frags in assign.items():
                for f in frags:
                    asked[f].add(donor)
                tasks[asyncio.ensure_future(_fetch_checked(node, run_id, donor, frags, bounds, step, digest, numels,
                                                           timeout))] = (donor, frags, now)
            if not tasks:
                break
            done, _ = await asyncio.wait(list(tasks), timeout=max(0.05, hedge_after / 2),
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                donor, frags, _ = tasks.pop(task)
                meta, payload, error = task.result()
                if error == "moved":
                    moved.add(donor)
                    stash.add(donor, meta, _split(payload, frags, bounds))
                    logger.info(f"[{node.short_id}] donor {short_id(donor)} already serves step {meta['step']} "
                                f"(target {step})")
                elif error is not None:
                    _reject_donor(node, donor, error, bad, result)
                else:
                    new = {f: blob for f, blob in _split(payload, frags, bounds).items() if f not in got}
                    got.update(new)
                    outer_steps.update((f, meta["outer_steps"][f]) for f in new)
                    if new:
                        result.donors[donor] = sorted(result.donors.get(donor, []) + list(new))
    finally:
        now = time.monotonic()
        for task, (donor, _, t_start) in tasks.items():
            task.cancel()
            if now - t_start >= hedge_after and donor not in bad:
                bad[donor] = f"no reply within {now - t_start:.1f} s (stalled); another donor delivered first"
                result.rejected.append((donor, bad[donor]))
    if len(got) < P:
        if moved:
            raise _DonorsMovedOn({"step": None})
        return None
    result.meta = {"step": step, "digest": digest, "numels": list(numels),
                   "outer_steps": [outer_steps[f] for f in range(P)]}
    return b"".join(got[f] for f in range(P))


def _reject_donor(node, donor: str, error: str, bad: Dict[str, str], result: Download) -> None:
    """A donor failed us: not asked again in this download; serving state that does not match the
    swarm's digest is an offence."""
    bad[donor] = error
    result.rejected.append((donor, error))
    logger.warning(f"[{node.short_id}] state from donor {short_id(donor)} rejected: {error}; "
                   "its fragments go to another donor")
    note = getattr(getattr(node, "gate", None), "offence", None)
    if note is not None and "does not match" in error:
        note(donor, f"served state that does not match the swarm's digest: {error}")


def dialable_first(donors: List[str], peers: Peers) -> List[str]:
    """The donors we can dial: those not private (behind NAT, ``swarm/reachability.py``). Private
    donors only when no public one claims the target (an open connection from them may still carry
    our request); each failure is then reported like any donor's."""
    public = [d for d in donors if not is_private(peers.get(d, {}).get("reach"))]
    return public or list(donors)


def download_state(node, run_id: str, peers: Union[Peers, Callable[[], Peers]], frag_numels: Sequence[int],
                   timeout: float, min_step: int = 0, *, on_target: Optional[Callable[[int], None]] = None,
                   max_targets: int = 4, hedge_after: Optional[float] = None,
                   companions: Iterable[str] = (), partners: Optional[Iterable[str]] = None,
                   record_wait: float = 10.0) -> Optional[Download]:
    """Fetch and verify the swarm's state newer than ``min_step``; None if there is none to catch up to.

    :param peers: the live peers' progress records, or a callable returning fresh ones (needed to
        re-pick the target when the donors moved on during the download).
    :param timeout: bound of one request to one donor, seconds.
    :param hedge_after: after this many seconds without an answer a fragment is also asked of
        another donor (default: a third of ``timeout``, at least 2 s).
    :param companions: the members of our last successful group (see :func:`pick_target`).
    :param partners: the identities we shared verified rounds with (:class:`.standing.Partners`): the
        voters, when any is live (:func:`.standing.voters`); None: the established identities (a joiner).
        Donors that failed us are no longer voters: when every donor of a target failed, the target
        is picked again without them (claims that nobody serves cost time, never our state).
    :param record_wait: after the donors moved past the target, how long to wait for records that
        claim their newer sync (they publish it right after the sync; the read may lag).
    :param on_target: called with the target step once it is chosen, before anything is fetched
        (the joiner announces itself then, so the next round's group waits for it).
    :raises SyncFailed: nobody delivered a verified copy; the message names each donor and why.
    """
    get_peers = peers if callable(peers) else (lambda: peers)
    hedge = hedge_after if hedge_after is not None else max(2.0, timeout / 3)
    t0 = time.monotonic()
    result = Download(meta={}, payload=b"", step=0, digest="")
    bad: Dict[str, str] = {}  # donors that failed us once are not asked again in this download
    stash = _NewerSyncFragments()
    passed: Optional[int] = None  # the step of a target the donors moved past
    for attempt in range(1, max_targets + 1):
        floor = min_step if passed is None else max(min_step, passed)
        deadline = time.monotonic() + (record_wait if passed is not None else 0.0)
        while True:
            view = {pid: v for pid, v in get_peers().items() if pid not in bad}
            trusted = None if partners is None else standing.voters(view, node.peer_id_str, partners)
            target = pick_target(view, node.peer_id_str, floor, num_frags=len(frag_numels), companions=companions,
                                 trusted=trusted)
            if target is not None or time.monotonic() >= deadline:
                break
            time.sleep(RECORD_POLL_S)
        if target is None:
            if passed is not None:
                newer = f" (they serve step {stash.key[0]})" if stash.key is not None else ""
                raise SyncFailed(f"the donors moved past step {passed}{newer} but no record claimed a newer sync "
                                 f"within {record_wait:.0f} s; not training on unverified state")
            if result.rejected:
                break
            return None
        step, digest, donors = target
        donors = dialable_first(donors, view)
        result.step, result.digest, result.targets, result.donors = step, digest, attempt, {}
        if on_target is not None:
            on_target(step)
        overall = timeout * (len(donors) + 1) + 10
        try:
            payload = node.call(_download_target(node, run_id, step, digest, donors, frag_numels, timeout, hedge,
                                                 result, bad, stash), timeout=overall)
        except _DonorsMovedOn:
            logger.info(f"[{node.short_id}] the swarm moved past step {step} during the download; picking again "
                        "from newer records")
            passed = step
            continue
        if payload is None:
            logger.warning(f"[{node.short_id}] no donor of step {step} digest {digest} delivered; picking the "
                           "target again without them")
            continue
        result.payload = payload
        result.seconds = time.monotonic() - t0
        return result
    reasons = "; ".join(f"{short_id(d)}: {why}" for d, why in result.rejected[-8:]) or "the donors kept moving on"
    raise SyncFailed(f"no donor delivered the swarm's state (step {result.step}, digest {result.digest}) "
                     f"({reasons}); not training on unverified state")
