"""Where a peer's DHT bytes go: a per-RPC, per-record-kind ledger kept in the DHT process (benchmarks only).

``bench.run`` sets ``P2PDILOCO_DHT_LEDGER=1`` in its peers' environment; :class:`~.node.SwarmNode` then
calls :func:`install` in its DHT process, and the training loop's summary carries :func:`snapshot`.
Every DHT RPC this node *makes* is counted under ``"<rpc>:<kind>"`` (``find:ready``, ``store:progress``,
``ping:-``...) as ``[calls, request bytes, response bytes]``, the bytes being the protobuf messages'
serialized sizes: what the RPC moved on the libp2p stream, without the stream's own framing, the
encryption and TCP/IP. The *kind* is the record kind of the key (:func:`.keys.kind_of`: ``ready``,
``group``, ``progress``, ``fingerprint``, ``generic``), learned from the key names this process hashes
into DHT ids; ``node`` for an id no key name gave (a node lookup).
Every DHT exchange starts at some node's client side, so over a swarm whose peers all keep a ledger
the sum of requests and responses is every DHT byte the peers moved (the bootstrap peer's own calls
aside).

It wraps ``DHTProtocol.get_stub`` and ``DHTID.generate`` of hivemind 1.1.12 in that process only;
nothing changes on the wire.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, List

from .keys import kind_of

__all__ = ["ENV", "enabled", "install", "snapshot"]

ENV = "P2PDILOCO_DHT_LEDGER"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class _Ledger:
    def __init__(self) -> None:
        self.kinds: Dict[bytes, str] = {}
        self.rows: Dict[str, List[int]] = defaultdict(lambda: [0, 0, 0])

    def kind(self, request: Any) -> str:
        keys = getattr(request, "keys", None)
        if not keys:
            return "-"
        found = sorted({self.kinds.get(bytes(k), "node") for k in keys})
        return "+".join(found)

    def count(self, rpc: str, request: Any, response: Any) -> None:
        row = self.rows[f"{rpc}:{self.kind(request)}"]
        row[0] += 1
        row[1] += request.ByteSize()
        row[2] += response.ByteSize() if response is not None else 0


class _CountingStub:
    def __init__(self, stub: Any, ledger: _Ledger):
        self._stub, self._ledger = stub, ledger

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return attr

        async def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            response = None
            try:
                response = await attr(request, *args, **kwargs)
                return response
            finally:
                self._ledger.count(name[4:], request, response)
        return call


async def install(_dht: Any, node: Any) -> bool:
    """Runs in the DHT process: start counting. Idempotent."""
    from hivemind.dht.routing import DHTID

    proto = node.protocol
    if getattr(proto, "_p2pdiloco_ledger", None) is not None:
        return True
    ledger = _Ledger()
    generate = DHTID.generate.__func__

    def counting_generate(cls: Any, source: Any = None, nbits: int = 255) -> Any:
        out = generate(cls, source, nbits)
        if isinstance(source, str):
            ledger.kinds[out.to_bytes()] = kind_of(source)
        return out

    DHTID.generate = classmethod(counting_generate)
    get_stub = proto.get_stub
    proto.get_stub = lambda peer: _CountingStub(get_stub(peer), ledger)
    proto._p2pdiloco_ledger = ledger
    return True


async def snapshot(_dht: Any, node: Any) -> Dict[str, List[int]]:
    """Runs in the DHT process: ``{"<rpc>:<kind>": [calls, request bytes, response bytes]}`` so far."""
    ledger = getattr(node.protocol, "_p2pdiloco_ledger", None)
    return {k: list(v) for k, v in sorted(ledger.rows.items())} if ledger is not None else {}
