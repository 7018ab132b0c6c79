"""Atomic checkpoints: write a temp file, fsync it, rename it over the old one, fsync the directory.

A crash (even ``kill -9``) at any moment therefore leaves either the previous checkpoint or the new
one, never a mix: ``os.replace`` is atomic on POSIX file systems, and the fsyncs make the rename
durable across a power cut. A temp file left by a crash (``.checkpoint-*.tmp``) is never read; the
next save removes it.

A checkpoint holds everything needed to resume exactly (the training loop builds it): model, inner
optimiser, every fragment's outer state, the inner step and the step of the last sync (schedule
position), the data stream position and RNG states, plus the global-state digest so a resume can
be checked against the swarm's. It is loaded with ``torch.load(weights_only=True)``: nothing is
unpickled. A missing, truncated or foreign file raises :class:`CheckpointError` with what to do.
"""
from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Dict, Optional

import torch

from . import faults
from .errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
_TMP_PREFIX = ".checkpoint-"
_TMP_SUFFIX = ".tmp"


def save_checkpoint(run_dir: str, state: Dict[str, Any]) -> str:
    """Write ``state`` to ``<run_dir>/checkpoint.pt`` atomically; returns the path.

    Fault-injection phase ``checkpoint.write`` fires between the fsync of the temp file and the
    rename (a stall there is the window in which a ``kill -9`` must not lose the last checkpoint).
    """
    os.makedirs(run_dir, exist_ok=True)
    _remove_partials(run_dir)
    path = os.path.join(run_dir, CHECKPOINT_NAME)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        faults.fire("checkpoint.write")
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


def find_checkpoint(run_dir: str) -> Optional[str]:
    """The committed checkpoint of ``run_dir``, or None (temp files of an interrupted save are ignored)."""
    path = os.path.join(run_dir, CHECKPOINT_NAME)
    return path if os.path.isfile(path) else None


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
        raise CheckpointError(f"checkpoint {path} is not a p2pdiloco checkpoint; delete it or pick another "
                              "train.run_dir")
    return state


def _remove_partials(run_dir: str) -> None:
    """Delete temp files left by a save that was killed (only ours: they are never read)."""
    for tmp in glob.glob(os.path.join(glob.escape(run_dir), f"{_TMP_PREFIX}*{_TMP_SUFFIX}")):
        try:
            os.unlink(tmp)
        except OSError:
            pass
