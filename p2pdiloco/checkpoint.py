"""Atomic checkpoints: write to a temp file, fsync, rename; so a crash leaves the last good one.

A checkpoint holds everything needed to resume exactly: model, inner optimiser, every fragment's
outer state, step counters, data stream position and RNG states. It is loaded with
``torch.load(weights_only=True)``: nothing is unpickled.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict

import torch

from .errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(run_dir: str, state: Dict[str, Any]) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CHECKPOINT_NAME)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(run_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); delete it to start fresh, "
            "or restore a good copy"
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"checkpoint {path} is not a p2pdiloco checkpoint")
    return state
