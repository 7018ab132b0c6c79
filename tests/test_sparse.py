"""The sparse codec (chunked top-k, low-bit values, 12-bit positions) and SparseLoCo's reducer.

Both are checked against plain reference implementations written out below (loops over chunks,
no vectorisation), the codec's malformed payloads are refused naming the sender, and the reducer's
decayed error buffer follows ``e ← β·e + Δ; e ← e − roundtrip(e)`` through syncs, failures and
checkpoints. The all-reduce over real peers is in test_sparse_swarm.py.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from p2pdiloco.compression import codec_by_id, get_codec
from p2pdiloco.compression.robust import weighted_mean
from p2pdiloco.compression.sparse import SparseCodec, sparse_codec
from p2pdiloco.config import load_config
from p2pdiloco.diloco.reducers import SparseReducer, make_reducer
from p2pdiloco.errors import ConfigError, SyncFailed, WireError
from p2pdiloco.swarm.partition import shard_bounds

pytestmark = pytest.mark.timeout(120)


# ---- a plain reference implementation of the codec -----------------------------------------------
def ref_roundtrip(x: torch.Tensor, chunk: int, k: int, bits: int) -> torch.Tensor:
    """What the codec's decode(encode(x)) must be: per chunk the k largest magnitudes, each replaced by
    its sign times the nearest of 2^(bits-1) levels spread evenly from the smallest to the largest kept
    magnitude (fp32 arithmetic, one rounding per operation), everything else 0."""
    x = x.double().numpy().astype(np.float32)
    out = np.zeros_like(x)
    levels = 2 ** (bits - 1)
    for s in range(0, len(x), chunk):
        c = x[s: s + chunk]
        kk = k if len(c) == chunk else math.ceil(k * len(c) / chunk)
        order = sorted(range(len(c)), key=lambda i: -abs(float(c[i])))[:kk]
        mags = [np.float32(abs(c[i])) for i in order]
        lo, hi = min(mags), max(mags)
        step = np.float32((hi - lo) / np.float32(levels - 1))
        for i in order:
            m = np.float32(abs(c[i]))
            lvl = 0 if step == 0 else min(levels - 1, int(np.round(np.float32((m - lo) / step))))
            v = np.float32(lo + np.float32(np.float32(lvl) * step))
            out[s + i] = -v if c[i] < 0 else v
    return torch.from_numpy(out)


def _x(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk,k,bits,n", [(4096, 64, 2, 4096 * 3 + 1000), (4096, 32, 2, 8192), (256, 7, 4, 1000),
                                            (64, 64, 8, 130), (4096, 64, 3, 50)])
def test_roundtrip_equals_the_reference(chunk, k, bits, n):
    c = sparse_codec(chunk, k, bits)
    x = _x(n, seed=n)
    data = c.encode(x)
    assert len(data) == c.encoded_size(n)
    got = c.decode(data, n)
    assert torch.equal(got, ref_roundtrip(x, chunk, k, bits))
    full, rest = divmod(n, chunk)
    assert int((got != 0).sum()) == full * k + (math.ceil(k * rest / chunk) if rest else 0)


def test_exact_sizes_and_registry():
    c = get_codec("sparse")
    assert (c.chunk, c.k, c.bits, c.codec_id, c.block_size) == (4096, 64, 2, 8, 4096)
    assert codec_by_id(8) is c and sparse_codec(4096, 64, 2) is c
    # per chunk of 4096: lo and hi (8 bytes), 64 positions of 12 bits (96), 64 codes of 2 bits (16)
    assert c.encoded_size(4096) == 120 and c.encoded_size(0) == 0
    assert c.encoded_size(4096 * 5 + 100) == 5 * 120 + (8 + math.ceil(2 * 12 / 8) + math.ceil(2 * 2 / 8))
    assert len(c.encode(torch.zeros(0))) == 0
    for n in (1, 5, 4095, 4097, 12345):
        assert len(c.encode(_x(n))) == c.encoded_size(n)
    assert 4 * 4096 / c.encoded_size(4096) > 136  # 137x fewer bytes than fp32 per part
    assert c.reply_size(4096, 4) == 4 * 120 and get_codec("e3m0").reply_size(4096, 4) == get_codec("e3m0").encoded_size(4096)


def test_zeros_stay_zero_and_chunks_are_independent():
    c = sparse_codec(256, 8, 2)
    x = torch.zeros(1024)
    x[3], x[700] = 1.5, -2.0
    y = c.roundtrip(x)
    assert torch.equal(y, x)  # the kept zeros decode to 0 (lo = 0), the two values exactly (lo/hi)
    v = _x(256 * 6, seed=3)
    whole = c.roundtrip(v)
    for a, b in shard_bounds(v.numel(), 4, c.block_size):  # owners' shards start on chunk boundaries
        assert torch.equal(c.roundtrip(v[a:b]), whole[a:b])


# ---- malformed payloads ----------------------------------------------------------------------------
def _layout(c: SparseCodec, data: bytes):
    """(scales, positions, codes) of a one-chunk payload, decoded by hand."""
    ib = math.ceil(c.k * c.index_bits / 8)
    bits = np.unpackbits(np.frombuffer(data[8: 8 + ib], np.uint8))[: c.k * c.index_bits].reshape(c.k, c.index_bits)
    pos = [int("".join(map(str, r)), 2) for r in bits]
    return data[:8], pos, data[8 + ib:]


def _with_positions(c: SparseCodec, data: bytes, pos) -> bytes:
    scales, _, codes = _layout(c, data)
    bits = "".join(format(p, f"0{c.index_bits}b") for p in pos)
    bits += "0" * (-len(bits) % 8)
    return scales + bytes(int(bits[i: i + 8], 2) for i in range(0, len(bits), 8)) + codes


@pytest.mark.parametrize("kind,msg", [("range", "out of range"), ("duplicate", "repeats an index"),
                                      ("unsorted", "not sorted"), ("nan", "scale"), ("lo>hi", "scale"),
                                      ("negative", "scale"), ("too many", "bytes, expected"),
                                      ("too few", "bytes, expected")])
def test_malformed_payloads_are_refused_naming_the_sender(kind, msg):
    c = sparse_codec(1000, 10, 2)  # positions of 10 bits: 1000..1023 are out of the chunk
    x = _x(1000, seed=1)
    good = c.encode(x)
    _, pos, _ = _layout(c, good)
    assert pos == sorted(pos) and c.roundtrip(x).nonzero().view(-1).tolist() == pos
    if kind == "range":
        bad = _with_positions(c, good, pos[:-1] + [1000])
    elif kind == "duplicate":
        bad = _with_positions(c, good, pos[:5] + [pos[4]] + pos[6:])
    elif kind == "unsorted":
        bad = _with_positions(c, good, [pos[1], pos[0]] + pos[2:])
    elif kind == "nan":
        bad = struct.pack("<ff", float("nan"), 1.0) + good[8:]
    elif kind == "lo>hi":
        bad = struct.pack("<ff", 2.0, 1.0) + good[8:]
    elif kind == "negative":
        bad = struct.pack("<ff", -1.0, 1.0) + good[8:]
    elif kind == "too many":
        bad = good + good[8:10]  # more positions than k: not the exact size
    else:
        bad = good[:-1]
    out = torch.full((1000,), 7.0)
    with pytest.raises(WireError, match=msg) as e:
        c.decode_into(bad, out, sender="QmMallory")
    assert "QmMallory" in str(e.value)
    assert torch.all(out == 7.0)  # refused before anything was written into place
    with pytest.raises(WireError):
        c.decode(bad, 1000, sender="QmMallory")


# ---- SparseLoCo's reducer ----------------------------------------------------------------------------
def _solo(codec):
    """A group of one: what crossed the wire, once (swarm.Swarm.allreduce's shortcut)."""
    calls = []

    def fn(vec, phase, c=None):
        calls.append((phase, (c or codec).name))
        return (c or codec).roundtrip(vec)
    return fn, calls


def test_error_buffer_follows_the_reference():
    c = sparse_codec(512, 8, 2)
    beta = 0.95
    red = SparseReducer(c, beta)
    fn, calls = _solo(c)
    e = torch.zeros(2048)
    sent_total, decayed = torch.zeros(2048, dtype=torch.float64), torch.zeros(2048, dtype=torch.float64)
    for t in range(6):
        delta = _x(2048, seed=10 + t) * 0.01
        acc = e * beta + delta  # the plain reference: e <- beta e + delta; send roundtrip(e); e <- e - sent
        sent = ref_roundtrip(acc, 512, 8, 2)
        e = acc - sent
        got = red.reduce(delta, fn)
        assert torch.equal(got, sent) and torch.equal(red.residual(), e)
        sent_total = sent_total * beta + sent.double()
        decayed = decayed * beta + delta.double()
    assert calls == [("delta", "sparse")] * 6
    # e_T = sum_t beta^(T-t) (delta_t - sent_t): nothing is lost but what the decay forgets (fp32 rounding only)
    assert torch.allclose(sent_total + e.double(), decayed, atol=1e-6)


def test_reducer_keeps_its_buffer_when_the_sync_fails_and_restores_from_state():
    c = sparse_codec(512, 8, 2)
    red = SparseReducer(c, 0.9)
    fn, _ = _solo(c)
    red.reduce(_x(1024, 1), fn)
    before = red.residual().clone()
    state = red.state_dict()

    def failing(vec, phase, codec=None):
        raise SyncFailed("injected")
    with pytest.raises(SyncFailed):
        red.reduce(_x(1024, 2), failing)
    assert torch.equal(red.residual(), before) and torch.equal(red.state_dict()["error"], before)
    other = SparseReducer(c, 0.9)
    other.load_state_dict(state)
    a, b = red.reduce(_x(1024, 3), fn), other.reduce(_x(1024, 3), fn)
    assert torch.equal(a, b) and torch.equal(red.residual(), other.residual())
    red.reset()
    assert red.residual() is None and red.state_dict() == {"kind": "sparse", "error": None}
    with pytest.raises(ValueError, match="sparse"):
        other.load_state_dict({"kind": "quantized", "residual": {}})


def test_group_mean_is_exactly_the_members_parts_averaged():
    """Three weighted peers through the relaying owner arithmetic: every peer's result is the weighted
    mean (member order) of what each member's buffer lost, and each buffer is its own."""
    import threading
    c = sparse_codec(256, 4, 2)
    weights = [1.0, 2.0, 0.5]
    reds = [SparseReducer(c, 0.95) for _ in weights]
    slots, barrier = {}, threading.Barrier(3)

    def member(i):
        def fn(vec, phase, codec=None):
            slots[i] = vec.clone()
            barrier.wait(10)
            parts = [c.roundtrip(slots[j]) for j in range(3)]
            out = torch.cat([weighted_mean([p[a:b] for p in parts], weights)
                             for a, b in shard_bounds(vec.numel(), 3, c.block_size)])
            barrier.wait(10)
            return out
        return fn
    for t in range(3):
        deltas = [_x(1024, seed=100 * t + i) for i in range(3)]
        before = [torch.zeros(1024) if r.residual() is None else r.residual().clone() for r in reds]
        outs = [None] * 3
        ths = [threading.Thread(target=lambda i=i: outs.__setitem__(i, reds[i].reduce(deltas[i], member(i))))
               for i in range(3)]
        [th.start() for th in ths]
        [th.join(30) for th in ths]
        sent = [before[i] * 0.95 + deltas[i] - reds[i].residual() for i in range(3)]
        expect = weighted_mean([c.roundtrip(before[i] * 0.95 + deltas[i]) for i in range(3)], weights)
        assert all(torch.equal(o, outs[0]) for o in outs) and torch.equal(outs[0], expect)
        assert torch.allclose(sum(s * w for s, w in zip(sent, weights)) / 3.5, expect, atol=1e-6)


# ---- configuration -----------------------------------------------------------------------------------
def _cfg(*sets):
    return load_config(None, ["scheme=diloco", *sets])


def test_config_selects_the_sparse_reducer_and_validates():
    ok = ["compression.codec=sparse", "outer.lr=1", "outer.momentum=0"]
    cfg = _cfg(*ok, "compression.sparse_k=32", "compression.sparse_bits=4", "compression.sparse_decay=0.9")
    red = make_reducer(cfg, [torch.zeros(10)])
    assert isinstance(red, SparseReducer) and (red.codec.k, red.codec.bits, red.decay) == (32, 4, 0.9)
    bad = {("compression.codec=sparse",): "outer.lr=1 --set outer.momentum=0",
           ("compression.codec=sparse", "outer.lr=1"): "momentum 0.9",
           (*ok, "robust.aggregator=centered_clip"): "robust.aggregator=mean",
           (*ok, "compression.lowrank=true"): "does not combine",
           (*ok, "compression.sparse_k=0"): "sparse_k",
           (*ok, "compression.sparse_k=5000"): "sparse_k",
           (*ok, "compression.sparse_chunk=1"): "sparse_chunk",
           (*ok, "compression.sparse_bits=1"): "sparse_bits",
           (*ok, "compression.sparse_decay=1.5"): "sparse_decay"}
    for sets, msg in bad.items():
        with pytest.raises(ConfigError, match=msg.replace(".", r"\.")):
            _cfg(*sets)


def test_quality_bench_counts_relayed_replies():
    from p2pdiloco.bench.compression_quality import SETTINGS, _Butterfly
    assert "outer.momentum=0" in SETTINGS["sparse"] and "compression.sparse_k=32" in SETTINGS["sparse-k32"]
    c = get_codec("sparse")
    bf = _Butterfly(1, [1.0], c)
    bf.k = 1
    out = bf.fn(0)(_x(8192), "delta")
    assert torch.equal(out, c.roundtrip(_x(8192)))
    bf2 = _Butterfly(1, [1.0], c)
    bf2.k = 4  # the bytes of one member of four: parts out, and its shard's relayed parts to each other member
    bf2.barrier = type("B", (), {"wait": lambda self, timeout=None: None})()
    bf2.slots = {i: _x(8192, i) for i in range(4)}
    bf2.weights = [1.0] * 4
    bf2.fn(0)(_x(8192), "delta")
    assert bf2.payload[0] == int(3 / 4 * (c.encoded_size(8192) + 4 * c.encoded_size(8192)))


def test_a_relayed_reply_is_checked_before_it_is_averaged():
    """A member checks an owner's relayed reply: exact size for the parts it names, every relayed part
    well formed, weights one per covered member adding up to the trailer's total."""
    from p2pdiloco.swarm.allreduce_member import PartSender
    from p2pdiloco.swarm.partition import relayed_mean
    c = sparse_codec(256, 8, 2)
    parts = [_x(512, seed=i) for i in range(3)]
    data = b"".join(c.encode(p) for p in parts)
    out = torch.zeros(512)
    relayed_mean(c, data, [1.0, 2.0, 3.0], out, "QmOwner")
    assert torch.equal(out, weighted_mean([c.roundtrip(p) for p in parts], [1.0, 2.0, 3.0]))
    with pytest.raises(WireError, match="QmOwner"):
        relayed_mean(c, data[:-1], [1.0, 2.0, 3.0], out, "QmOwner")  # one byte short
    with pytest.raises(WireError, match="QmOwner"):
        relayed_mean(c, data, [1.0, 2.0], out, "QmOwner")  # three parts, two weights
    bad = bytearray(data)
    bad[8:11] = b"\x00\x00\x00"  # the first part's first two positions equal
    with pytest.raises(WireError, match="repeats"):
        relayed_mean(c, bytes(bad), [1.0, 2.0, 3.0], out, "QmOwner")
    ok = {"cov": [0, 1, 2], "ws": [1.0, 2.0, 3.0], "w": 6.0}
    assert PartSender._relayed_weights(ok, "QmOwner") == [1.0, 2.0, 3.0]
    for bad_reply in ({**ok, "w": 6.5}, {**ok, "ws": [1.0, 2.0]}, {**ok, "ws": [1.0, -2.0, 7.0]},
                      {**ok, "ws": "x"}, {"cov": [0, 1, 2], "w": 6.0}):
        with pytest.raises(WireError, match="QmOwner"):
            PartSender._relayed_weights(bad_reply, "QmOwner")


def test_quality_bench_reports_the_coordinates_the_update_touched():
    """The share of coordinates the applied update has changed at least once, per round: all of them
    for a dense codec, a share that grows round by round and stays below 1 for top-k."""
    from p2pdiloco.bench.compression_quality import SETTINGS, run_setting
    from p2pdiloco.config import load_config

    base = ["streaming.fragments=1", "inner.sync_every=2", "train.eval_batches=1", "data.max_bytes=200000"]
    dense = run_setting(load_config("tests/tiny-diloco.toml", [*base, *SETTINGS["fp32"]]), peers=2, rounds=2)
    assert dense["touched"] == [1.0, 1.0]
    sparse = load_config("tests/tiny-diloco.toml", [*base, *SETTINGS["sparse-k32"], "compression.sparse_chunk=1024",
                                                    "compression.sparse_k=8"])
    share = run_setting(sparse, peers=2, rounds=3)["touched"]
    assert 0 < share[0] < share[1] < share[2] < 0.05, share  # 2 peers x 8 of 1024 per round: at most 1.6% more
