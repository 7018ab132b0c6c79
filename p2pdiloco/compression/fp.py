"""Lossless fp32 and half-precision fp16 codecs (the uncompressed baselines)."""
from __future__ import annotations

import torch

from .base import Codec, register_codec

__all__ = ["Float32Codec", "Float16Codec"]


@register_codec
class Float32Codec(Codec):
    name = "fp32"
    codec_id = 0
    relative_error_bound = 0.0

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        return x.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()

    def _decode(self, data: bytes, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(bytearray(data), dtype=torch.float32, count=numel)


@register_codec
class Float16Codec(Codec):
    name = "fp16"
    codec_id = 1
    relative_error_bound = 2.0**-11

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().to("cpu", torch.float32).clamp(-65504.0, 65504.0)
        return x.to(torch.float16).contiguous().numpy().tobytes()

    def _decode(self, data: bytes, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(bytearray(data), dtype=torch.float16, count=numel).float()
