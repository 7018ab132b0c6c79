"""Record signatures (swarm/signing.py): Ed25519 and RSA owners, what is refused, what it costs on the
wire, and a swarm mixing identities made by this version (Ed25519) and older ones (RSA)."""
from __future__ import annotations

import dataclasses
import os
import threading
import types

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from p2pdiloco.identity import peer_id_of_public_key
from p2pdiloco.swarm.signing import OwnerSignatures, SigningKey, load_public_key, serialize_record

KINDS = ("ed25519", "rsa")
_KEYS = {kind: (SigningKey.generate(kind), SigningKey.generate(kind)) for kind in KINDS}


def _record(owner: bytes, value: bytes = b"v", expiration: float = 1e9, key: bytes = b"run:progress") -> DHTRecord:
    return DHTRecord(key, MSGPackSerializer.dumps(owner), value, expiration)


def _signed(signer: OwnerSignatures, **kw) -> DHTRecord:
    rec = _record(signer.local_public_key, **kw)
    return dataclasses.replace(rec, value=signer.sign_value(rec))


# what each case does to a record its owner signed, and whether a node must accept the result
CASES = [
    ("as signed", lambda r, me, other: r, True),
    ("value changed", lambda r, me, other: dataclasses.replace(r, value=b"w" + r.value[1:]), False),
    ("re-dated (replay)", lambda r, me, other: dataclasses.replace(r, expiration_time=r.expiration_time + 60), False),
    ("signature stripped", lambda r, me, other: dataclasses.replace(r, value=me.strip_value(r)), False),
    ("signed twice", lambda r, me, other: dataclasses.replace(r, value=r.value + r.value[1:]), False),
    ("another key's signature", lambda r, me, other: dataclasses.replace(
        r, value=b"v[signature:" + other.key.sign(serialize_record(_record(me.local_public_key))) + b"]"), False),
    ("two owners", lambda r, me, other: dataclasses.replace(r, key=other.local_public_key), False),
    ("junk owner key", lambda r, me, other: dataclasses.replace(
        r, subkey=MSGPackSerializer.dumps(b"[owner:ssh-ed25519 AAAAjunk]")), False),
    ("no owner (not protected here)", lambda r, me, other: _record(b"plain", value=b"v"), True),
    # the signature is the value's suffix, nothing else: record syntax inside the signed value is content
    ("record syntax in the signed text", lambda r, me, other: _signed(
        me, value=b"v [signature:x] [owner:ssh-ed25519 AAAA] [signature:" + b"A" * 88 + b"] w"), True),
    ("signature moved into the text", lambda r, me, other: dataclasses.replace(
        r, value=r.value[1:] + r.value[:1]), False),
    ("junk after the signature", lambda r, me, other: dataclasses.replace(r, value=r.value + b" "), False),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,mutate,accepted", CASES, ids=[c[0] for c in CASES])
def test_owner_signatures_table(kind, case, mutate, accepted):
    me, other = (OwnerSignatures(k) for k in _KEYS[kind])
    record = _signed(me)
    assert me.validate(record) and other.validate(record)  # any node checks any owner's record
    assert me.validate(mutate(record, me, other)) is accepted


def test_rsa_records_are_the_bytes_hivemind_signs_and_checks():
    """An RSA identity's records are what older p2pdiloco peers (hivemind's RSASignatureValidator) make
    and check: the two accept each other's records."""
    theirs = RSASignatureValidator(RSAPrivateKey())
    ours = OwnerSignatures(SigningKey(theirs._private_key._private_key))
    assert ours.local_public_key == theirs.local_public_key
    rec = _record(theirs.local_public_key)
    signed_by_them = dataclasses.replace(rec, value=theirs.sign_value(rec))
    signed_by_us = dataclasses.replace(rec, value=ours.sign_value(rec))
    assert ours.validate(signed_by_them) and theirs.validate(signed_by_us)
    assert not ours.validate(dataclasses.replace(signed_by_them, value=b"x" + signed_by_them.value))


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_reason_with_record_syntax_leaves_our_record_valid_and_readable(kind):
    """An owner's abort reason lands in every member's own history record (``fw``). Whatever it says,
    the member's record stays valid on every node and readable: no record syntax of the owner's gets
    into it, and its length is bounded. (The validators run as a DHT node runs them.)"""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator
    from hivemind.utils import ValueWithExpiration

    from p2pdiloco.swarm import records
    from p2pdiloco.swarm.swarm import Swarm

    evil = ("owner Qm1234 aborted the round: [signature:x] [owner:ssh-ed25519 AAAA] [signature:"
            + "B" * 88 + "]\x00\n" + "z" * 1000)
    member = types.SimpleNamespace(_history={}, _progress_lock=threading.Lock())
    Swarm.note_failure(member, 3, 0, evil)  # what train/events.py does with a failed round's reason
    reason = member._history["fw"][-1]
    assert "[" not in reason and "]" not in reason and len(reason) <= records.FAIL_REASON_CHARS, reason
    assert reason.startswith("owner Qm1234 aborted the round: (signature:x)"), reason

    book = records.RecordBook(_KEYS[kind][0])
    key = "run:history"
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(book.owner_subkey),
                       MSGPackSerializer.dumps(book.encode(key, member._history)), 1e9)
    record = dataclasses.replace(record, value=book.signer.sign_value(record))
    reader = OwnerSignatures(_KEYS[kind][1])  # another node
    assert CompositeValidator([reader, records.RecordSchema()]).validate(record)
    if kind == "rsa":  # older RSA peers (hivemind's validator, which searches the whole value) accept it too
        assert RSASignatureValidator(RSAPrivateKey()).validate(record)
    stored = MSGPackSerializer.loads(reader.strip_value(record))
    found = ValueWithExpiration({book.owner_subkey: ValueWithExpiration(stored, 1e9)}, 1e9)
    seen = records.RecordBook(_KEYS[kind][1]).decode(key, found)
    assert list(seen.values())[0]["fw"] == [reason] and list(seen) == [book.peer_id]


def _rsa_key_with_exponent(e: int) -> SigningKey:
    """An RSA-2048 private key whose public exponent is ``e`` (the primes of a normal key, d recomputed)."""
    from math import gcd

    from cryptography.hazmat.primitives.asymmetric import rsa

    base = _KEYS["rsa"][0].private_key.private_numbers()
    p, q = base.p, base.q
    phi = (p - 1) * (q - 1)
    while gcd(e, phi) != 1:
        e += 2
    d = pow(e, -1, phi)
    public = rsa.RSAPublicNumbers(e, p * q)
    return SigningKey(rsa.RSAPrivateNumbers(p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q),
                                            rsa.rsa_crt_iqmp(p, q), public).private_key())


@pytest.mark.parametrize("exponent", [3, (1 << 1500) + 1], ids=["e=3", "e of 1501 bits"])
def test_rsa_owner_keys_need_the_public_exponent_65537(exponent):
    """A huge exponent makes every node's check of the owner's records many times slower (and e=3
    is nobody's default): such keys own nothing, even with a signature that verifies."""
    odd = OwnerSignatures(_rsa_key_with_exponent(exponent))
    assert odd.key.private_key.public_key().public_numbers().e != 65537
    assert load_public_key(odd.key.ssh_public_key) is None
    assert peer_id_of_public_key(odd.key.ssh_public_key) is None
    record = _signed(odd)
    assert not odd.validate(record) and not OwnerSignatures(_KEYS["rsa"][1]).validate(record)
    normal = _signed(OwnerSignatures(_KEYS["rsa"][0]))  # control: the same primes with e = 65537
    assert OwnerSignatures(_KEYS["rsa"][1]).validate(normal)


def test_an_ed25519_record_carries_a_quarter_of_the_rsa_overhead():
    """Key and signature bytes per record (every DHT answer carries them for every owner)."""
    overhead = {}
    for kind in KINDS:
        signer = OwnerSignatures(_KEYS[kind][0])
        rec = _signed(signer, value=b"")
        overhead[kind] = len(rec.subkey) + len(rec.value)
    assert overhead["ed25519"] <= 200 and overhead["rsa"] >= 700, overhead


def test_peer_ids_follow_libp2p_for_both_kinds():
    ed, rsa = _KEYS["ed25519"][0], _KEYS["rsa"][0]
    assert peer_id_of_public_key(ed.ssh_public_key).startswith("12D3KooW")  # identity multihash of the key
    assert peer_id_of_public_key(rsa.ssh_public_key).startswith("Qm")  # sha2-256 multihash
    assert peer_id_of_public_key(b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIjunk") is None


@pytest.mark.timeout(120)
def test_a_swarm_of_ed25519_and_rsa_identities_reads_each_others_records(tmp_path):
    """A peer keeping an RSA identity file from an older version and a new (Ed25519) peer: both peer ids
    are what the daemon derives from the file, and each reads the other's signed records."""
    from hivemind.p2p import P2P

    from p2pdiloco.swarm.node import SwarmNode

    old_key = str(tmp_path / "old.key")
    P2P.generate_identity(old_key)  # what earlier versions wrote: RSA
    old = SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=old_key)
    new = SwarmNode(old.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    identity_path=str(tmp_path / "new.key"))
    try:
        assert old.records.signer.key.kind == "rsa" and new.records.signer.key.kind == "ed25519"
        assert old.records.peer_id == old.peer_id_str and new.records.peer_id == new.peer_id_str
        assert old.store("mix:progress", {"step": 1}, ttl=60) and new.store("mix:progress", {"step": 2}, ttl=60)
        for node in (old, new):
            seen = node.get_subkeys("mix:progress")
            assert seen == {old.peer_id_str: {"step": 1}, new.peer_id_str: {"step": 2}}, seen
    finally:
        new.shutdown()
        old.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_a_key_file_copied_to_a_second_peer_is_refused_with_a_clear_message(tmp_path, kind):
    """The local lock stops two processes sharing one file; a copy of the file (another machine) is
    caught by asking the swarm whether our peer id already answers (our check, for both kinds:
    hivemind's reads RSA keys only)."""
    import shutil

    from hivemind.p2p import P2P

    from p2pdiloco.errors import UserError
    from p2pdiloco.identity import write_new_key
    from p2pdiloco.swarm.node import SwarmNode

    original, copy = str(tmp_path / "a.key"), str(tmp_path / "copy.key")
    (P2P.generate_identity if kind == "rsa" else write_new_key)(original)
    shutil.copy(original, copy)
    os.chmod(copy, 0o600)
    first = SwarmNode([], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=original)
    try:
        assert first.records.signer.key.kind == kind
        with pytest.raises(UserError, match="already used by a running peer"):
            SwarmNode(first.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=copy)
        other = SwarmNode(first.visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          identity_path=str(tmp_path / "own.key"))  # control: its own key joins
        other.shutdown()
    finally:
        first.shutdown()


def test_plain_text_makes_what_a_peer_sent_one_safe_line():
    """What other peers tell us reaches our logs and records through plain_text: one line without control
    characters or record markers, cut to the limit however long the text we were sent."""
    from p2pdiloco.swarm.signing import plain_text

    sent = "closed\n12:00:00 INFO fake line\x1b[31m [signature:AAAA] [owner:x]\t\tend"
    out = plain_text(sent, 200)
    assert out == "closed 12:00:00 INFO fake line (31m (signature:AAAA) (owner:x) end"
    assert all(c.isprintable() for c in out) and "[" not in out
    assert plain_text("x" * 10_000_000, 40) == "x" * 39 + "…"
    assert plain_text(None, 10) == "None"
