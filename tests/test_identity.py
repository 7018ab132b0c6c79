"""Identity hygiene.

* key files are created 0600; one readable or writable by others is refused with what to do;
* one key file, two processes: the second refuses (through the real CLI, ``p2pdiloco bootstrap
  --identity same.key`` twice, in tests/test_cli.py::test_bootstrap_identity_addresses_and_clean_shutdown;
  here the lock itself, across two processes);
* default listen addresses are loopback;
* a peer without a key file signs with an ephemeral key that does not stay on disk, and the key
  that signs DHT records is the one that makes the peer id;
* no private key in the repository or in the built package.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
import zipfile

import pytest

from p2pdiloco.errors import IdentityError
from p2pdiloco.identity import (ephemeral_identity, discard_ephemeral, load_signing_key, peer_id_of_public_key,
                                prepare_identity, release_identity, write_new_key)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_key_created_0600_and_unsafe_or_corrupt_keys_refused(tmp_path):
    path = str(tmp_path / "sub" / "peer.key")
    got = prepare_identity(path)
    try:
        assert got == path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path + ".lock").st_mode) & 0o077 == 0
    finally:
        release_identity(path)
    for mode in (0o644, 0o640, 0o604, 0o660, 0o666):
        os.chmod(path, mode)
        with pytest.raises(IdentityError, match=r"accessible by other users .*chmod 600"):
            prepare_identity(path)
        release_identity(path)
    os.chmod(path, 0o600)
    prepare_identity(path)  # fixed: accepted again
    release_identity(path)
    bad = tmp_path / "corrupt.key"
    bad.write_bytes(b"not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="not a valid private key"):
        prepare_identity(str(bad))
    release_identity(str(bad))
    with pytest.raises(IdentityError, match="not a regular file"):
        os.mkdir(tmp_path / "dir.key")
        prepare_identity(str(tmp_path / "dir.key"))


def _hold(path: str, locked, stop) -> None:
    prepare_identity(path)
    locked.set()
    stop.wait(60)


def test_second_process_with_the_same_key_is_refused(tmp_path):
    import multiprocessing

    path = str(tmp_path / "same.key")
    ctx = multiprocessing.get_context("fork")  # a second process with the real code, without re-importing torch
    locked, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, locked, stop), daemon=True)
    holder.start()
    try:
        assert locked.wait(30)
        with pytest.raises(IdentityError, match="already in use by another p2pdiloco process"):
            prepare_identity(path)
    finally:
        stop.set()
        holder.join(10)
        if holder.is_alive():
            holder.kill()
    assert holder.exitcode == 0
    prepare_identity(path)  # the lock dies with its process: no stale lock file problem
    release_identity(path)


def test_default_listen_addresses_are_loopback_unless_the_swarm_is_elsewhere():
    """A bootstrap, and a volunteer whose swarm is on this machine, listen on loopback; a volunteer whose
    initial peer is on another machine listens on every interface (that peer and its swarm must dial it;
    the p2p daemon authenticates every connection), unless told where."""
    from p2pdiloco.addresses import listen_maddrs
    from p2pdiloco.cli import build_parser
    from p2pdiloco.config import BootstrapConfig, RunConfig

    peer = "/p2p/12D3KooWRqEip4Qjkz81uhEjW1R2z3w5fP7f9HkpSDCkpJ7Gvnvt"
    assert RunConfig().swarm.host_maddrs == []
    assert listen_maddrs([], []) == ["/ip4/127.0.0.1/tcp/0"]
    assert listen_maddrs([], ["/ip4/127.0.0.1/tcp/31337" + peer, "/dns/localhost/tcp/1" + peer]) == [
        "/ip4/127.0.0.1/tcp/0"]
    # beyond loopback: TCP and QUIC (a QUIC dial leaves from the listening socket: hole punching)
    assert listen_maddrs([], ["/ip4/127.0.0.1/tcp/31337" + peer, "/ip4/192.0.2.7/tcp/31337" + peer]) == [
        "/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
    assert listen_maddrs([], ["/ip6/2001:db8::7/tcp/31337" + peer]) == ["/ip6/::/tcp/0", "/ip6/::/udp/0/quic-v1"]
    assert listen_maddrs(["/ip4/127.0.0.1/tcp/5"], ["/ip4/192.0.2.7/tcp/31337" + peer]) == ["/ip4/127.0.0.1/tcp/5"]
    assert BootstrapConfig().host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert RunConfig().swarm.announce_maddrs == [] and BootstrapConfig().announce_maddrs == []
    args = build_parser().parse_args(["bootstrap"])
    assert args.host_maddrs is None  # -> BootstrapConfig's loopback default
    # the volunteer configs we ship keep the default (bootstrap/bootstrap.toml is the operator's
    # explicit opt-in for a public bootstrap server, which is "unless the user asks for more")
    for toml in os.listdir(os.path.join(ROOT, "peers")):
        text = open(os.path.join(ROOT, "peers", toml)).read()
        assert "0.0.0.0" not in re.sub(r"#.*", "", text), f"peers/{toml} listens on all interfaces"


@pytest.mark.timeout(120)
def test_ephemeral_key_signs_records_and_leaves_nothing_on_disk(tmp_path):
    from p2pdiloco.swarm.node import SwarmNode

    before = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("p2pdiloco-id-")}
    node = SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        after = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("p2pdiloco-id-")}
        assert after <= before, "the ephemeral key stayed on disk"
        assert node.records.peer_id == node.peer_id_str  # records are signed by the peer id's own key
        assert all("/ip4/127.0.0.1/" in m for m in node.visible_maddrs())
    finally:
        node.shutdown()
    keyed = SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(tmp_path / "id.key"))
    try:
        assert keyed.records.peer_id == keyed.peer_id_str
        assert stat.S_IMODE(os.stat(tmp_path / "id.key").st_mode) == 0o600
    finally:
        keyed.shutdown()


def test_ephemeral_identity_file_is_private_and_discarded():
    path = ephemeral_identity()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        key = load_signing_key(path)
        assert key.kind == "ed25519"  # new identities: short keys and signatures on every record
        assert peer_id_of_public_key(key.ssh_public_key).startswith("12D3KooW")
    finally:
        discard_ephemeral(path)
    assert not os.path.exists(os.path.dirname(path))
    assert peer_id_of_public_key(b"ssh-ed25519 AAAA") is None and peer_id_of_public_key(b"junk") is None


# ---- no private key shipped --------------------------------------------------------------------------
_PEM = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )?PRIVATE KEY-----")
_KEY_NAMES = re.compile(r"(\.key|\.pem|\.p12|\.pfx|(^|/)id_(rsa|ed25519|ecdsa))$")


def _is_private_key(name: str, data: bytes) -> bool:
    if _PEM.search(data) or _KEY_NAMES.search(name):
        return True
    if len(data) < 60 or len(data) > 20000 or b"\x00" not in data and data.isascii():
        return False  # text files are not protobuf keys
    try:  # hivemind / libp2p key files: protobuf PrivateKey wrapping a DER (RSA) or raw (Ed25519) key
        from cryptography.hazmat.primitives import serialization
        from hivemind.proto import crypto_pb2

        pb = crypto_pb2.PrivateKey.FromString(data)
        if pb.key_type == crypto_pb2.KeyType.Ed25519:
            return len(pb.data) == 64
        serialization.load_der_private_key(pb.data, password=None)
        return True
    except Exception:
        return False


def _scan(files):
    return [name for name, data in files if _is_private_key(name, data)]


def test_no_private_key_in_repository_or_package(tmp_path):
    # the detector itself works
    from hivemind.p2p import P2P

    probe, ours = str(tmp_path / "probe"), str(tmp_path / "ours")
    P2P.generate_identity(probe)  # RSA, hivemind's
    write_new_key(ours)  # Ed25519, ours
    assert _is_private_key("probe", open(probe, "rb").read()) and _is_private_key("ours", open(ours, "rb").read())
    assert _is_private_key("x.txt", b"junk\n-----BEGIN RSA " + b"PRIVATE KEY-----\nabc")  # split: not a key here

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    names = [n for n in tracked.decode().split("\0") if n and os.path.isfile(os.path.join(ROOT, n))]
    found = _scan((n, open(os.path.join(ROOT, n), "rb").read()) for n in names)
    assert not found, f"private keys tracked by git: {found}"
    # everything on disk under the package directory, tracked or not (what an install would copy)
    pkg = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "p2pdiloco")):
        for f in files:
            p = os.path.join(dirpath, f)
            pkg.append((os.path.relpath(p, ROOT), open(p, "rb").read()))
    assert not _scan(pkg), f"private keys inside the package directory: {_scan(pkg)}"
    # the built wheel
    src = tmp_path / "src"
    for n in names:
        dst = src / n
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(os.path.join(ROOT, n), "rb").read())
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = list((tmp_path / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        contents = [(i.filename, z.read(i)) for i in z.infolist()]
    assert any(n.endswith("identity.py") for n, _ in contents)
    assert not _scan(contents), f"private keys in the wheel: {_scan(contents)}"
