"""Contract tests of p2pdiloco.model: parameter layout, shapes, init, learning, validation."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from p2pdiloco import model as model_mod
from p2pdiloco.errors import ConfigError
from p2pdiloco.model import GPT, PRESETS, ModelConfig, build_model, count_parameters, get_preset

pytestmark = pytest.mark.timeout(60)

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)


def _model(cfg: ModelConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return build_model(cfg)


def test_public_names():
    assert set(model_mod.__all__) == {
        "ModelConfig", "GPT", "build_model", "count_parameters", "PRESETS", "get_preset", "seeded_model",
    }


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_layout(tie):
    cfg = dataclasses.replace(SMALL, n_layers=3, tie_embeddings=tie)
    m = _model(cfg)
    names = [n for n, _ in m.named_parameters()]
    top = {n.split(".")[0] for n in names}
    assert top == ({"tok_emb", "pos_emb", "blocks", "ln_f"} | (set() if tie else {"head"}))
    block_ids = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
    assert block_ids == {0, 1, 2}
    # every block carries the same set of parameters, and nothing per-layer lives outside blocks
    per_block = [sorted(re.sub(r"^blocks\.\d+\.", "", n) for n in names if n.startswith(f"blocks.{i}.")) for i in range(3)]
    assert per_block[0] == per_block[1] == per_block[2] and len(per_block[0]) == 12
    assert isinstance(m.blocks, torch.nn.ModuleList)
    if tie:
        assert m.head is None
        assert "head.weight" not in dict(m.named_parameters())
    else:
        assert m.head.weight.shape == (cfg.vocab_size, cfg.d_model)
        assert m.head.weight.data_ptr() != m.tok_emb.weight.data_ptr()


def test_tied_head_uses_token_embedding():
    m = _model()
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        before, _ = m(idx)
        m.tok_emb.weight[:, 0] += 1.0  # changes embedding *and* (tied) output projection
        after, _ = m(idx)
        # position-independent check: logits are ln_f(x) @ tok_emb.weight.T
        x = m.tok_emb(idx) + m.pos_emb(torch.arange(8))
        for b in m.blocks:
            x = b(x)
        expected = m.ln_f(x) @ m.tok_emb.weight.T
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, expected)


def test_forward_shapes_and_loss_none_without_targets():
    m = _model()
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = m(idx)
    assert logits.shape == (3, 16, 256) and loss is None
    logits, loss = m(idx[:, :5], idx[:, :5])
    assert logits.shape == (3, 5, 256) and loss.dim() == 0
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_causal():
    m = _model().eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = m(idx)
    b, _ = m(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_initial_loss_is_uniform():
    m = _model(PRESETS["tiny"])
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 128), generator=g)
    targets = torch.randint(0, 256, (4, 128), generator=g)
    _, loss = m(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_init_statistics():
    cfg = dataclasses.replace(SMALL, d_model=64, n_layers=8)
    m = _model(cfg)
    fc_std = m.blocks[0].mlp.fc.weight.std().item()
    proj_std = m.blocks[0].mlp.proj.weight.std().item()
    attn_proj_std = m.blocks[0].attn.proj.weight.std().item()
    assert abs(fc_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(attn_proj_std - 0.02 / math.sqrt(16)) < 0.001
    assert m.blocks[0].attn.qkv.bias.abs().sum() == 0


def test_adamw_reduces_loss_on_fixed_batch():
    m = _model()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 256, (4, 16), generator=g)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(10):
        _, loss = m(idx[:, :-1], idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, loss = m(idx[:, :-1], idx[:, 1:])
    assert loss.item() < first - 0.5


def test_deterministic_init():
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(d_model=130), "model.d_model"),
        (dict(n_heads=0), "model.n_heads"),
        (dict(n_layers=-1), "model.n_layers"),
        (dict(vocab_size=0), "model.vocab_size"),
        (dict(seq_len=0), "model.seq_len"),
        (dict(mlp_ratio=0), "model.mlp_ratio"),
        (dict(d_model=12.5), "model.d_model"),
        (dict(n_layers=True), "model.n_layers"),
        (dict(dropout=1.0), "model.dropout"),
        (dict(dropout=-0.1), "model.dropout"),
        (dict(tie_embeddings="yes"), "model.tie_embeddings"),
    ],
)
def test_validate_rejects(change, key):
    cfg = dataclasses.replace(ModelConfig(), **change)
    with pytest.raises(ConfigError, match=re.escape(key)):
        cfg.validate()
    with pytest.raises(ConfigError):
        build_model(cfg)


def test_validate_divisibility_message():
    with pytest.raises(ConfigError) as e:
        ModelConfig(d_model=130, n_heads=4).validate()
    assert "model.d_model (130) must be divisible by model.n_heads (4)" in str(e.value)


def test_presets_valid_and_tiny_size():
    for cfg in PRESETS.values():
        assert cfg.validate() is cfg
    assert 700_000 <= count_parameters(_model(PRESETS["tiny"])) <= 1_500_000
    with torch.device("meta"):  # shape-only: no memory, no init cost
        small = count_parameters(build_model(PRESETS["small"]))
        big = count_parameters(build_model(PRESETS["gpu-350m"]))
    assert 10_000_000 <= small <= 20_000_000
    assert 200_000_000 <= big <= 400_000_000


def test_get_preset_copies_and_rejects_unknown():
    cfg = get_preset("tiny")
    cfg.d_model = 64
    assert PRESETS["tiny"].d_model == 128
    with pytest.raises(ConfigError, match="tiny"):
        get_preset("huge")


def test_count_parameters_counts_tied_once():
    tied = count_parameters(_model(SMALL))
    untied = count_parameters(_model(dataclasses.replace(SMALL, tie_embeddings=False)))
    assert untied - tied == SMALL.vocab_size * SMALL.d_model


def test_blocks_are_pre_layernorm():
    m = _model()
    seen = {}
    for i, block in enumerate(m.blocks):
        for name in ("ln_1", "attn", "ln_2", "mlp"):
            getattr(block, name).register_forward_hook(
                lambda mod, args, out, key=(i, name): seen.__setitem__(key, (args[0], out))
            )
    m.ln_f.register_forward_hook(lambda mod, args, out: seen.__setitem__("ln_f", (args[0], out)))
    m(torch.randint(0, 256, (2, 8)))
    n = len(m.blocks)
    for i in range(n):
        torch.testing.assert_close(seen[(i, "attn")][0], seen[(i, "ln_1")][1])
        torch.testing.assert_close(seen[(i, "mlp")][0], seen[(i, "ln_2")][1])
        # the residual stream (ln_1's input) bypasses the sublayer: ln_2 sees x + attn(ln_1(x))
        torch.testing.assert_close(seen[(i, "ln_2")][0], seen[(i, "ln_1")][0] + seen[(i, "attn")][1])
        block_out = seen[(i + 1, "ln_1")][0] if i + 1 < n else seen["ln_f"][0]
        torch.testing.assert_close(block_out, seen[(i, "ln_2")][0] + seen[(i, "mlp")][1])
