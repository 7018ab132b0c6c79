"""A trained run's global model: loaded from its run folder, exported, sampled.

**Export** (:func:`export_run`): the swarm's global parameters (the outer copy of every fragment in
the checkpoint, not the peer's local inner model) as a ``save_pretrained`` directory (config.json,
model.safetensors, tokenizer files). An HF run exports its own architecture; the built-in GPT exports
as the standard ``GPT2LMHeadModel`` (the same computation: learned positions, pre-LayerNorm blocks,
exact-erf GELU (``activation_function = "gelu"``), eps 1e-5, ``n_inner = mlp_ratio · d_model``;
our ``nn.Linear`` weights transposed into GPT-2's ``Conv1D``).

:func:`sample_run` continues a prompt with the same global model (``p2pdiloco sample``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .checkpoint import find_checkpoint, load_checkpoint
from .config import RunConfig, config_from_dict
from .diloco.fragments import split_fragments
from .errors import CheckpointError, UserError
from .hf import is_config_path
from .model import seeded_model
from .tokenizer import TextCodec, hf_tokenizer

__all__ = ["load_run", "load_global_", "export_run", "generate", "sample_run"]


def load_run(run_dir: str) -> Tuple[RunConfig, nn.Module, Optional[str]]:
    """(RunConfig, model holding the swarm's global parameters, tokenizer path or None) of a run folder.

    Reads ``run_config.json`` (written by ``join``) and ``checkpoint.pt``; the parameters are the outer
    (global) copy of every fragment, not the peer's inner model. Raises :class:`UserError` with what
    to do when a file is missing or does not match."""
    cfg_path = os.path.join(run_dir, "run_config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"{run_dir} has no run_config.json; give the train.run_dir of a peer that ran "
                        "`p2pdiloco join`")
    with open(cfg_path) as f:
        cfg = config_from_dict(json.load(f))
    ckpt_path = find_checkpoint(run_dir)
    if ckpt_path is None:
        raise UserError(f"{run_dir} has no checkpoint.pt yet; a peer writes one after its first full sync")
    ckpt = load_checkpoint(ckpt_path)
    tok = os.path.join(run_dir, "tokenizer.json")
    if cfg.model.kind == "hf" and is_config_path(cfg.model.hf_config) and not os.path.isfile(cfg.model.hf_config):
        cfg.model.hf_config = os.path.join(run_dir, "hf_config.json")
    if not isinstance(ckpt.get("outer"), list):
        raise CheckpointError(f"checkpoint {ckpt_path} holds no global parameters")
    cfg.model.init_from = ""  # every parameter comes from the checkpoint
    model = seeded_model(cfg.model, cfg.train.seed)
    load_global_(model, ckpt, cfg)
    model.eval()
    return cfg, model, (tok if os.path.isfile(tok) else None)


@torch.no_grad()
def load_global_(model: nn.Module, ckpt: Dict[str, Any], cfg) -> nn.Module:
    """Copy the checkpoint's global parameters (every fragment's outer copy) into ``model`` in place
    (a tied weight is one parameter: copied once, through the fragment that holds it). Returns it."""
    layout = split_fragments(model, cfg.streaming.fragments, cfg.streaming.pattern)
    named = dict(model.named_parameters())
    outer = ckpt.get("outer")
    if not isinstance(outer, list) or len(outer) != layout.num_fragments:
        raise CheckpointError("the checkpoint's global state does not match the run configuration's fragments")
    for names, o in zip(layout.names, outer):
        params = o["params"]
        if len(params) != len(names):
            raise CheckpointError("the checkpoint's global state does not match the run configuration's model")
        for n, t in zip(names, params):
            if named[n].shape != t.shape:
                raise CheckpointError(f"checkpoint parameter {n} has shape {tuple(t.shape)}, the model "
                                      f"{tuple(named[n].shape)}")
            named[n].copy_(t)
    return model


def _gpt2_from_gpt(model) -> nn.Module:
    """The built-in GPT as a ``GPT2LMHeadModel`` computing the same logits (see the module docstring)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.initialization import no_init_weights

    c = model.cfg
    hf = GPT2Config(vocab_size=c.vocab_size, n_positions=c.seq_len, n_embd=c.d_model, n_layer=c.n_layers,
                    n_head=c.n_heads, n_inner=c.mlp_ratio * c.d_model, activation_function="gelu",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                    tie_word_embeddings=c.tie_embeddings, bos_token_id=None, eos_token_id=None)
    with torch.random.fork_rng(devices=[]), no_init_weights():
        out = GPT2LMHeadModel(hf)
    out.tie_weights()
    src = model.state_dict()
    dst: Dict[str, torch.Tensor] = {"transformer.wte.weight": src["tok_emb.weight"],
                                    "transformer.wpe.weight": src["pos_emb.weight"],
                                    "transformer.ln_f.weight": src["ln_f.weight"],
                                    "transformer.ln_f.bias": src["ln_f.bias"]}
    for i in range(c.n_layers):
        a, b = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            dst[f"{b}{theirs}.weight"] = src[f"{a}{ours}.weight"]
            dst[f"{b}{theirs}.bias"] = src[f"{a}{ours}.bias"]
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            dst[f"{b}{theirs}.weight"] = src[f"{a}{ours}.weight"].t().contiguous()  # Conv1D: [in, out]
            dst[f"{b}{theirs}.bias"] = src[f"{a}{ours}.bias"]
    dst["lm_head.weight"] = src["tok_emb.weight"] if c.tie_embeddings else src["head.weight"]
    missing, unexpected = out.load_state_dict(dst, strict=False)
    missing = [m for m in missing if not m.endswith(".attn.bias") and not m.endswith("masked_bias")]
    if missing or unexpected:  # pragma: no cover - a transformers version with another GPT-2 layout
        raise UserError(f"cannot map the GPT onto GPT2LMHeadModel (missing {missing}, unexpected {unexpected})")
    return out


def export_run(run_dir: str, out_dir: str) -> str:
    """Write the run's global model to ``out_dir`` as a Hugging Face model directory; returns a summary."""
    cfg, model, tok_path = load_run(run_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    lm = model.lm if cfg.model.kind == "hf" else _gpt2_from_gpt(model)
    os.makedirs(out_dir, exist_ok=True)
    lm.save_pretrained(out_dir)
    hf_tokenizer(tok_path, cfg.model.seq_len).save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    arch = type(lm).__name__
    return f"wrote {out_dir}: {arch}, {n:,} parameters (the swarm's global copy), tokenizer " + (
        "BPE" if tok_path else "byte-level (256)")


def generate(model: nn.Module, ids: List[int], max_new_tokens: int, seq_len: int, temperature: float = 0.8,
             seed: int = 0) -> List[int]:
    """Sample ``max_new_tokens`` continuation ids from ``model`` (greedy when temperature is 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            x = torch.tensor([out[-seq_len:]], dtype=torch.long)
            logits, _ = model(x)
            last = logits[0, -1].float()
            if temperature <= 0:
                nxt = int(last.argmax())
            else:
                nxt = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen))
            out.append(nxt)
    return out[len(ids):]


def sample_run(run_dir: str, prompt: str, max_new_tokens: int = 80, temperature: float = 0.8,
               seed: int = 0) -> Tuple[str, str]:
    """(prompt, continuation) from the run's global model."""
    cfg, model, tok_path = load_run(run_dir)
    codec = TextCodec(tok_path)
    ids = codec.encode(prompt)
    if not ids:
        raise UserError("--prompt is empty; give some text to continue")
    return prompt, codec.decode(generate(model, ids, max_new_tokens, cfg.model.seq_len, temperature, seed))
