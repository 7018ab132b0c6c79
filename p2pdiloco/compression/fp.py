"""Lossless fp32 and half-precision fp16 codecs (the uncompressed baselines)."""
from __future__ import annotations

import numpy as np
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

    def decode_into(self, data: bytes, out: torch.Tensor, sender: str | None = None) -> None:
        self.check_length(data, out.numel(), sender)
        if out.numel():  # one copy, straight from the received bytes into the destination
            out.numpy().view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)

    def encode_view(self, x: torch.Tensor):
        x = x.detach().to("cpu", torch.float32).contiguous()
        return memoryview(x.numpy()).cast("B") if x.numel() else b""


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
