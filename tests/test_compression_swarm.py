"""Compression over the real network: three SwarmNodes on 127.0.0.1 in this process (each with its
own event-loop thread, DHT process and libp2p daemon) running the real butterfly all-reduce, and a
bootstrap + three ``p2pdiloco join`` processes training with 4-bit low-rank compression.
"""
from __future__ import annotations

import itertools
import logging
import threading

import pytest
import torch

from conftest import TINY
from p2pdiloco.compression import get_codec
from p2pdiloco.compression.base import Codec
from p2pdiloco.compression.quant4 import E3M0Codec
from p2pdiloco.config import load_config
from p2pdiloco.diloco.reducers import make_reducer
from p2pdiloco.errors import SyncFailed
from p2pdiloco.metrics import read_metrics
from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import Group, make_group_id
from test_compression import SHAPES, SimGroup, _block_absmax, _lowrank_deltas, butterfly_mean

RUN = "ctest"
_gids = itertools.count()


@pytest.fixture(scope="module")
def trio():
    """Three nodes, sorted by peer id (= member order), each with an AllReducer."""
    from p2pdiloco.swarm.node import SwarmNode

    nodes = [SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    try:
        for _ in range(2):
            nodes.append(SwarmNode(nodes[0].visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        nodes.sort(key=lambda n: n.peer_id_str)
        reducers = [AllReducer(n, RUN, timeout=20) for n in nodes]
        yield nodes, reducers
    finally:
        for n in nodes:
            n.shutdown()


@pytest.fixture
def clean(trio):
    """Forgive offences between tests (a test's deliberate offender must not stay banned)."""
    nodes, reducers = trio
    for n in nodes:
        n.gate.forgive()
    for r in reducers:
        r.stats.clear()
        r.dropped_log.clear()
    yield trio


def _groups(nodes):
    members = tuple(n.peer_id_str for n in nodes)
    gid = make_group_id(RUN, 0, next(_gids), members)
    return [Group(gid=gid, members=members, my_index=i, frag=0, round=0) for i in range(len(nodes))]


def _run_threads(fns):
    """Run one callable per peer concurrently; return (results, errors) by peer."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def go(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "an all-reduce hung"
    return results, errors


def _allreduce_all(trio, vecs, weights, codec, phase="x"):
    nodes, ars = trio
    groups = _groups(nodes)
    return _run_threads([
        (lambda i=i: nodes[i].call(ars[i].allreduce(groups[i], phase, vecs[i], weights[i], codec), timeout=60))
        for i in range(3)])


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    heavy = torch.randn(n, generator=g) / (torch.randn(n, 2, generator=g).pow(2).sum(1) / 2).sqrt()  # Student-t 2
    # scales within the robust screen's norm_bound of each other (honest peers)
    return [torch.randn(n, generator=g), heavy, 3 * torch.randn(n, generator=g)]


# ---- 4-bit all-reduce -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["e3m0", "nf4", "fp4"])
def test_4bit_allreduce_is_bitwise_identical_and_within_bound(clean, name):
    codec = get_codec(name)
    nodes, _ = clean
    n = 100_003  # not a multiple of the block size or of the group size
    vecs, weights = _inputs(n, seed=len(name)), [1.0, 2.0, 3.0]
    sent0 = [node.traffic.snapshot()[0] for node in nodes]
    results, errors = _allreduce_all(clean, vecs, weights, codec)
    assert errors == [None] * 3, errors
    assert all(torch.equal(r, results[0]) for r in results)  # every peer decoded the same bytes
    # ... which are exactly the owner arithmetic: fp32 sum of decoded parts in member order, one encode
    assert torch.equal(results[0], butterfly_mean(vecs, weights, codec))
    # within the codec's bound of the true fp32 mean: each part's quantization plus the mean's
    W = sum(weights)
    true = sum(w * v for w, v in zip(weights, vecs)) / W
    decoded_mean = sum(w * codec.roundtrip(v) for w, v in zip(weights, vecs)) / W
    b = codec.relative_error_bound
    bound = b * sum(w / W * _block_absmax(v) for w, v in zip(weights, vecs)) + b * _block_absmax(decoded_mean)
    assert bool(((results[0] - true).abs() <= bound * (1 + 1e-5) + 1e-6).all())
    assert (results[0] - true).abs().max() > 0  # it is lossy, the bound is doing work
    # what crossed the wire, counted by our streams: per peer two parts out and its shard's mean back
    # to the two others, ~4.5 bits per value each, plus a few hundred bytes of framing
    for node, s0 in zip(nodes, sent0):
        sent = node.traffic.snapshot()[0] - s0
        payload = 4 * codec.encoded_size(n // 3)
        assert payload < sent < payload + 2048, (sent, payload)
        assert sent < (4 * 4 * n / 3) / 6  # an fp32 butterfly sends 4 * (n/3) * 4 bytes per peer


# ---- bad parts from one peer ---------------------------------------------------------------------------
class _Truncating(E3M0Codec):
    """Says e3m0 (id 2) but sends one byte short (a test double: not registered)."""

    def encode(self, x):
        return super().encode(x)[:-1]


class _NaNScale(E3M0Codec):
    """Valid e3m0 layout whose first block scale is NaN."""

    def encode(self, x):
        data = bytearray(super().encode(x))
        data[0:4] = torch.tensor([float("nan")]).numpy().astype("<f4").tobytes()
        return bytes(data)


class _NaNFloat32(Codec):
    name, codec_id = "fp32", 0

    def encoded_size(self, numel):
        return 4 * numel

    def encode(self, x):
        x = x.detach().float().clone()
        x[0] = float("nan")
        return x.numpy().tobytes()

    def _decode(self, data, numel):  # pragma: no cover - never used to decode
        raise AssertionError


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,run_codec,check", [
    ("wrong_size", "e3m0", "length"),
    ("wrong_codec", "e3m0", "codec"),
    ("nan_4bit", "e3m0", "finite"),
    ("nan_fp32", "fp32", "finite"),
])
def test_bad_part_from_one_peer_is_rejected_and_logged_with_its_id(clean, caplog, monkeypatch, case, run_codec,
                                                                   check):
    """Peer 1 sends every owner a bad part (its own shard it reduces honestly). The owners drop the
    part before using it, log the sender's full peer id, and the honest peers end with identical
    results that hold no trace of it; the offender itself applies nothing (SyncFailed)."""
    nodes, ars = clean
    codec = get_codec(run_codec)
    bad = {"wrong_size": _Truncating(), "wrong_codec": get_codec("fp16"), "nan_4bit": _NaNScale(),
           "nan_fp32": _NaNFloat32()}[case]
    offender = nodes[1].peer_id_str
    original = ars[1]._send_part

    async def send_bad(group, phase, j, part, weight, codec_, out, level=None):
        return await original(group, phase, j, part, weight, bad, out, level)

    monkeypatch.setattr(ars[1], "_send_part", send_bad)
    n = 5000
    g = torch.Generator().manual_seed(7)
    vecs, weights = [torch.randn(n, generator=g) for _ in range(3)], [1.0, 1.0, 1.0]
    with caplog.at_level(logging.WARNING):
        results, errors = _allreduce_all(clean, vecs, weights, codec)
    assert isinstance(errors[1], SyncFailed)  # the offender got "abort" from every honest owner
    assert errors[0] is None and errors[2] is None, errors
    assert torch.equal(results[0], results[2])
    assert bool(torch.isfinite(results[0]).all())
    # the fault fired: each honest owner dropped the part under the expected check
    for i in (0, 2):
        assert ars[i].stats[f"dropped:{check}"] == 1, ars[i].stats
        assert [entry[0] for entry in ars[i].dropped_log] == [offender]
    dropped_lines = [r.getMessage() for r in caplog.records if "dropped the part of peer" in r.getMessage()]
    assert len(dropped_lines) == 2 and all(offender in line for line in dropped_lines), dropped_lines
    honest = {nodes[0].peer_id_str, nodes[2].peer_id_str}
    assert not any(h in r.getMessage() for r in caplog.records for h in honest
                   if "dropped" in r.getMessage() or "offence" in r.getMessage())
    # the honest owners' shards are the mean of the honest parts alone
    from p2pdiloco.swarm.partition import shard_bounds

    bounds = shard_bounds(n, 3, codec.block_size)
    honest_mean = butterfly_mean([vecs[0], vecs[2]], [1.0, 1.0], codec)
    for j in (0, 2):
        a, b = bounds[j]
        assert torch.equal(results[0][a:b], honest_mean[a:b])


# ---- low-rank over the swarm ------------------------------------------------------------------------------
def _swarm_reduce_all(trio, reds, deltas, weights, codec):
    nodes, ars = trio
    groups = _groups(nodes)

    def bound(i):
        def allreduce(vec, phase, c=None):
            return nodes[i].call(ars[i].allreduce(groups[i], f"f0.{phase}", vec, weights[i], c or codec), timeout=60)
        return allreduce

    return _run_threads([(lambda i=i: reds[i].reduce(deltas[i], bound(i))) for i in range(3)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec_name", ["fp32", "e3m0"])
def test_lowrank_over_the_swarm_recovers_rank_r_and_agrees(clean, codec_name):
    """Rank-3 pseudo-gradients (shared column space, so the mean has rank 3) through three real
    all-reduces per sync (hdr fp32, P and Q with the run codec): every peer applies the same bytes,
    exactly those of the reference arithmetic (SimGroup); with fp32 factors they equal the true mean
    to fp32 precision; with e3m0 factors (two 4-bit stages, on P and on Q) the first round is within
    0.6 of it in relative L2 and error feedback keeps the rest for later rounds."""
    codec = get_codec(codec_name)
    cfg = load_config(None, [f"compression.codec={codec_name}", "compression.lowrank=true", "compression.rank=3",
                             "compression.min_numel=1000", "compression.error_feedback=true"])
    reds = [make_reducer(cfg, [torch.zeros(s) for s in SHAPES]) for _ in range(3)]
    refs = [make_reducer(cfg, [torch.zeros(s) for s in SHAPES]) for _ in range(3)]
    weights = [1.0, 2.0, 1.0]
    gen = torch.Generator().manual_seed(11)
    for rnd in range(2):  # the second round runs on warm bases, agreed stats and residuals
        deltas = _lowrank_deltas(gen, 3, 3)
        results, errors = _swarm_reduce_all(clean, reds, deltas, weights, codec)
        assert errors == [None] * 3, errors
        assert all(torch.equal(r, results[0]) for r in results)
        assert torch.equal(results[0], SimGroup(3, weights, codec=codec).run(refs, deltas)[0])
        true = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
        if codec_name == "fp32":
            assert (results[0] - true).abs().max() <= 1e-4 * true.abs().max()
        elif rnd == 0:
            assert (results[0] - true).norm() < 0.6 * true.norm()
            assert reds[0].info()["residual_norm"] > 0
        assert all(r.info()["ranks"] == reds[0].info()["ranks"] for r in reds)
    assert reds[0].info()["values_sent"] < 0.2 * reds[0].info()["values_dense"]


# ---- a whole swarm with 4-bit + low-rank ------------------------------------------------------------------
H = 10
OUTER_STEPS = 3


@pytest.mark.timeout(300)
def test_swarm_trains_with_4bit_lowrank_and_stays_identical(procs, tmp_path):
    settings = [f"inner.sync_every={H}", f"train.max_outer_steps={OUTER_STEPS}", "inner.batch_size=4",
                "swarm.run_id=compress", "train.progress_bar=false", "swarm.min_peers_to_start=3",
                "compression.codec=e3m0", "compression.lowrank=true", "compression.rank=4"]
    addr = procs.bootstrap()
    peers = [procs.start("join", "--initial-peers", addr, "--config", TINY, *sum(
        (["--set", s] for s in settings + [f"data.shard={i}", f"train.run_dir={tmp_path}/p{i}"]), []),
        name=f"p{i}") for i in range(3)]
    for p in peers:
        assert procs.wait(p, 240) == 0, procs.err(p.name)[-3000:]
    syncs, starts = {}, {}
    for i in range(3):
        recs = read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"))
        starts[i] = [r for r in recs if r["event"] == "start"][0]
        syncs[i] = [r for r in recs if r["event"] == "sync"]
        assert [r["outer_step"] for r in syncs[i]] == list(range(1, OUTER_STEPS + 1)), syncs[i]
        assert all(r["ok"] and r["group_size"] == 3 for r in syncs[i]), syncs[i]
    for k in range(OUTER_STEPS):
        assert len({syncs[i][k]["digest"] for i in range(3)}) == 1, f"peers disagree after sync {k + 1}"
        assert len({tuple(syncs[i][k]["ranks"]) for i in range(3)}) == 1  # agreed ranks, logged
    last = syncs[0][-1]
    assert last["ranks"] and all(1 <= r <= 4 for r in last["ranks"])
    assert last["val_loss"] < starts[0]["val_loss"]
    # bytes on the wire per peer per sync: far below an fp32 all-reduce of the model
    params = starts[0]["params"]
    fp32_butterfly = 2 * (3 - 1) / 3 * 4 * params
    for i in range(3):
        for r in syncs[i]:
            assert r["sync_bytes_sent"] < fp32_butterfly / 32, (r["sync_bytes_sent"], fp32_butterfly)
