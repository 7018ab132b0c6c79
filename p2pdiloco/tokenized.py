"""Tokenized corpora: JSONL/Parquet records (read with ``datasets`` in streaming mode) and any source
under a BPE tokenizer, tokenized once and cached on disk.

Used by :func:`p2pdiloco.data.load_corpus` when ``data.source`` names records (a ``.jsonl``,
``.json`` or ``.parquet`` file, or a glob of them) or ``data.tokenizer`` is set; the byte-level text
path is :mod:`p2pdiloco.text`, and the files are found by :mod:`p2pdiloco.sources`.

* **Records.** Files (a glob expands in sorted order) are read one record at a time with
  ``datasets.load_dataset(..., streaming=True)`` (never the whole corpus in memory); the text is
  ``record[data.text_field]``. Record ``i`` of file ``f`` is held out for validation when
  ``sha256("f:i") mod 1000 < val_fraction · 1000`` (the same on every peer, stable when files are
  added). Each document's tokens are followed by ``<|endoftext|>`` (BPE) or ``"\\n\\n"`` (bytes).
  Reading stops after ``data.max_bytes`` bytes of text.
* **Text sources with a tokenizer** (stdlib, a file, a directory): the byte-level corpus's train and
  validation splits, decoded as UTF-8 and tokenized.
* **Cache.** Tokens are written to ``<cache>/<key>.{train,val}.bin`` (uint16 when the vocabulary fits,
  else int32) with a JSON description, then memory-mapped; ``key`` hashes the files' paths, sizes and
  modification times, the tokenizer file, ``text_field``, ``max_bytes`` and ``val_fraction``, so a
  restart reuses them and any change re-tokenizes. ``<cache>`` is ``data.cache_dir``, default
  ``$XDG_CACHE_HOME/p2pdiloco/tokens`` (``~/.cache/...``).
* **Sharding and resuming** are :class:`p2pdiloco.data.BatchStream`'s, as for bytes: each peer
  samples windows of its own contiguous region of the training tokens; the stream's position is in
  the checkpoint.

Bad input raises :class:`ConfigError`, one line: a glob matching nothing, an unreadable or malformed
file, a record without ``text_field``, a source without text, no record held out for validation.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterator, List, Tuple

import numpy as np
import torch

from .errors import ConfigError
from .sources import STDLIB_SOURCE, is_records_source, iter_documents, records_files, stdlib_files
from .text import Corpus, text_corpus
from .tokenizer import TextCodec, tokenizer_vocab_size

__all__ = ["load_tokenized", "iter_training_text"]

_FORMAT = "p2pdiloco-tokens-v1"


def _is_val(path_key: str, i: int, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{path_key}:{i}".encode()).digest()[:8], "big")
    return h % 1000 < val_fraction * 1000


def iter_training_text(cfg) -> Iterator[str]:
    """Texts of ``cfg.source`` (stdlib, text path or records) for training a tokenizer, up to max_bytes."""
    if is_records_source(cfg.source):
        budget = cfg.max_bytes
        for f in records_files(cfg.source):
            for _, text in iter_documents(f, cfg.text_field):
                if budget <= 0:
                    return
                budget -= len(text.encode("utf-8"))
                yield text
        return
    cfg.validate()
    corpus = text_corpus(cfg.source, cfg.max_bytes, cfg.val_fraction)
    yield from _chunks(bytes(corpus.train.numpy()).decode("utf-8", errors="replace"))


def _chunks(text: str, size: int = 1 << 16) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters cut at line ends (tokenizing one huge string is slow)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _cache_dir(cfg) -> str:
    if cfg.cache_dir:
        return cfg.cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "p2pdiloco", "tokens")


def _cache_key(cfg, files: List[str]) -> str:
    h = hashlib.sha256(_FORMAT.encode() + b"\0")
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if cfg.tokenizer:
        with open(cfg.tokenizer, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    h.update(f"{cfg.text_field}\0{cfg.max_bytes}\0{cfg.val_fraction!r}".encode())
    return h.hexdigest()[:24]


def _source_files(cfg, records: bool) -> List[str]:
    """The files whose paths, sizes and times key the cache."""
    if records:
        return records_files(cfg.source)
    if cfg.source == STDLIB_SOURCE:
        return [full for _, full in stdlib_files()[1]]
    if os.path.exists(cfg.source):
        return [cfg.source] if os.path.isfile(cfg.source) else sorted(
            os.path.join(d, n) for d, _, ns in os.walk(cfg.source) for n in ns)
    text_corpus(cfg.source, cfg.max_bytes, cfg.val_fraction)  # its error: the path does not exist
    raise AssertionError("unreachable")  # pragma: no cover


def _tokenize(cfg, codec: TextCodec, files: List[str], records: bool, write: Callable[[str, List[int]], None]) -> int:
    """Tokenize the source, handing ("train" or "val", ids) to ``write``; returns the documents read."""
    if not records:
        corpus = text_corpus(cfg.source, cfg.max_bytes, cfg.val_fraction)
        for split, tokens in (("train", corpus.train), ("val", corpus.val)):
            text = bytes(tokens.numpy()).decode("utf-8", errors="replace")
            for piece in _chunks(text):
                write(split, codec.encode(piece))
        return len(files)
    sep = [codec.eos_id] if codec.eos_id is not None else list(b"\n\n")
    budget, n_docs = cfg.max_bytes, 0
    batch: List[Tuple[str, str]] = []  # (split, text): encode_batch tokenizes in parallel

    def flush() -> None:
        for (split, _), ids in zip(batch, codec.encode_batch([t for _, t in batch])):
            write(split, ids + sep)
        batch.clear()

    for f in files:
        for i, text in iter_documents(f, cfg.text_field):
            if budget <= 0:
                break
            budget -= len(text.encode("utf-8"))
            batch.append(("val" if _is_val(os.path.basename(f), i, cfg.val_fraction) else "train", text))
            n_docs += 1
            if len(batch) >= 256:
                flush()
    flush()
    return n_docs


def _write_cache(cfg, files: List[str], records: bool, dtype, root: str, key: str, meta_path: str) -> None:
    """Tokenize into ``<root>/<key>.{train,val}.bin`` and describe them in ``meta_path``; each file
    appears complete (written aside, then renamed) or not at all."""
    codec = TextCodec(cfg.tokenizer or None)
    os.makedirs(root, exist_ok=True)
    digest = hashlib.sha256(f"{_FORMAT}\0{key}".encode())
    counts = {"train": 0, "val": 0}
    tmp = {s: os.path.join(root, f".{key}.{s}.bin.{os.getpid()}.tmp") for s in counts}
    outs = {s: open(p, "wb") for s, p in tmp.items()}
    try:
        def write(split: str, ids: List[int]) -> None:
            arr = np.asarray(ids, dtype=dtype)
            outs[split].write(arr.tobytes())
            counts[split] += arr.size

        n_docs = _tokenize(cfg, codec, files, records, write)
    finally:
        for fh in outs.values():
            fh.close()
    try:
        if counts["train"] + counts["val"] < 2:
            raise ConfigError(f"data.source {cfg.source!r} holds no text in field {cfg.text_field!r}; point it at "
                              "records with text")
        if counts["val"] == 0:
            raise ConfigError(f"data.source {cfg.source!r}: no record was held out for validation ({n_docs} "
                              "records); raise data.val_fraction or add records")
        for s in counts:
            with open(tmp[s], "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            os.replace(tmp[s], os.path.join(root, f"{key}.{s}.bin"))
    finally:
        for p in tmp.values():
            if os.path.exists(p):
                os.unlink(p)
    meta = {"format": _FORMAT, "dtype": np.dtype(dtype).name, "train": counts["train"], "val": counts["val"],
            "docs": n_docs, "digest": digest.hexdigest()[:16]}
    with open(meta_path + ".tmp", "w") as fh:
        json.dump(meta, fh)
    os.replace(meta_path + ".tmp", meta_path)


def load_tokenized(cfg) -> Corpus:
    """The :class:`p2pdiloco.data.Corpus` of a records source or a tokenizer run (see the module docstring)."""
    records = is_records_source(cfg.source)
    files = _source_files(cfg, records)
    vocab = tokenizer_vocab_size(cfg.tokenizer) if cfg.tokenizer else 256
    dtype = np.uint8 if vocab <= 256 else np.uint16 if vocab <= 65536 else np.int32
    root = _cache_dir(cfg)
    key = _cache_key(cfg, files)
    meta_path = os.path.join(root, f"{key}.json")
    if not os.path.isfile(meta_path):
        _write_cache(cfg, files, records, dtype, root, key, meta_path)
    with open(meta_path) as fh:
        meta = json.load(fh)

    def mapped(split: str) -> torch.Tensor:
        arr = np.memmap(os.path.join(root, f"{key}.{split}.bin"), dtype=meta["dtype"], mode="c",
                        shape=(meta[split],))
        return torch.from_numpy(arr)  # memory-mapped: pages are read as windows are sampled

    kind = f"records {cfg.source} (field {cfg.text_field!r})" if records else f"{cfg.source} text"
    tok = f"BPE {cfg.tokenizer} ({vocab} ids)" if cfg.tokenizer else "bytes"
    docs = f"{meta['docs']} records, " if records else ""
    description = (f"{kind}: {docs}{meta['train']:,} train + {meta['val']:,} val tokens, "
                   f"{tok}, cached in {root}, digest {meta['digest']}")
    return Corpus(train=mapped("train"), val=mapped("val"), digest=meta["digest"], description=description)
