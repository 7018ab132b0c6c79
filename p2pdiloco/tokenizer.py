"""Tokenizers: the embedded byte-level one (256 ids, no files) and byte-level BPE through the Hugging
Face ``tokenizers`` library (``p2pdiloco tokenizer train``, ``[data] tokenizer = "tok.json"``).

The BPE tokenizer splits text with GPT-2's byte-level pre-tokenizer, so every string is encodable
(no unknown token), and reserves id 0 for ``<|endoftext|>``, appended after every document of a
records source. It is trained locally from a ``data.source`` (the embedded stdlib corpus, a text
file or directory, or JSONL/Parquet records): nothing is downloaded. A run identifies its tokenizer
by the sha256 of the file (:func:`tokenizer_identity`, the fingerprint's ``data.vocab``), so peers with
different tokenizers are refused.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Iterable, List, Optional

from .errors import ConfigError

__all__ = ["EOS", "train_bpe", "load_tokenizer", "tokenizer_identity", "tokenizer_vocab_size", "TextCodec",
           "hf_tokenizer"]

#: the end-of-document token (id 0 of a tokenizer trained here)
EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> int:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``texts`` and save it to ``out``
    (tokenizers' JSON). Returns the vocabulary size reached (smaller when the text has few merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ConfigError(f"--vocab-size ({vocab_size}) must be at least 257 (256 bytes + {EOS})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tok.save(out)
    return tok.get_vocab_size()


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from ``path``; :class:`ConfigError` when missing or not a tokenizer."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise ConfigError(f"data.tokenizer {path!r} does not exist; train one with `p2pdiloco tokenizer train "
                          f"--data stdlib --vocab-size 4096 --out {path}`")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:
        raise ConfigError(f"data.tokenizer {path!r} is not a tokenizers JSON file ({str(e).splitlines()[0][:200]})") from None


def tokenizer_vocab_size(path: str) -> int:
    return _described(path)[0]


def tokenizer_identity(path: str) -> str:
    """``bpe-<vocab>-<sha256 prefix of the file>``: the fingerprint's ``data.vocab`` for a BPE run."""
    vocab, digest = _described(path)
    return f"bpe-{vocab}-{digest}"


def _described(path: str):
    if not os.path.isfile(path):
        load_tokenizer(path)  # raises the clear error for a missing file
    st = os.stat(path)
    return _describe(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _describe(path: str, size: int, mtime_ns: int):
    """(vocabulary size, sha256 prefix) of a tokenizer file, cached per (path, size, mtime): the
    fingerprint is computed more than once per run."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return load_tokenizer(path).get_vocab_size(), digest


class TextCodec:
    """encode/decode of a run's tokenizer: BPE from ``path``, or bytes (UTF-8) when ``path`` is None."""

    def __init__(self, path: Optional[str]):
        self.tok = load_tokenizer(path) if path else None
        self.eos_id = self.tok.token_to_id(EOS) if self.tok is not None else None

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text).ids if self.tok is not None else list(text.encode("utf-8"))

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        if self.tok is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: List[int]) -> str:
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=False)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _byte_tokenizer():
    """A tokenizers object whose id b is the byte b (GPT-2's byte-to-unicode alphabet, no merges):
    the byte-level GPT's vocabulary for an exported model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def hf_tokenizer(path: Optional[str], seq_len: int):
    """A ``PreTrainedTokenizerFast`` of the run's tokenizer (BPE file, or bytes when None), for export."""
    from transformers import PreTrainedTokenizerFast

    if path:
        return PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(path), eos_token=EOS,
                                       model_max_length=seq_len)
    return PreTrainedTokenizerFast(tokenizer_object=_byte_tokenizer(), model_max_length=seq_len)
