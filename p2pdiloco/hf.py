"""Hugging Face causal LMs as swarm models (``[model] kind = "hf"``).

``transformers`` is imported inside the functions that need it (its import costs ~1.6 s): the
byte-level GPT path never loads it. Export and sampling of a trained run are in :mod:`p2pdiloco.export`.

**Which model.** ``model.hf_config`` is an architecture name (a ``transformers`` model type such as
``llama``, ``mistral``, ``qwen2``) sized by the ``[model]`` keys (``d_model`` → ``hidden_size``,
``n_layers`` → ``num_hidden_layers``, ``n_heads`` → ``num_attention_heads``, ``hf_kv_heads`` (0:
``n_heads``) → ``num_key_value_heads``, ``hf_intermediate_size`` (0: ``mlp_ratio · d_model``) →
``intermediate_size``, ``seq_len`` → ``max_position_embeddings``, ``vocab_size``,
``tie_embeddings`` → ``tie_word_embeddings``), or a path to a ``config.json`` taken as it is (its
``vocab_size`` must equal ``model.vocab_size`` and ``model.seq_len`` must fit its positions). Every
field of the resolved config is in the run fingerprint as ``model.hf.<key>`` (:func:`hf_fingerprint`),
so a peer with another config is refused naming the field. The hub is never contacted
(``HF_HUB_OFFLINE``; nothing is loaded by name).

**Initialisation.** The model is built without ``transformers``' own init (its ``normal_`` draws other
numbers under other CPU kernels) and then initialised from the global torch RNG (seeded with
``train.seed`` by the caller) with :func:`p2pdiloco.exact.exact_normal_`, parameter by parameter in
``named_parameters`` order: matrices and embeddings ~ N(0, ``initializer_range``) (drawn in chunks of
2²² elements so a 1B model does not need gigabytes of fp64 temporaries), the weights of norm layers
1, every other vector 0 (Llama's own scheme, with exact draws). Every peer therefore starts bitwise
identical, on any machine, with no download.

**Pretrained start** (``model.init_from``): after the random initialisation (so the RNG is consumed
the same way), the ``*.safetensors`` weights of a local model directory are copied in; the files'
sha256 is the fingerprint's ``model.init_from`` (the path itself differs between machines).

**Fragments.** :class:`HFCausalLM` names its decoder layers' prefix (``fragment_block_pattern``), so
streaming fragments (:mod:`p2pdiloco.diloco.fragments`) split it by decoder layer exactly as the GPT is
split by block.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never contact the hub: nothing here is loaded by name
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigError
from .exact import exact_normal_

__all__ = ["HFCausalLM", "build_hf_model", "resolve_hf_config", "hf_fingerprint", "init_digest", "is_config_path"]

#: elements per exact_normal_ draw for HF parameters (a new path: the GPT's draws are untouched)
_CHUNK = 1 << 22
#: config keys that say nothing about the computation (left out of the fingerprint)
_NOT_FINGERPRINTED = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
                      "use_cache", "return_dict", "output_hidden_states", "output_attentions",
                      "id2label", "label2id", "problem_type", "chunk_size_feed_forward"}


def is_config_path(spec: str) -> bool:
    """Whether ``model.hf_config`` names a config.json file (else an architecture name)."""
    return spec.endswith(".json") or os.sep in spec or spec.startswith(".")


def resolve_hf_config(cfg) -> Any:
    """The ``transformers`` config of ``cfg`` (a :class:`p2pdiloco.model.ModelConfig` with kind "hf").

    Raises :class:`ConfigError` for an unknown architecture, an unreadable config.json, or sizes
    that disagree with ``model.vocab_size`` / ``model.seq_len``."""
    from transformers import AutoConfig

    spec = cfg.hf_config
    if is_config_path(spec):
        if not os.path.isfile(spec):
            raise ConfigError(f"model.hf_config {spec!r} does not exist; give a config.json path or an architecture "
                              "name such as llama")
        try:
            with open(spec) as f:
                d = json.load(f)
            model_type = d.pop("model_type")
            hf = AutoConfig.for_model(model_type, **d)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.hf_config {spec!r} is not a usable transformers config.json ({e})") from None
        if getattr(hf, "vocab_size", None) != cfg.vocab_size:
            raise ConfigError(f"model.hf_config {spec} has vocab_size {getattr(hf, 'vocab_size', None)} but "
                              f"model.vocab_size is {cfg.vocab_size}; set model.vocab_size to the tokenizer's size "
                              "and the same in config.json")
        max_pos = getattr(hf, "max_position_embeddings", None)
        if isinstance(max_pos, int) and cfg.seq_len > max_pos:
            raise ConfigError(f"model.seq_len ({cfg.seq_len}) exceeds max_position_embeddings ({max_pos}) of "
                              f"{spec}; lower model.seq_len")
        return hf
    kv = cfg.hf_kv_heads or cfg.n_heads
    if cfg.n_heads % kv:
        raise ConfigError(f"model.n_heads ({cfg.n_heads}) must be a multiple of model.hf_kv_heads ({kv})")
    sizes = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                 num_attention_heads=cfg.n_heads, num_key_value_heads=kv,
                 intermediate_size=cfg.hf_intermediate_size or cfg.mlp_ratio * cfg.d_model,
                 max_position_embeddings=cfg.seq_len, tie_word_embeddings=cfg.tie_embeddings,
                 attention_dropout=float(cfg.dropout))
    try:
        return AutoConfig.for_model(spec, **sizes)
    except ValueError:
        raise ConfigError(f"model.hf_config {spec!r} is not a transformers architecture name (e.g. llama, mistral, "
                          "qwen2) nor a path to a config.json") from None


def hf_fingerprint(cfg) -> Dict[str, Any]:
    """``model.hf.<key>`` → value of every field of the resolved config (nested values as JSON)."""
    d = resolve_hf_config(cfg).to_dict()
    out: Dict[str, Any] = {}
    for k in sorted(d):
        if k in _NOT_FINGERPRINTED or k.startswith("_"):
            continue
        v = d[k]
        if not (v is None or isinstance(v, (bool, int, float, str))):
            v = json.dumps(v, sort_keys=True, default=str)
        if isinstance(v, str) and len(v) > 256:  # fingerprint records take short strings: a long value by hash
            v = "sha256:" + hashlib.sha256(v.encode()).hexdigest()[:16]
        out[f"model.hf.{k}"] = v
    return out


def _layers_prefix(lm: nn.Module, n_layers: int) -> Optional[str]:
    """Name of the ModuleList of decoder layers (``model.layers`` for Llama, ``transformer.h`` for GPT-2),
    or None (such a model trains with one fragment: split_fragments says so)."""
    for name, module in lm.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers and n_layers > 0:
            return name
    return None


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind the GPT's interface: ``forward(idx, targets=None)`` →
    ``(logits [B, T, V], mean cross-entropy or None)``. The LM is ``self.lm``; its parameter names are
    ``lm.<transformers name>``.

    ``fragment_block_pattern`` matches the decoder layers' parameters (group 1: the layer index):
    streaming fragments cut the model by decoder layer."""

    def __init__(self, lm: nn.Module, n_layers: int):
        super().__init__()
        self.lm = lm
        prefix = _layers_prefix(lm, n_layers)
        self.fragment_block_pattern = (
            re.compile("^" + re.escape(f"lm.{prefix}") + r"\.(\d+)\.") if prefix is not None else None)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        logits = self.lm(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss


@torch.no_grad()
def _exact_init_(model: nn.Module, std: float) -> None:
    """The module docstring's scheme, in named_parameters order, with exact draws."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        if p.dim() >= 2:
            flat = p.data.view(-1)
            for i in range(0, flat.numel(), _CHUNK):
                exact_normal_(flat[i:i + _CHUNK], std=std)
        elif name.endswith("weight") and "norm" in type(owner).__name__.lower():
            p.fill_(1.0)
        else:
            p.zero_()


def build_hf_model(cfg) -> HFCausalLM:
    """A freshly initialised :class:`HFCausalLM` on the current default device (CPU unless a
    ``torch.device`` context says otherwise), from the global torch RNG (seed it first)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    hf = resolve_hf_config(cfg)
    try:
        with torch.random.fork_rng(devices=[]), no_init_weights():  # transformers' own init: skipped, RNG untouched
            lm = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    except ValueError:
        raise ConfigError(f"model.hf_config {cfg.hf_config!r} ({hf.model_type}) has no causal language model in "
                          "transformers; choose a decoder such as llama, mistral or qwen2") from None
    lm.tie_weights()  # tie_word_embeddings: one parameter (skipped with the init above)
    model = HFCausalLM(lm, hf.num_hidden_layers)
    _exact_init_(model, float(getattr(hf, "initializer_range", 0.02)))
    if cfg.init_from and not any(p.is_meta for p in model.parameters()):
        _load_pretrained_(model.lm, cfg.init_from)
    return model


def _weight_files(path: str) -> List[str]:
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from {path!r} is not a directory; give a local Hugging Face model directory "
                          "(config.json + *.safetensors, e.g. the output of p2pdiloco export)")
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"model.init_from {path!r} holds no *.safetensors file")
    return files


def init_digest(path: str) -> str:
    """sha256 prefix of the ``*.safetensors`` files of ``path`` (the fingerprint's ``model.init_from``)."""
    h = hashlib.sha256()
    for f in _weight_files(path):
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()[:16]


@torch.no_grad()
def _load_pretrained_(lm: nn.Module, path: str) -> None:
    """Copy the weights of a local model directory into ``lm`` (names and shapes must match)."""
    from safetensors.torch import load_file

    loaded: Dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        loaded.update(load_file(f))
    for name, p in lm.named_parameters():
        t = loaded.get(name)
        if t is None:
            raise ConfigError(f"model.init_from {path}: no weight {name}; the directory holds another architecture "
                              "than model.hf_config")
        if t.shape != p.shape:
            raise ConfigError(f"model.init_from {path}: {name} has shape {tuple(t.shape)}, the model "
                              f"{tuple(p.shape)}; set the [model] sizes of that model")
        p.copy_(t.to(p.dtype))
