"""Reducers (plain, quantized with error feedback, low-rank) without a network.

``SimGroup`` runs one reducer per simulated peer in its own thread and all-reduces exactly like
swarm/allreduce.py does: shards start on codec block boundaries, the owner decodes every part
(its own included), sums ``w_i * part_i`` in fp32 in member order, divides, and encodes the mean
once; every peer decodes those bytes. The swarm itself is exercised in test_compression_swarm.py.
"""
from __future__ import annotations

import threading

import pytest
import torch

from p2pdiloco.compression import get_codec
from p2pdiloco.config import load_config
from p2pdiloco.diloco.core import DiLoCo
from p2pdiloco.diloco.reducers import LowRankReducer, PlainReducer, QuantizedReducer, make_reducer
from p2pdiloco.errors import ConfigError, SyncFailed
from p2pdiloco.model import build_model
from p2pdiloco.run_identity import run_fingerprint
from p2pdiloco.swarm.partition import shard_bounds

pytestmark = pytest.mark.timeout(120)

E3M0 = get_codec("e3m0")
FP32 = get_codec("fp32")


def butterfly_mean(vecs, weights, codec):
    """The owner-side arithmetic of swarm/allreduce.py, shard by shard."""
    numel = vecs[0].numel()
    out = []
    for a, b in shard_bounds(numel, len(vecs), codec.block_size):
        acc = torch.zeros(b - a)
        for v, w in zip(vecs, weights):  # member order
            part = codec.decode(codec.encode(v[a:b]), b - a)
            acc.add_(part * w)  # a multiply, then an add (no fused form: p2pdiloco.exact)
        acc.div_(sum(weights))
        out.append(codec.decode(codec.encode(acc), b - a))
    return torch.cat(out)


class SimGroup:
    """``k`` peers in threads; ``allreduce(idx)`` is peer idx's bound all-reduce callable."""

    def __init__(self, k, weights=None, codec=FP32, fail_phase=None):
        self.k = k
        self.weights = weights or [1.0] * k
        self.codec = codec
        self.fail_phase = fail_phase
        self.barrier = threading.Barrier(k)
        self.slots = {}
        self.calls = []

    def allreduce(self, idx):
        def fn(vec, phase, codec=None):
            codec = codec or self.codec
            if idx == 0:
                self.calls.append((phase, codec.name, vec.numel()))
            if phase == self.fail_phase:
                raise SyncFailed(f"injected failure in phase {phase}")
            if self.k == 1:  # the swarm's group of one: what crossed the wire, once
                return codec.roundtrip(vec) if codec.relative_error_bound else vec.clone()
            self.slots[idx] = vec.detach().float().cpu().clone()
            self.barrier.wait(timeout=30)
            out = butterfly_mean([self.slots[i] for i in range(self.k)], self.weights, codec)
            self.barrier.wait(timeout=30)
            return out
        return fn

    def run(self, reducers, deltas):
        outs, errors = [None] * self.k, []

        def go(i):
            try:
                outs[i] = reducers[i].reduce(deltas[i], self.allreduce(i))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(self.k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return outs


def _cfg(*sets):
    return load_config(None, ["scheme=diloco", *sets])  # blocking fp32 DiLoCo, then the test's keys


# ---- configuration ------------------------------------------------------------------------------
def test_config_keys_validation_and_fingerprint():
    cfg = _cfg("compression.codec=nf4", "compression.lowrank=true", "compression.rank=8", "compression.min_rank=2",
               "compression.energy_target=0.8", "compression.min_numel=100", "compression.error_feedback=true",
               "compression.adaptive=false")
    c = cfg.compression
    assert (c.codec, c.lowrank, c.rank, c.min_rank, c.energy_target, c.min_numel, c.error_feedback, c.adaptive) == \
        ("nf4", True, 8, 2, 0.8, 100, True, False)
    base = run_fingerprint(_cfg())
    for s in ("compression.lowrank=true", "compression.rank=2", "compression.error_feedback=true",
              "compression.codec=e3m0", "compression.energy_target=0.5"):
        assert run_fingerprint(_cfg(s)) != base, s
    for bad, key in [("compression.rank=0", "compression.rank"), ("compression.min_rank=5", "compression.min_rank"),
                     ("compression.energy_target=1.5", "compression.energy_target"),
                     ("compression.min_numel=0", "compression.min_numel"), ("compression.codec=int3", "int3"),
                     ("compression.ranks=3", "compression.ranks")]:
        with pytest.raises(ConfigError, match=key):
            _cfg(bad)


def test_make_reducer_picks_by_config():
    params = [torch.zeros(64, 64), torch.zeros(64)]
    assert isinstance(make_reducer(_cfg(), params), PlainReducer)
    assert isinstance(make_reducer(_cfg("compression.codec=fp32", "compression.error_feedback=true"), params),
                      PlainReducer)  # lossless: nothing to feed back
    assert isinstance(make_reducer(_cfg("compression.codec=e3m0"), params), PlainReducer)  # feedback is opt-in
    assert isinstance(make_reducer(_cfg("compression.codec=e3m0", "compression.error_feedback=true"), params),
                      QuantizedReducer)
    lr = make_reducer(_cfg("compression.codec=e3m0", "compression.lowrank=true", "compression.min_numel=1000"),
                      params)
    assert isinstance(lr, LowRankReducer) and lr.comp.lowrank_indices == [0] and lr.comp.small_indices == [1]


# ---- block-aligned shards: roundtrip(vec) is exactly what the owners decode -----------------------
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_aligned_shards_make_roundtrip_the_contribution(numel, parts):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    bounds = shard_bounds(numel, parts, E3M0.block_size)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all((a % 64 == 0 or a == numel) and a <= b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    per_shard = torch.cat([E3M0.roundtrip(x[a:b]) for a, b in bounds])
    assert torch.equal(per_shard, E3M0.roundtrip(x))
    assert shard_bounds(numel, parts) == shard_bounds(numel, parts, 1)  # lossless codecs: unchanged


def test_unaligned_shards_would_not_be_the_contribution():
    """Why the alignment matters: cut mid-block, the shards' blocks get different scales."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[10] = 50.0  # a block-dominating outlier in the first block
    a, b = 0, 40
    assert not torch.equal(torch.cat([E3M0.roundtrip(x[a:b]), E3M0.roundtrip(x[b:])]), E3M0.roundtrip(x))


# ---- quantized reducer with error feedback --------------------------------------------------------
def test_error_feedback_invariant_one_peer():
    """One peer: Σ applied + residual == Σ true pseudo-gradients (fp32 rounding only); without
    error feedback the lost mass keeps growing."""
    gen = torch.Generator().manual_seed(1)
    group = SimGroup(1, codec=E3M0)
    ef, plain = QuantizedReducer(E3M0), PlainReducer()
    applied_ef = applied_plain = true = torch.zeros(5000)
    for _ in range(20):
        delta = torch.randn(5000, generator=gen) * 1e-2 + 3e-3  # a consistent drift: bias shows up
        (a,) = group.run([ef], [delta])
        (b,) = SimGroup(1, codec=E3M0).run([plain], [delta])
        applied_ef, applied_plain, true = applied_ef + a, applied_plain + b, true + delta
    err_ef = (applied_ef + ef.residual() - true).abs().max()
    assert err_ef <= 1e-5 * true.abs().max()
    # the residual stays one round's quantization error, the plain channel's error accumulates
    assert (applied_ef - true).norm() < 0.5 * (applied_plain - true).norm()
    assert ef.residual().abs().max() > 0


def test_error_feedback_invariant_three_peers():
    """Three weighted peers: per peer, Σ contributions + residual == Σ Δ; averaged, Σ applied + mean
    residual == Σ mean Δ up to the owners' one re-quantization of each mean (bounded by the codec)."""
    gen = torch.Generator().manual_seed(2)
    weights = [1.0, 2.0, 3.0]
    group = SimGroup(3, weights, codec=E3M0)
    reds = [QuantizedReducer(E3M0) for _ in range(3)]
    n, rounds = 4099, 6
    applied = true_mean = torch.zeros(n)
    true = [torch.zeros(n) for _ in range(3)]
    contrib = [torch.zeros(n) for _ in range(3)]
    requant_bound = torch.zeros(n)
    for _ in range(rounds):
        deltas = [torch.randn(n, generator=gen) for _ in range(3)]
        sent = [d + (r.residual() if r.residual() is not None else 0) for d, r in zip(deltas, reds)]
        outs = group.run(reds, deltas)
        assert all(torch.equal(o, outs[0]) for o in outs)  # bitwise identical on every peer
        exact = sum(w * E3M0.roundtrip(s) for w, s in zip(weights, sent)) / sum(weights)
        requant_bound += E3M0.relative_error_bound * _block_absmax(exact) + 1e-6
        applied = applied + outs[0]
        for i in range(3):
            true[i] += deltas[i]
            contrib[i] += E3M0.roundtrip(sent[i])
        true_mean = true_mean + sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    for i in range(3):
        assert (contrib[i] + reds[i].residual() - true[i]).abs().max() <= 1e-4
    mean_res = sum(w * r.residual() for w, r in zip(weights, reds)) / sum(weights)
    assert bool(((applied + mean_res - true_mean).abs() <= requant_bound + 1e-4).all())


def _block_absmax(x, block=64):
    n = x.numel()
    nb = -(-n // block)
    xb = torch.nn.functional.pad(x.abs(), (0, nb * block - n)).view(nb, block)
    return xb.amax(1, keepdim=True).expand(nb, block).reshape(-1)[:n]


def test_quantized_reducer_keeps_residual_when_the_sync_fails():
    red = QuantizedReducer(E3M0)
    SimGroup(1, codec=E3M0).run([red], [torch.randn(300)])
    before = red.residual().clone()
    with pytest.raises(SyncFailed):
        SimGroup(1, codec=E3M0, fail_phase="delta").run([red], [torch.randn(300)])
    assert torch.equal(red.residual(), before)


# ---- low-rank reducer ---------------------------------------------------------------------------
SHAPES = [torch.Size([96, 80]), torch.Size([80]), torch.Size([64, 4, 16])]


def _lowrank_deltas(gen, peers, r):
    """Per peer: a rank-r matrix with a shared column space (so the mean has rank r), random 1-D."""
    u = torch.linalg.qr(torch.randn(96, r, generator=gen, dtype=torch.float64))[0].float()
    u2 = torch.linalg.qr(torch.randn(64, r, generator=gen, dtype=torch.float64))[0].float()
    out = []
    for _ in range(peers):
        a = u @ torch.randn(r, 80, generator=gen)
        b = u2 @ torch.randn(r, 64, generator=gen)
        out.append(torch.cat([a.reshape(-1), torch.randn(80, generator=gen), b.reshape(-1)]))
    return out


def _lowrank_reducers(k, codec, **kw):
    cfg = _cfg(f"compression.codec={codec.name}", "compression.lowrank=true", "compression.min_numel=1000",
               *[f"compression.{a}={b}" for a, b in kw.items()])
    return [make_reducer(cfg, [torch.zeros(s) for s in SHAPES]) for _ in range(k)]


def test_lowrank_reducer_phases_codecs_and_exact_recovery():
    gen = torch.Generator().manual_seed(3)
    weights = [1.0, 1.5, 2.0]
    group = SimGroup(3, weights, codec=FP32)
    reds = _lowrank_reducers(3, FP32, rank=3)
    deltas = _lowrank_deltas(gen, 3, 3)
    outs = group.run(reds, deltas)
    true = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert (outs[0] - true).abs().max() <= 1e-4 * true.abs().max()
    # header in fp32, then P (+ small tensors) and Q with the run's codec
    (m1, n1), (m2, n2) = (96, 80), (64, 64)
    assert group.calls == [("hdr", "fp32", 2 * (2 * 3 + 1)), ("p", "fp32", 3 * (m1 + m2) + 80), ("q", "fp32", 3 * (n1 + n2))]
    info = reds[0].info()
    assert info["ranks"] == [3, 3] and info["values_dense"] == sum(s.numel() for s in SHAPES)
    assert info["values_sent"] == sum(c[2] for c in group.calls)


def test_lowrank_reducer_with_4bit_factors_is_identical_and_feeds_back():
    gen = torch.Generator().manual_seed(4)
    group = SimGroup(3, codec=E3M0)
    reds = _lowrank_reducers(3, E3M0, rank=2, error_feedback="true")
    true_sum = applied = torch.zeros(sum(s.numel() for s in SHAPES))
    for _ in range(4):
        deltas = [torch.randn(true_sum.numel(), generator=gen) for _ in range(3)]
        outs = group.run(reds, deltas)
        assert all(torch.equal(o, outs[0]) for o in outs)
        true_sum = true_sum + sum(deltas) / 3
        applied = applied + outs[0]
    assert [c[1] for c in group.calls[:3]] == ["fp32", "e3m0", "e3m0"]
    # error feedback holds what low rank and the wire dropped: the mean residual accounts for
    # most of the gap between what was applied and what the peers meant
    gap = applied - true_sum
    mean_res = sum(r.take_residual() for r in reds) / 3  # laid out like the input, zeros where none
    assert (gap + mean_res).norm() < 0.25 * gap.norm()


def test_lowrank_reducer_failed_sync_leaves_state_and_next_round_works():
    gen = torch.Generator().manual_seed(5)
    reds = _lowrank_reducers(2, FP32, rank=2, error_feedback="true")
    SimGroup(2).run(reds, _lowrank_deltas(gen, 2, 2))
    before = [r.state_dict() for r in reds]
    with pytest.raises(SyncFailed):
        SimGroup(2, fail_phase="q").run(reds, _lowrank_deltas(gen, 2, 2))
    for r, b in zip(reds, before):
        after = r.state_dict()["lowrank"]
        assert all(torch.equal(x, y) for x, y in zip(after["residual"], b["lowrank"]["residual"]))
    outs = SimGroup(2).run(reds, _lowrank_deltas(gen, 2, 2))
    assert torch.equal(outs[0], outs[1])


def test_lowrank_ranks_fall_and_are_logged_in_sync_reports():
    """Solo DiLoCo on the tiny model with pseudo-gradients forced to rank 1: the agreed rank
    diminishes from 4 to the minimum and SyncReport.extra carries it."""
    cfg = load_config("tests/tiny-diloco.toml", ["inner.sync_every=2", "compression.lowrank=true",
                                              "compression.codec=e3m0", "compression.energy_target=0.9"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    d = DiLoCo(model, cfg)
    gen = torch.Generator().manual_seed(0)
    names = {id(p): n for n, p in model.named_parameters()}
    directions = {}
    reports = []
    for step in range(8):
        with torch.no_grad():  # a rank-1 drift per matrix, as if training were very low-rank
            for p in model.parameters():
                if p.dim() == 2:
                    key = names[id(p)]
                    if key not in directions:
                        directions[key] = (torch.randn(p.shape[0], 1, generator=gen),
                                           torch.randn(1, p.shape[1], generator=gen))
                    u, v = directions[key]
                    p.add_(1e-3 * (u @ v))
        reports += d.after_inner_step(1)
    assert [r.ok for r in reports] == [True] * 4
    first, last = reports[0].extra, reports[-1].extra
    assert set(first) >= {"ranks", "rank_energy", "values_sent", "values_dense", "residual_norm"}
    assert first["ranks"] and all(r == 4 for r in first["ranks"])
    assert all(r == 1 for r in last["ranks"]), last["ranks"]
    assert all(e is not None and e > 0.9 for e in last["rank_energy"])
    assert last["values_sent"] < first["values_sent"]
    assert last["values_dense"] / last["values_sent"] > 40


# ---- checkpoints and state adoption ---------------------------------------------------------------
class _Stream:
    def state_dict(self):
        return {}

    def load_state_dict(self, s):
        pass


@pytest.mark.parametrize("sets", [["compression.codec=e3m0", "compression.error_feedback=true"],
                                  ["compression.codec=e3m0", "compression.lowrank=true", "compression.error_feedback=true"],
                                  ["compression.codec=sparse", "outer.lr=1", "outer.momentum=0",
                                   "compression.sparse_chunk=256", "compression.sparse_k=8"],
                                  ["compression.codec=nf4", "compression.lowrank=true", "compression.error_feedback=true",
                                   "compression.feedback_form=model"]])
def test_reducer_state_survives_a_checkpoint(tmp_path, sets):
    """Save after two syncs, restore into fresh objects through the real checkpoint files: the
    next sync of the restored peer is bitwise the same as the original's."""
    from p2pdiloco.checkpoint import load_checkpoint, save_checkpoint
    from p2pdiloco.train.replica import restore as _restore, snapshot as _snapshot

    cfg = load_config("tests/tiny-diloco.toml", ["inner.sync_every=2", *sets])

    def make():
        torch.manual_seed(0)
        m = build_model(cfg.model)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3), DiLoCo(m, cfg)

    def steps(m, opt, d, n, seed):
        g = torch.Generator().manual_seed(seed)
        reps = []
        for _ in range(n):
            x = torch.randint(0, 256, (2, cfg.model.seq_len + 1), generator=g)
            _, loss = m(x[:, :-1], x[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            reps += d.after_inner_step(2)
        return reps

    m, opt, d = make()
    steps(m, opt, d, 4, seed=1)
    assert any(s for s in (r.state_dict() for r in d.reducers))  # there is state to keep
    save_checkpoint(str(tmp_path), _snapshot(m, opt, d, _Stream()))
    m2, opt2, d2 = make()
    _restore(load_checkpoint(str(tmp_path / "checkpoint.pt")), m2, opt2, d2, _Stream())
    rng = torch.get_rng_state()
    a = steps(m, opt, d, 2, seed=2)
    torch.set_rng_state(rng)
    b = steps(m2, opt2, d2, 2, seed=2)
    # the report's extra fields beside the reducer's (ranks, error norms, ...) include a wall-clock wait
    untimed = [{k: v for k, v in r.extra.items() if not k.endswith("_seconds")} for r in (a[-1], b[-1])]
    assert untimed[0]  # the reducer reported something to compare
    assert a[-1].digest == b[-1].digest and untimed[0] == untimed[1]


def test_adopting_swarm_state_resets_residuals():
    cfg = load_config("tests/tiny-diloco.toml", ["inner.sync_every=1", "compression.codec=e3m0",
                                              "compression.lowrank=true", "compression.error_feedback=true"])
    torch.manual_seed(0)
    m = build_model(cfg.model)
    d = DiLoCo(m, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    assert d.after_inner_step(1)[0].ok
    assert d.reducers[0].info()["residual_norm"] > 0
    donor = DiLoCo(build_model(cfg.model), cfg)
    d.load_snapshot(*donor.snapshot())
    assert d.reducers[0].comp.residual_norm() == 0 and d.reducers[0]._small_ef.norm() == 0
    assert d.digest() == donor.digest()


def test_state_dict_does_not_wait_for_a_sync_in_flight():
    """Checkpoints are taken while a background sync may run (streaming overlap): state_dict
    returns at once the state after the last completed sync."""
    gen = torch.Generator().manual_seed(6)
    (red,) = _lowrank_reducers(1, E3M0, rank=2, error_feedback="true")
    SimGroup(1, codec=E3M0).run([red], _lowrank_deltas(gen, 1, 2))
    done = red.state_dict()
    entered, release = threading.Event(), threading.Event()

    def slow_allreduce(vec, phase, codec=None):
        if phase == "q":
            entered.set()
            release.wait(30)
        return (codec or E3M0).roundtrip(vec)

    t = threading.Thread(target=red.reduce, args=(_lowrank_deltas(gen, 1, 2)[0], slow_allreduce))
    t.start()
    try:
        assert entered.wait(30)
        got = {}
        reader = threading.Thread(target=lambda: got.update(s=red.state_dict()))
        reader.start()
        reader.join(5)
        assert "s" in got, "state_dict blocked on the sync in flight"
        a, b = got["s"]["lowrank"], done["lowrank"]
        assert a["ranks"] == b["ranks"] and a["round"] == b["round"]
        assert all(torch.equal(x, y) for x, y in zip(a["residual"], b["residual"]))
    finally:
        release.set()
        t.join(30)
    assert red.state_dict()["lowrank"]["round"] == done["lowrank"]["round"] + 1


@pytest.mark.parametrize("warm_start", ["ritz", "mean"])
def test_lowrank_4bit_factors_keep_weak_directions_with_ritz_warm_start(warm_start):
    """A rank-16 mean with singular values 0.8^j through nf4 factors, laid out by columns. With the
    averaged Q as the next basis (``mean``) its columns stay mixtures of the singular directions, so
    every factor column carries a share of the strongest and the weakest directions drown in its
    quantization error; Ritz vectors give each column one direction and its own scale."""
    m, n, r = 128, 192, 16
    gen = torch.Generator().manual_seed(7)
    u = torch.linalg.qr(torch.randn(m, r, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))[0]
    s = 0.8 ** torch.arange(r, dtype=torch.float64)
    nf4 = get_codec("nf4")
    cfg = _cfg("compression.codec=nf4", "compression.lowrank=true", f"compression.rank={r}", "compression.adaptive=false",
               "compression.factor_layout=columns", f"compression.warm_start={warm_start}")
    reds = [make_reducer(cfg, [torch.zeros(m, n)]) for _ in range(3)]
    group = SimGroup(3, codec=nf4)
    for _ in range(4):
        deltas = [((u * s) @ v.t() + 1e-5 * torch.randn(m, n, generator=gen, dtype=torch.float64)).float().reshape(-1)
                  for _ in range(3)]
        outs = group.run(reds, deltas)
        assert all(torch.equal(o, outs[0]) for o in outs)
    o = outs[0].reshape(m, n).double()
    err = [float((u[:, j] @ o @ v[:, j] - s[j]).abs() / s[j]) for j in range(r)]
    if warm_start == "ritz":
        assert max(err) < 0.1, err
    else:
        assert max(err[12:]) > 0.5, err


# ---- feedback_form = model: the unsent part stays in the peer's model ----------------------------
def test_feedback_form_config():
    assert _cfg().compression.feedback_form == "resend"
    ef = ("compression.codec=nf4", "compression.error_feedback=true")
    assert run_fingerprint(_cfg(*ef, "compression.feedback_form=model")) != run_fingerprint(_cfg(*ef))
    sparse = ("compression.codec=sparse", "outer.lr=1", "outer.momentum=0", "compression.error_feedback=true")
    for sets, msg in [(["compression.feedback_form=later"], "must be 'resend'"),
                      (["compression.feedback_form=model"], "set compression.error_feedback=true"),
                      ([*sparse, "compression.feedback_form=model"], "does not apply to compression.codec=sparse"),
                      ([*ef, "compression.feedback_form=model", "streaming.mode=delay"], "needs streaming.mode=tau")]:
        with pytest.raises(ConfigError, match=msg):
            _cfg(*sets)


@pytest.mark.parametrize("form", ["model", "resend"])
@pytest.mark.parametrize("sets", [["compression.codec=nf4", "compression.lowrank=true", "compression.min_numel=1000"],
                                  ["compression.codec=e3m0"]], ids=["lowrank-nf4", "e3m0"])
def test_feedback_form_model_keeps_the_unsent_part_in_the_model(sets, form):
    """A group of one applies exactly its own compressed part, so what the part left out is
    e = Δ − avg. ``model``: after each sync the model sits at θ − e (the next Δ holds e, the reducer
    keeps nothing to add again); ``resend``: the model is the global copy and the reducer keeps e."""
    cfg = load_config("tests/tiny-diloco.toml", ["inner.sync_every=1", *sets, "compression.error_feedback=true",
                                                 f"compression.feedback_form={form}"])
    torch.manual_seed(0)
    m = build_model(cfg.model)
    d = DiLoCo(m, cfg)
    frag, red = d.fragments[0], d.reducers[0]
    seen = {}
    reduce = red.reduce

    def spy(delta, allreduce):
        seen["delta"], seen["avg"] = delta.clone(), reduce(delta, allreduce)
        return seen["avg"]

    red.reduce = spy
    for _ in range(2):  # the second round's Δ holds the first round's e: it is not added twice
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        assert d.after_inner_step(1)[0].ok
        e = seen["delta"] - seen["avg"]
        assert e.norm() > 0.01 * seen["delta"].norm()  # the codec / the low rank left something out
        offset = frag.outer.pseudo_gradient(frag.model_params)  # θ − θ_m
        if form == "model":
            torch.testing.assert_close(offset, e, rtol=0, atol=1e-6)
            assert red.take_residual() is None  # handed over: nothing left to add to the next Δ
        else:
            assert torch.equal(offset, torch.zeros_like(offset))
            kept = red.take_residual()
            torch.testing.assert_close(kept, e, rtol=0, atol=1e-6)
            break  # take_residual emptied it: a second round would not be the resend form any more
