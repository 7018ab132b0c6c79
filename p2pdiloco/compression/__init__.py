"""Codecs for what goes on the wire. Importing this package registers every codec."""
from .base import CODECS, Codec, codec_by_id, get_codec, register_codec
from . import fp  # noqa: F401  (registers fp32, fp16)
from . import quant4  # noqa: F401  (registers e3m0, nf4, fp4)
from . import quant2  # noqa: F401  (registers q2)
from . import quant1  # noqa: F401  (registers q1)
from . import sparse  # noqa: F401  (registers sparse)

__all__ = ["Codec", "CODECS", "get_codec", "codec_by_id", "register_codec"]
