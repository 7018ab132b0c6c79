"""Byte-level corpora: the bytes of a text source, split into training and validation by file.

Tokens are bytes: vocabulary 256, one token per byte, stored as ``uint8``. Files
(:mod:`p2pdiloco.sources`) are concatenated in sorted relative-path order and the total is cut at
``max_bytes`` (the last file taken may be truncated). The validation split is chosen per FILE: a
file is held out when ``int(sha256(relative_path)) % 1000 < val_fraction * 1000``, which depends on
the path only, so it is the same on every peer and stable when files are added. If no file is held
out, the file with the smallest hash value is; if every file is, the largest goes back to training.
A source that is a single file cannot be split by file: its last ``val_fraction`` of bytes is the
validation split instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .sources import STDLIB_SOURCE, directory_files, read_bounded, stdlib_files

__all__ = ["Corpus", "text_corpus", "clear_text_cache"]


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


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest(), "big")


@functools.lru_cache(maxsize=8)
def _load_cached(source: str, max_bytes: int, val_fraction: float) -> Corpus:
    if source == STDLIB_SOURCE:
        root, paths = stdlib_files()
        files = read_bounded(paths, max_bytes, skip_binary=False)
        kind = f"stdlib of Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro} ({root})"
    elif os.path.isfile(source):
        with open(source, "rb") as f:
            data = f.read(max_bytes)
        files = [(os.path.basename(source), data)] if data else []
        kind = f"file {source}"
    elif os.path.isdir(source):
        files = read_bounded(directory_files(source), max_bytes, skip_binary=True)
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


def text_corpus(source: str, max_bytes: int, val_fraction: float) -> Corpus:
    """The byte-level corpus of ``source`` (cached per process; a relative path is resolved first).
    Raises :class:`ConfigError` for a missing path or a source without usable text."""
    source = source if source == STDLIB_SOURCE else os.path.abspath(source)
    return _load_cached(source, int(max_bytes), float(val_fraction))


def clear_text_cache() -> None:
    """Forget cached byte-level corpora."""
    _load_cached.cache_clear()
