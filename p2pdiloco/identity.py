"""Peer identity files: stable peer ids from private keys kept safely on disk.

Rules: a key file is created with mode 0600; an existing one readable or
writable by group/others is refused; two processes cannot use one key file at the same time (an
exclusive ``flock`` on ``<key>.lock`` held for the life of the process). The file is libp2p's
protobuf-wrapped private key, which the p2p daemon loads directly: new identities are **Ed25519**
(short keys and signatures: every DHT record carries both); RSA files made by earlier versions or by
hivemind keep working.

The lock ends with its process, however it dies: the kernel drops a ``flock`` when the last file
descriptor of it closes, and no fork keeps one (every forked child, e.g. hivemind's DHT process,
closes its copy at once: ``os.register_at_fork``). The lock file also names its holder (pid and
start time) and the holder's helper processes (DHT process, p2p daemon: :func:`note_helpers`); it is
emptied on a clean release. A lock that still names a holder is therefore *stale*, left by a process
that crashed or was killed: the next process logs so and takes it over, after waiting up to
:data:`LEFTOVER_WAIT_S` for that holder's helpers to exit (they do, within a second:
:mod:`p2pdiloco.swarm.lifeline`) and stopping any that did not. A pid is only trusted together with
its start time, so a reused pid is never mistaken for the old holder.

The same key signs this peer's DHT records (:mod:`p2pdiloco.swarm.records`): a libp2p peer id
is derived from its public key, so anyone can check that a record was written by the peer it names.
A peer started without an identity file gets an *ephemeral* key: written 0600 into a fresh 0700
temporary directory for the daemon to read at start-up, then deleted (:func:`ephemeral_identity`).
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .errors import IdentityError

__all__ = ["prepare_identity", "release_identity", "note_helpers", "ephemeral_identity", "discard_ephemeral",
           "load_signing_key", "peer_id_of_public_key", "write_new_key", "LEFTOVER_WAIT_S"]

logger = logging.getLogger(__name__)

#: how long taking over a stale lock waits for the dead holder's helper processes to exit, seconds
LEFTOVER_WAIT_S = 10.0

_LOCKS: Dict[str, int] = {}  # key path -> fd of its lock file, held by this process


def prepare_identity(path: str) -> str:
    """Create the key file if missing (0600), check its permissions, and lock it for this process.

    Returns the absolute path. Raises :class:`IdentityError` with what to do on any problem.
    """
    path = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _lock(path)
    if not os.path.exists(path):
        write_new_key(path)
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
    lock_path = path + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise IdentityError(_in_use_message(path, holder)) from None
    try:
        holder = _read_holder(fd)
        if holder is not None and holder.get("pid") != os.getpid():
            _take_over(lock_path, holder)
        _write_holder(fd, {"pid": os.getpid(), "started": _start_time(os.getpid()), "argv": sys.argv[:6],
                           "helpers": []})
    except BaseException:
        os.close(fd)
        raise
    _LOCKS[path] = fd


def release_identity(path: Optional[str]) -> None:
    """Release the lock of :func:`prepare_identity` (a clean release: the lock file is emptied)."""
    fd = _LOCKS.pop(os.path.abspath(path), None) if path else None
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)


def note_helpers(path: str, pids: Sequence[int]) -> None:
    """Record in the lock file the processes this one started for ``path`` (DHT process, p2p daemon),
    so that a restart after a crash can wait for them or stop them. No-op without the lock."""
    fd = _LOCKS.get(os.path.abspath(path))
    record = _read_holder(fd) if fd is not None else None
    if record is None:
        return
    record["helpers"] = [[pid, _start_time(pid)] for pid in pids]
    _write_holder(fd, record)


def _forget_locks_in_child() -> None:
    """After a fork: the child must not keep the parent's locks alive (the parent's ends with it)."""
    for fd in _LOCKS.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def _start_time(pid: int) -> Optional[float]:
    """Start time of process ``pid`` (seconds since the epoch), None if there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid: Any, started: Any) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (not a reused pid)."""
    import psutil

    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 0.05
    except psutil.Error:
        return False


def _read_holder(fd: int) -> Optional[Dict[str, Any]]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_holder(fd: int, record: Dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _take_over(lock_path: str, holder: Dict[str, Any]) -> None:
    """We hold the lock; the file still names a previous holder, so it ended without releasing it."""
    pid = holder.get("pid")
    what = f"process {pid} ({' '.join(map(str, holder.get('argv') or [])) or 'command unknown'})"
    if _alive(pid, holder.get("started")):
        logger.warning(f"identity lock {lock_path} still names {what}, which runs but no longer holds it; "
                       "taking the lock over")
    else:
        logger.warning(f"identity lock {lock_path} is stale: {what} held it and is no longer running "
                       "(it crashed or was killed); taking the lock over")
    helpers = [h for h in holder.get("helpers") or [] if isinstance(h, list) and len(h) == 2]
    left = [h for h in helpers if _alive(*h)]
    if left:
        logger.warning(f"waiting up to {LEFTOVER_WAIT_S:.0f} s for its leftover processes "
                       f"{', '.join(str(h[0]) for h in left)} to exit")
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [h for h in left if _alive(*h)]
    for h in left:
        logger.warning(f"leftover process {h[0]} of the dead holder did not exit; stopping it (SIGKILL)")
        try:
            os.kill(h[0], signal.SIGKILL)
        except OSError:
            pass


def _lock_holders(lock_path: str) -> List[int]:
    """Pids of other processes (of this user) that have ``lock_path`` open (Linux /proc; else empty)."""
    try:
        target = os.stat(lock_path)
        entries = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                out.append(int(name))
                break
    return out


def _in_use_message(path: str, holder: Optional[Dict[str, Any]]) -> str:
    advice = "each peer needs its own identity file (--set swarm.identity_path=...)"
    if holder is not None and _alive(holder.get("pid"), holder.get("started")):
        return (f"identity {path} is already in use by another p2pdiloco process on this machine "
                f"(pid {holder['pid']}); {advice}")
    holders = _lock_holders(path + ".lock")
    if not holders:  # released meanwhile, or not visible to us
        return f"identity {path} is already in use by another p2pdiloco process on this machine; {advice}"
    pids = " ".join(map(str, holders))
    gone = f" (pid {holder['pid']}, no longer running)" if holder is not None else ""
    return (f"identity {path} is locked by process(es) {pids}, not by the p2pdiloco process that took the "
            f"lock{gone}: if they are left over from a crashed peer (an older p2pdiloco did not stop them), "
            f"stop them and their p2pd children (`kill -9 {pids}`) and start again; otherwise {advice}")


def ephemeral_identity() -> str:
    """A fresh key file (0600 in a new 0700 directory) for a peer without a stable identity.

    Call :func:`discard_ephemeral` once the daemon has read it: the key then lives only in memory.
    """
    directory = tempfile.mkdtemp(prefix="p2pdiloco-id-")  # created 0700
    path = os.path.join(directory, "identity.key")
    write_new_key(path)
    atexit.register(discard_ephemeral, path)  # also gone if start-up fails
    return path


def discard_ephemeral(path: str) -> None:
    """Delete an ephemeral key file and its directory (after the daemon started)."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def write_new_key(path: str) -> None:
    """A new Ed25519 identity key at ``path``, mode 0600 (libp2p's protobuf: 32-byte seed, then the public key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from hivemind.proto import crypto_pb2

    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public).SerializeToString()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)


def load_signing_key(path: str) -> Any:
    """The private key of an identity file (Ed25519 or RSA), as a
    :class:`~p2pdiloco.swarm.signing.SigningKey` for record signing."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from hivemind.proto import crypto_pb2

    from .swarm.signing import SigningKey

    try:
        with open(path, "rb") as f:
            pb = crypto_pb2.PrivateKey.FromString(f.read())
        if pb.key_type == crypto_pb2.KeyType.Ed25519:
            if len(pb.data) != 64:
                raise ValueError("an Ed25519 key is 64 bytes")
            key = ed25519.Ed25519PrivateKey.from_private_bytes(pb.data[:32])
            if key.public_key().public_bytes(serialization.Encoding.Raw,
                                             serialization.PublicFormat.Raw) != pb.data[32:]:
                raise ValueError("the public half does not match the seed")
            return SigningKey(key)
        if pb.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("neither Ed25519 nor RSA")
        return SigningKey(serialization.load_der_private_key(pb.data, password=None))
    except Exception:
        raise IdentityError(
            f"identity file {path} is not a usable Ed25519 or RSA private key; move it away to let p2pdiloco "
            "create a new one"
        ) from None


@functools.lru_cache(maxsize=4096)
def peer_id_of_public_key(ssh_public_key: bytes) -> Optional[str]:
    """The libp2p peer id (base58) of a public key in OpenSSH format, or None if it is not a usable one.

    libp2p: the protobuf PublicKey{type, data}; RSA (data: DER SubjectPublicKeyInfo) is named by its
    sha2-256 multihash, Ed25519 (data: the 32 raw bytes) by the identity multihash (the bytes inline).
    """
    import multihash
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    from .swarm.signing import load_public_key

    key = load_public_key(bytes(ssh_public_key))
    if key is None:
        return None
    if isinstance(key, ed25519.Ed25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=raw).SerializeToString()
        return PeerID(bytes([0x00, len(encoded)]) + encoded).to_base58()  # identity multihash, length < 128
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()
