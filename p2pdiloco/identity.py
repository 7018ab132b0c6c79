"""Peer identity files: stable peer ids from private keys kept safely on disk.

Rules (reliability.md row 15): a key file is created with mode 0600; an existing one readable or
writable by group/others is refused; two processes cannot use one key file at the same time (an
exclusive ``flock`` on ``<key>.lock`` held for the life of the process). hivemind's key format
(a protobuf-wrapped RSA key) is reused so its daemon can load the file directly.

The same RSA key signs this peer's DHT records (:mod:`p2pdiloco.swarm.records`): a libp2p peer id
is the hash of its public key, so anyone can check that a record was written by the peer it names.
A peer started without an identity file gets an *ephemeral* key: written 0600 into a fresh 0700
temporary directory for the daemon to read at start-up, then deleted (:func:`ephemeral_identity`).
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from typing import Any, Optional

from .errors import IdentityError

__all__ = ["prepare_identity", "release_identity", "ephemeral_identity", "discard_ephemeral", "load_signing_key",
           "peer_id_of_public_key"]

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



def ephemeral_identity() -> str:
    """A fresh key file (0600 in a new 0700 directory) for a peer without a stable identity.

    Call :func:`discard_ephemeral` once the daemon has read it: the key then lives only in memory.
    """
    from hivemind.p2p import P2P

    directory = tempfile.mkdtemp(prefix="p2pdiloco-id-")  # created 0700
    path = os.path.join(directory, "identity.key")
    old = os.umask(0o077)
    try:
        P2P.generate_identity(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    atexit.register(discard_ephemeral, path)  # also gone if start-up fails
    return path


def discard_ephemeral(path: str) -> None:
    """Delete an ephemeral key file and its directory (after the daemon started)."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def load_signing_key(path: str) -> Any:
    """The RSA private key of an identity file, as hivemind's ``RSAPrivateKey`` (for record signing)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        with open(path, "rb") as f:
            pb = crypto_pb2.PrivateKey.FromString(f.read())
        if pb.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_der_private_key(pb.data, password=None)
    except Exception:
        raise IdentityError(
            f"identity file {path} is not a usable RSA private key; move it away to let p2pdiloco create a new one"
        ) from None
    return key


@functools.lru_cache(maxsize=4096)
def peer_id_of_public_key(ssh_public_key: bytes) -> Optional[str]:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH format, or None if it is not one.

    libp2p: peer id = multihash(sha2-256, protobuf PublicKey{RSA, DER SubjectPublicKeyInfo}).
    """
    try:
        import multihash
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from hivemind.p2p import PeerID
        from hivemind.proto import crypto_pb2

        key = serialization.load_ssh_public_key(ssh_public_key)
        if not isinstance(key, rsa.RSAPublicKey) or not 2048 <= key.key_size <= 8192:
            return None
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
        return PeerID(digest).to_base58()
    except Exception:
        return None
