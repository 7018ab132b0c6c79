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

:class:`CheckpointWriter` takes the writing off the training thread: the state is copied to host
memory at once (so the checkpoint is the state of that moment, whatever training does next) and
serialized, fsynced and renamed by one background thread. At most one checkpoint is in flight: a
save due while one is still being written is skipped, so a slow disk costs checkpoints, not memory.
"""
from __future__ import annotations

import glob
import logging
import os
import tempfile
import threading
from typing import Any, Dict, Optional

import torch

from . import faults
from .errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "host_copy", "CheckpointWriter",
           "CHECKPOINT_NAME"]

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
_TMP_PREFIX = ".checkpoint-"
_TMP_SUFFIX = ".tmp"


def save_checkpoint(run_dir: str, state: Dict[str, Any], step: Optional[int] = None) -> str:
    """Write ``state`` to ``<run_dir>/checkpoint.pt`` atomically; returns the path.

    Fault-injection phase ``checkpoint.write`` fires between the fsync of the temp file and the
    rename (a stall there is the window in which a ``kill -9`` must not lose the last checkpoint),
    at ``step`` (the inner step the state is of; default the training loop's current one).
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
        faults.fire("checkpoint.write", step=step)
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


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory and every list, tuple and dict rebuilt: a state
    that nothing training does afterwards can change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # a module's state dict is an OrderedDict with _metadata (versions) to keep
        out = type(obj)()
        for k, v in obj.items():
            out[k] = host_copy(v)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields one by one
        return type(obj)(*(host_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """Atomic checkpoints written by one background thread, at most one in flight (module docstring).

    :meth:`submit` copies the state to host memory and returns at once; a write that fails is logged
    (the last committed checkpoint stays) and counted in :attr:`failures`. :meth:`flush` waits until
    nothing is in flight; :meth:`save_now` flushes, then writes on the calling thread, raising on a
    failure (the last checkpoint of a run)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self.skipped = 0
        self.failures = 0

    def submit(self, run_dir: str, state: Dict[str, Any], step: int) -> bool:
        """Start writing ``state`` (a copy of it); False (nothing done) while the last one is in flight."""
        with self._cond:
            if self._busy:
                self.skipped += 1
                logger.info(f"checkpoint at step {step} skipped: the previous one is still being written "
                            f"({self.skipped} skipped so far); the next one is newer")
                return False
            self._busy = True
        try:
            copy = host_copy(state)
        except BaseException:
            self._done()
            raise
        threading.Thread(target=self._write, args=(run_dir, copy, step), name="checkpoint-writer",
                         daemon=True).start()
        return True

    def _write(self, run_dir: str, state: Dict[str, Any], step: int) -> None:
        try:
            save_checkpoint(run_dir, state, step=step)
        except Exception as e:
            self.failures += 1
            logger.error(f"checkpoint at step {step} not written to {run_dir} ({type(e).__name__}: {e}); training "
                         "goes on and the last committed checkpoint stays: check the disk (space, permissions)")
        finally:
            self._done()

    def _done(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)

    def save_now(self, run_dir: str, state: Dict[str, Any], step: int) -> str:
        self.flush()
        return save_checkpoint(run_dir, state, step=step)


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
