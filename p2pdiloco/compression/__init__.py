"""Codecs for what goes on the wire. Importing this package registers every codec."""
from .base import CODECS, Codec, codec_by_id, get_codec, register_codec
from . import fp  # noqa: F401  (registers fp32, fp16)

__all__ = ["Codec", "CODECS", "get_codec", "codec_by_id", "register_codec"]
