"""Chunked top-k sparse codec (SparseLoCo's wire format, Sarfi et al. 2025).

The vector is cut into chunks of ``chunk`` values (4096 by default); each chunk keeps its ``k``
largest-magnitude values (64: 1.56%), sent as their positions in the chunk (``ceil(log2 chunk)``
bits each, 12 for 4096) and ``bits``-bit codes: a sign bit and ``bits − 1`` magnitude bits choosing
one of ``2^(bits−1)`` levels spread evenly from the smallest to the largest kept magnitude (two fp32
numbers per chunk). Every other value decodes to 0. A last chunk of ``n < chunk`` values keeps
``ceil(k·n/chunk)`` of them. Per chunk of ``chunk`` values::

    lo, hi        2 × fp32    the smallest and largest kept magnitude
    indices       k × ceil(log2 chunk) bits, strictly increasing, padded to a byte
    codes         k × bits bits (sign, then the level), padded to a byte

so ``encoded_size`` is exact (k = 64, 2 bits: 120 bytes per 4096 values, 137x fewer than fp32).
A payload is refused before anything is decoded into place when a position is out of the chunk,
repeated or out of order, or a level is negative, not finite or ``lo > hi`` (a wrong count is a
wrong byte length). The codec is the lossy channel; the decayed error buffer that makes top-k work
(what was not sent is kept and sent later) is :class:`~p2pdiloco.diloco.reducers.SparseReducer`'s.

In the all-reduce the owner of a shard does not re-encode the mean (a sum of several peers' top-k
has up to ``group size × k`` values per chunk, and truncating it again would drop what members
sent, invisibly to their error buffers): its reply relays the members' payloads themselves
(``relays_parts``), and every member computes the same weighted mean of them in member order
(:func:`p2pdiloco.compression.robust.weighted_mean`, one rounding per operation, so the same bits
on every machine).
"""
from __future__ import annotations

import math
from functools import lru_cache
import numpy as np
import torch

from ..errors import WireError
from .base import CODECS, Codec, register_codec

__all__ = ["SparseCodec", "sparse_codec", "SPARSE_CODEC_ID"]

SPARSE_CODEC_ID = 8


def _pack(values: np.ndarray, nbits: int) -> np.ndarray:
    """Rows of unsigned integers < 2**nbits, each row packed big-endian into whole bytes."""
    rows, cols = values.shape
    shifts = np.arange(nbits - 1, -1, -1, dtype=np.uint32)
    bits = ((values.astype(np.uint32)[:, :, None] >> shifts) & 1).astype(np.uint8).reshape(rows, cols * nbits)
    return np.packbits(bits, axis=1)  # pads each row to a byte with zeros


def _unpack(data: np.ndarray, cols: int, nbits: int) -> np.ndarray:
    """Inverse of :func:`_pack` for ``data`` of shape (rows, bytes per row)."""
    rows = data.shape[0]
    bits = np.unpackbits(data, axis=1, count=cols * nbits).reshape(rows, cols, nbits).astype(np.uint32)
    shifts = np.arange(nbits - 1, -1, -1, dtype=np.uint32)
    return (bits << shifts).sum(axis=2, dtype=np.uint32)


class SparseCodec(Codec):
    """Top-``k`` of every ``chunk`` values, ``bits``-bit codes (module docstring)."""

    name = "sparse"
    codec_id = SPARSE_CODEC_ID
    #: lossy, unbounded relative to a block's absmax (dropped values are lost whole): error feedback's job
    relative_error_bound = 1.0
    relays_parts = True

    def __init__(self, chunk: int = 4096, k: int = 64, bits: int = 2):
        if not (chunk >= 2 and 1 <= k <= chunk and bits in (2, 3, 4, 8)):
            raise ValueError(f"sparse codec: chunk {chunk}, k {k}, bits {bits} out of range")
        self.chunk, self.k, self.bits = chunk, k, bits
        self.block_size = chunk
        self.index_bits = max(1, math.ceil(math.log2(chunk)))
        self.levels = 1 << (bits - 1)

    def kept(self, n: int) -> int:
        """Values kept from a chunk of ``n`` values."""
        return self.k if n == self.chunk else -(-self.k * n // self.chunk)

    def _chunk_size(self, n: int) -> int:
        k = self.kept(n)
        return 8 + -(-k * self.index_bits // 8) + -(-k * self.bits // 8)

    def encoded_size(self, numel: int) -> int:
        full, rest = divmod(numel, self.chunk)
        return full * self._chunk_size(self.chunk) + (self._chunk_size(rest) if rest else 0)

    def _rows(self, numel: int):
        """(start, rows, n, k) for the full chunks and for the last partial one."""
        full, rest = divmod(numel, self.chunk)
        out = [(0, full, self.chunk, self.k)] if full else []
        if rest:
            out.append((full * self.chunk, 1, rest, self.kept(rest)))
        return out

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().to("cpu", torch.float32).contiguous().view(-1)
        return b"".join(self._encode_rows(x[s: s + r * n].view(r, n), k) for s, r, n, k in self._rows(x.numel()))

    def _encode_rows(self, x: torch.Tensor, k: int) -> bytes:
        mag = x.abs()
        idx = torch.topk(mag, k, dim=1, sorted=False).indices.sort(dim=1).values
        val = torch.gather(x, 1, idx)
        amag = val.abs()
        lo, hi = amag.min(dim=1, keepdim=True).values, amag.max(dim=1, keepdim=True).values
        step = (hi - lo) / (self.levels - 1)
        level = torch.where(step > 0, torch.round((amag - lo) / torch.where(step > 0, step, 1.0)), 0.0)
        codes = ((val < 0).to(torch.int64) << (self.bits - 1)) | level.clamp(0, self.levels - 1).to(torch.int64)
        scales = torch.cat([lo, hi], dim=1).numpy().astype("<f4").view(np.uint8)
        parts = [scales, _pack(idx.numpy(), self.index_bits), _pack(codes.numpy(), self.bits)]
        return np.concatenate(parts, axis=1).tobytes()

    def check_payload(self, data: bytes, numel: int, sender: str | None = None) -> None:
        """Refuse a payload whose positions or levels are malformed (length already exact)."""
        self._parse(data, numel, sender)

    def _parse(self, data: bytes, numel: int, sender: str | None):
        buf = np.frombuffer(data, dtype=np.uint8)
        off, rows = 0, []
        for s, r, n, k in self._rows(numel):
            size = self._chunk_size(n)
            block = buf[off: off + r * size].reshape(r, size)
            off += r * size
            ib = -(-k * self.index_bits // 8)
            scales = block[:, :8].copy().view("<f4").astype(np.float32)
            idx = _unpack(block[:, 8: 8 + ib], k, self.index_bits).astype(np.int64)
            codes = _unpack(block[:, 8 + ib:], k, self.bits).astype(np.int64)
            self._validate(scales, idx, n, sender)
            rows.append((s, r, n, scales, idx, codes))
        return rows

    def _validate(self, scales: np.ndarray, idx: np.ndarray, n: int, sender: str | None) -> None:
        lo, hi = scales[:, 0], scales[:, 1]
        if not (np.isfinite(scales).all() and (lo >= 0).all() and (lo <= hi).all()):
            raise WireError("sparse part has a malformed chunk scale (not finite, negative or lo > hi)", sender)
        if (idx >= n).any():
            raise WireError(f"sparse part has an index out of range (>= {n} in its chunk)", sender)
        d = np.diff(idx, axis=1)
        if (d == 0).any():
            raise WireError("sparse part repeats an index within a chunk", sender)
        if (d < 0).any():
            raise WireError("sparse part's indices are not sorted within a chunk", sender)

    def _decode(self, data: bytes, numel: int) -> torch.Tensor:
        return self._decode_checked(data, numel, None)

    def _decode_checked(self, data: bytes, numel: int, sender: str | None) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        for s, r, n, scales, idx, codes in self._parse(data, numel, sender):
            lo = torch.from_numpy(scales[:, :1])
            step = torch.from_numpy((scales[:, 1:] - scales[:, :1]) / np.float32(self.levels - 1))
            level = torch.from_numpy(codes & (self.levels - 1)).to(torch.float32)
            mag = torch.add(lo, torch.mul(level, step))  # one rounding per operation: the same bits everywhere
            val = torch.where(torch.from_numpy(codes >> (self.bits - 1)) == 1, torch.neg(mag), mag)
            pos = torch.from_numpy(idx + (np.arange(r, dtype=np.int64)[:, None] * n + s))
            out[pos.view(-1)] = val.view(-1)
        return out

    def decode(self, data: bytes, numel: int, sender: str | None = None) -> torch.Tensor:
        self.check_length(data, numel, sender)
        return self._decode_checked(data, numel, sender)

    def decode_into(self, data: bytes, out: torch.Tensor, sender: str | None = None) -> None:
        numel = out.numel()
        self.check_length(data, numel, sender)
        if numel:
            out.copy_(self._decode_checked(data, numel, sender))


register_codec(SparseCodec)  # the default parameters under the name "sparse" and wire id 8


@lru_cache(maxsize=None)
def sparse_codec(chunk: int = 4096, k: int = 64, bits: int = 2) -> SparseCodec:
    """The sparse codec with these parameters (one instance per parameter set; the registered one for
    the defaults). Every peer of a run builds it from the same config, so parts agree in size."""
    default = CODECS["sparse"]
    if (chunk, k, bits) == (default.chunk, default.k, default.bits):
        return default
    return SparseCodec(chunk, k, bits)
