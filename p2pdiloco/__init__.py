"""p2pdiloco: peer-to-peer, low-communication (DiLoCo) training of language models by volunteers.

The public API is what ``__all__`` lists; everything else is internal and may change.
"""
from .api import join_swarm, leave_swarm, model_signature
from .config import RunConfig, load_config
from .data import BatchStream, Corpus, DataConfig, evaluate, load_corpus
from .diloco.core import DiLoCo, SyncReport
from .errors import (
    CheckpointError,
    ConfigError,
    P2PDilocoError,
    SyncFailed,
    UserError,
    WireError,
)
from .model import GPT, ModelConfig, build_model

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # training
    "DiLoCo",
    "SyncReport",
    "join_swarm",
    "leave_swarm",
    "model_signature",
    # configuration
    "RunConfig",
    "load_config",
    # model and data
    "GPT",
    "ModelConfig",
    "build_model",
    "DataConfig",
    "Corpus",
    "load_corpus",
    "BatchStream",
    "evaluate",
    # errors
    "P2PDilocoError",
    "UserError",
    "ConfigError",
    "CheckpointError",
    "SyncFailed",
    "WireError",
]
