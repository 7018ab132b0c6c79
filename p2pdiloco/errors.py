"""The one exception hierarchy of p2pdiloco.

    P2PDilocoError                  base of everything raised on purpose
    ├── UserError                   bad input from the person running a command: the CLI prints
    │   │                           the message (no traceback) and exits with status 2
    │   ├── ConfigError             unknown key, wrong type, impossible value, missing file
    │   ├── AddressError            malformed multiaddr
    │   ├── IdentityError           key file unsafe (world-readable) or already in use
    │   ├── BootstrapUnreachable    no initial peer answered within the bounded wait
    │   ├── FingerprintMismatch     this peer's configuration differs from the run's
    │   ├── CheckpointError         missing or corrupt checkpoint
    │   └── JoinFailed              no live peer delivered state matching the swarm's digest: the
    │                               peer stops instead of training on unverified state
    ├── LocalWorkerLost             another local worker of this machine's peer stopped (join
    │                               --local-workers): the peer leaves the swarm; the CLI prints one
    │                               line and exits with status 1
    ├── WireError                   a message from the network failed validation (size, dtype,
    │                               codec, non-finite values, version); carries the sender
    └── SyncFailed                  a sync round could not complete (timeout, peer lost);
        │                           the round is discarded on every peer, nothing partial is applied
        └── MatchmakingFailed       no group could be formed in time
            └── RoundMissed         the round's one group closed without us: catch up (download state)
"""
from __future__ import annotations

from typing import Optional

__all__ = [
    "P2PDilocoError",
    "UserError",
    "ConfigError",
    "AddressError",
    "IdentityError",
    "BootstrapUnreachable",
    "FingerprintMismatch",
    "CheckpointError",
    "JoinFailed",
    "LocalWorkerLost",
    "WireError",
    "SyncFailed",
    "MatchmakingFailed",
    "RoundMissed",
]


class P2PDilocoError(Exception):
    """Base class of every error p2pdiloco raises on purpose."""


class UserError(P2PDilocoError):
    """The user gave something we cannot use; the message says what and what to do."""


class ConfigError(UserError):
    pass


class AddressError(UserError):
    pass


class IdentityError(UserError):
    pass


class BootstrapUnreachable(UserError):
    pass


class FingerprintMismatch(UserError):
    pass


class CheckpointError(UserError):
    pass


class JoinFailed(UserError):
    pass


class LocalWorkerLost(P2PDilocoError):
    """A collective between the local workers of one peer failed: one of them died (or hung past the
    collective timeout). Nothing of the step is applied on this machine; the last checkpoint stands."""


class WireError(P2PDilocoError):
    """Data received from a peer failed validation before it was used."""

    def __init__(self, message: str, sender: Optional[str] = None):
        self.sender = sender
        super().__init__(f"{message} (from peer {sender})" if sender else message)


class SyncFailed(P2PDilocoError):
    """A sync round failed as a whole; no peer applies any part of it."""


class MatchmakingFailed(SyncFailed):
    pass


class RoundMissed(MatchmakingFailed):
    pass
