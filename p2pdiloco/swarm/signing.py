"""Who wrote a DHT record: owner keys and signatures, checked by every node that stores or reads it.

A protected record names its owner's public key, in OpenSSH format, in its key or subkey as
``[owner:<key>]``, and its value ends with ``[signature:<base64>]`` over (key, subkey, value,
expiration). This is the layout of hivemind's ``RSASignatureValidator``, whose RSA records
(``ssh-rsa``, PSS/SHA-256, public exponent 65537) stay byte for byte the same here; :class:`OwnerSignatures` also takes
**Ed25519** owners (``ssh-ed25519``), which is what new identities are (:mod:`p2pdiloco.identity`).
An Ed25519 record carries ~190 bytes of key and signature where an RSA-2048 one carries ~750, and the
DHT answers every read with every owner's record: most of the control traffic is these bytes.

A peer id names the owner too: libp2p derives it from the same public key (RSA: a SHA-256
multihash of it; Ed25519: the key itself, inline), so readers map a record to the peer that wrote
it without trusting anything the record says (:func:`p2pdiloco.identity.peer_id_of_public_key`).

The signature is read only where the signer puts it: the value's suffix. hivemind's validator
searches the whole value for ``[signature:...]`` and wants exactly one, so a value whose text
holds that marker anywhere (a failure reason quoting another peer's message) would fail on every
node; here text inside the value is covered by the signature like any other byte. Our own records
never carry the marker in their text anyway (:func:`plain_text` is what a peer runs over strings
it writes about others), so hivemind's validator accepts them too.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import re
from typing import Any, Optional, Tuple

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

__all__ = ["SigningKey", "OwnerSignatures", "load_public_key", "serialize_record", "verify", "split_signature",
           "plain_text", "RSA_PUBLIC_EXPONENT"]

_OWNER_RE = re.compile(re.escape(b"[owner:") + rb"(.+?)" + re.escape(b"]"))
_SIGNATURE_MARK = b"[signature:"
#: the signature suffix, matched from the last ``[signature:`` of a value to its very end (base64 has no ``[``)
_SIGNATURE_SUFFIX_RE = re.compile(re.escape(_SIGNATURE_MARK) + rb"([A-Za-z0-9+/]+={0,2})" + re.escape(b"]"))
#: the only RSA public exponent an owner key may have (what every RSA key generator uses): verification
#: costs grow with the exponent's size, so an owner choosing a huge one would slow every node that checks it
RSA_PUBLIC_EXPONENT = 65537
_RSA_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class SigningKey:
    """A peer's private key (RSA or Ed25519, a ``cryptography`` key object) for signing records."""

    def __init__(self, private_key: Any):
        if not isinstance(private_key, (rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey)):
            raise TypeError(f"an RSA or Ed25519 private key is needed, not {type(private_key).__name__}")
        self.private_key = private_key
        #: the public key in OpenSSH format (``ssh-rsa ...`` or ``ssh-ed25519 ...``)
        self.ssh_public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    @classmethod
    def generate(cls, kind: str = "ed25519") -> "SigningKey":
        if kind == "ed25519":
            return cls(ed25519.Ed25519PrivateKey.generate())
        if kind == "rsa":
            return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))
        raise ValueError(f"unknown key kind {kind!r} (ed25519 or rsa)")

    @property
    def kind(self) -> str:
        return "rsa" if isinstance(self.private_key, rsa.RSAPrivateKey) else "ed25519"

    def sign(self, data: bytes) -> bytes:
        """The base64 signature of ``data``."""
        if isinstance(self.private_key, rsa.RSAPrivateKey):
            return base64.b64encode(self.private_key.sign(data, _RSA_PADDING, hashes.SHA256()))
        return base64.b64encode(self.private_key.sign(data))


@functools.lru_cache(maxsize=4096)
def load_public_key(ssh_public_key: bytes) -> Optional[Any]:
    """The public key of an OpenSSH-format key when it may own records (Ed25519, or RSA of 2048 to 8192
    bits with public exponent 65537), else None."""
    try:
        key = serialization.load_ssh_public_key(ssh_public_key)
    except Exception:
        return None
    if isinstance(key, rsa.RSAPublicKey):
        ok = 2048 <= key.key_size <= 8192 and key.public_numbers().e == RSA_PUBLIC_EXPONENT
        return key if ok else None
    return key if isinstance(key, ed25519.Ed25519PublicKey) else None


def verify(ssh_public_key: bytes, data: bytes, signature_b64: bytes) -> bool:
    """Whether ``signature_b64`` is the owner's signature of ``data`` (False for any malformed input)."""
    key = load_public_key(bytes(ssh_public_key))
    if key is None:
        return False
    try:
        signature = base64.b64decode(signature_b64, validate=True)
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, _RSA_PADDING, hashes.SHA256())
        else:
            key.verify(signature, data)
        return True
    except (ValueError, exceptions.InvalidSignature):
        return False


def split_signature(value: bytes) -> Tuple[bytes, Optional[bytes]]:
    """(what was signed, the base64 signature) of a signed value: the signature is the suffix
    ``[signature:<base64>]`` that :meth:`OwnerSignatures.sign_value` appends; (value, None) when the
    value does not end with one. Markers elsewhere in the value are its content, not signatures."""
    at = value.rfind(_SIGNATURE_MARK)
    match = _SIGNATURE_SUFFIX_RE.fullmatch(value, at) if at >= 0 else None
    return (value[:at], match.group(1)) if match else (value, None)


#: characters a peer's own records never carry in text it writes about others (see plain_text)
_RECORD_SYNTAX = str.maketrans({"[": "(", "]": ")"})


def plain_text(text: Any, limit: int) -> str:
    """``text`` made safe to store in our own record: square brackets become parentheses,
    so no record marker (``[signature:``, ``[owner:``) survives; control characters and runs of
    whitespace become one space; at most ``limit`` characters (cut with an ellipsis). For every string
    a peer writes about what others told it (an owner's abort reason in a failed round's entry)."""
    text = str(text)[:4 * limit + 64]  # bounded work however long the text we were sent
    text = "".join(c if c.isprintable() else " " for c in text).translate(_RECORD_SYNTAX)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:max(0, limit - 1)] + "…"
    return text


def serialize_record(record: DHTRecord) -> bytes:
    """The bytes a signature covers (hivemind's: msgpack of key, subkey, value, expiration)."""
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


class OwnerSignatures(RecordValidatorBase):
    """The DHT validator for owner-signed records (see the module docstring); ``key`` signs ours.

    A record that names no owner is not protected here (another validator decides); one that names
    two different owners, does not end with a signature, or whose signature does not verify is
    refused on store and dropped on read. The signature is the value's suffix only
    (:func:`split_signature`): ``[signature:...]`` anywhere else in the value is signed content.
    """

    def __init__(self, key: SigningKey):
        self.key = key
        self.local_public_key: bytes = b"[owner:" + key.ssh_public_key + b"]"

    def validate(self, record: DHTRecord) -> bool:
        owners = _OWNER_RE.findall(record.key) + (_OWNER_RE.findall(record.subkey) if record.subkey is not None else [])
        if not owners:
            return True
        if len(set(owners)) > 1:
            return False
        signed, signature = split_signature(record.value)
        if signature is None:
            return False
        return verify(owners[0], serialize_record(dataclasses.replace(record, value=signed)), signature)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.local_public_key not in record.key and self.local_public_key not in record.subkey:
            return record.value
        return record.value + b"[signature:" + self.key.sign(serialize_record(record)) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        return split_signature(record.value)[0]

    @property
    def priority(self) -> int:
        return 10  # before the validators that read the value (they see it with the signature stripped)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerSignatures)  # one signer per DHT: the first one's key signs
