"""The codec interface: how a flat fp32 vector becomes bytes on the wire and back.

A codec is stateless and deterministic: ``decode(encode(x))`` is a pure function of ``x``, so the
owner of a shard can encode the mean once and every peer that decodes those bytes holds bitwise
identical values. ``encoded_size(n)`` is exact: the receiving side checks the byte length against it
*before* decoding or allocating anything, which is how malformed parts are rejected.

Codec ids are part of the wire protocol (one byte in every part header): never renumber them.
"""
from __future__ import annotations

import abc
from typing import Dict, Optional, Tuple, Type

import numpy as np
import torch

from ..errors import ConfigError, WireError

__all__ = ["Codec", "ScaledBlocks", "register_codec", "get_codec", "codec_by_id", "CODECS", "check_block_scales"]


def check_block_scales(codec: str, scales: torch.Tensor, sender: str | None = None) -> None:
    """Raise :class:`WireError` naming ``sender`` unless every block scale of a ``codec`` part is >= 0 and
    finite: a block codec's decoded values are then finite (its codebook is bounded), so the scales are
    all it checks."""
    if not bool(((scales >= 0) & (scales < float("inf"))).all()):  # NaN fails this too
        raise WireError(f"{codec} part has a negative or non-finite block scale", sender)


class Codec(abc.ABC):
    #: short name used in configs, e.g. "fp32", "fp16", "e3m0", "nf4", "fp4"
    name: str = ""
    #: stable wire id (0..255)
    codec_id: int = -1
    #: bound on |decode(encode(x)) - x| relative to a block's absmax, documented per codec (0 = lossless)
    relative_error_bound: float = 0.0
    #: values per independently encoded block (1 = element-wise). The all-reduce starts every shard
    #: at a multiple of this, so ``roundtrip(x)`` of a whole vector equals what the shards' owners
    #: decode: a compressor can then compute its own contribution exactly (error feedback).
    block_size: int = 1
    #: the owner's reply relays the members' parts as they came (each member then averages them the
    #: same way) instead of one re-encoding of the mean: for a codec whose mean is not in its own
    #: format (the sum of several top-k parts, :mod:`.sparse`)
    relays_parts: bool = False

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes ``encode`` produces for ``numel`` fp32 values."""

    def reply_size(self, numel: int, members: int) -> int:
        """Bytes of an owner's reply for ``numel`` values averaging ``members`` parts."""
        return self.members_factor(members) * self.encoded_size(numel)

    def members_factor(self, members: int) -> int:
        return members if self.relays_parts else 1

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Encode a 1-D fp32 tensor (any device) to bytes."""

    @abc.abstractmethod
    def _decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Decode bytes of exactly ``encoded_size(numel)`` bytes to a 1-D fp32 CPU tensor."""

    def check_length(self, data: bytes, numel: int, sender: str | None = None) -> None:
        """Raise :class:`WireError` naming ``sender`` unless ``data`` is exactly ``encoded_size(numel)`` bytes."""
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise WireError(f"{self.name} part has {len(data)} bytes, expected {expected} for {numel} values", sender)

    def decode(self, data: bytes, numel: int, sender: str | None = None) -> torch.Tensor:
        """Validate then decode; raises :class:`WireError` naming ``sender`` on any mismatch."""
        self.check_length(data, numel, sender)
        out = self._decode(data, numel)
        # Fast path: a finite sum implies every value is finite (NaN and inf propagate); only when the
        # sum is not finite (a bad value, or a legitimate overflow of the sum) scan element-wise.
        if not torch.isfinite(out.sum(dtype=torch.float32)) and not torch.isfinite(out).all():
            raise WireError(f"{self.name} part decodes to non-finite values", sender)
        return out

    def decode_into(self, data: bytes, out: torch.Tensor, sender: str | None = None) -> None:
        """Decode ``data`` into ``out`` (a contiguous 1-D fp32 CPU tensor of the chunk's values),
        raising :class:`WireError` naming ``sender`` when the length is not exact. Finiteness is the
        caller's to check (the all-reduce does it in the same pass as the part's norm)."""
        numel = out.numel()
        self.check_length(data, numel, sender)
        if numel:
            out.copy_(self._decode(data, numel))

    def encode_view(self, x: torch.Tensor):
        """``encode(x)`` as any bytes-like object, valid until ``x`` changes: what the all-reduce writes
        to a stream (the lossless codec hands out the tensor's own memory instead of a copy)."""
        return self.encode(x)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a peer sees after ``x`` crossed the wire (used to treat one's own part like others')."""
        return self._decode(self.encode(x), x.numel())


CODECS: Dict[str, Codec] = {}
_BY_ID: Dict[int, Codec] = {}


class ScaledBlocks(Codec):
    """A codec whose bytes are one fp32 scale per block (little-endian), then the packed codes: its
    subclass gives :meth:`quantize` (``(scales, packed uint8)``) and :meth:`dequantize`, and this class
    turns them into bytes and back, validating the scales before anything is decoded. ``code_bits``
    bits per value, the first value of a byte in its highest bits (:meth:`_pack`); code ``c`` decodes
    to ``codebook[c] * scale``."""

    block_size = 64
    code_bits = 8
    codebook: list = []

    def __init__(self) -> None:
        per, mask = 8 // self.code_bits, (1 << self.code_bits) - 1
        shifts = [(per - 1 - i) * self.code_bits for i in range(per)]
        book, byte = torch.tensor(self.codebook, dtype=torch.float32), torch.arange(256)
        self._shifts = torch.tensor(shifts, dtype=torch.int32)
        # a byte -> its 8 // code_bits codebook values, first value first
        self._lut = torch.stack([book[(byte >> s) & mask] for s in shifts], dim=1).contiguous()

    def _pack(self, codes: torch.Tensor, pad: int) -> torch.Tensor:
        """``codes`` (integers below ``2**code_bits``, one per value) as bytes, the first value in the
        highest bits; a last partial byte is filled with ``pad`` codes."""
        per = 8 // self.code_bits
        codes = torch.nn.functional.pad(codes.to(torch.int32), (0, -codes.numel() % per), value=pad).view(-1, per)
        return (codes << self._shifts.to(codes.device)).sum(dim=1, dtype=torch.int32).to(torch.uint8)

    def encoded_size(self, numel: int) -> int:
        return 4 * (-(-numel // self.block_size)) + (numel * self.code_bits + 7) // 8

    def _blocks(self, x: torch.Tensor) -> Tuple[torch.Tensor, int, torch.Tensor]:
        """``(x flat fp32, number of blocks, x zero-padded to [nblocks, block_size])``."""
        x = x.detach().reshape(-1).float()
        nb = -(-x.numel() // self.block_size)
        return x, nb, torch.nn.functional.pad(x, (0, nb * self.block_size - x.numel())).view(nb, self.block_size)

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scales fp32 [nblocks], packed uint8)`` on ``x``'s device; ``ValueError`` on non-finite input."""

    def dequantize(self, scales: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """Inverse of :meth:`quantize` (on the tensors' device): fp32 ``[numel]``."""
        nb, bs = scales.numel(), self.block_size
        vals = self._lut.to(packed.device).index_select(0, packed.to(torch.int32)).view(-1)
        vals = torch.nn.functional.pad(vals, (0, max(0, nb * bs - vals.numel())))[: nb * bs]
        return vals.view(nb, bs).mul_(scales.view(nb, 1)).view(-1)[:numel]

    def encode(self, x: torch.Tensor) -> bytes:
        scales, packed = self.quantize(x)
        return scales.cpu().numpy().astype("<f4", copy=False).tobytes() + packed.cpu().numpy().tobytes()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        scales, packed = self.quantize(x)
        return self.dequantize(scales, packed, x.numel()).cpu()

    def decode(self, data: bytes, numel: int, sender: Optional[str] = None) -> torch.Tensor:
        """Validate then decode: the output is finite exactly when every scale is (the codebook is
        bounded), so the scales alone are checked."""
        self.check_length(data, numel, sender)
        return self._decode(data, numel, sender)

    def _decode(self, data: bytes, numel: int, sender: Optional[str] = None) -> torch.Tensor:
        nb = -(-numel // self.block_size)
        scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32))
        check_block_scales(self.name, scales, sender)
        packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 * nb).copy())
        return self.dequantize(scales, packed, numel)

    def decode_into(self, data: bytes, out: torch.Tensor, sender: Optional[str] = None) -> None:
        self.check_length(data, out.numel(), sender)
        if out.numel():
            out.copy_(self._decode(data, out.numel(), sender))


def register_codec(cls: Type[Codec]) -> Type[Codec]:
    inst = cls()
    if inst.name in CODECS or inst.codec_id in _BY_ID:
        raise RuntimeError(f"codec {inst.name}/{inst.codec_id} registered twice")
    CODECS[inst.name] = inst
    _BY_ID[inst.codec_id] = inst
    return cls


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}") from None


def codec_by_id(codec_id: int, sender: str | None = None) -> Codec:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise WireError(f"unknown codec id {codec_id}", sender) from None
