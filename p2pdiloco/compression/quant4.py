"""4-bit blockwise codecs: E3M0 (Streaming DiLoCo), NF4 and FP4 (QLoRA / bitsandbytes codebooks).

All three share one byte layout, defined here and independent of any library:

    [ scales: ceil(n/64) x float32, little-endian ][ codes: ceil(n/2) bytes ]

* Blocks are 64 consecutive values; the last block may be shorter. A block's scale is its absmax
  (fp32, exact; 4 bytes per 64 values = 0.5 bit per value, so 4.5 bits per value in all).
* Code ``c`` (0..15) decodes to ``CODEBOOK[c] * scale`` (one fp32 multiply, so decoding is a pure,
  bitwise-reproducible function of the bytes on any machine, device or thread count).
* Two codes per byte: value ``2i`` in the high nibble, value ``2i+1`` in the low nibble. When ``n``
  is odd the last low nibble is padding (the encoder writes the code of 0.0; the decoder ignores it).
* Encoding rounds ``x / absmax`` to the nearest codebook value in the value domain (ties go to the
  smaller value). For a codebook whose widest gap between neighbouring values is ``g`` this bounds
  the error by ``g/2 * absmax``; ``relative_error_bound`` adds 2^-20 for fp32 rounding in the
  division and in the dequantizing multiply (each at most 2^-24 relative).

Exact sizes: ``encoded_size(n) = 4 * ceil(n / 64) + ceil(n / 2)``.

Codebooks (``x / absmax`` grid):

* ``e3m0`` (id 2): sign bit (bit 3) + 3-bit exponent ``e`` (bits 0-2); ``e = 0`` is zero and
  ``e = 1..7`` is ``±2^(e-7)``, i.e. magnitudes {0, 1/64, 1/32, 1/16, 1/8, 1/4, 1/2, 1}. Widest gap
  1/2..1, bound 0.25. Value-domain rounding is used because it minimises both the worst case and the
  mean squared error: log-domain rounding (threshold sqrt(1/2) between 1/2 and 1) has a worst case of
  1 - sqrt(1/2) = 0.293 (tested). Code 8 ("negative zero") is never produced and decodes to 0.
  Streaming DiLoCo: Douillard et al. 2025, arXiv:2501.18512.
* ``nf4`` (id 3): the 16 NormalFloat values of QLoRA (Dettmers et al. 2023, arXiv:2305.14314), code
  order as in bitsandbytes (code 0 = -1, code 7 = 0, code 15 = +1). Widest gap -1..-0.696, bound 0.152.
* ``fp4`` (id 4): bitsandbytes' FP4 (E2M1) values normalised to absmax 1 with bitsandbytes' code
  order: {0, 1/192, 2/3, 1, 1/3, 1/2, 1/6, 1/4}, bit 3 = sign. Widest gap 2/3..1, bound 1/6.

The codes mean what bitsandbytes' codes mean, but quantization here is pure torch (vectorised, runs
on the tensor's device): bitsandbytes rounds through its own normalisation, so its bytes are not
guaranteed identical to ours, and our layout does not depend on which library encoded.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..errors import WireError
from . import fused
from .base import Codec, check_block_scales, register_codec

__all__ = ["BLOCK_SIZE", "Blockwise4BitCodec", "E3M0Codec", "NF4Codec", "FP4Codec"]

#: values per block (one fp32 absmax scale each)
BLOCK_SIZE = 64
#: slack added to half the widest codebook gap, for fp32 rounding (see module docstring)
_ROUNDING_SLACK = 2.0**-20
#: the fast encoder cuts [-1, 1] into 2 * _BINS + 1 bins of width 1 / _BINS (see _bin_tables)
_BINS = 512
#: values per chunk on CPU (a multiple of BLOCK_SIZE)
_CPU_CHUNK = 1 << 20
#: vectors at least this long go through the fused CPU kernels when numba is there (fused.py); below it the
#: torch path is as fast and a process that only codes small vectors never compiles them
_FUSED_MIN = 1 << 14

_E3M0_CODEBOOK = [0.0] + [2.0 ** (e - 7) for e in range(1, 8)] + [0.0] + [-(2.0 ** (e - 7)) for e in range(1, 8)]

_NF4_CODEBOOK = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip

_FP4_POSITIVE = [0.0, 1.0 / 192.0, 2.0 / 3.0, 1.0, 1.0 / 3.0, 0.5, 1.0 / 6.0, 0.25]
_FP4_CODEBOOK = _FP4_POSITIVE + [-v for v in _FP4_POSITIVE]


def _half_widest_gap(codebook) -> float:
    vals = sorted(set(float(np.float32(v)) for v in codebook))
    return max(b - a for a, b in zip(vals, vals[1:])) / 2.0


def _bin_tables(midpoints: torch.Tensor, sorted_codes: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Tables of the bin encoder: per bin its midpoint (or +inf) and the codes below/above it.

    Returns ``None`` (use bucketize) when a bin would hold two midpoints or a midpoint lies within
    2^-16 of a bin edge; the three codebooks here pass.
    """
    m = midpoints.double()
    k = torch.arange(2 * _BINS + 1, dtype=torch.float64)
    lo, hi = (k - 0.5) / _BINS - 1, (k + 0.5) / _BINS - 1
    below = torch.searchsorted(m, lo)  # number of midpoints < lo
    inside = torch.searchsorted(m, hi) - below
    edge_dist = ((m + 1) * _BINS + 0.5 - torch.round((m + 1) * _BINS + 0.5)).abs() / _BINS
    if int(inside.max()) > 1 or float(edge_dist.min()) <= 2.0**-16:
        return None
    ext = torch.cat([midpoints, torch.tensor([float("inf")])])
    thresholds = torch.where(inside > 0, ext[below], torch.tensor(float("inf"))).float()
    top = len(sorted_codes) - 1
    codes = torch.stack([sorted_codes[below], sorted_codes[(below + 1).clamp(max=top)]], dim=1).reshape(-1)
    return thresholds, codes.contiguous()


def _chunk(device: torch.device, numel: int) -> int:
    """Values per step: on CPU, 2^20 (multiple of the block size) keeps temporaries in cache and
    avoids page-faulting fresh buffers (about 10x faster at 16M values); elsewhere, all at once."""
    return _CPU_CHUNK if device.type == "cpu" else max(numel, 1)


class Blockwise4BitCodec(Codec):
    """Blockwise absmax 4-bit codec over a 16-entry codebook (layout in the module docstring).

    Subclasses set ``name``, ``codec_id`` and ``codebook`` (16 values in [-1, 1], indexed by code,
    containing 0, +1 or -1). ``encode`` raises ``ValueError`` on non-finite input.
    """

    codebook: list = []
    block_size = BLOCK_SIZE
    #: the codebook is E3M0's (sign + exponent): the fused encoder takes codes from the exponent bits
    exponent_codes = False

    def __init__(self) -> None:
        cb = torch.tensor(self.codebook, dtype=torch.float32)
        if cb.numel() != 16 or cb.abs().max() != 1.0 or not (cb == 0).any():
            raise RuntimeError(f"{self.name}: codebook must have 16 values in [-1, 1] including 0 and ±1")
        self._codebook = cb
        # Encoding: sorted distinct values, the code that represents each, and the midpoints between
        # neighbours (bucketize(x, midpoints) = index of the nearest value, ties to the smaller one).
        order = sorted(range(16), key=lambda c: (float(cb[c]), c))
        distinct_vals, distinct_codes = [], []
        for c in order:
            v = float(cb[c])
            if distinct_vals and distinct_vals[-1] == v:
                continue  # duplicate (e.g. ±0): keep the lowest code
            distinct_vals.append(v)
            distinct_codes.append(c)
        sv = torch.tensor(distinct_vals, dtype=torch.float32)
        self._midpoints = (sv[:-1] + sv[1:]) / 2
        self._sorted_codes = torch.tensor(distinct_codes, dtype=torch.uint8)
        self._zero_code = int(distinct_codes[distinct_vals.index(0.0)])
        # Decoding: one byte -> the two values it holds (high nibble first).
        byte = torch.arange(256)
        self._pair_lut = torch.stack([cb[byte >> 4], cb[byte & 15]], dim=1).contiguous()
        self._bins = _bin_tables(self._midpoints, self._sorted_codes)
        # the fused CPU kernels' tables (fused.py)
        if self._bins is not None:
            self._np_thresholds = self._bins[0].numpy().copy()
            self._np_codes = self._bins[1].numpy().astype(np.int64)
        self._np_codebook = cb.numpy().copy()
        self._device_cache: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    # -- sizes -------------------------------------------------------------------------------
    def encoded_size(self, numel: int) -> int:
        return 4 * (-(-numel // BLOCK_SIZE)) + (numel + 1) // 2

    # -- encode ------------------------------------------------------------------------------
    def _tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(thresholds, codes) of the bin encoder, or (midpoints, sorted codes) for bucketize."""
        tables = self._device_cache.get(device)
        if tables is None:
            src = self._bins if self._bins is not None else (self._midpoints, self._sorted_codes)
            tables = (src[0].to(device), src[1].to(device))
            self._device_cache[device] = tables
        return tables

    def _bin_offset(self, device: torch.device) -> torch.Tensor:
        offset = self._device_cache.get(("offset", device))
        if offset is None:
            offset = self._device_cache[("offset", device)] = torch.tensor(_BINS + 0.5, device=device)
        return offset

    def _codes(self, xn: torch.Tensor) -> torch.Tensor:
        """Code of the nearest codebook value for each ``xn`` in [-1, 1] (ties to the smaller value)."""
        a, b = self._tables(xn.device)
        if self._bins is None:
            return b.index_select(0, torch.bucketize(xn.reshape(-1), a, out_int32=True))
        # bin k holds [(k - 1/2) / _BINS - 1, (k + 1/2) / _BINS - 1); at most one midpoint lies in
        # a bin, and none within 2^-16 of a bin edge, so a bin index off by one from fp32 rounding
        # (only within 2^-23 of an edge) still yields the same code. Equal to bucketize (tested).
        xn = xn.reshape(-1)
        # _BINS * xn is exact (a power of two), so this one pass rounds like xn * _BINS + (_BINS + 0.5)
        k = torch.add(self._bin_offset(xn.device), xn, alpha=_BINS).to(torch.int32).clamp_(0, 2 * _BINS)
        above = xn > a.index_select(0, k)
        return b.index_select(0, k.mul_(2).add_(above))

    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(scales fp32 [nblocks], packed uint8 [ceil(n/2)])`` on ``x``'s device."""
        x = x.detach().reshape(-1)
        n = x.numel()
        if x.device.type == "cpu" and n >= _FUSED_MIN and self._bins is not None:
            k = fused.kernels()
            if k is not None:
                return self._quantize_fused(k, x)
        step = _chunk(x.device, n)
        if step >= n:
            return self._quantize_chunk(x)
        scales = torch.empty(-(-n // BLOCK_SIZE), dtype=torch.float32, device=x.device)
        packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
        for start in range(0, n, step):
            s, p = self._quantize_chunk(x[start : start + step])
            scales[start // BLOCK_SIZE : start // BLOCK_SIZE + s.numel()] = s
            packed[start // 2 : start // 2 + p.numel()] = p
        return scales, packed

    def _quantize_fused(self, k, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`quantize` in one pass on CPU (fused.py): the same bytes as the torch path."""
        n = x.numel()
        xs = x.float().contiguous().numpy()
        scales = torch.empty(-(-n // BLOCK_SIZE), dtype=torch.float32)
        packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
        if self.exponent_codes:
            ok = fused.encode_e3m0_into(k, xs, scales.numpy(), packed.numpy())
        else:
            ok = fused.encode_into(k, xs, self._np_thresholds, self._np_codes, self._zero_code, scales.numpy(),
                                   packed.numpy())
        if not ok:
            raise ValueError(f"{self.name}: cannot encode non-finite values")
        return scales, packed

    def _quantize_chunk(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32:
            x = x.float()
        n = x.numel()
        nb = -(-n // BLOCK_SIZE)
        pad = nb * BLOCK_SIZE - n
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        xb = x.view(nb, BLOCK_SIZE)
        absmax = xb.abs().amax(dim=1) if nb else x.new_zeros(0)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(f"{self.name}: cannot encode non-finite values")
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        pairs = self._codes(xb / safe[:, None]).view(-1, 2)
        packed = torch.empty(pairs.shape[0], dtype=torch.uint8, device=x.device)
        torch.bitwise_left_shift(pairs[:, 0], 4, out=packed).bitwise_or_(pairs[:, 1])  # 2x faster than a | b
        return absmax, packed[: (n + 1) // 2]

    def encode(self, x: torch.Tensor) -> bytes:
        scales, packed = self.quantize(x)
        scales_np = scales.cpu().numpy().astype("<f4", copy=False)
        return scales_np.tobytes() + packed.cpu().numpy().tobytes()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` without the bytes in between (the scales are fp32 either way)."""
        scales, packed = self.quantize(x)
        return self.dequantize(scales, packed, x.numel()).cpu()

    # -- decode ------------------------------------------------------------------------------
    def dequantize(self, scales: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """Inverse of :meth:`quantize` (on the tensors' device); returns fp32 ``[numel]``."""
        if packed.device.type == "cpu" and numel >= _FUSED_MIN:
            k = fused.kernels()
            if k is not None:
                out = torch.empty(numel, dtype=torch.float32)
                if fused.decode_into(k, scales.contiguous().numpy(), packed.contiguous().numpy(), self._np_codebook,
                                     out.numpy()):
                    return out
                # a negative or non-finite scale: the torch path's result (callers validate scales first)
        step = _chunk(packed.device, numel)
        if step >= numel:
            return self._dequantize_chunk(scales, packed, numel)
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
        for start in range(0, numel, step):
            k = min(step, numel - start)
            out[start : start + k] = self._dequantize_chunk(
                scales[start // BLOCK_SIZE : start // BLOCK_SIZE + -(-k // BLOCK_SIZE)],
                packed[start // 2 : start // 2 + (k + 1) // 2],
                k,
            )
        return out

    def _dequantize_chunk(self, scales: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
        nb = scales.numel()
        lut = self._pair_lut.to(packed.device)
        vals = lut.index_select(0, packed.to(torch.int32)).view(-1)
        full = nb * BLOCK_SIZE
        if vals.numel() != full:
            vals = torch.nn.functional.pad(vals, (0, full - vals.numel()))
        return vals.view(nb, BLOCK_SIZE).mul_(scales.view(nb, 1)).view(-1)[:numel]  # in place: one buffer

    def decode(self, data: bytes, numel: int, sender: Optional[str] = None) -> torch.Tensor:
        """Validate then decode; raises :class:`WireError` naming ``sender`` on any mismatch.

        Same contract as :meth:`Codec.decode`, cheaper: the output is finite exactly when every
        block scale is finite (codebook values lie in [-1, 1]), so only the scales are checked.
        """
        self.check_length(data, numel, sender)
        return self._decode(data, numel, sender)

    def decode_into(self, data: bytes, out: torch.Tensor, sender: Optional[str] = None) -> None:
        """:meth:`decode` written straight into ``out`` (whole blocks multiply into place)."""
        numel = out.numel()
        self.check_length(data, numel, sender)
        k = fused.kernels() if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() \
            and numel >= _FUSED_MIN else None
        if k is not None:
            nb = -(-numel // BLOCK_SIZE)
            scales = np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32)
            packed = np.frombuffer(data, dtype=np.uint8, offset=4 * nb)
            if not fused.decode_into(k, scales, packed, self._np_codebook, out.view(-1).numpy()):
                raise WireError(f"{self.name} part has a negative or non-finite block scale", sender)
            return
        nb = numel // BLOCK_SIZE
        if numel == 0 or numel % BLOCK_SIZE or out.device.type != "cpu" or numel > _CPU_CHUNK:
            out.copy_(self._decode(data, numel, sender))
            return
        scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32))
        check_block_scales(self.name, scales, sender)
        packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 * nb).astype(np.int32))
        vals = self._pair_lut.index_select(0, packed).view(nb, BLOCK_SIZE)
        torch.mul(vals, scales.view(nb, 1), out=out.view(nb, BLOCK_SIZE))

    def _decode(self, data: bytes, numel: int, sender: Optional[str] = None) -> torch.Tensor:
        nb = -(-numel // BLOCK_SIZE)
        scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32))
        check_block_scales(self.name, scales, sender)
        packed = torch.frombuffer(bytearray(data[4 * nb :]), dtype=torch.uint8) if numel else torch.zeros(0, dtype=torch.uint8)
        return self.dequantize(scales, packed, numel)


@register_codec
class E3M0Codec(Blockwise4BitCodec):
    """Sign + 3-bit exponent, no mantissa: ``x ≈ ±absmax * 2^(e-7)``, e = 1..7, e = 0 is zero."""

    name = "e3m0"
    codec_id = 2
    codebook = _E3M0_CODEBOOK
    relative_error_bound = _half_widest_gap(_E3M0_CODEBOOK) + _ROUNDING_SLACK
    exponent_codes = True


@register_codec
class NF4Codec(Blockwise4BitCodec):
    """NormalFloat4 (QLoRA) with a per-64-value absmax scale."""

    name = "nf4"
    codec_id = 3
    codebook = _NF4_CODEBOOK
    relative_error_bound = _half_widest_gap(_NF4_CODEBOOK) + _ROUNDING_SLACK


@register_codec
class FP4Codec(Blockwise4BitCodec):
    """bitsandbytes FP4 (E2M1, normalised to absmax 1) with a per-64-value absmax scale."""

    name = "fp4"
    codec_id = 4
    codebook = _FP4_CODEBOOK
    relative_error_bound = _half_widest_gap(_FP4_CODEBOOK) + _ROUNDING_SLACK

