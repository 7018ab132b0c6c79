"""The p2pdiloco wire protocol over libp2p streams (hivemind's P2P binary stream handlers).

Every message is one *frame*::

    u32 big-endian header length | msgpack header (a map, at most MAX_HEADER bytes) | payload

The payload is present only when the header has ``"n"`` (its exact byte length, checked against
what the receiver expects *before* anything is read or allocated). Every request header carries
``"v"``: PROTOCOL_VERSION; a peer that speaks another version gets a ``refuse`` (or, on ``part``,
``abort``) reply whose reason names both versions.

Handlers (the name is prefixed with the run id, so several runs can share one DHT):

    join   matchmaking: a follower asks the group leader of (fragment, round) to be admitted
           request  {t: "join", v, frag, round, reach}                 reach: public | private | relayed
                                                                        (the joiner's own word; private
                                                                        peers are never dialed)
           reply    {t: "wait"}                                        every 2 s while the request is held
                                                                        (a holder silent for 6 s is
                                                                        dropped for the round)
           reply    {t: "warm", members, owners?}                      the group is closing with these
                                                                        members: connect to the owners
                                                                        you send parts to, then answer
           request  {t: "warmed", unreachable: [peer id, ...]}         the owners we could not connect to
           reply    {t: "group", gid, members: [peer id, ...], base, owners?}
                                                                       admitted; the group is final.
                                                                        owners: the members that own a
                                                                        shard (absent: all of them)
                    {t: "group", gid, base, as: "proposed"}            the group as proposed ('warm')
           request  {t: "join", ..., riders: [{id, reach, via?}, ...]} a bucket head carrying the requests
                                                                        it holds (matchmaking item 13)
           request  {t: "ride", riders: [...]} | {t: "unride", ids}    requests it took or lost since,
                                                                        until the leader's first answer
           request  {t: "warmed", unreachable, riders: {id: [...]}}    its riders' link reports too
           reply    {t: "batch", replies: {id: reply}, size}           each one's last word (a 'group'
                                                                        or 'refuse' as above)
                    {t: "refuse", reason, hint?, why?}                 not admitted (hint: the leader
                                                                        this peer follows, if any; reason
                                                                        "left out", why: the members it
                                                                        could not be connected with)
    part   all-reduce: a member sends the shard owned by the receiver, gets the averaged shard back
           request  {t: "part", v, gid, phase, idx, w, codec, numel, n} + payload (encoded part)
           reply    {t: "avg", codec, numel, cov, w, n} + payload      the owner's encoded mean, the
                                                                        member indexes it covers, their weight
                    {t: "abort", reason}                               the round failed, or *this
                                                                        sender's* part was rejected
                                                                        (the others' round goes on);
                                                                        apply nothing
    reach  reachability dial-back (reachability.py; one handler per node, not per run)
           request  {t: "reach", v, ports: [int, ...]}                 "dial me back on these TCP ports"
           reply    {t: "reach", ok, addr, relayed}                    ok: a TCP connection to the
                                                                        requester's *observed* IP at one
                                                                        of the ports succeeded
    state  state download for joining peers (see state_sync)
           request  {t: "state", v}
           reply    {t: "state", meta, n} + payload | {t: "refuse", reason}

    any    {t: "refuse", reason}    sent by :class:`PeerGate` before a handler runs: the sender is
                                    banned (repeated offences) or has too many requests open (quotas below)

Hostile input: nothing received is unpickled; headers are msgpack
with ``strict_map_key``, no bin or extension types and at most MAX_HEADER bytes, and must arrive
within HEADER_TIMEOUT; payload sizes are checked before anything is read. A message that fails
validation is an *offence* of its sender (:meth:`PeerGate.offence`), and so is failing a round one
joined (a member whose part never came while the others' did, allreduce.py); ``ban_after`` offences
within ``ban_seconds`` ban the peer for ``ban_seconds``: every handler refuses it and matchmaking
ignores it. Other honest failures (a dropped connection, a slow header, a version mismatch) are
not offences, so a bad network does not get anyone banned.

Quotas (:func:`quota_refusal`, one rule for requests in flight here and for the all-reduce's
pending rounds). Identities cost nothing, so a cap shared by everyone would be filled by a few
dozen identities holding silent streams. Peers are *members* for MEMBER_SECONDS after a round of
ours whose every shard covered their part (:meth:`PeerGate.vouch`; an offence ends it), else
*strangers*. Each peer has a cap of its own (16 for a member, 4 for a stranger); strangers
together get 256 places (of 1024 requests in flight, of 512 pending rounds), so the rest stays
for members whatever the strangers do; and once strangers hold half of their room, a stranger
gets only its first place. Filling
the strangers' room then takes 160 identities (32 holding 4 each, 128 holding 1), and even then
members, who run the rounds, are served. What held streams cost is bounded in time too: a
silent stream is dropped after HEADER_TIMEOUT, a part for a group never formed after the
all-reduce timeout.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Deque, Dict, Iterable, Optional, Tuple

import msgpack

from ..errors import WireError

__all__ = [
    "close_after_reply",
    "PROTOCOL_VERSION",
    "MAX_HEADER",
    "HEADER_TIMEOUT",
    "MAX_INFLIGHT_PER_PEER",
    "MAX_INFLIGHT",
    "MAX_INFLIGHT_PER_STRANGER",
    "MAX_INFLIGHT_STRANGERS",
    "MEMBER_SECONDS",
    "quota_refusal",
    "inflight_limits",
    "Traffic",
    "PeerGate",
    "read_frame",
    "read_header",
    "read_payload",
    "write_frame",
    "check_version",
    "note_offence",
    "refuse_bad_request",
]

logger = logging.getLogger(__name__)

#: bumped whenever a message changes incompatibly
PROTOCOL_VERSION = 11  # 2: group ids chain the base group (matchmaking.py); 3: 'avg' replies name the members they cover;
#                      4: reachability: join requests say whether the joiner can be dialed, groups name their shard owners;
#                      5: a closing group is proposed ('warm') and its members report unreachable owners ('warmed');
#                      6: parts and results travel in chunks ('c' frames; 'again'; the 'avg' reply is a trailer)
#                      7: DHT records may be signed by Ed25519 owners (swarm/signing.py), which version 6 drops:
#                         the run fingerprint carries this version, so a mixed swarm is refused at join, not split
#                      8: the state digest covers each fragment's outer step count (p2pdiloco/digest.py): version 7
#                         peers would compute other digests for the same state
#                      9: a peer holding a join request sends 'wait' frames; version 8 joiners would read the
#                         first one as a refusal
#                     10: progress records name their fields by short wire names (records.WIRE_NAMES); version 9
#                         peers would read none of them; a group as proposed is answered by its id alone
#                     11: a bucket's head carries its bucket's join requests ('riders', 'ride', 'unride', 'batch':
#                         matchmaking item 13); a version 10 leader would read a carrier's frames as a hang-up
#: largest accepted header (a group of thousands of peer ids fits easily)
MAX_HEADER = 256 * 1024
#: a handler waits this long for a request header before dropping the stream (seconds)
HEADER_TIMEOUT = 10.0
#: requests one member (see PeerGate.vouch) may have open at once at our handlers; more are refused as "busy"
MAX_INFLIGHT_PER_PEER = 16
#: requests all peers together may have open at once
MAX_INFLIGHT = 1024
#: requests one stranger (not a member) may have open at once: a joiner needs one or two at a time
MAX_INFLIGHT_PER_STRANGER = 4
#: requests all strangers together may have open at once; the rest of MAX_INFLIGHT is the members'
MAX_INFLIGHT_STRANGERS = 256
#: seconds a peer stays a member after a verified round with us (many rounds at any run's pace)
MEMBER_SECONDS = 1800.0
#: what close_after_reply discards at most while it waits for the caller's EOF
_MAX_DRAIN = 1 << 20
_LEN = 4


@dataclass
class Traffic:
    """Bytes that crossed the wire through our streams (payload and framing), thread-safe. A counter with
    a ``parent`` (one kind of stream: state downloads) counts into the parent too."""

    sent: int = 0
    received: int = 0
    parent: Optional["Traffic"] = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
        if self.parent is not None:
            self.parent.add(sent, received)

    def snapshot(self) -> Tuple[int, int]:
        with self._lock:
            return self.sent, self.received


async def write_frame(writer: asyncio.StreamWriter, header: Dict[str, Any], payload: bytes = b"",
                      traffic: Optional[Traffic] = None) -> None:
    if payload:
        header = dict(header, n=len(payload))
    blob = msgpack.packb(header, use_bin_type=True)
    writer.write(len(blob).to_bytes(_LEN, "big"))
    writer.write(blob)
    if payload:
        view = memoryview(payload)
        for off in range(0, len(view), 1 << 20):
            writer.write(view[off: off + (1 << 20)])
            await writer.drain()
    await writer.drain()
    if traffic is not None:
        traffic.add(sent=_LEN + len(blob) + len(payload))


async def read_header(reader: asyncio.StreamReader, traffic: Optional[Traffic] = None,
                      sender: Optional[str] = None, timeout: Optional[float] = HEADER_TIMEOUT) -> Dict[str, Any]:
    """Read and decode one header. Handlers use the default ``timeout`` (a peer that opens a stream
    and sends nothing cannot hold a handler); callers reading a reply pass ``None`` and bound the
    whole exchange themselves. Raises :class:`WireError` on anything malformed or late."""
    if timeout is not None:
        try:
            return await asyncio.wait_for(read_header(reader, traffic, sender, None), timeout)
        except asyncio.TimeoutError:
            err = WireError(f"no complete header within {timeout:.0f} s", sender)
            err.benign = True  # maybe just a slow link: not an offence
            raise err from None
    raw_len = await reader.readexactly(_LEN)
    n = int.from_bytes(raw_len, "big")
    if n == 0 or n > MAX_HEADER:
        raise WireError(f"header of {n} bytes (limit {MAX_HEADER})", sender)
    blob = await reader.readexactly(n)
    if traffic is not None:
        traffic.add(received=_LEN + n)
    try:
        header = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:
        raise WireError(f"undecodable header ({type(e).__name__})", sender) from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise WireError("header is not a map with a message type 't'", sender)
    return header


async def read_payload(reader: asyncio.StreamReader, header: Dict[str, Any], expected: int,
                       traffic: Optional[Traffic] = None, sender: Optional[str] = None) -> bytes:
    """Read exactly ``expected`` payload bytes, refusing any other declared length up front."""
    declared = header.get("n", 0)
    if type(declared) is not int or declared != expected:
        raise WireError(f"payload of {_short(declared)} bytes declared, expected {expected}", sender)
    data = await reader.readexactly(expected) if expected else b""
    if traffic is not None:
        traffic.add(received=len(data))
    return data


async def read_frame(reader: asyncio.StreamReader, max_payload: int, traffic: Optional[Traffic] = None,
                     sender: Optional[str] = None) -> Tuple[Dict[str, Any], bytes]:
    """Read a frame whose payload may be any size up to ``max_payload`` (for replies we asked for)."""
    header = await read_header(reader, traffic, sender, timeout=None)
    declared = header.get("n", 0)
    if type(declared) is not int or not 0 <= declared <= max_payload:
        raise WireError(f"payload of {_short(declared)} bytes declared, limit {max_payload}", sender)
    return header, await read_payload(reader, header, declared, traffic, sender)


async def close_after_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float = 60.0) -> None:
    """Close a handler's stream only after the caller has closed its end (EOF), bounded by ``timeout``.

    Closing right after the last write lets the p2p daemon reset the stream with the reply's tail
    still in flight (a 1.1 MB reply cut at 1 MB over TCP; over QUIC any reply still in flight). The
    caller closes once it has read everything, so waiting for its EOF guarantees delivery; a minute
    covers a large reply read slowly over a home uplink. Whatever the caller still sends is
    discarded in small chunks, at most ``_MAX_DRAIN`` bytes: a caller cannot make us buffer data.

    It is always a handler's last act, so a cancellation (our node shutting down while a caller
    still holds its end open) ends it quietly: asyncio's stream callback would log the cancelled
    handler task as an error with a traceback.
    """

    async def drain() -> None:
        seen = 0
        while seen <= _MAX_DRAIN:
            chunk = await reader.read(1 << 16)
            if not chunk:
                return
            seen += len(chunk)

    try:
        await asyncio.wait_for(drain(), timeout=timeout)
    except (Exception, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def check_version(header: Dict[str, Any]) -> Optional[str]:
    """None when the request speaks our version, else the refusal reason to send back."""
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        return (f"protocol version {_short(v)} is not supported by this peer (it speaks version {PROTOCOL_VERSION}); "
                "upgrade p2pdiloco so all peers run the same version")
    return None


def _short(value: Any, limit: int = 40) -> str:
    """repr() of a value received from the network, cut short (never echo a huge field back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- quotas ---------------------------------------------------------------------------------------
def inflight_limits() -> Tuple[int, int, int, int]:
    """(total, per member, strangers' total, per stranger) of requests in flight, read when used."""
    return MAX_INFLIGHT, MAX_INFLIGHT_PER_PEER, MAX_INFLIGHT_STRANGERS, MAX_INFLIGHT_PER_STRANGER


def quota_refusal(held: int, member: bool, held_total: int, held_by_strangers: int,
                  limits: Tuple[int, int, int, int]) -> Optional[str]:
    """Why a peer may not take one more unit of a shared resource (None: it may); see the module
    docstring. ``held``: units the peer holds; ``held_total``/``held_by_strangers``: all peers'/the
    strangers' units; ``limits``: (total, per member, strangers' total, per stranger), with the
    strangers' total below the total (the difference is room only members can take)."""
    total, per_member, strangers_total, per_stranger = limits
    if member:
        if held >= per_member:
            return f"this peer already has {held} open here (limit {per_member})"
    else:
        if held >= per_stranger:
            return f"this peer already has {held} open here (limit {per_stranger} until it shared a round with us)"
        if held_by_strangers >= strangers_total:
            return f"peers that have not shared a round with us hold all {strangers_total} of their places"
        if held and 2 * held_by_strangers >= strangers_total:
            # past half of the strangers' room each further place takes another identity, not
            # another stream: a few identities cannot fill it
            return "peers that have not shared a round with us hold half of their places; one each now"
    if held_total >= total:
        return f"all {total} places are taken"
    return None


# ---- misbehaving peers ---------------------------------------------------------------------------
class PeerGate:
    """Offence counting, timed bans and per-peer request limits for one node (thread-safe).

    * :meth:`offence` records that ``peer`` sent something invalid (a malformed message, a part that
      failed validation, an implausible reply) or stalled a round it joined. ``ban_after`` offences
      within ``ban_seconds`` ban the peer for ``ban_seconds``; ``ban_after = 0`` disables bans
      (offences are still counted).
    * :meth:`banned` is what matchmaking and the all-reduce ask before dealing with a peer.
    * :meth:`wrap` turns a stream handler into one that refuses banned or over-busy senders (the
      quotas of :func:`quota_refusal`) before the handler runs and never lets an exception escape
      onto the event loop.
    * :meth:`vouch` makes peers *members* for MEMBER_SECONDS (they shared a verified round with us);
      :meth:`member` asks. An offence ends membership.

    Counters for tests and operators: ``offences`` (per peer, all time), ``bans`` (bans imposed),
    ``refused`` (requests refused at the gate), ``errors`` (handler exceptions caught).
    """

    def __init__(self, ban_after: int = 3, ban_seconds: float = 600.0, short_id: str = ""):
        self.ban_after = ban_after
        self.ban_seconds = ban_seconds
        self.short_id = short_id
        self.offences: Counter = Counter()
        self.bans = 0
        self.refused = 0
        self.errors = 0
        self._recent: Dict[str, Deque[float]] = {}
        self._until: Dict[str, float] = {}
        self._inflight: Counter = Counter()
        self._members: Dict[str, float] = {}  # peer -> monotonic time its membership ends
        self._lock = threading.Lock()

    def configure(self, ban_after: int, ban_seconds: float) -> None:
        with self._lock:
            self.ban_after, self.ban_seconds = ban_after, ban_seconds

    def offence(self, peer: str, reason: str) -> bool:
        """Count an offence of ``peer`` (logged with its full id); True when it got the peer banned."""
        now = time.monotonic()
        with self._lock:
            self.offences[peer] += 1
            recent = self._recent.setdefault(peer, deque())
            recent.append(now)
            while recent and recent[0] < now - self.ban_seconds:
                recent.popleft()
            newly = bool(self.ban_after) and len(recent) >= self.ban_after and self._until.get(peer, 0) <= now
            if newly:
                self._until[peer] = now + self.ban_seconds
                self.bans += 1
                recent.clear()
            self._members.pop(peer, None)  # a member that misbehaves is a stranger again
            self._forget_old(now)
        logger.warning(f"[{self.short_id}] offence by peer {peer}: {reason}")
        if newly:
            logger.warning(f"[{self.short_id}] banned peer {peer} for {self.ban_seconds:.0f} s "
                           f"({self.ban_after} offences)")
        return newly

    def forgive(self, peer: Optional[str] = None) -> None:
        """Lift ``peer``'s ban and forget its offences (every peer's when None)."""
        with self._lock:
            for table in (self._recent, self._until, self.offences):
                if peer is None:
                    table.clear()
                else:
                    table.pop(peer, None)

    def vouch(self, peers: Iterable[str], seconds: Optional[float] = None) -> None:
        """``peers`` shared a verified round with us: members for ``seconds`` (MEMBER_SECONDS)."""
        until = time.monotonic() + (MEMBER_SECONDS if seconds is None else seconds)
        with self._lock:
            for p in peers:
                self._members[p] = max(until, self._members.get(p, 0.0))
            self._forget_old(time.monotonic())

    def member(self, peer: str) -> bool:
        with self._lock:
            return self._members.get(peer, 0.0) > time.monotonic()

    def banned(self, peer: str) -> bool:
        return self.remaining(peer) > 0

    def remaining(self, peer: str) -> float:
        """Seconds left of ``peer``'s ban (0 when not banned)."""
        with self._lock:
            return max(0.0, self._until.get(peer, 0.0) - time.monotonic())

    def _forget_old(self, now: float) -> None:
        # bounded memory however many identities misbehave: drop expired bans, memberships and idle counters
        if len(self._recent) + len(self._until) + len(self._members) < 4096:
            return
        for p in [p for p, until in self._members.items() if until <= now]:
            del self._members[p]
        for p in [p for p, until in self._until.items() if until <= now]:
            del self._until[p]
        for p in [p for p, q in self._recent.items() if not q or q[-1] < now - self.ban_seconds]:
            del self._recent[p]
        if len(self.offences) > 4096:
            self.offences = Counter(dict(self.offences.most_common(1024)))

    def _enter(self, peer: str) -> Optional[str]:
        left = self.remaining(peer)
        if left > 0:
            return (f"peer {peer} is banned here for another {left:.0f} s after repeated offences "
                    "(invalid messages or rounds it stalled)")
        with self._lock:
            now = time.monotonic()
            strangers = sum(n for p, n in self._inflight.items() if self._members.get(p, 0.0) <= now)
            refusal = quota_refusal(self._inflight[peer], self._members.get(peer, 0.0) > now,
                                    sum(self._inflight.values()), strangers, inflight_limits())
            if refusal is not None:
                return f"busy: too many open requests ({refusal})"
            self._inflight[peer] += 1
        return None

    def _leave(self, peer: str) -> None:
        with self._lock:
            self._inflight[peer] -= 1
            if self._inflight[peer] <= 0:
                del self._inflight[peer]

    def inflight(self) -> int:
        with self._lock:
            return sum(self._inflight.values())

    def wrap(self, handler: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """The handler, behind the gate: banned or over-busy senders get ``refuse``; exceptions are
        logged (with the sender's id) instead of escaping onto the event loop."""

        async def gated(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sender = info.peer_id.to_base58()
            refusal = self._enter(sender)
            if refusal is not None:
                with self._lock:
                    self.refused += 1
                try:
                    await write_frame(writer, {"t": "refuse", "reason": refusal})
                except Exception:
                    pass
                await close_after_reply(reader, writer, timeout=2.0)
                return
            try:
                await handler(info, reader, writer)
            except asyncio.CancelledError:
                # our node is shutting down (the peer leaves) while it served this stream: nothing to
                # report, and nothing to re-raise (asyncio's stream callback would log the cancelled
                # task's exception as a traceback on every leave during a round).
                writer.close()
                return
            except Exception as e:  # a handler bug must not take the peer down; say who triggered it
                with self._lock:
                    self.errors += 1
                logger.error(f"[{self.short_id}] handler failed on a request from {sender}: "
                             f"{type(e).__name__}: {e}", exc_info=logger.isEnabledFor(logging.DEBUG))
                writer.close()
            finally:
                self._leave(sender)

        return gated


def note_offence(node: Any, sender: str, exc: BaseException) -> None:
    """Count ``exc`` as an offence of ``sender`` when it is a validation failure (:class:`WireError`);
    connection drops and timeouts are not offences (a bad network must not get anyone banned)."""
    gate = getattr(node, "gate", None)
    if gate is not None and isinstance(exc, WireError) and not getattr(exc, "benign", False):
        gate.offence(sender, str(exc)[:300])


async def refuse_bad_request(node: Any, sender: str, exc: BaseException, writer: asyncio.StreamWriter) -> None:
    """What a handler does with a request that failed validation: count the offence (see
    :func:`note_offence`) and tell the sender why in one ``refuse`` frame (a clear error to
    the sender). Connection errors get no reply: there is nobody to read it."""
    note_offence(node, sender, exc)
    if isinstance(exc, WireError):
        try:
            await write_frame(writer, {"t": "refuse", "reason": str(exc)[:300]})
        except Exception:
            pass
