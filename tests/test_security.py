"""Hostile peers: bad parts, Byzantine updates, forged and replayed records, bans, unverified step
claims, protocol versions, nothing unpickled.

The misbehaving peer is the real peer with one hook changed: :class:`EvilAllReducer` overrides
``AllReducer._outgoing`` (what a member sends to each shard owner); everything else it runs, and
everything the honest peers run, is the production code. Peers are in-process SwarmNodes on
127.0.0.1 (each with its own DHT process and libp2p daemon), shared by the tests of this module.
"""
from __future__ import annotations

import ast
import asyncio
import itertools
import logging
import os
import time
from typing import Callable, Optional, Sequence

import msgpack
import pytest
import torch

from conftest import loopback_nodes, reset_gates
from p2pdiloco.compression import get_codec
from p2pdiloco.compression.robust import RobustConfig, centered_clip, screen, weighted_mean
from p2pdiloco.errors import FingerprintMismatch, SyncFailed
from p2pdiloco.swarm.allreduce import AllReducer
from p2pdiloco.swarm.group import Group, make_group_id
from p2pdiloco.swarm.partition import shard_bounds
from p2pdiloco.swarm.node import SwarmNode
from p2pdiloco.swarm.protocol import PROTOCOL_VERSION, read_frame, write_frame

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_runs = itertools.count()


class EvilAllReducer(AllReducer):
    """The real all-reducer, except for what it sends: ``attack(j, part, weight) -> (part, weight)``."""

    attack: Optional[Callable] = None

    def _outgoing(self, group, phase, j, part, weight):
        if self.attack is None:
            return part, weight
        return self.attack(j, part.clone(), weight)


@pytest.fixture(scope="module")
def nodes():
    with loopback_nodes(5) as ns:
        yield ns


@pytest.fixture(autouse=True)
def _fresh_gates(request):
    if "nodes" in request.fixturenames:
        reset_gates(request.getfixturevalue("nodes"))
    yield


def make_reducers(nodes: Sequence[SwarmNode], evil: int, robust: RobustConfig, timeout: float = 20.0):
    run = f"sec{next(_runs)}"
    return [(EvilAllReducer if i == evil else AllReducer)(n, run, timeout=timeout, robust=robust)
            for i, n in enumerate(nodes)], run


def allreduce_all(nodes, reducers, run: str, vecs, weights, codec, round_: int, phase: str = "d"):
    """One all-reduce among all ``nodes``; returns each peer's result tensor or exception."""
    ids = sorted(n.peer_id_str for n in nodes)
    gid = make_group_id(run, 0, round_, ids)
    futs = [n.submit(r.allreduce(Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, round_), phase, v, w, codec))
            for n, r, v, w in zip(nodes, reducers, vecs, weights)]
    out = []
    for f in futs:
        try:
            out.append(f.result(90))
        except Exception as e:  # SyncFailed for the offender
            out.append(e)
    return out, ids


def expected_result(nodes, ids, vecs, weights, included: Callable[[int, int], bool], codec_align: int = 1):
    """Per shard j (owned by member j): the weighted mean, in member order, of the parts owner j keeps."""
    numel = vecs[0].numel()
    by_id = {n.peer_id_str: i for i, n in enumerate(nodes)}
    out = torch.empty(numel)
    for j, (lo, hi) in enumerate(shard_bounds(numel, len(ids), codec_align)):
        keep = [by_id[p] for p in ids if included(by_id[p], by_id[ids[j]])]
        out[lo:hi] = weighted_mean([vecs[i][lo:hi] for i in keep], [weights[i] for i in keep])
    return out


# ---- NaN / Inf / absurd weights / malformed parts never reach an honest peer ------------------------
ATTACKS = {
    "nan": lambda j, part, w: (part.index_fill_(0, torch.tensor([0]), float("nan")), w),
    "inf": lambda j, part, w: (part.index_fill_(0, torch.tensor([1]), float("-inf")), w),
    "absurd_weight": lambda j, part, w: (part, 1e11),
    "negative_weight": lambda j, part, w: (part, -5.0),
    "huge_values": lambda j, part, w: (part * 1e30, w),
    "wrong_numel": lambda j, part, w: (part[:-1], w),
}


@pytest.mark.timeout(240)
def test_bad_parts_are_dropped_consistently_and_offender_banned(nodes, caplog):
    """Each round one peer sends a different kind of bad part to every owner. Every honest peer
    gets bitwise identical, finite results equal to the mean of the parts the owners kept; the
    offender gets SyncFailed with the reason; every drop is logged with the offender's peer id,
    counted, and after ban_after offences the offender is banned."""
    ns = nodes[:4]
    evil = 3
    reducers, run = make_reducers(ns, evil, RobustConfig())
    codec = get_codec("fp32")
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="p2pdiloco")
    for n in ns:
        n.gate.configure(ban_after=len(ATTACKS) * 3 + 1, ban_seconds=600)  # ban at the very end
    bad_id = ns[evil].peer_id_str
    for round_, (name, attack) in enumerate(ATTACKS.items()):
        vecs = [torch.randn(1000) * 0.01 + 0.01 for _ in ns]
        weights = [40.0, 48.0, 40.0, 44.0]
        reducers[evil].attack = attack
        results, ids = allreduce_all(ns, reducers, run, vecs, weights, codec, round_)
        assert isinstance(results[evil], SyncFailed), (name, results[evil])
        assert "your part was dropped" in str(results[evil]), str(results[evil])
        honest = results[:evil]
        for r in honest:
            assert isinstance(r, torch.Tensor), (name, r)
            assert torch.isfinite(r).all()
            assert torch.equal(r, honest[0]), f"{name}: honest peers disagree"
        # owners drop the offender's part, the offender's own shard keeps it: the shards differ, so the
        # round is re-done without the offender and every shard averages the same (honest) members
        want = expected_result(ns, ids, vecs, weights, lambda i, owner: i != evil)
        assert torch.equal(honest[0], want), f"{name}: result is not the mean of the honest parts"
    for i in range(evil):
        assert reducers[i].stats["parts_dropped"] == len(ATTACKS), dict(reducers[i].stats)
        assert reducers[i].stats["rounds_redone"] == len(ATTACKS), dict(reducers[i].stats)
        assert all(peer == bad_id for peer, *_ in reducers[i].dropped_log)
        assert ns[i].gate.offences[bad_id] == len(ATTACKS)
    for check in ("finite", "weight", "norm", "codec"):
        assert reducers[0].stats[f"dropped:{check}"] >= 1, dict(reducers[0].stats)
    assert any(bad_id in rec.getMessage() and "dropped the part" in rec.getMessage() for rec in caplog.records)

    # repeat offender: one more bad round crosses ban_after on every honest owner
    for n in ns[:evil]:
        n.gate.configure(ban_after=len(ATTACKS) + 1, ban_seconds=600)
    vecs = [torch.randn(1000) for _ in ns]
    results, ids = allreduce_all(ns, reducers, run, vecs, [1.0] * 4, codec, len(ATTACKS))
    assert all(n.gate.banned(bad_id) for n in ns[:evil])
    # banned: its part is dropped up front even when it is perfectly fine
    reducers[evil].attack = None
    results, ids = allreduce_all(ns, reducers, run, vecs, [1.0] * 4, codec, len(ATTACKS) + 1)
    assert isinstance(results[evil], SyncFailed) and "banned" in str(results[evil])
    assert torch.equal(results[0], expected_result(ns, ids, vecs, [1.0] * 4, lambda i, owner: i != evil))
    assert reducers[0].stats["dropped:banned"] == 1


@pytest.mark.timeout(120)
def test_banned_peer_is_refused_by_every_handler(nodes):
    """A banned peer gets a clear refusal from join, part and state handlers alike, and the
    matchmaker leaves it out of the ready set."""
    from p2pdiloco.swarm.matchmaking import Matchmaker
    from hivemind.p2p import PeerID

    honest, bad = nodes[0], nodes[1]
    run = f"sec{next(_runs)}"
    Matchmaker(honest, run, matchmaking_timeout=2.0)
    AllReducer(honest, run, timeout=5.0)
    honest.gate.configure(ban_after=1, ban_seconds=600)
    honest.gate.offence(bad.peer_id_str, "test offence")
    assert honest.gate.banned(bad.peer_id_str)

    async def ask(handler: str, header: dict):
        _, reader, writer = await bad.p2p.call_binary_stream_handler(PeerID.from_base58(honest.peer_id_str),
                                                                     f"p2pdiloco.{run}.{handler}")
        try:
            await write_frame(writer, header)
            reply, _ = await asyncio.wait_for(read_frame(reader, 0), 10)
            return reply
        finally:
            writer.close()

    for handler, header in [("join", {"t": "join", "v": PROTOCOL_VERSION, "frag": 0, "round": 0}),
                            ("part", {"t": "part", "v": PROTOCOL_VERSION, "gid": "x", "phase": "d"})]:
        reply = bad.call(ask(handler, header), timeout=30)
        assert reply["t"] == "refuse" and "banned" in reply["reason"], (handler, reply)
    assert honest.gate.refused >= 2

    # its ready record is ignored by matchmaking: the honest peer forms its group without it
    run2 = f"sec{next(_runs)}"
    mm = Matchmaker(honest, run2, matchmaking_timeout=2.0)
    bad.store(f"{run2}:mm:0:7", {"t": time.time()}, ttl=30)
    assert bad.peer_id_str in honest.get_subkeys(f"{run2}:mm:0:7")  # the record itself is valid
    group = honest.call(mm.form_group(0, 7, 2), timeout=60)
    assert group.members == (honest.peer_id_str,)


@pytest.mark.timeout(300)
def test_bad_contributions_never_reach_honest_parameters(nodes, monkeypatch):
    """Real DiLoCo training (3 honest peers + 1 misbehaving peer, H = 2, 3 outer rounds): the
    misbehaving peer sends NaN, then an absurd weight, then +Inf. Every honest peer applies every
    round with a group of 4, its global parameters stay finite, and all honest peers end bitwise
    identical; the offender's syncs fail (it applies nothing) and every owner dropped its part."""
    import threading

    from torch import nn

    from p2pdiloco.config import load_config
    from p2pdiloco.diloco.core import DiLoCo
    import p2pdiloco.swarm.swarm as swarm_mod

    ns, evil, H, rounds = nodes[:4], 3, 2, 3
    run = f"sec{next(_runs)}"
    cfg = load_config(None, ["scheme=diloco"])  # blocking fp32 DiLoCo: one fragment, exact sums
    cfg.swarm.run_id = run
    cfg.inner.sync_every = H
    swarms = []
    for i, n in enumerate(ns):
        monkeypatch.setattr(swarm_mod, "AllReducer", EvilAllReducer if i == evil else AllReducer)
        s = swarm_mod.Swarm(n, run, matchmaking_timeout=20.0, allreduce_timeout=30.0, robust=cfg.robust,
                            progress_period=0.5)
        s.update_progress(step=0, round=0, samples=0, next_sync=H, synced_step=0)
        s.publish_progress(wait=True)
        s.start_publishing()
        swarms.append(s)
    monkeypatch.setattr(swarm_mod, "AllReducer", AllReducer)
    sends = itertools.count()
    plan = [ATTACKS["nan"], ATTACKS["absurd_weight"], ATTACKS["inf"]]
    swarms[evil].allreducer.attack = lambda j, part, w: plan[min(next(sends) // 3, 2)](j, part, w)

    reports, dilocos, errors = {}, {}, []

    models = []
    for i in range(4):  # built here, not in the threads: the global RNG is not thread-safe
        torch.manual_seed(0)  # same initial θ everywhere
        models.append(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)))
        dilocos[i] = DiLoCo(models[i], cfg, swarms[i])

    def train(i: int) -> None:
        try:
            model, diloco = models[i], dilocos[i]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(100 + i)
            out = []
            for _ in range(H * rounds):
                x = torch.randn(8, 16, generator=g)
                loss = ((model(x) - x.flip(1)) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out += diloco.after_inner_step(8)
            out += diloco.finish()
            reports[i] = out
        except BaseException as e:  # surfaced below
            errors.append((i, e))

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        for i in range(3):
            assert [r.ok for r in reports[i]] == [True] * rounds, [(r.ok, r.error) for r in reports[i]]
            # the offender's own shard kept its part, the others did not: every round was re-done without
            # it, and every honest peer reports 3 members and who was left out (no silent partial average)
            assert all(r.group_size == 3 for r in reports[i]), [r.group_size for r in reports[i]]
            assert all(r.extra.get("coverage") == "redone" and r.extra.get("left_out") == [ns[evil].peer_id_str]
                       for r in reports[i]), [r.extra for r in reports[i]]
            assert all(torch.isfinite(p).all() for p in dilocos[i].outer[0].params)
            assert all(torch.isfinite(p).all() for p in models[i].parameters())
        assert dilocos[0].digest() == dilocos[1].digest() == dilocos[2].digest()
        assert not any(r.ok for r in reports[evil]), [(r.ok, r.error) for r in reports[evil]]
        bad_id = ns[evil].peer_id_str
        for i in range(3):
            dropped = swarms[i].allreducer.stats
            assert dropped["parts_dropped"] == rounds, dict(dropped)
            assert dropped["dropped:finite"] == 2 and dropped["dropped:weight"] == 1, dict(dropped)
            assert {peer for peer, *_ in swarms[i].allreducer.dropped_log} == {bad_id}
    finally:
        for d in dilocos.values():
            d.close()
        for s in swarms:
            s.shutdown()


# ---- Byzantine updates vs CenteredClip --------------------------------------------------------------
def _honest_and_flip(n: int = 4000, peers: int = 4, scale: float = -1000.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g) * 0.01
    honest = [base + 0.005 * torch.randn(n, generator=g) for _ in range(peers)]
    return honest, scale * honest[0]


def test_centered_clip_bound_unit():
    """The stated bound (robust.py): 1 arbitrary part of 5 moves CenteredClip by at most half the
    honest parts' spread from the honest mean; the plain mean is dragged ~|bad|/5 away."""
    for scale in (-1000.0, -5.0, 1e6):
        honest, bad = _honest_and_flip(scale=scale)
        mu = weighted_mean(honest, [1.0] * 4)
        spread = max(float((h - mu).norm()) for h in honest)
        for pos in range(5):  # wherever the bad part sits in member order
            parts = honest[:pos] + [bad] + honest[pos:]
            cc = centered_clip(parts, [1.0] * 5)
            assert float((cc - mu).norm()) <= 0.5 * spread, (scale, pos)
            assert float((weighted_mean(parts, [1.0] * 5) - mu).norm()) > 1.0 * float(mu.norm())
    # all honest: CenteredClip stays next to the mean
    cc = centered_clip(honest, [1.0] * 4)
    assert float((cc - mu).norm()) <= 0.1 * spread


def test_screen_unit():
    cfg = RobustConfig()
    dropped = screen([10, 10, 10, 1e9], [1, 1, 1, 1], own=0, cfg=cfg, numel=100)
    assert list(dropped) == [3] and "weight 1e+09 is more than 10x the median weight 10" in dropped[3]
    dropped = screen([1, 1, 1, 1], [1.0, 1.2, 0.9, 50.0], own=3, cfg=cfg, numel=100)
    assert dropped == {}  # the owner's own part is never dropped
    dropped = screen([1, 1, 1, 1], [1.0, 1.2, 0.9, 50.0], own=0, cfg=cfg, numel=100)
    assert list(dropped) == [3] and "norm" in dropped[3]
    assert screen([1, 1, 1, 1], [1.0, 1.2, 0.9, 50.0], own=0, cfg=cfg, numel=10) == {}  # tiny shards: no norm screen
    off = RobustConfig(norm_bound=0, max_weight_ratio=0)
    assert screen([1, 1, 1e9], [1, 1, 1e9], own=0, cfg=off, numel=100) == {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("aggregator", ["centered_clip", "mean"])
def test_sign_flipped_x1000_from_one_of_five(nodes, aggregator):
    """Through the real all-reduce: 1 of 5 peers sends −1000× its update (norm screen off, so only
    the aggregator defends). CenteredClip stays within the stated bound of the honest mean; the
    plain mean does not (the documented weakness: use centered_clip or keep the norm screen on)."""
    evil = 4
    robust = RobustConfig(aggregator=aggregator, norm_bound=0.0)
    reducers, run = make_reducers(nodes, evil, robust)
    reducers[evil].attack = lambda j, part, w: (part * -1000.0, w)
    honest, _ = _honest_and_flip(n=5000, peers=5, seed=1)
    results, ids = allreduce_all(nodes, reducers, run, honest, [1.0] * 5, get_codec("fp32"), 0)
    assert all(isinstance(r, torch.Tensor) for r in results), results  # nothing dropped: the screen is off
    assert all(torch.equal(r, results[0]) for r in results)
    mu_h = weighted_mean(honest[:evil], [1.0] * evil)
    by_id = {n.peer_id_str: i for i, n in enumerate(nodes)}
    evil_shard = shard_bounds(5000, 5)[ids.index(nodes[evil].peer_id_str)]
    mask = torch.ones(5000, dtype=torch.bool)
    mask[evil_shard[0]:evil_shard[1]] = False  # the attacker's own shard holds its own, unflipped part
    err = float((results[0] - mu_h)[mask].norm())
    spread = max(float((h - mu_h)[mask].norm()) for h in honest[:evil])
    if aggregator == "centered_clip":
        assert err <= 0.5 * spread, (err, spread)
    else:
        assert err > 50 * float(mu_h[mask].norm()), (err, float(mu_h[mask].norm()))
    assert all(r.stats["parts_dropped"] == 0 for r in reducers)
    assert sorted(by_id) == ids


@pytest.mark.timeout(240)
def test_scaled_update_within_norm_bound_needs_centered_clip(nodes):
    """The norm screen alone is not enough: a sign-flipped ×5 update passes it (bound 10) and
    drags the plain mean by more than the honest mean itself; CenteredClip keeps it close."""
    evil = 4
    honest, _ = _honest_and_flip(n=5000, peers=5, seed=2)
    mu_h = weighted_mean(honest[:evil], [1.0] * evil)
    errs = {}
    for aggregator in ("mean", "centered_clip"):
        reducers, run = make_reducers(nodes, evil, RobustConfig(aggregator=aggregator))
        reducers[evil].attack = lambda j, part, w: (part * -5.0, w)
        results, ids = allreduce_all(nodes, reducers, run, honest, [1.0] * 5, get_codec("fp32"), 0)
        assert all(isinstance(r, torch.Tensor) for r in results)
        shard = shard_bounds(5000, 5)[ids.index(nodes[evil].peer_id_str)]
        mask = torch.ones(5000, dtype=torch.bool)
        mask[shard[0]:shard[1]] = False
        errs[aggregator] = float((results[0] - mu_h)[mask].norm()) / float(mu_h[mask].norm())
        assert all(r.stats["parts_dropped"] == 0 for r in reducers)  # within the bound: not screened
    assert errs["mean"] > 1.0 and errs["centered_clip"] < 0.25, errs


# ---- forged, malformed and replayed DHT records ---------------------------------------------------
async def _store_raw_in_dht_process(target, key, subkey, value, expiration, _dht, node):
    from hivemind.dht.routing import DHTID

    ok = await node.protocol.call_store(target, keys=[DHTID.generate(source=key)], values=[value],
                                        expiration_time=[expiration], subkeys=[subkey])
    return None if ok is None else list(ok)


def _raw_store(attacker: SwarmNode, target: SwarmNode, key: str, subkey: bytes, value: bytes, expiration: float):
    """Send one StoreRequest with exactly these bytes straight to ``target``'s DHT (no signing, no
    validation on our side): what a hostile DHT node can do."""
    import functools

    return attacker.dht.run_coroutine(functools.partial(_store_raw_in_dht_process, target.peer_id, key, subkey,
                                                        value, expiration))


def _signed_bytes(owner: SwarmNode, key: str, data: dict, expiration: float) -> bytes:
    """What ``owner`` itself would store for ``data`` (signature included)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(owner.records.owner_subkey),
                       MSGPackSerializer.dumps(owner.records.encode(key, data)), expiration)
    return owner.records.signer.sign_value(record)


@pytest.mark.timeout(180)
def test_forged_malformed_and_replayed_records_are_rejected(nodes):
    from hivemind.utils import MSGPackSerializer, get_dht_time

    victim, reader, attacker = nodes[0], nodes[1], nodes[2]
    key = f"sec{next(_runs)}:progress"
    assert victim.store(key, {"step": 10, "synced_step": 10, "digest": "aa"}, ttl=60)
    old_exp = get_dht_time() + 60
    old = _signed_bytes(victim, key, {"step": 10, "synced_step": 10, "digest": "aa"}, old_exp)
    time.sleep(0.05)
    assert victim.store(key, {"step": 20, "synced_step": 20, "digest": "bb"}, ttl=120)
    assert reader.get_subkeys(key)[victim.peer_id_str]["step"] == 20

    subkey = victim.records.owner_subkey
    # forged: the victim's owner subkey, a value signed by the attacker's key (and one not signed at all)
    forged_value = MSGPackSerializer.dumps(attacker.records.encode(key, {"step": 10**9, "synced_step": 10**9,
                                                                        "digest": "ee"}))
    sig = attacker.records.signer  # signs only records under the attacker's own subkey
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from p2pdiloco.swarm.signing import serialize_record

    exp = get_dht_time() + 600  # one expiration for every forged record: signatures cover it
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), forged_value, exp)
    signed_by_attacker = forged_value + b"[signature:" + sig.key.sign(serialize_record(rec)) + b"]"
    # malformed: correctly signed by the attacker under its own subkey, but breaking the schema
    bad_schema = msgpack.packb({"k": "progress", "s": 1, "d": {"step": "lots"}}, use_bin_type=True)
    rec2 = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(attacker.records.owner_subkey),
                     MSGPackSerializer.dumps(bad_schema), exp)
    malformed = attacker.records.signer.sign_value(rec2)
    for target in (victim, reader):
        assert _raw_store(attacker, target, key, subkey, signed_by_attacker, exp) == [False]
        assert _raw_store(attacker, target, key, subkey, forged_value, exp) == [False]
        assert _raw_store(attacker, target, key, attacker.records.owner_subkey, malformed, exp) == [False]
        # an unsigned record under the victim's plain peer id (the old, unprotected format)
        assert _raw_store(attacker, target, key, victim.peer_id_str.encode(), forged_value, exp) == [False]
        # replayed: the victim's own older record, signature intact; the newer one expires later
        assert _raw_store(attacker, target, key, subkey, old, old_exp) == [False]
    own = _signed_bytes(attacker, key, {"step": 1}, exp)
    assert _raw_store(attacker, victim, key, attacker.records.owner_subkey, own, exp) == [True]  # control
    # the same stores through our API refuse to even produce such records
    with pytest.raises(ValueError):
        attacker.store(key, {"step": "lots"}, ttl=60)
    with pytest.raises(ValueError):
        attacker.store(key, {"step": 1}, ttl=60, subkey=victim.peer_id_str)
    for node in (reader, attacker, victim):
        seen = node.get_subkeys(key)
        assert seen[victim.peer_id_str]["step"] == 20, seen
        assert seen.get(attacker.peer_id_str, {}).get("step") in (None, 1), seen


def test_record_book_keeps_the_newer_record():
    """Reader side: once a record with a higher seq was seen, an older one returned later (a lagging
    or hostile DHT node) is ignored until the newer one expires."""
    from hivemind.utils import ValueWithExpiration, get_dht_time
    from p2pdiloco.swarm.records import RecordBook
    from p2pdiloco.swarm.signing import SigningKey

    book = RecordBook(SigningKey.generate())
    key = "r:progress"
    old = book.encode(key, {"step": 1})
    new = book.encode(key, {"step": 2})
    exp = get_dht_time() + 60

    def found(value):
        return ValueWithExpiration({book.owner_subkey: ValueWithExpiration(value, exp)}, exp)

    assert list(book.decode(key, found(new)).values()) == [{"step": 2}]
    assert list(book.decode(key, found(old)).values()) == [{"step": 2}]
    assert book.stale == 1
    # wrong kind under this key, junk, foreign subkeys: dropped and counted; the verified record
    # stays in the view until it expires (a read that lacks it, or replaces it with junk, changes nothing)
    ready = book.encode("r:mm:0:1", {"t": 1.0})
    mine = {book.peer_id: {"step": 2}}
    assert book.decode(key, found(ready)) == mine
    assert book.decode(key, found(b"\x93\x01\x02")) == mine
    assert book.decode(key, ValueWithExpiration({b"someone": ValueWithExpiration(new, exp)}, exp)) == mine
    assert book.decode(key, None) == mine
    assert sum(book.rejected.values()) == 3
    fresh = RecordBook(SigningKey.generate())
    assert fresh.decode(key, found(ready)) == {} and fresh.decode(key, found(b"\x93\x01\x02")) == {}
    # a group record counts only when written by one of its members (its leader ranks first by the
    # round's draw, which a storing node cannot check), and with its members sorted
    me = book.peer_id
    for round_, (members, counts) in enumerate(((sorted([me, "QmZZZZ"]), True), (sorted([me, "111111"]), True),
                                                (["QmYYYY", "QmZZZZ"], False),
                                                (sorted([me, "QmZZZZ"], reverse=True), False))):
        g = book.encode(f"r:group:0:{round_}", {"members": members})
        assert book.decode(f"r:group:0:{round_}", found(g)) == ({me: {"members": members}} if counts else {}), members


def test_a_progress_record_travels_under_short_names_and_reads_back_whole():
    """Every field of a progress record travels under its wire name (records.WIRE_NAMES) and reads back
    under its own, through the reader's book and the storing node's schema check; a record that names a
    field both ways is refused by both, and a writer cannot name a field by another's wire name."""
    import msgpack
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
    from p2pdiloco.swarm.records import WIRE_NAMES, RecordBook, RecordSchema
    from p2pdiloco.swarm.signing import SigningKey

    book, key = RecordBook(SigningKey.generate()), "r:progress"
    data = dict(step=120, round=3, next_sync=160, synced_step=120, samples=960, sent=123456, recv=654321, sps=2.5,
                rate=20.0, share=0.25, loss=3.25, val_loss=3.5, last_sync=1.8e9, failed=80, t=1.8e9, gone=False,
                digest="0123456789abcdef-0123456789abcdef", reach="public", lw=2, pos=121.5, pt=1.8e9, gid="ab12")
    assert set(WIRE_NAMES["progress"]) <= set(data)  # every renamed field is in this record
    blob = book.encode(key, data)
    sent = msgpack.unpackb(blob)["d"]
    assert not set(sent) & set(WIRE_NAMES["progress"]), sent  # no long name left on the wire
    long = msgpack.packb({**msgpack.unpackb(blob), "d": data}, use_bin_type=True)
    assert len(long) - len(blob) == sum(len(n) - len(w) for n, w in WIRE_NAMES["progress"].items())
    exp = get_dht_time() + 60

    def found(value):
        return ValueWithExpiration({book.owner_subkey: ValueWithExpiration(value, exp)}, exp)

    def stored(value) -> bool:  # what a DHT node's schema check says
        return RecordSchema().validate(DHTRecord(b"k", MSGPackSerializer.dumps(book.owner_subkey),
                                                 MSGPackSerializer.dumps(value), exp))

    assert book.decode(key, found(blob)) == {book.peer_id: data} and stored(blob)
    both = msgpack.packb({"k": "progress", "s": 2**40, "d": {**sent, "step": 7}}, use_bin_type=True)
    assert not stored(both)
    rejected = sum(book.rejected.values())
    assert book.decode(key, found(both)) == {book.peer_id: data}  # refused: the first record stays
    assert sum(book.rejected.values()) == rejected + 1
    with pytest.raises(ValueError, match="wire name"):
        book.encode(key, {"step": 1, "ns": 5})


@pytest.mark.timeout(120)
def test_bogus_fingerprint_cannot_lock_out_and_majority_wins(nodes):
    from p2pdiloco.swarm.swarm import Swarm

    run = f"sec{next(_runs)}"
    key = f"{run}:fingerprint"
    good = {"inner.sync_every": 10}
    s0 = Swarm(nodes[0], run, matchmaking_timeout=2, allreduce_timeout=5)
    s0.check_fingerprint("good", good)  # the run's first peer
    nodes[3].store(key, {"fp": "evil", "fields": {"inner.sync_every": 99}}, ttl=600)  # a liar
    s1 = Swarm(nodes[1], run, matchmaking_timeout=2, allreduce_timeout=5)
    s1.check_fingerprint("good", good)  # 1 honest claim vs 1 bogus: a tie, ours wins; not locked out
    assert set(nodes[2].get_subkeys(key)) == {nodes[0].peer_id_str, nodes[1].peer_id_str, nodes[3].peer_id_str}
    s2 = Swarm(nodes[2], run, matchmaking_timeout=2, allreduce_timeout=5)
    with pytest.raises(FingerprintMismatch, match="inner.sync_every: run has 10, you have 99"):
        s2.check_fingerprint("evil", {"inner.sync_every": 99})  # 2 honest vs 1 bogus: the majority decides


@pytest.mark.timeout(120)
def test_a_run_of_another_protocol_version_is_refused_with_upgrade_advice(nodes):
    """Peers of another protocol version (e.g. 6: they drop Ed25519-signed records, so they would not
    see us) are refused at join with what to install, not with advice to change settings."""
    from p2pdiloco.swarm.swarm import Swarm

    run = f"sec{next(_runs)}"
    Swarm(nodes[0], run, matchmaking_timeout=2, allreduce_timeout=5).check_fingerprint(
        "old", {"inner.sync_every": 10, "protocol.version": PROTOCOL_VERSION - 1})
    with pytest.raises(FingerprintMismatch, match=rf"speak protocol version {PROTOCOL_VERSION - 1} and this "
                                                 rf"p2pdiloco speaks {PROTOCOL_VERSION}: install"):
        Swarm(nodes[1], run, matchmaking_timeout=2, allreduce_timeout=5).check_fingerprint(
            "new", {"inner.sync_every": 10, "protocol.version": PROTOCOL_VERSION})


# ---- one peer's unverified claim of a huge step -----------------------------------------------------
@pytest.mark.timeout(120)
def test_single_claim_of_a_huge_step_moves_nobody(nodes):
    """A liar publishes (signed, schema-valid) progress claiming step 10**9 with some digest. With
    two or more other peers, nobody picks it as a target and nobody asks it for state."""
    from p2pdiloco.swarm import state_sync
    from p2pdiloco.swarm.swarm import Swarm

    run = f"sec{next(_runs)}"
    honest = [Swarm(n, run, matchmaking_timeout=2, allreduce_timeout=5) for n in nodes[:3]]
    liar = nodes[3]
    served = []
    state_sync.StateServer(liar, run, lambda: served.append(1) or ({"step": 10**9}, b""))
    digest = "0123456789abcdef"
    for s in honest:
        s.update_progress(step=40, synced_step=40, digest=digest, round=4, next_sync=50, gid="g-honest")
        s.publish_progress(wait=True)
    liar.store(f"{run}:progress", {"step": 10**9, "synced_step": 10**9, "digest": "f" * 16, "round": 10**8,
                                   "next_sync": 10**9 + 10}, ttl=60)
    peers = honest[0].live_peers()
    assert peers[liar.peer_id_str]["synced_step"] == 10**9  # the claim is there, signed and well-formed
    me = honest[0].peer_id
    target = _pick(state_sync, peers, me, min_step=40)
    assert target is None, target
    # a fresh joiner (nothing of its own) goes with the two peers that agree, never with the liar
    target = _pick(state_sync, peers, me, min_step=0)
    assert target is not None and target[0] == 40 and liar.peer_id_str not in target[2]
    assert not served


def _pick(state_sync, peers, me, min_step):
    return state_sync.pick_target(peers, me, min_step)


# ---- versions and deserialization -----------------------------------------------------------------
@pytest.mark.timeout(120)
def test_peer_speaking_another_protocol_version_gets_a_clear_refusal(nodes):
    from hivemind.p2p import PeerID
    from p2pdiloco.swarm.matchmaking import Matchmaker
    from p2pdiloco.swarm.state_sync import StateServer

    server, client = nodes[0], nodes[1]
    run = f"sec{next(_runs)}"
    Matchmaker(server, run, matchmaking_timeout=2.0)
    AllReducer(server, run, timeout=5.0)
    StateServer(server, run, lambda: None)

    async def ask(handler, header):
        _, reader, writer = await client.p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id_str),
                                                                        f"p2pdiloco.{run}.{handler}")
        try:
            await write_frame(writer, header)
            reply, _ = await asyncio.wait_for(read_frame(reader, 0), 10)
            return reply
        finally:
            writer.close()

    future = PROTOCOL_VERSION + 1
    for handler, header in [("join", {"t": "join", "v": future, "frag": 0, "round": 0}),
                            ("part", {"t": "part", "v": future, "gid": "g", "phase": "d", "idx": 0, "w": 1.0,
                                      "codec": 0, "numel": 0}),
                            ("state", {"t": "state", "v": future})]:
        reply = client.call(ask(handler, header), timeout=30)
        assert reply["t"] in ("refuse", "abort"), reply
        assert f"protocol version {future} is not supported" in reply["reason"], reply
        assert f"speaks version {PROTOCOL_VERSION}" in reply["reason"] and "upgrade" in reply["reason"]
    assert server.gate.offences[client.peer_id_str] == 0  # an old/new peer is not an attacker
    # and a whole peer on another version is stopped earlier, by the run fingerprint, naming the field
    from p2pdiloco.config import RunConfig
    from p2pdiloco.run_identity import fingerprint_fields

    fields = fingerprint_fields(RunConfig())
    assert fields["protocol.version"] == PROTOCOL_VERSION


def test_nothing_from_the_network_is_unpickled():
    """Guard by source scan: no pickle/marshal/dill loads, no eval/exec, every torch.load passes
    weights_only=True, numpy loads never allow pickles; msgpack decodes forbid ext types."""
    pkg = os.path.join(ROOT, "p2pdiloco")
    offenders = []
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                    if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve")
                           for n in names):
                        offenders.append(f"{path}:{node.lineno}: imports a pickle-like module")
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                kw = {k.arg: k.value for k in node.keywords}
                if name in ("eval", "exec") or name.endswith("pickle.loads") or name.endswith("pickle.load"):
                    offenders.append(f"{path}:{node.lineno}: {name}")
                if name.endswith("torch.load"):
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        offenders.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
                if name.endswith("np.load") or name.endswith("numpy.load"):
                    ap = kw.get("allow_pickle")
                    if isinstance(ap, ast.Constant) and ap.value is True:
                        offenders.append(f"{path}:{node.lineno}: numpy load with allow_pickle=True")
                if name.endswith("unpackb") or name.endswith("msgpack.loads"):
                    ext = kw.get("max_ext_len")
                    if not (isinstance(ext, ast.Constant) and ext.value == 0):
                        offenders.append(f"{path}:{node.lineno}: msgpack decode without max_ext_len=0")
    assert not offenders, "\n".join(offenders)


def test_a_failed_first_dial_is_waited_out_and_counted_other_errors_are_not():
    """A failed dial (here: libp2p's dial backoff) is waited out within the round's timeout, polling
    the daemon's connect, then the stream is opened; a failure that is not a dial is raised at once;
    a dial still failing at the deadline raises ConnectionError naming the cause."""
    import asyncio
    from types import SimpleNamespace

    peer = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
    backoff = RuntimeError("Connect failed. msg=failed to dial: all dials failed * [/ip4/10.0.0.1/tcp/1] dial backoff")
    calls, connects = [], []

    class P2P:
        def __init__(self, errors, connect_errors):
            self.errors, self.connect_errors = list(errors), list(connect_errors)
            self._client = SimpleNamespace(connect=self.connect)

        async def call_binary_stream_handler(self, peer, name):
            calls.append(peer)
            if self.errors:
                raise self.errors.pop(0)
            return None, "reader", "writer"

        async def connect(self, peer, addrs):
            connects.append(peer)
            if self.connect_errors:
                raise self.connect_errors.pop(0)

    def reducer(errors, connect_errors=(), timeout=5):
        calls.clear(), connects.clear()
        node = SimpleNamespace(p2p=P2P(errors, connect_errors), short_id="me", add_handler=lambda *a: None)
        return AllReducer(node, "r", timeout=timeout), node

    ar, node = reducer([backoff], [backoff, backoff])  # in backoff for two polls, then connected
    assert asyncio.run(ar._connect(peer)) == (None, "reader", "writer")
    assert ar.stats["dial_retries"] == 1 and len(calls) == 2 and len(connects) == 3
    assert node.dial_stats["dial_failed"] == 1 and node.dial_stats["dial_recovered"] == 1
    ar, node = reducer([backoff], [backoff] * 100, timeout=1)
    with pytest.raises(ConnectionError, match="dial backoff"):
        asyncio.run(ar._connect(peer))
    assert node.dial_stats["dial_gave_up"] == 1
    ar, node = reducer([ValueError("protocol not supported")])
    with pytest.raises(ValueError):
        asyncio.run(ar._connect(peer))
    assert ar.stats["dial_retries"] == 0 and not connects


@pytest.mark.timeout(120)
def test_a_member_left_out_of_every_shard_is_reported_as_degraded(nodes, caplog):
    """A member whose own pseudo-gradient is not finite leaves itself out of its shard, and every other
    owner drops its part: every shard covers the same two members. The round is applied over them and
    reported as degraded on every honest member, naming who was left out (no silent partial average)."""
    ns = nodes[:3]
    reducers, run = make_reducers(ns, evil=-1, robust=RobustConfig())
    codec = get_codec("fp32")
    torch.manual_seed(3)
    vecs = [torch.randn(999) for _ in ns]
    bad = 2
    vecs[bad][::100] = float("nan")  # in every shard: every owner drops its part
    weights = [1.0, 3.0, 2.0]
    ids = sorted(n.peer_id_str for n in ns)
    gid = make_group_id(run, 0, 0, ids)
    caplog.set_level(logging.WARNING, logger="p2pdiloco")
    futs = [n.submit(r.allreduce_covered(Group(gid, tuple(ids), ids.index(n.peer_id_str), 0, 0), "d", v, w, codec))
            for n, r, v, w in zip(ns, reducers, vecs, weights)]
    results = []
    for f in futs:
        try:
            results.append(f.result(60))
        except SyncFailed as e:
            results.append(e)
    assert isinstance(results[bad], SyncFailed) and "non-finite" in str(results[bad]), results[bad]
    bad_id = ns[bad].peer_id_str
    honest = [i for i in range(3) if i != bad]
    for i in honest:
        out, cov = results[i]
        assert cov.kind == "degraded" and cov.left_out == (bad_id,), cov
        assert set(cov.members) == {ns[j].peer_id_str for j in honest}
        assert cov.weight == sum(weights[j] for j in sorted(honest, key=lambda j: ns[j].peer_id_str))
        assert reducers[i].stats["rounds_degraded"] == 1 and reducers[i].stats["dropped:finite"] == 1
        assert torch.equal(out, results[honest[0]][0])
    order = sorted(honest, key=lambda j: ns[j].peer_id_str)  # member order
    want = weighted_mean([vecs[j] for j in order], [weights[j] for j in order])
    assert torch.equal(results[honest[0]][0], want)
    assert any("is degraded" in rec.getMessage() and bad_id in rec.getMessage() for rec in caplog.records)
