"""A 1-bit blockwise codec, ``q1``: a sign per value and one magnitude per block.

Byte layout (independent of any library, like :mod:`.quant2` and :mod:`.quant4`)::

    [ scales: ceil(n/64) x float32, little-endian ][ signs: ceil(n/8) bytes ]

* Blocks are 64 consecutive values (the last may be shorter); a block's scale is the mean of its
  values' magnitudes, summed in float64 and rounded once to fp32, so a value costs 1 + 0.5 bits
  (21.3x fewer bytes than fp32).
* Bit ``b`` decodes to ``(+1 if b else -1) * scale``: one fp32 multiply, bitwise the same on every
  machine. A value >= 0 (zero included) encodes as 1.
* Eight bits per byte, value ``8i`` in the highest bit; the padding bits of a last partial byte are
  1 and ignored by the decoder.

The mean magnitude is the scale that minimises a block's squared error among ``±s`` codes (the
derivative of ``Σ (|x| − s)²``). The error per value is at most the block's absmax (a value near zero
decodes to ``±s``, a large one to ``s``), so the codec is meant for what error feedback follows:
``compression.feedback_form = model`` keeps what it drops in the peer's model, and the next round
sends it again.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .base import ScaledBlocks, register_codec

__all__ = ["Q1Codec"]

_ROUNDING_SLACK = 2.0**-20


@register_codec
class Q1Codec(ScaledBlocks):
    """Blockwise sign codec with the block's mean magnitude as scale (layout in the module docstring)."""

    name = "q1"
    codec_id = 6
    code_bits = 1
    codebook = [-1.0, 1.0]
    relative_error_bound = 1.0 + _ROUNDING_SLACK

    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scales fp32 [nblocks], packed uint8 [ceil(n/8)])`` on ``x``'s device; ``ValueError`` on
        non-finite input."""
        x, nb, xb = self._blocks(x)
        n, bs = x.numel(), self.block_size
        counts = torch.full((nb,), float(bs), dtype=torch.float64, device=x.device)
        if nb and n % bs:
            counts[-1] = n % bs
        scales = (xb.double().abs().sum(dim=1) / counts).float() if nb else x.new_zeros(0)
        if not bool(torch.isfinite(scales).all()):
            raise ValueError("q1: cannot encode non-finite values")
        return scales, self._pack(x >= 0, pad=1)
