"""The inner lr schedule (``inner.lr_schedule``): warm-up, then constant or a cosine to the run's
planned end, the same function for the peers, the in-process data-parallel reference and the
hivemind baseline; misconfigurations are refused with a message."""
from __future__ import annotations

import math

import pytest

from p2pdiloco.config import ConfigError, InnerConfig, RunConfig
from p2pdiloco.train.inner import _inner_lr, lr_factor


def _inner(**kw) -> InnerConfig:
    c = InnerConfig(**kw)
    c.validate()
    return c


def test_constant_schedule_is_the_warm_up_then_flat():
    c = _inner(warmup_steps=10)
    assert [lr_factor(c, s) for s in range(0, 12)] == [(s + 1) / 10 for s in range(9)] + [1.0, 1.0, 1.0]
    assert lr_factor(c, 10**6) == 1.0
    assert lr_factor(_inner(warmup_steps=0), 0) == 1.0


def test_cosine_schedule_decays_from_one_to_the_floor_at_decay_steps():
    c = _inner(warmup_steps=10, lr_schedule="cosine", decay_steps=110, min_lr_ratio=0.1)
    assert lr_factor(c, 4) == 0.5                               # warm-up unchanged
    assert lr_factor(c, 9) == 1.0                               # its last step: the full lr
    assert lr_factor(c, 59) == pytest.approx(0.55)              # half way: (1 + 0.1) / 2
    assert lr_factor(c, 109) == pytest.approx(0.1)              # decay_steps: the floor
    assert lr_factor(c, 5000) == pytest.approx(0.1)             # and flat after it
    after = [lr_factor(c, s) for s in range(9, 120)]
    assert all(a >= b for a, b in zip(after, after[1:])) and after[1] < 1.0
    zero = _inner(warmup_steps=0, lr_schedule="cosine", decay_steps=4, min_lr_ratio=0.0)
    assert [lr_factor(zero, s) for s in range(5)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4, 4)])


def test_the_peer_and_the_references_use_the_same_schedule():
    cfg = RunConfig()
    cfg.inner.lr, cfg.inner.warmup_steps, cfg.inner.lr_schedule, cfg.inner.decay_steps = 2e-3, 5, "cosine", 50
    cfg.validate()
    assert _inner_lr(cfg, 30) == 2e-3 * lr_factor(cfg.inner, 30) < 2e-3
    import p2pdiloco.bench.dp_reference as ref
    import p2pdiloco.bench.hivemind_dp as hm
    import inspect
    assert "_inner_lr(cfg, step)" in inspect.getsource(ref) and "lr_factor(cfg.inner, e)" in inspect.getsource(hm)


@pytest.mark.parametrize("kw, words", [
    (dict(lr_schedule="linear"), "inner.lr_schedule ('linear') must be one of constant, cosine"),
    (dict(lr_schedule="cosine"), "needs inner.decay_steps"),
    (dict(lr_schedule="cosine", decay_steps=20, warmup_steps=20), "larger than inner.warmup_steps (20)"),
    (dict(lr_schedule="cosine", decay_steps=100, round_samples=640, sync_every=20), "rounds by samples"),
    (dict(min_lr_ratio=1.5), "inner.min_lr_ratio (1.5) must be in [0, 1]"),
])
def test_misconfigured_schedules_are_refused(kw, words):
    with pytest.raises(ConfigError) as e:
        _inner(**kw)
    assert words in str(e.value)


def test_the_benchmark_spans_a_cosine_over_its_budget():
    from p2pdiloco.bench.run import budget_sets
    from p2pdiloco.config import load_config

    cos = load_config("peers/tiny-cpu.toml", ["inner.lr_schedule=cosine"], validate=False)
    assert budget_sets(cos, 1800) == ["inner.decay_steps=1800"]
    load_config("peers/tiny-cpu.toml", ["inner.lr_schedule=cosine", *budget_sets(cos, 1800)])  # valid then
    given = load_config("peers/tiny-cpu.toml", ["inner.lr_schedule=cosine", "inner.decay_steps=900"])
    assert budget_sets(given, 1800) == []
    assert budget_sets(load_config("peers/tiny-cpu.toml"), 1800) == []
