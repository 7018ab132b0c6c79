"""Byte-level corpora, per-peer data shards, resumable batch streams and a fixed evaluation.

Tokens are bytes: vocabulary 256, one token per byte, stored as ``uint8``. Nothing is downloaded.
(JSONL/Parquet records and BPE tokenizers go through :mod:`p2pdiloco.tokenized` instead, which
returns the same :class:`Corpus` of token ids; sharding, batch streams and evaluation below are
shared.)

Corpus sources (``DataConfig.source``):

* ``"stdlib"`` (default, a reserved word): the ``.py`` files of the running Python's standard
  library (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``, test suites, IDLE,
  ``lib2to3``, ``turtledemo``, bundled wheels and the platform-generated ``_sysconfigdata*`` files.
  Every machine has it; peers on different Python versions get different corpora, which the
  :attr:`Corpus.digest` reveals.
* a path to a text file: its bytes, used as they are.
* a path to a directory: every regular file below it, recursively, in sorted relative-path order.
  Hidden files and directories (name starts with ``.``) are skipped, and so are files that look
  binary (a NUL byte in their first 8 KiB, git's heuristic).

Files are concatenated in sorted relative-path order (POSIX separators) and the total is cut at
``max_bytes`` (the last file taken may be truncated). The validation split is chosen per FILE: a
file is held out when ``int(sha256(relative_path)) % 1000 < val_fraction * 1000``, which depends on
the path only, so it is the same on every peer and stable when files are added. If no file is held
out, the file with the smallest hash value is; if every file is, the largest goes back to training.
A source that is a single file cannot be split by file: its last ``val_fraction`` of bytes is the
validation split instead.

Sharding: the training tokens are cut into ``num_shards`` contiguous regions and each peer samples
only from its own (``DataConfig.shard``, or :func:`shard_for_peer` of its peer id), the
heterogeneous-data setting of DiLoCo (Douillard et al. 2023, arXiv:2311.08105).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

import torch
import torch.nn as nn

from .errors import CheckpointError, ConfigError

__all__ = [
    "STDLIB_SOURCE",
    "DataConfig",
    "Corpus",
    "load_corpus",
    "clear_corpus_cache",
    "shard_for_peer",
    "BatchStream",
    "evaluate",
]

logger = logging.getLogger(__name__)

#: The reserved ``source`` value naming the built-in standard-library corpus.
STDLIB_SOURCE = "stdlib"

_STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3",
        "turtledemo", "__pycache__", "_bundled", "lib-dynload",
    }
)
_BINARY_SNIFF_BYTES = 8192


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class DataConfig:
    """Where the tokens come from and which part of them this peer trains on.

    Field names are the user-visible keys of the ``[data]`` TOML table.

    ``source``: ``"stdlib"`` or a path to a text file or directory (see the module docstring).
    ``max_bytes``: cap on the corpus size in bytes (= tokens), train and validation together.
    ``val_fraction``: share of files held out for validation, in (0, 0.5].
    ``num_shards``: number of contiguous training regions peers are spread over.
    ``shard``: this peer's region, or -1 to derive it from the peer id (:func:`shard_for_peer`).
    ``seed``: seed of the batch sampling (combined with the shard index).
    ``tokenizer``: "" (bytes, 256 ids) or a path to a BPE tokenizer JSON (:mod:`p2pdiloco.tokenizer`).
    ``text_field``: the field holding the text in JSONL/Parquet records (:mod:`p2pdiloco.tokenized`).
    ``cache_dir``: where tokenized corpora are cached ("" = ``~/.cache/p2pdiloco/tokens``).
    """

    source: str = STDLIB_SOURCE
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    num_shards: int = 16
    shard: int = -1
    seed: int = 0
    tokenizer: str = ""
    text_field: str = "text"
    cache_dir: str = ""

    def validate(self) -> "DataConfig":
        """Check every invariant; raise :class:`ConfigError` naming the key and the fix. Returns self.

        Does not touch the file system; a missing ``source`` path is reported by :func:`load_corpus`.
        """
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f'data.source must be "stdlib" or a path to a file or directory, got {self.source!r}')
        for key in ("max_bytes", "num_shards", "shard", "seed"):
            if not _is_int(getattr(self, key)):
                raise ConfigError(f"data.{key} must be an integer, got {getattr(self, key)!r}")
        if self.max_bytes < 2:
            raise ConfigError(f"data.max_bytes ({self.max_bytes}) must be at least 2 (it is a byte count)")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)):
            raise ConfigError(f"data.val_fraction must be a number, got {self.val_fraction!r}")
        if not 0.0 < self.val_fraction <= 0.5:
            raise ConfigError(f"data.val_fraction ({self.val_fraction}) must be in (0, 0.5], e.g. 0.05")
        if self.num_shards < 1:
            raise ConfigError(f"data.num_shards ({self.num_shards}) must be at least 1")
        if not -1 <= self.shard < self.num_shards:
            raise ConfigError(
                f"data.shard ({self.shard}) must be -1 (derive from the peer id) or in "
                f"[0, data.num_shards) = [0, {self.num_shards})"
            )
        if self.seed < 0:
            raise ConfigError(f"data.seed ({self.seed}) must be a non-negative integer")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError("data.text_field must name the records' text field, e.g. text")
        return self

    @property
    def needs_tokenized(self) -> bool:
        """True when the corpus goes through :mod:`p2pdiloco.tokenized` (records or a BPE tokenizer)."""
        from .tokenized import is_records_source

        return bool(self.tokenizer) or is_records_source(self.source)

    def shard_for(self, peer_id: str) -> int:
        """This peer's shard: ``shard`` when set, else :func:`shard_for_peer` of ``peer_id``."""
        return self.shard if self.shard >= 0 else shard_for_peer(peer_id, self.num_shards)


@dataclass
class Corpus:
    """A loaded corpus. ``train`` and ``val`` are 1-D ``uint8`` CPU tensors shared by every caller
    of :func:`load_corpus` (it caches): treat them as read-only.

    ``digest`` is a 16-hex-digit sha256 prefix of the corpus identity (source kind, the list of
    (relative path, size, split) and the bytes); two peers with equal digests train on identical
    tokens. ``description`` is one human-readable line.
    """

    train: torch.Tensor
    val: torch.Tensor
    digest: str
    description: str


def _stdlib_files() -> Tuple[str, List[Tuple[str, str]]]:
    """(root, sorted [(relative posix path, absolute path)]) of the stdlib corpus."""
    root = sysconfig.get_paths()["stdlib"]
    found: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                full = os.path.join(dirpath, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort()
    return root, found


def _directory_files(root: str) -> List[Tuple[str, str]]:
    found: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.isfile(full):
                continue
            found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort()
    return found


def _looks_binary(data: bytes) -> bool:
    return b"\x00" in data[:_BINARY_SNIFF_BYTES]


def _read_bounded(
    files: List[Tuple[str, str]], max_bytes: int, skip_binary: bool
) -> List[Tuple[str, bytes]]:
    """Read files in order until ``max_bytes`` bytes are taken (the last one possibly truncated)."""
    taken: List[Tuple[str, bytes]] = []
    remaining = max_bytes
    for rel, full in files:
        if remaining <= 0:
            break
        with open(full, "rb") as f:
            data = f.read(max(remaining, _BINARY_SNIFF_BYTES) if skip_binary else remaining)
        if skip_binary and _looks_binary(data):
            logger.debug("skipping binary-looking file %s", full)
            continue
        if not data:
            continue
        data = data[:remaining]
        taken.append((rel, data))
        remaining -= len(data)
    return taken


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest(), "big")


@functools.lru_cache(maxsize=8)
def _load_cached(source: str, max_bytes: int, val_fraction: float) -> Corpus:
    if source == STDLIB_SOURCE:
        root, paths = _stdlib_files()
        files = _read_bounded(paths, max_bytes, skip_binary=False)
        kind = f"stdlib of Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro} ({root})"
    elif os.path.isfile(source):
        with open(source, "rb") as f:
            data = f.read(max_bytes)
        files = [(os.path.basename(source), data)] if data else []
        kind = f"file {source}"
    elif os.path.isdir(source):
        files = _read_bounded(_directory_files(source), max_bytes, skip_binary=True)
        kind = f"directory {source}"
    else:
        raise ConfigError(
            f"data.source {source!r} does not exist (resolved to {os.path.abspath(source)}); "
            f'give a path to a text file or directory, or "stdlib" for the built-in corpus'
        )
    total = sum(len(d) for _, d in files)
    if total < 2:
        raise ConfigError(
            f"data.source {source!r} holds no usable text ({total} bytes; directories skip hidden and binary "
            f"files); point it at text data"
        )

    # Per-file split. `is_val` is recorded per file so the digest identifies the split too.
    threshold = val_fraction * 1000
    if len(files) >= 2:
        hashes = [_path_hash(rel) for rel, _ in files]
        is_val = [h % 1000 < threshold for h in hashes]
        if not any(is_val):
            is_val[min(range(len(files)), key=lambda i: hashes[i])] = True
        if all(is_val):
            is_val[max(range(len(files)), key=lambda i: hashes[i])] = False
        train_bytes = b"".join(d for (_, d), v in zip(files, is_val) if not v)
        val_bytes = b"".join(d for (_, d), v in zip(files, is_val) if v)
        n_val_files = sum(is_val)
    else:
        # One file: hold out its tail instead (at least 1 byte each side).
        data = files[0][1]
        cut = min(max(1, len(data) - int(len(data) * val_fraction)), len(data) - 1)
        train_bytes, val_bytes = data[:cut], data[cut:]
        is_val = [False]
        n_val_files = 0

    h = hashlib.sha256()
    h.update(b"p2pdiloco-corpus-v1\0")
    h.update((STDLIB_SOURCE if source == STDLIB_SOURCE else "path").encode() + b"\0")
    h.update(f"{val_fraction!r}\0".encode())
    for (rel, d), v in zip(files, is_val):
        h.update(f"{rel}\0{len(d)}\0{int(v)}\n".encode("utf-8", "surrogateescape"))
    h.update(train_bytes)
    h.update(b"\0val\0")
    h.update(val_bytes)
    digest = h.hexdigest()[:16]

    split = f"{n_val_files} files held out" if len(files) >= 2 else "tail of the file held out"
    description = (
        f"{kind}: {len(files)} files, {len(train_bytes):,} train + {len(val_bytes):,} val bytes "
        f"({split}), digest {digest}"
    )
    return Corpus(
        train=torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        digest=digest,
        description=description,
    )


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load (or return the cached) corpus of ``cfg.source``, ``cfg.max_bytes``, ``cfg.val_fraction``.

    Records sources and BPE runs are delegated to :func:`p2pdiloco.tokenized.load_tokenized` (token ids,
    cached on disk); everything else below is the byte-level path.

    Raises :class:`ConfigError` for an invalid config, a missing path or a source without usable
    text. Cached per process (relative paths are resolved first); see :func:`clear_corpus_cache`.
    """
    cfg.validate()
    if cfg.needs_tokenized:  # JSONL/Parquet records or a BPE tokenizer: tokenized once, cached on disk
        from .tokenized import load_tokenized

        return load_tokenized(cfg)
    source = cfg.source if cfg.source == STDLIB_SOURCE else os.path.abspath(cfg.source)
    return _load_cached(source, int(cfg.max_bytes), float(cfg.val_fraction))


def clear_corpus_cache() -> None:
    """Forget cached corpora (tests; or after the files of a path source changed)."""
    _load_cached.cache_clear()


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    """Stable shard index in ``[0, num_shards)`` of a peer id (sha256, not Python's salted ``hash``)."""
    if not _is_int(num_shards) or num_shards < 1:
        raise ConfigError(f"data.num_shards ({num_shards}) must be at least 1")
    return int.from_bytes(hashlib.sha256(peer_id.encode("utf-8")).digest()[:8], "big") % num_shards


def _stream_seed(seed: int, shard: int) -> int:
    return int.from_bytes(hashlib.sha256(f"p2pdiloco-batches:{seed}:{shard}".encode()).digest()[:8], "big") >> 1


class BatchStream:
    """Random training windows from one shard's contiguous region of ``tokens``.

    The region of shard ``s`` is ``[len * s // num_shards, len * (s + 1) // num_shards)``; every
    window of ``seq_len + 1`` tokens lies entirely inside it. Sampling uses a private CPU
    ``torch.Generator`` seeded from ``(seed, shard)``, so two streams built with the same arguments
    produce the same batches, independent of global RNG state and of the device.

    Raises :class:`ConfigError` when the region is shorter than ``seq_len + 1`` tokens.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        shard: int,
        num_shards: int,
        batch_size: int,
        seq_len: int,
        seed: int,
    ):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if not _is_int(num_shards) or num_shards < 1:
            raise ConfigError(f"data.num_shards ({num_shards}) must be at least 1")
        if not _is_int(shard) or not 0 <= shard < num_shards:
            raise ConfigError(f"data.shard ({shard}) must be in [0, {num_shards})")
        if not _is_int(batch_size) or batch_size < 1:
            raise ConfigError(f"batch size ({batch_size}) must be a positive integer")
        if not _is_int(seq_len) or seq_len < 1:
            raise ConfigError(f"seq_len ({seq_len}) must be a positive integer")
        n = tokens.numel()
        self.lo = n * shard // num_shards
        self.hi = n * (shard + 1) // num_shards
        if self.hi - self.lo < seq_len + 1:
            raise ConfigError(
                f"data shard {shard} of {num_shards} has {self.hi - self.lo} tokens, fewer than seq_len + 1 "
                f"({seq_len + 1}); use fewer shards (data.num_shards), more data (data.max_bytes or a larger "
                f"data.source) or a shorter model.seq_len"
            )
        self.tokens = tokens.cpu()
        self.shard, self.num_shards = shard, num_shards
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.batches_drawn = 0
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(_stream_seed(seed, shard))
        self._offsets = torch.arange(seq_len + 1)

    @property
    def region(self) -> Tuple[int, int]:
        """``(lo, hi)``: the half-open token range this stream samples from."""
        return self.lo, self.hi

    def next_starts(self) -> torch.Tensor:
        """Draw the start offsets of the next batch (advances the stream; mostly for tests)."""
        starts = torch.randint(self.lo, self.hi - self.seq_len, (self.batch_size,), generator=self._gen)
        self.batches_drawn += 1
        return starts

    def next_batch(self, device: Union[str, torch.device]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``: int64 tensors ``[batch_size, seq_len]`` on ``device``, ``y`` = ``x`` shifted by one."""
        windows = self.tokens[self.next_starts()[:, None] + self._offsets].long()
        windows = windows.to(device)
        return windows[:, :-1], windows[:, 1:]

    def _identity(self) -> Dict[str, int]:
        return dict(
            shard=self.shard, num_shards=self.num_shards, batch_size=self.batch_size,
            seq_len=self.seq_len, seed=self.seed, num_tokens=self.tokens.numel(),
        )

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: generator state, batch counter and the stream's arguments."""
        return {"generator": self._gen.get_state().clone(), "batches_drawn": self.batches_drawn, **self._identity()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the next batches are exactly those the saved stream would
        have produced. Raises :class:`CheckpointError` if the state belongs to a stream built with
        different arguments (shard, sizes, seed or corpus length)."""
        try:
            saved = {k: int(state[k]) for k in self._identity()}
            gen_state, drawn = state["generator"], int(state["batches_drawn"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"batch stream state is malformed ({e!r}); delete the checkpoint or restore it") from None
        mismatched = {k: (saved[k], v) for k, v in self._identity().items() if saved[k] != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {a}, now {b}" for k, (a, b) in mismatched.items())
            raise CheckpointError(
                f"batch stream state does not match this run ({detail}); resume with the original data and "
                f"batch settings, or start the data stream afresh"
            )
        self._gen.set_state(gen_state.clone())
        self.batches_drawn = drawn


@torch.no_grad()
def evaluate(
    model: nn.Module,
    val_tokens: torch.Tensor,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int = 8,
    device: Union[str, torch.device],
) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` on the start of the validation split.

    Uses fixed, non-overlapping windows: input ``i`` is ``val[i*seq_len : (i+1)*seq_len]`` and its
    targets are shifted by one, for the first ``min(batch_size * max_batches, (len - 1) // seq_len)``
    windows. No randomness, so the value is the same on every peer and every call for equal weights.
    ``model(x, y)`` must return ``(logits, mean_loss)`` and already live on ``device``; it is put in
    eval mode and its previous mode restored. Raises :class:`ConfigError` if the split is shorter
    than ``seq_len + 1`` tokens.
    """
    n_windows = min(batch_size * max_batches, (val_tokens.numel() - 1) // seq_len)
    if n_windows < 1:
        raise ConfigError(
            f"the validation split has {val_tokens.numel()} tokens, fewer than seq_len + 1 ({seq_len + 1}); "
            f"raise data.val_fraction or use more data"
        )
    was_training = model.training
    model.eval()
    try:
        offsets = torch.arange(seq_len + 1)
        total, count = 0.0, 0
        for first in range(0, n_windows, batch_size):
            starts = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
            windows = val_tokens[starts[:, None] + offsets].long().to(device)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            # every window has seq_len targets, so weighting by window count gives the per-token mean
            total += float(loss) * len(starts)
            count += len(starts)
        return total / count
    finally:
        model.train(was_training)
