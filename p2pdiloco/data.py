"""Byte-level corpora, per-peer data shards, resumable batch streams and a fixed evaluation.

Tokens are bytes (vocabulary 256, :mod:`p2pdiloco.text`), or the ids of a BPE tokenizer and the
text of JSONL/Parquet records (:mod:`p2pdiloco.tokenized`); either is a :class:`Corpus`, and sharding,
batch streams and evaluation below are shared. Nothing is downloaded.

Corpus sources (``DataConfig.source``) are found by :mod:`p2pdiloco.sources` (``"stdlib"``, the
Python standard library: every machine has it, and peers on different Python versions get different
corpora, which :attr:`Corpus.digest` reveals; a text file; a directory; JSONL/Parquet records).
Text is split into training and validation bytes by :mod:`p2pdiloco.text`.

Sharding: the training tokens are cut into ``num_shards`` contiguous regions and each peer samples
only from its own (``DataConfig.shard``, or :func:`shard_for_peer` of its peer id), the
heterogeneous-data setting of DiLoCo (Douillard et al. 2023, arXiv:2311.08105).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Tuple, Union

import torch
import torch.nn as nn

from .errors import CheckpointError, ConfigError
from .sources import STDLIB_SOURCE, is_records_source
from .text import Corpus, clear_text_cache, text_corpus
from .tokenized import load_tokenized

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
        return bool(self.tokenizer) or is_records_source(self.source)

    def shard_for(self, peer_id: str) -> int:
        """This peer's shard: ``shard`` when set, else :func:`shard_for_peer` of ``peer_id``."""
        return self.shard if self.shard >= 0 else shard_for_peer(peer_id, self.num_shards)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load (or return the cached) corpus of ``cfg.source``, ``cfg.max_bytes``, ``cfg.val_fraction``.

    Records sources and BPE runs are delegated to :func:`p2pdiloco.tokenized.load_tokenized` (token ids,
    cached on disk); everything else below is the byte-level path.

    Raises :class:`ConfigError` for an invalid config, a missing path or a source without usable
    text. Cached per process (relative paths are resolved first); see :func:`clear_corpus_cache`.
    """
    cfg.validate()
    if cfg.needs_tokenized:  # JSONL/Parquet records or a BPE tokenizer: tokenized once, cached on disk
        return load_tokenized(cfg)
    return text_corpus(cfg.source, cfg.max_bytes, cfg.val_fraction)


def clear_corpus_cache() -> None:
    """Forget cached corpora (tests; or after the files of a path source changed)."""
    clear_text_cache()


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
