"""A small decoder-only transformer (GPT-2 layout) and its configuration.

The model is deliberately plain: learned positional embedding, pre-LayerNorm blocks of causal
self-attention (``torch.nn.functional.scaled_dot_product_attention``) and a GELU MLP, a final
LayerNorm and an LM head tied to the token embedding (Radford et al. 2019, "Language Models are
Unsupervised Multitask Learners"; the layout follows nanoGPT).

Parameter layout is a contract that later code relies on (fragments for streaming DiLoCo are cut by
block index, arXiv:2501.18512)::

    tok_emb.weight                      [vocab_size, d_model]
    pos_emb.weight                      [seq_len, d_model]
    blocks.{i}.ln_1.{weight,bias}
    blocks.{i}.attn.qkv.{weight,bias}   [3*d_model, d_model]
    blocks.{i}.attn.proj.{weight,bias}  [d_model, d_model]     (residual projection)
    blocks.{i}.ln_2.{weight,bias}
    blocks.{i}.mlp.fc.{weight,bias}     [mlp_ratio*d_model, d_model]
    blocks.{i}.mlp.proj.{weight,bias}   [d_model, mlp_ratio*d_model]  (residual projection)
    ln_f.{weight,bias}
    head.weight                         [vocab_size, d_model]  (only when tie_embeddings is False)

Every per-layer parameter lives under ``blocks.{i}``; nothing else is per-layer.

Initialisation is a pure function of the torch CPU RNG's integers: :func:`build_model` always
initialises on the CPU with :func:`p2pdiloco.exact.exact_normal_` (``nn.init.normal_`` takes a
vectorised path that gives other weights under another ``ATEN_CPU_CAPABILITY``), so the same
``torch.manual_seed`` gives bitwise identical weights on every machine and every device the model is
later moved to.

Measured parameter counts of :data:`PRESETS` (tied embeddings, counted once)::

    tiny      d=128,  4 layers,  4 heads, seq 128     =     842,496
    small     d=384,  8 layers,  6 heads, seq 256     =  14,393,088
    gpu-350m  d=1024, 24 layers, 16 heads, seq 1024   = 303,622,144
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigError
from .exact import exact_normal_
from .hf import build_hf_model, resolve_hf_config

__all__ = [
    "ModelConfig",
    "GPT",
    "build_model",
    "count_parameters",
    "PRESETS",
    "get_preset",
    "seeded_model",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    """Shape of the model. Field names are the user-visible keys of the ``[model]`` TOML table.

    ``vocab_size`` is 256 for the byte-level corpora of :mod:`p2pdiloco.data` (a BPE tokenizer's size
    otherwise). ``seq_len`` is the longest context (tokens) the model accepts; it sizes the positional
    embedding.

    ``kind``: ``"gpt"`` (this module's model) or ``"hf"``: a ``transformers`` causal LM
    (:mod:`p2pdiloco.hf`) of architecture ``hf_config`` (a model type such as ``llama``, sized by the
    fields above plus ``hf_kv_heads`` and ``hf_intermediate_size``, 0 = derived) or a config.json path.
    The ``hf_*`` fields are ignored for ``kind = "gpt"``. ``init_from`` (``kind = "hf"`` only): a local
    Hugging Face model directory (``*.safetensors``, e.g. an earlier ``p2pdiloco export``) whose weights
    replace the random initialisation; their hash is in the fingerprint.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    kind: str = "gpt"
    hf_config: str = "llama"
    hf_kv_heads: int = 0
    hf_intermediate_size: int = 0
    init_from: str = ""

    def validate(self) -> "ModelConfig":
        """Check every invariant; raise :class:`ConfigError` naming the key and the fix. Returns self."""
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio"):
            value = getattr(self, key)
            if not _is_int(value):
                raise ConfigError(f"model.{key} must be an integer, got {value!r}")
            if value < 1:
                raise ConfigError(f"model.{key} ({value}) must be a positive integer")
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}); "
                f"choose e.g. n_heads={_largest_divisor_at_most(self.d_model, self.n_heads)}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ConfigError(f"model.dropout must be a number, got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"model.dropout ({self.dropout}) must be in [0, 1); 0 disables dropout")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.kind not in ("gpt", "hf"):
            raise ConfigError(f'model.kind ({self.kind!r}) must be "gpt" (the built-in model) or "hf" (a transformers '
                              "causal LM, see model.hf_config)")
        for key in ("hf_kv_heads", "hf_intermediate_size"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 0:
                raise ConfigError(f"model.{key} ({getattr(self, key)!r}) must be an integer >= 0 (0: derived)")
        if self.init_from and self.kind != "hf":
            raise ConfigError('model.init_from needs model.kind = "hf" (the built-in GPT starts from the run\'s seed)')
        if self.kind == "hf" and not self.hf_config:
            raise ConfigError("model.hf_config must name an architecture (e.g. llama) or a config.json path")
        return self

    def num_blocks(self) -> int:
        """Transformer blocks (decoder layers) of the model this config builds."""
        if self.kind == "hf":
            return int(resolve_hf_config(self).num_hidden_layers)
        return self.n_layers


def _largest_divisor_at_most(n: int, limit: int) -> int:
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = float(cfg.dropout)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; see the module docstring for the parameter layout.

    ``forward(idx, targets=None)`` takes token ids ``idx`` of shape ``[B, T]`` (``T <= seq_len``,
    ids in ``[0, vocab_size)``) and returns ``(logits [B, T, vocab_size], loss)`` where ``loss`` is the
    mean next-token cross-entropy (nats/token) against ``targets [B, T]``, or ``None`` without them.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = dataclasses.replace(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Tied: the LM head is tok_emb.weight itself (F.linear in forward), so there is no `head`
        # submodule and no duplicate parameter to average or checkpoint.
        self.head: Optional[nn.Linear] = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2: N(0, 0.02) everywhere (exact_normal_: the same bits on every CPU), zero biases, and the two residual projections of each block
        # scaled by 1/sqrt(2*n_layers) so the residual stream's variance does not grow with depth.
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = 1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(".proj") else 1.0
                exact_normal_(module.weight, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                exact_normal_(module.weight, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [B, T], got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len ({self.cfg.seq_len})")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        logits = F.linear(x, weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss


def build_model(cfg: ModelConfig) -> nn.Module:
    """Validate ``cfg`` and build a freshly initialised :class:`GPT` on the CPU (``kind = "hf"``: a
    :class:`p2pdiloco.hf.HFCausalLM`, initialised the same exact way).

    Initialisation draws from the global torch CPU RNG, so call ``torch.manual_seed`` first for a
    reproducible model; move it with ``.to(device)`` afterwards. Raises :class:`ConfigError` on an
    invalid config.
    """
    if cfg.validate().kind == "hf":
        return build_hf_model(cfg)
    return GPT(cfg)


def seeded_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The run's starting model θ₀: the global torch RNG seeded with the run's ``train.seed``, then
    :func:`build_model`. Every peer, local worker and export builds θ₀ this way, so all start bitwise
    identical (the draw order is ``build_model``'s)."""
    torch.manual_seed(seed)
    return build_model(cfg)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


#: Named model shapes. Treat the values as read-only; use :func:`get_preset` for a private copy.
PRESETS: Dict[str, ModelConfig] = {
    # ~0.84M parameters: unit tests, smoke runs, many peers on one laptop.
    "tiny": ModelConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128),
    # ~14.4M parameters: a meaningful run on CPUs.
    "small": ModelConfig(d_model=384, n_layers=8, n_heads=6, seq_len=256),
    # ~304M parameters (GPT-2 medium shape, byte vocabulary): one GPU per peer.
    "gpu-350m": ModelConfig(d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
}


def get_preset(name: str) -> ModelConfig:
    """A copy of ``PRESETS[name]``; raises :class:`ConfigError` listing the known names."""
    try:
        return dataclasses.replace(PRESETS[name])
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
