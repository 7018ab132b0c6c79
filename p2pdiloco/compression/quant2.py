"""A 2-bit blockwise codec, ``q2``: for what is sent alongside error feedback that keeps the loss.

Byte layout (independent of any library, like the 4-bit codecs of :mod:`.quant4`)::

    [ scales: ceil(n/64) x float32, little-endian ][ codes: ceil(n/4) bytes ]

* Blocks are 64 consecutive values (the last may be shorter); a block's scale is its absmax (fp32,
  exact), so a value costs 2 + 0.5 bits.
* Code ``c`` (0..3) decodes to ``CODEBOOK[c] * scale`` with ``CODEBOOK = (-1, -1/4, 1/4, 1)``: one
  fp32 multiply, bitwise the same on every machine.
* Four codes per byte, value ``4i`` in the two highest bits; the padding codes of a last partial byte
  are the encoder's code for the smallest magnitude and are ignored by the decoder.
* Encoding rounds ``x / absmax`` to the nearest codebook value (ties to the smaller value). The widest
  gap, 1/4 to 1, bounds the error by 3/8 of the block's absmax (plus 2^-20 for fp32 rounding).

The magnitudes {1/4, 1} minimise the mean squared error of a 64-value Gaussian block normalised by its
absmax among codebooks of the form (-1, -a, a, 1) (measured on 20,000 blocks: a = 0.25, MSE 0.031 of a
signal power 0.155; a = 1/3 gives 0.036, a ternary -1, 0, 1 gives 0.076). There is no zero: a block of
many small values and one large one sends the small ones as a quarter of the large, which is what an
error-feedback buffer is for (the codec is lossy per value by design; ``compression.feedback_form =
model`` keeps what it drops in the peer's model).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .base import ScaledBlocks, register_codec

__all__ = ["Q2Codec", "CODEBOOK"]

CODEBOOK = (-1.0, -0.25, 0.25, 1.0)
_ROUNDING_SLACK = 2.0**-20


@register_codec
class Q2Codec(ScaledBlocks):
    """Blockwise absmax 2-bit codec over (-1, -1/4, 1/4, 1) (layout in the module docstring)."""

    name = "q2"
    codec_id = 5
    code_bits = 2
    codebook = list(CODEBOOK)
    relative_error_bound = 0.375 + _ROUNDING_SLACK

    def __init__(self) -> None:
        super().__init__()
        cb = torch.tensor(CODEBOOK, dtype=torch.float32)
        self._midpoints = (cb[:-1] + cb[1:]) / 2  # bucketize: index of the nearest value, ties to the smaller

    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scales fp32 [nblocks], packed uint8 [ceil(n/4)])`` on ``x``'s device; ``ValueError`` on
        non-finite input."""
        x, nb, xb = self._blocks(x)
        n = x.numel()
        absmax = xb.abs().amax(dim=1) if nb else x.new_zeros(0)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("q2: cannot encode non-finite values")
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = torch.bucketize(xb / safe[:, None], self._midpoints.to(x.device), right=False).view(-1)
        return absmax, self._pack(codes[:n], pad=1)
