"""A run's identity: the configuration every peer of a run must share, and its hash.

:func:`fingerprint_fields` flattens the parts of a :class:`~p2pdiloco.config.RunConfig` that must be
equal on every peer (model architecture, vocabulary, H, outer optimizer, fragment layout,
compression, the robust aggregator, the wire protocol version) to ``section.key`` values;
:func:`fingerprint_of` hashes such fields. Every peer, whether started by the command line or the
library API, hashes with :func:`fingerprint_of`, so equal fields always give equal fingerprints.
The fields are published in the DHT and compared by every joining peer
(:mod:`p2pdiloco.swarm.records`), which names the fields that differ when it refuses one.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict

from .config import RunConfig
from .diloco.fragments import layout_fingerprint
from .hf import hf_fingerprint, init_digest
from .swarm.protocol import PROTOCOL_VERSION
from .tokenizer import tokenizer_identity

__all__ = ["fingerprint_fields", "fingerprint_of", "run_fingerprint"]

#: model fields only a Hugging Face model has: a GPT run's fields leave them out
_HF_ONLY = ("kind", "hf_config", "hf_kv_heads", "hf_intermediate_size", "init_from")
#: streaming fields that are local latency knobs: peers may differ
_LOCAL_STREAMING = ("prepare_steps", "prepare_seconds")


def fingerprint_fields(cfg: RunConfig) -> Dict[str, Any]:
    """Everything that must be equal on every peer of a run, flattened to ``section.key``."""
    d = cfg.to_dict()
    out: Dict[str, Any] = {}
    for k, v in d["model"].items():
        if cfg.model.kind == "gpt" and k in _HF_ONLY:
            continue
        out[f"model.{k}"] = v
    if cfg.model.kind == "hf":  # the resolved transformers config, field by field (a refusal names it)
        out.pop("model.hf_config")  # a path differs between machines; its content is what counts
        out.update(hf_fingerprint(cfg.model))
        if cfg.model.init_from:  # pretrained weights: their hash, not their path
            out["model.init_from"] = init_digest(cfg.model.init_from)
    out["data.vocab"] = tokenizer_identity(cfg.data.tokenizer) if cfg.data.tokenizer else "bytes-256"
    out["train.seed"] = cfg.train.seed
    out["inner.sync_every"] = cfg.inner.sync_every
    out["inner.round_samples"] = cfg.inner.round_samples  # the budget; each peer's steps per round are its own
    if cfg.inner.round_samples:  # what a round averages (rounds of H steps: every member took H steps)
        out["inner.normalize_steps"] = cfg.inner.normalize_steps
    for k, v in d["outer"].items():
        out[f"outer.{k}"] = v
    for k, v in d["streaming"].items():
        if k not in _LOCAL_STREAMING:
            out[f"streaming.{k}"] = v
    # who syncs what: peers whose code splits the model differently must not train together
    out["streaming.layout"] = layout_fingerprint(cfg.model, cfg.streaming.fragments, cfg.streaming.pattern)
    for k, v in d["compression"].items():
        out[f"compression.{k}"] = v
    for k, v in d["robust"].items():  # every owner applies the same screen and aggregator
        out[f"robust.{k}"] = v
    if cfg.swarm.group_cap:  # how a round averages (absent: one level, as before the cap existed)
        out["swarm.group_cap"] = cfg.swarm.group_cap
    out["protocol.version"] = PROTOCOL_VERSION
    return out


def fingerprint_of(fields: Dict[str, Any]) -> str:
    """The 16-hex-digit hash of fingerprint fields (the one every peer publishes)."""
    blob = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_fingerprint(cfg: RunConfig) -> str:
    """The fingerprint of a run configuration: :func:`fingerprint_of` its :func:`fingerprint_fields`."""
    return fingerprint_of(fingerprint_fields(cfg))
