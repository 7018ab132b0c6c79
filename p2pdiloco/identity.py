"""Peer identity files: stable peer ids from private keys kept safely on disk.

Rules (reliability.md row 15): a key file is created with mode 0600; an existing one readable or
writable by group/others is refused; two processes cannot use one key file at the same time (an
exclusive ``flock`` on ``<key>.lock`` held for the life of the process). hivemind's key format
(a protobuf-wrapped RSA key) is reused so its daemon can load the file directly.
"""
from __future__ import annotations

import fcntl
import os
import stat
from typing import Optional

from .errors import IdentityError

__all__ = ["prepare_identity", "release_identity"]

_LOCKS: dict = {}


def prepare_identity(path: str) -> str:
    """Create the key file if missing (0600), check its permissions, and lock it for this process.

    Returns the absolute path. Raises :class:`IdentityError` with what to do on any problem.
    """
    path = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _lock(path)
    if not os.path.exists(path):
        from hivemind.p2p import P2P

        old = os.umask(0o077)
        try:
            P2P.generate_identity(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
    if not os.path.isfile(path):
        raise IdentityError(f"identity {path} is not a regular file")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"identity key {path} is accessible by other users (mode {mode:o}); "
            f"a private key must be private: run `chmod 600 {path}`"
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
        from hivemind.proto import crypto_pb2

        key = crypto_pb2.PrivateKey.FromString(data)
        if not key.data:
            raise ValueError("empty key")
    except Exception:
        raise IdentityError(
            f"identity file {path} is not a valid private key; move it away to let p2pdiloco create a new one"
        ) from None
    return path


def _lock(path: str) -> None:
    if path in _LOCKS:
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise IdentityError(
            f"identity {path} is already in use by another p2pdiloco process on this machine; "
            "each peer needs its own identity file (--set swarm.identity_path=...)"
        ) from None
    _LOCKS[path] = fd


def release_identity(path: Optional[str]) -> None:
    fd = _LOCKS.pop(os.path.abspath(path), None) if path else None
    if fd is not None:
        os.close(fd)

