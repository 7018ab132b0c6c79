"""The p2pdiloco wire protocol over libp2p streams (hivemind's P2P binary stream handlers).

Every message is one *frame*::

    u32 big-endian header length | msgpack header (a map, at most MAX_HEADER bytes) | payload

The payload is present only when the header has ``"n"`` (its exact byte length, checked against
what the receiver expects *before* anything is read or allocated). Every request header carries
``"v"``: PROTOCOL_VERSION; a peer that speaks another version gets a ``refuse`` reply saying so.

Handlers (the name is prefixed with the run id, so several runs can share one DHT):

    join   matchmaking: a follower asks the group leader of (fragment, round) to be admitted
           request  {t: "join", v, frag, round}
           reply    {t: "group", gid, members: [peer id, ...]}       admitted; the group is final
                    {t: "refuse", reason, hint?}                       not admitted (hint: the leader
                                                                        this peer follows, if any)
    part   all-reduce: a member sends the shard owned by the receiver, gets the averaged shard back
           request  {t: "part", v, gid, phase, idx, w, codec, numel, n} + payload (encoded part)
           reply    {t: "avg", codec, numel, n} + payload              the owner's encoded mean
                    {t: "abort", reason}                               the round failed; apply nothing
    state  state download for joining peers (see state_sync)
           request  {t: "state", v}
           reply    {t: "state", meta, n} + payload | {t: "refuse", reason}

Nothing received is unpickled: headers are msgpack with ``strict_map_key`` and no extension types,
payloads are raw tensor bytes decoded by a codec that validates length and finiteness.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import msgpack

from ..errors import WireError

__all__ = [
    "close_after_reply",
    "PROTOCOL_VERSION",
    "MAX_HEADER",
    "Traffic",
    "read_frame",
    "write_frame",
    "check_version",
]

#: bumped whenever a message changes incompatibly
PROTOCOL_VERSION = 1
#: largest accepted header (a group of thousands of peer ids fits easily)
MAX_HEADER = 256 * 1024
_LEN = 4


@dataclass
class Traffic:
    """Bytes that crossed the wire through our streams (payload and framing), thread-safe."""

    sent: int = 0
    received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

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
                      sender: Optional[str] = None) -> Dict[str, Any]:
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
    if not isinstance(declared, int) or declared != expected:
        raise WireError(f"payload of {declared!r} bytes declared, expected {expected}", sender)
    data = await reader.readexactly(expected) if expected else b""
    if traffic is not None:
        traffic.add(received=len(data))
    return data


async def read_frame(reader: asyncio.StreamReader, max_payload: int, traffic: Optional[Traffic] = None,
                     sender: Optional[str] = None) -> Tuple[Dict[str, Any], bytes]:
    """Read a frame whose payload may be any size up to ``max_payload`` (for replies we asked for)."""
    header = await read_header(reader, traffic, sender)
    declared = header.get("n", 0)
    if not isinstance(declared, int) or not 0 <= declared <= max_payload:
        raise WireError(f"payload of {declared!r} bytes declared, limit {max_payload}", sender)
    return header, await read_payload(reader, header, declared, traffic, sender)


async def close_after_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float = 10.0) -> None:
    """Close a handler's stream only after the caller has closed its end (EOF), bounded by ``timeout``.

    Closing right after the last write lets the p2p daemon reset the stream with the reply's tail
    still in flight (seen here: a 1.1 MB reply cut at 1 MB). The caller closes once it has read
    everything, so waiting for its EOF guarantees delivery.
    """
    try:
        await asyncio.wait_for(reader.read(), timeout=timeout)
    except Exception:
        pass
    finally:
        writer.close()


def check_version(header: Dict[str, Any]) -> Optional[str]:
    """None when the request speaks our version, else the refusal reason to send back."""
    v = header.get("v")
    if v != PROTOCOL_VERSION:
        return (f"protocol version {v!r} is not supported by this peer (it speaks version {PROTOCOL_VERSION}); "
                "upgrade p2pdiloco so all peers run the same version")
    return None
