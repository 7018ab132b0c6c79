"""The sparse codec over the real all-reduce: three SwarmNodes on 127.0.0.1 in this process. The owners
relay the members' sparse parts and every member averages them itself: results bitwise identical on
every peer and exactly the weighted mean of what the members sent; a malformed sparse part is dropped
before anything is applied, naming its sender; SparseLoCo's reducer agrees across peers round after round.
(Peers on different ATen kernel builds: test_exactness_hw.py's sparse run.)
"""
from __future__ import annotations

import logging

import pytest
import torch

from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.compression.sparse import SparseCodec, sparse_codec
from p2pdiloco.diloco.reducers import SparseReducer
from p2pdiloco.errors import SyncFailed
from p2pdiloco.swarm.partition import shard_bounds
from test_compression_swarm import _groups, _run_threads, clean, trio  # noqa: F401 (fixtures)

CODEC = sparse_codec(1024, 16, 2)  # not the registered default: the owner must take the run's own instance


def _reference(vecs, weights, codec):
    """Every shard: the weighted mean, in member order, of each member's decoded part (nothing re-encoded)."""
    n = vecs[0].numel()
    return torch.cat([weighted_mean([codec.roundtrip(v[a:b]) for v in vecs], weights)
                      for a, b in shard_bounds(n, len(vecs), codec.block_size)])


def _allreduce(trio, vecs, weights, codec):
    nodes, ars = trio
    groups = _groups(nodes)
    return _run_threads([(lambda i=i: nodes[i].call(ars[i].allreduce(groups[i], "x", vecs[i], weights[i], codec),
                                                    timeout=60)) for i in range(3)])


@pytest.mark.timeout(120)
def test_sparse_allreduce_is_bitwise_identical_and_exact(clean):
    nodes, _ = clean
    n = 1024 * 30 + 77  # a partial last chunk; shards of whole chunks
    g = torch.Generator().manual_seed(5)
    vecs, weights = [torch.randn(n, generator=g) * s for s in (1.0, 2.0, 0.5)], [1.0, 2.0, 3.0]
    sent0 = [node.traffic.snapshot()[0] for node in nodes]
    results, errors = _allreduce(clean, vecs, weights, CODEC)
    assert errors == [None] * 3, errors
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], _reference(vecs, weights, CODEC))
    assert int((results[0] != 0).sum()) > 16 * 30  # the union of the members' top-k, not truncated again
    # per peer: its parts to two owners, and its shard's three relayed parts to each of the two others
    for node, s0 in zip(nodes, sent0):
        sent = node.traffic.snapshot()[0] - s0
        payload = 2 * CODEC.encoded_size(n // 3) + 2 * 3 * CODEC.encoded_size(n // 3)
        assert 0.9 * payload < sent < 1.1 * payload + 2048, (sent, payload)
        assert sent * 30 < 4 * 4 * n / 3  # an fp32 butterfly: 4 * (n/3) * 4 bytes per peer


class _BadPositions(SparseCodec):
    """A sparse part of the right size whose positions are malformed (a test double: not registered)."""

    def __init__(self, kind):
        super().__init__(CODEC.chunk, CODEC.k, CODEC.bits)
        self.kind = kind

    def encode(self, x):
        data = bytearray(super().encode(x))
        if self.kind == "duplicate":  # the first two 12-bit positions of the first chunk made equal (and 0)
            data[8:11] = b"\x00\x00\x00"
        else:  # unsorted: the first position set to its largest value, the second left as it is
            data[8] = 0xFF
            data[9] = (data[9] & 0x0F) | 0xC0
        return bytes(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["duplicate", "unsorted"])
def test_malformed_sparse_part_is_dropped_naming_the_sender(clean, caplog, monkeypatch, kind):
    nodes, ars = clean
    offender = nodes[1].peer_id_str
    bad = _BadPositions(kind)
    original = ars[1]._send_part

    async def send_bad(group, phase, j, part, weight, codec_, out, level=None):
        return await original(group, phase, j, part, weight, bad, out, level)

    monkeypatch.setattr(ars[1], "_send_part", send_bad)
    n = 1024 * 9
    g = torch.Generator().manual_seed(8)
    vecs, weights = [torch.randn(n, generator=g) for _ in range(3)], [1.0, 1.0, 1.0]
    with caplog.at_level(logging.WARNING):
        results, errors = _allreduce(clean, vecs, weights, CODEC)
    assert isinstance(errors[1], SyncFailed)
    assert errors[0] is None and errors[2] is None, errors
    assert torch.equal(results[0], results[2])
    for i in (0, 2):
        assert ars[i].stats["dropped:payload"] == 1, ars[i].stats
        assert [e[0] for e in ars[i].dropped_log] == [offender]
    lines = [r.getMessage() for r in caplog.records if "dropped the part of peer" in r.getMessage()]
    assert len(lines) == 2 and all(offender in x and "sparse part" in x for x in lines), lines
    honest = _reference([vecs[0], vecs[2]], [1.0, 1.0], CODEC)
    bounds = shard_bounds(n, 3, CODEC.block_size)
    for j in (0, 2):  # the honest owners' shards average the honest parts alone
        a, b = bounds[j]
        assert torch.equal(results[0][a:b], honest[a:b])


@pytest.mark.timeout(120)
def test_sparse_reducer_over_the_swarm_agrees_round_after_round(clean):
    nodes, ars = clean
    weights = [1.0, 2.0, 1.0]
    reds = [SparseReducer(CODEC, 0.95) for _ in range(3)]
    g = torch.Generator().manual_seed(12)
    bufs = [torch.zeros(1024 * 12) for _ in range(3)]
    for _ in range(3):
        groups = _groups(nodes)
        deltas = [torch.randn(1024 * 12, generator=g) for _ in range(3)]

        def bound(i):
            def allreduce(vec, phase, c=None):
                return nodes[i].call(ars[i].allreduce(groups[i], f"f0.{phase}", vec, weights[i], c or CODEC), timeout=60)
            return allreduce
        results, errors = _run_threads([(lambda i=i: reds[i].reduce(deltas[i], bound(i))) for i in range(3)])
        assert errors == [None] * 3, errors
        accs = [b * 0.95 + d for b, d in zip(bufs, deltas)]  # e <- beta e + delta, per peer
        assert all(torch.equal(r, results[0]) for r in results)
        assert torch.equal(results[0], _reference(accs, weights, CODEC))
        bufs = [a - CODEC.roundtrip(a) for a in accs]
        assert all(torch.equal(r.residual(), b) for r, b in zip(reds, bufs))  # each peer keeps its own
