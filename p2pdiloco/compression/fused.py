"""One-pass CPU kernels for the 4-bit blockwise codecs (quant4.py), compiled by numba.

The torch path of ``Blockwise4BitCodec`` encodes a chunk in about a dozen passes over memory (absmax,
divide, bin index, threshold compare, code lookup, nibble packing) and decodes in three; on a CPU peer
those passes, not the link, bounded a loopback all-reduce (docs/compression.md). These kernels do the
same arithmetic value by value, one block at a time, in a single pass:

* encode: a block's absmax (fp32), then each value divided by it in fp32 (the very division the torch
  path does) and the code of the nearest codebook value, ties to the smaller one: the number of
  midpoints strictly below the value, as ``torch.bucketize`` counts them. Two codes per byte, high
  nibble first; an odd tail's low nibble is the code of 0.0, as the torch path pads.
* decode: each code's codebook value times its block's scale, one fp32 multiply.

No step rounds differently from the torch path (IEEE division and multiplication, exact comparisons,
no fast-math, nothing an FMA could contract), so the bytes and the decoded values are bitwise those of
the torch path on any CPU: tests/test_codecs.py compares both on random and adversarial input.

A vector of a million values or more is cut into block-aligned slices, one per torch intra-op thread,
coded side by side (the kernels release the GIL), so the kernels use the cores the torch path would.

numba compiles each kernel on its first call in a process (about a second) and keeps the machine code
in its cache (``__pycache__`` next to this file, or ``NUMBA_CACHE_DIR``) for the next process. Without
numba, or with ``P2PDILOCO_FUSED_CODECS=0``, the codecs use the torch path alone.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

__all__ = ["ENV", "kernels", "encode_into", "encode_e3m0_into", "decode_into"]

ENV = "P2PDILOCO_FUSED_CODECS"

_kernels: Any = None
_tried = False


def kernels() -> Optional[Any]:
    """The compiled kernels (``encode``, ``decode``), or None when numba is missing or they are switched off."""
    global _kernels, _tried
    if _tried:
        return _kernels
    _tried = True
    if os.environ.get(ENV, "1") in ("0", ""):
        return None
    try:
        _kernels = _build()
    except Exception:  # no numba (or it cannot compile here): the torch path does the work
        _kernels = None
    return _kernels


def _build() -> Any:
    """Compile the kernels (numba caches them on disk): the bin encoder, E3M0's bit encoder, the decoder."""
    import numba
    from types import SimpleNamespace

    block_absmax = _absmax_kernel(numba)
    encode, encode_e3m0 = _encode_kernels(numba, block_absmax)
    return SimpleNamespace(encode=encode, encode_e3m0=encode_e3m0, decode=_decode_kernel(numba))


def _absmax_kernel(numba) -> Any:
    @numba.njit(cache=True, nogil=True)
    def block_absmax(xbits, start, end, cell_i, cell_f):  # pragma: no cover - compiled
        """(absmax, divisor) of the block ``[start, end)`` from the floats' bits (for finite floats the
        order of |x|'s bits is the order of |x|); divisor 1 for an all-zero block; absmax -1 when the
        block holds inf or NaN. ``cell_i``/``cell_f``: one int32 and its float32 view."""
        mbits = 0
        for i in range(start, end):
            mbits = max(mbits, xbits[i] & 0x7FFFFFFF)
        if mbits >= 0x7F800000:
            return np.float32(-1.0), np.float32(1.0)
        cell_i[0] = mbits
        m = cell_f[0]
        return m, (m if mbits != 0 else np.float32(1.0))
    return block_absmax


def _encode_kernels(numba, block_absmax) -> Tuple[Any, Any]:
    @numba.njit(cache=True, nogil=True)
    def encode(x, xbits, thresholds, codes, zero_code, scales, packed):  # pragma: no cover - compiled
        """x float32[n] (xbits: the same memory as int32) -> scales float32[ceil(n/64)], packed
        uint8[ceil(n/2)] with the bin encoder of quant4._bin_tables; returns False on a non-finite value."""
        n = x.shape[0]
        nb = (n + 63) // 64
        zero = np.float32(0.0)
        bins = np.float32(512.0)
        offset = np.float32(512.5)
        top = thresholds.shape[0] - 1
        codes_row = np.empty(64, dtype=np.int64)
        cell_i = np.empty(1, dtype=np.int32)
        cell_f = cell_i.view(np.float32)
        for b in range(nb):
            start = b * 64
            end = min(start + 64, n)
            m, safe = block_absmax(xbits, start, end, cell_i, cell_f)
            if m < zero:  # inf or NaN
                return False
            scales[b] = m
            for i in range(start, end):
                xn = x[i] / safe
                k = np.int64(xn * bins + offset)
                k = min(max(k, 0), top)
                codes_row[i - start] = codes[2 * k + (1 if xn > thresholds[k] else 0)]
            cnt = end - start
            if cnt & 1:
                codes_row[cnt] = zero_code  # the padding of an odd tail: the code of 0.0
            for j in range(0, cnt, 2):
                packed[(start + j) >> 1] = np.uint8((codes_row[j] << 4) | codes_row[j + 1])
        return True

    @numba.njit(cache=True, nogil=True)
    def encode_e3m0(x, xbits, scales, packed, qbits):  # pragma: no cover - compiled
        """E3M0 only: the code straight from the bits of x / absmax (no table), the same codes as the
        bin encoder. For |q| in [2^E, 2^(E+1)) with E >= -6 the neighbours are 2^E and 2^(E+1) with the
        midpoint at mantissa 0x400000; in [2^-7, 2^-6) they are 0 and 2^-6 with the midpoint at 2^-7
        (mantissa 0); below 2^-7 the code is 0. A value on a midpoint goes to the smaller value: down
        in magnitude when positive, up when negative. ``qbits``: int32 scratch of 64."""
        n = x.shape[0]
        nb = (n + 63) // 64
        zero = np.float32(0.0)
        q = qbits.view(np.float32)
        cell_i = np.empty(1, dtype=np.int32)
        cell_f = cell_i.view(np.float32)
        for b in range(nb):
            start = b * 64
            end = min(start + 64, n)
            cnt = end - start
            m, safe = block_absmax(xbits, start, end, cell_i, cell_f)
            if m < zero:  # inf or NaN
                return False
            scales[b] = m
            for j in range(cnt):
                q[j] = x[start + j] / safe
            if cnt & 1:
                qbits[cnt] = 0  # the padding of an odd tail: 0.0, code 0
            for j in range(0, cnt + (cnt & 1), 2):
                pair = 0
                for h in range(2):
                    bits = qbits[j + h]
                    neg = 1 if bits < 0 else 0
                    mag = bits & 0x7FFFFFFF
                    ex = (mag >> 23) - 127
                    mant = mag & 0x7FFFFF
                    if ex >= -6:
                        e = ex + 7 + (1 if mant + neg > 0x400000 else 0)
                    elif ex == -7:
                        e = 1 if mant + neg > 0 else 0
                    else:
                        e = 0
                    code = e + 8 * neg if e > 0 else 0
                    pair = (pair << 4) | code
                packed[(start + j) >> 1] = np.uint8(pair)
        return True
    return encode, encode_e3m0


def _decode_kernel(numba) -> Any:
    @numba.njit(cache=True, nogil=True)
    def decode(scales, packed, codebook, out):  # pragma: no cover - compiled
        """scales float32[nb], packed uint8[ceil(n/2)], codebook float32[16] -> out float32[n]; returns
        False on a negative or non-finite scale (out then partly written)."""
        n = out.shape[0]
        nb = scales.shape[0]
        for b in range(nb):
            s = scales[b]
            if not (s >= np.float32(0.0) and s <= np.float32(3.4028234663852886e38)):
                return False
            start = b * 64
            end = min(start + 64, n)
            for i in range(start, end):
                byte = np.int64(packed[i >> 1])
                code = (byte >> 4) if (i & 1) == 0 else (byte & 15)
                out[i] = codebook[code] * s
        return True
    return decode


#: below this many values a vector is coded on the calling thread alone
PARALLEL_MIN = 1 << 20
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _slices(n: int) -> List[Tuple[int, int]]:
    """``[start, end)`` of the block-aligned slices a vector of ``n`` values is coded in: as many as
    torch's intra-op threads (the kernels release the GIL), one below :data:`PARALLEL_MIN`."""
    import torch

    parts = max(1, min(torch.get_num_threads(), n // PARALLEL_MIN)) if n >= PARALLEL_MIN else 1
    step = -(-n // parts)
    step += -step % 64
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _run(fn: Callable[[int, int], bool], n: int) -> bool:
    """``fn`` over the slices of a vector of ``n`` values, side by side on a small thread pool."""
    global _pool
    slices = _slices(n)
    if len(slices) == 1:
        return fn(0, n)
    with _pool_lock:
        if _pool is None or _pool._max_workers < len(slices):  # noqa: SLF001 - sized once per thread count
            _pool = ThreadPoolExecutor(max_workers=len(slices), thread_name_prefix="p2pdiloco-codec")
        pool = _pool
    return all(f.result() for f in [pool.submit(fn, a, b) for a, b in slices])


def encode_into(k: Any, x: np.ndarray, thresholds: np.ndarray, codes: np.ndarray, zero_code: int,
                scales: np.ndarray, packed: np.ndarray) -> bool:
    """Encode float32 ``x`` (contiguous) into ``scales`` and ``packed`` with the bin tables of
    ``quant4._bin_tables``; False when ``x`` holds a non-finite value."""
    xb, zc = x.view(np.int32), np.int64(zero_code)
    return _run(lambda a, b: bool(k.encode(x[a:b], xb[a:b], thresholds, codes, zc, scales[a // 64: -(-b // 64)],
                                           packed[a // 2: (b + 1) // 2])), x.shape[0])


def encode_e3m0_into(k: Any, x: np.ndarray, scales: np.ndarray, packed: np.ndarray) -> bool:
    """E3M0's encoder from the exponent bits (no table lookups); the same bytes as :func:`encode_into`."""
    xb = x.view(np.int32)
    return _run(lambda a, b: bool(k.encode_e3m0(x[a:b], xb[a:b], scales[a // 64: -(-b // 64)], packed[a // 2: (b + 1) // 2],
                                                np.empty(64, dtype=np.int32))), x.shape[0])


def decode_into(k: Any, scales: np.ndarray, packed: np.ndarray, codebook: np.ndarray, out: np.ndarray) -> bool:
    return _run(lambda a, b: bool(k.decode(scales[a // 64: -(-b // 64)], packed[a // 2: (b + 1) // 2], codebook,
                                           out[a:b])), out.shape[0])
