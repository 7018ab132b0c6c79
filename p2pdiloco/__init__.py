"""p2pdiloco: peer-to-peer, low-communication (DiLoCo) training of language models by volunteers.

The public API is what ``__all__`` lists; everything else is internal and may change.
"""
import importlib
from typing import Any

# Lazy exports (PEP 562): `p2pdiloco bootstrap` and `status` need no torch, so importing the package
# must not import it. Each public name is loaded from its module on first use.
_EXPORTS = {
    "join_swarm": ".api", "leave_swarm": ".api", "model_signature": ".api",
    "RunConfig": ".config", "load_config": ".config",
    "BatchStream": ".data", "Corpus": ".data", "DataConfig": ".data", "evaluate": ".data", "load_corpus": ".data",
    "DiLoCo": ".api", "SyncReport": ".diloco.core",
    "CheckpointError": ".errors", "ConfigError": ".errors", "P2PDilocoError": ".errors", "SyncFailed": ".errors",
    "UserError": ".errors", "WireError": ".errors",
    "GPT": ".model", "ModelConfig": ".model", "build_model": ".model",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'p2pdiloco' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + list(_EXPORTS))


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
