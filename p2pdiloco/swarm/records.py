"""Signed, schema-checked DHT records: what a peer publishes, only that peer can write.

Every record p2pdiloco keeps in the DHT is a *dictionary entry* whose subkey is
``[owner:<the writer's public key>]`` (Ed25519, or RSA for older identities; hivemind's
``RSASignatureValidator`` layout: :mod:`p2pdiloco.swarm.signing`). The key that signs is the peer's
libp2p identity key, and a libp2p peer id is derived from that public key, so the subkey *is* the
writer's peer id: readers derive it, nobody can claim it.

Value (msgpack map, at most 64 KiB)::

    {k: kind, s: seq, d: {...fields}}

``kind`` follows from the key (:func:`.keys.kind_of`: progress, fingerprint, ready, group, anything
else generic); ``seq`` grows with every record a peer writes (microseconds since the epoch, kept
strictly increasing); ``d`` must match the kind's pydantic.v1 schema below (strict types: no
conversions); a progress record's fields travel under one- and two-letter names (:data:`WIRE_NAMES`).
Progress records carry the claims other peers act on: step, synced step and state
digest (the state *offer* a joining peer downloads against).

Defences:

* **forged** records: the DHT of every p2pdiloco node (bootstrap peers included) runs
  :class:`~p2pdiloco.swarm.signing.OwnerSignatures` plus :class:`RecordSchema`: a record not signed by the key in its
  subkey, an unsigned record, or one that does not match its schema is refused when someone asks
  us to store it and dropped when another node returns it to us;
* **replayed** records: the signature covers key, subkey, value and expiration time, so an old
  record cannot be re-dated; the DHT keeps the one that expires last; and :class:`RecordBook`
  remembers the newest ``seq`` it saw per (key, owner): an older record returned later is ignored
  and the newer one is kept until it expires (a newer record is never replaced by an older one);
* **malformed** records: schema-checked on store and again on read, by the reader's own code.

What signing cannot stop: a peer lying in *its own* records, or one attacker running many identities.
Readers treat records as claims and count them by standing, not by identity
(:mod:`p2pdiloco.swarm.standing`): the state to adopt and "who is ahead" follow a majority of the
reader's partners (peers it completed verified rounds with) or, for a joiner, of the established
peers; a group record counts only when its writer is one of the group's members; the
run's fingerprint follows the peers that trained (:func:`run_fingerprint`). Known limits: a peer can
still claim a group (led by itself) that leaves someone out, which makes that peer skip the round
and catch up; a ``next_sync`` claim makes others wait for it up to the matchmaking timeout in about
log2 of the rounds (overdue peers: :mod:`p2pdiloco.swarm.matchmaking`, item 12).
"""
from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import msgpack
from pydantic.v1 import BaseModel, Extra, StrictBool, StrictFloat, StrictInt, conint, conlist, constr, root_validator

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from ..identity import peer_id_of_public_key
from .keys import kind_of
from .signing import OwnerSignatures, SigningKey
from .standing import established

__all__ = ["RecordBook", "RecordSchema", "SCHEMAS", "MAX_RECORD", "WIRE_NAMES", "wire_data", "run_fingerprint",
           "note_val_loss", "note_failure"]

#: largest record value accepted (bytes)
MAX_RECORD = 1 << 16
_OWNER = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]{16,8192}|ssh-ed25519 [A-Za-z0-9+/=]{68})\]$")

Count = conint(strict=True, ge=0, le=2**62)
Number = Union[StrictFloat, StrictInt]
_SCALARS = (bool, int, float, str, type(None))


def _small_scalar(v: Any) -> bool:
    if isinstance(v, str):
        return len(v) <= 1024
    if isinstance(v, int) and not isinstance(v, bool):
        return -2**63 <= v < 2**64
    return isinstance(v, _SCALARS)


def _check_extras(cls, values: Dict[str, Any]) -> Dict[str, Any]:
    """Fields a schema does not name (another module's additions) must be small scalars or short
    lists of them: nothing nested, nothing large."""
    known = cls.__fields__
    extras = [k for k in values if k not in known]
    if len(extras) > 64:
        raise ValueError("too many fields")
    for k in extras:
        v = values[k]
        if len(k) > 64:
            raise ValueError("field name too long")
        if isinstance(v, list):
            if len(v) > 64 or not all(_small_scalar(x) for x in v):
                raise ValueError(f"field {k}: only short lists of scalars allowed")
        elif not _small_scalar(v):
            raise ValueError(f"field {k}: only scalars allowed")
    return values


class _Open(BaseModel):
    """Named fields typed strictly; other fields allowed if they are small scalars."""

    class Config:
        extra = Extra.allow

    @root_validator(pre=True, allow_reuse=True)
    def _small_extras(cls, values):
        return _check_extras(cls, values)


#: how many outer steps' validation losses a history record carries (``vr``/``vl``)
VAL_HISTORY = 16
#: how many failed rounds a history record carries (``fr``/``ff``/``ft``/``fw``), and reason length
FAIL_HISTORY = 4
FAIL_REASON_CHARS = 160


class ProgressRecord(_Open):
    """``<run>:progress`` (one per live peer, refreshed every progress_period)."""

    step: Optional[Count] = None
    round: Optional[Count] = None
    next_sync: Optional[Count] = None
    synced_step: Optional[Count] = None
    samples: Optional[Count] = None
    sent: Optional[Count] = None
    recv: Optional[Count] = None
    sps: Optional[Number] = None
    #: samples (sequences) per second over the last seconds, and our share of the last round's samples
    rate: Optional[Number] = None
    share: Optional[Number] = None
    #: local workers training this peer's replica (join --local-workers; absent: 1)
    lw: Optional[conint(strict=True, ge=1, le=4096)] = None
    #: the swarm clock (inner.round_samples > 0, diloco/clock.py): our position and when (unix s) it was read
    pos: Optional[Number] = None
    pt: Optional[Number] = None
    loss: Optional[Number] = None
    val_loss: Optional[Number] = None
    last_sync: Optional[Number] = None
    #: the send step of the last round that did not complete for this peer (failed or missed)
    failed: Optional[Count] = None
    t: Optional[Number] = None
    digest: Optional[constr(strict=True, max_length=4096, regex=r"^[0-9a-f\-]*$")] = None
    gone: Optional[StrictBool] = None
    #: can others dial this peer (swarm/reachability.py): public, private or relayed
    reach: Optional[constr(strict=True, regex=r"^(public|private|relayed)$")] = None


class HistoryRecord(_Open):
    """``<run>:history`` (one per peer, stored when it changes and before it would expire): the recent
    past a dashboard started mid-run shows, kept out of the progress record that every peer reads at
    every matchmaking poll. Filled by :func:`note_val_loss` and :func:`note_failure`; oldest first,
    equal lengths."""

    #: the last VAL_HISTORY outer steps at which this peer measured a validation loss, and those losses
    vr: Optional[conlist(Count, max_items=VAL_HISTORY)] = None
    vl: Optional[conlist(Number, max_items=VAL_HISTORY)] = None
    #: the last FAIL_HISTORY failed rounds: outer step, fragment, time (unix s) and reason (truncated)
    fr: Optional[conlist(Count, max_items=FAIL_HISTORY)] = None
    ff: Optional[conlist(Count, max_items=FAIL_HISTORY)] = None
    ft: Optional[conlist(Number, max_items=FAIL_HISTORY)] = None
    fw: Optional[conlist(constr(strict=True, max_length=FAIL_REASON_CHARS), max_items=FAIL_HISTORY)] = None
    t: Optional[Number] = None


class ReadyRecord(_Open):
    """``<run>:mm:<frag>:<round>``: this peer is ready to sync that fragment's round."""

    t: Optional[Number] = None
    reach: Optional[constr(strict=True, regex=r"^(public|private|relayed)$")] = None
    #: this peer left the history in which it entered the round (it adopted another): not ready for it
    withdrawn: Optional[StrictBool] = None


PeerIdStr = constr(strict=True, min_length=1, max_length=128, regex=r"^[1-9A-HJ-NP-Za-km-z]+$")


class GroupRecord(_Open):
    """``<run>:group:<frag>:<round>``: the members of the round's one group, written by its leader."""

    members: conlist(PeerIdStr, min_items=1, max_items=4096)
    #: the id of the group the leader's state came from ("" at the start of a run)
    base: Optional[constr(strict=True, max_length=64, regex=r"^[0-9a-f]*$")] = None


class FingerprintRecord(_Open):
    """``<run>:fingerprint``: the configuration fields every peer of the run must share."""

    fp: constr(strict=True, min_length=1, max_length=128)
    fields: Dict[constr(strict=True, max_length=128), Any] = {}
    #: when (unix s) the claimant first claimed it: peers that start together tell each other apart from a
    #: run in progress (Swarm.only_recent_claims)
    since: Optional[Number] = None

    @root_validator(skip_on_failure=True, allow_reuse=True)
    def _fields_are_scalars(cls, values):
        fields = values.get("fields") or {}
        if len(fields) > 1024:
            raise ValueError("too many fingerprint fields")
        for k, v in fields.items():
            ok = _small_scalar(v) or (isinstance(v, list) and len(v) <= 64 and all(_small_scalar(x) for x in v))
            if not ok:
                raise ValueError(f"fingerprint field {k}: only scalars or short lists allowed")
        return values


class GenericRecord(_Open):
    """Any other key: small scalar fields only."""


SCHEMAS: Dict[str, Type[BaseModel]] = {
    "progress": ProgressRecord,
    "history": HistoryRecord,
    "ready": ReadyRecord,
    "group": GroupRecord,
    "fingerprint": FingerprintRecord,
    "generic": GenericRecord,
}


#: a progress record's field names on the wire (the code and the schema use the long ones): every peer
#: reads every live peer's progress record at each of its reads, and the names were a third of the value
WIRE_NAMES: Dict[str, Dict[str, str]] = {"progress": {
    "step": "st", "round": "r", "next_sync": "ns", "synced_step": "ss", "samples": "sa", "sent": "tx",
    "recv": "rx", "sps": "sp", "rate": "ra", "share": "sh", "loss": "lo", "val_loss": "vl", "last_sync": "ls",
    "failed": "f", "digest": "dg", "gone": "g", "reach": "re"}}
_LONG_NAMES = {kind: {w: n for n, w in names.items()} for kind, names in WIRE_NAMES.items()}
assert all(not set(_LONG_NAMES[k]) & set(SCHEMAS[k].__fields__) for k in WIRE_NAMES), "a wire name is a field's name"


def wire_data(kind: str, data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` with the kind's fields under their wire names (:data:`WIRE_NAMES`)."""
    names = WIRE_NAMES.get(kind)
    return data if names is None else {names.get(k, k): v for k, v in data.items()}


def _from_wire(kind: str, data: Any) -> Tuple[Any, Optional[str]]:
    """(``data`` with the kind's long field names, None), or (None, why not): a field named both ways.
    Long names are read as they are."""
    names = _LONG_NAMES.get(kind)
    if names is None or not isinstance(data, dict):
        return data, None
    out: Dict[Any, Any] = {}
    for k, v in data.items():
        name = names.get(k, k) if isinstance(k, str) else k
        if name in out:
            return None, f"field {name} given twice"
        out[name] = v
    return out, None


def _check_data(kind: str, data: Any) -> Optional[str]:
    """None when ``data`` matches the kind's schema exactly (no conversions), else why not."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        return f"unknown record kind {kind!r}"
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return "record data is not a map with string keys"
    try:
        parsed = schema.parse_obj(data)
    except Exception as e:
        errors = e.errors() if hasattr(e, "errors") else [{"loc": (), "msg": str(e)}]
        where = ".".join(str(x) for x in errors[0]["loc"]) if errors else ""
        return f"does not match the {kind} schema ({where}: {errors[0]['msg'] if errors else e})"[:300]
    dumped = parsed.dict()
    for k, v in data.items():
        if k in schema.__fields__ and not _same(dumped.get(k), v):
            return f"field {k} needed a type conversion"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN (a diverged peer may report a NaN loss; that is information, not an attack)
    return type(a) is type(b) and a == b if not isinstance(a, (list, dict)) else a == b


def _check_semantics(kind: str, owner: str, data: Dict[str, Any]) -> Optional[str]:
    """Checks that need the owner: a group record must be written by one of its members (its leader,
    who ranks first by tier and the round's draw: a node storing the record knows neither)."""
    if kind == "group":
        members = data["members"]
        if members != sorted(set(members)) or owner not in members:
            return "group record not written by one of its members or members not sorted"
    return None


def _decode_envelope(value: Any) -> Tuple[Optional[Dict[str, Any]], str]:
    """(envelope, "") from our msgpack bytes, or (None, why not)."""
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_RECORD:
        return None, "value is not bytes of at most 64 KiB"
    try:
        env = msgpack.unpackb(value, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception:
        return None, "undecodable value"
    if (not isinstance(env, dict) or set(env) != {"k", "s", "d"} or not isinstance(env["k"], str)
            or type(env["s"]) is not int or not 0 <= env["s"] < 2**63):
        return None, "not a p2pdiloco record envelope {k, s, d}"
    env["d"], problem = _from_wire(env["k"], env["d"])
    return (env, "") if problem is None else (None, problem)


class RecordSchema(RecordValidatorBase):
    """DHT-side validator (runs in hivemind's DHT process, after the signature check): a record is
    accepted only if its subkey names an owner and its value is a schema-valid envelope."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False, max_ext_len=0)
            value = msgpack.unpackb(record.value, raw=False, max_ext_len=0)
        except Exception:
            return False
        if not isinstance(subkey, bytes) or not _OWNER.match(subkey):
            return False  # every p2pdiloco record is signed by its owner
        env, _ = _decode_envelope(value)
        return env is not None and _check_data(env["k"], env["d"]) is None

    @property
    def priority(self) -> int:
        return 5  # below OwnerSignatures (10): sees the value with the signature stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RecordSchema)


class RecordBook:
    """This peer's side of the records: signs what it writes, verifies and orders what it reads.

    :param signing_key: the :class:`~p2pdiloco.swarm.signing.SigningKey` of this peer's libp2p identity.

    Counters for tests: ``rejected`` (reason → count) and ``stale`` (older records ignored).
    """

    def __init__(self, signing_key: SigningKey):
        self.signer = OwnerSignatures(signing_key)
        #: the subkey every record of ours is stored under
        self.owner_subkey: bytes = self.signer.local_public_key
        self.peer_id: Optional[str] = peer_id_of_public_key(_OWNER.match(self.owner_subkey).group(1))
        self.rejected: Counter = Counter()
        self.stale = 0
        self._seq = 0
        self._latest: Dict[Tuple[str, str], Tuple[int, float, Dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def validators(self) -> List[RecordValidatorBase]:
        """What the DHT process must run (pass to ``hivemind.DHT(record_validators=...)``)."""
        return [self.signer, RecordSchema()]

    # ---- writing ----------------------------------------------------------------------------------
    def encode(self, key: str, data: Dict[str, Any]) -> bytes:
        """The value to store under ``key`` (our subkey): raises ValueError if ``data`` breaks the schema."""
        kind = kind_of(key)
        problem = _check_data(kind, data)
        if problem is None and set(data) & set(_LONG_NAMES.get(kind, ())):
            problem = f"names a field {sorted(set(data) & set(_LONG_NAMES[kind]))[0]!r} that is another's wire name"
        if problem is not None:
            raise ValueError(f"record for {key} {problem}")
        with self._lock:
            self._seq = max(self._seq + 1, time.time_ns() // 1000)
            seq = self._seq
        blob = msgpack.packb({"k": kind, "s": seq, "d": wire_data(kind, data)}, use_bin_type=True)
        if len(blob) > MAX_RECORD:
            raise ValueError(f"record for {key} is {len(blob)} bytes (limit {MAX_RECORD})")
        return blob

    # ---- reading ----------------------------------------------------------------------------------
    def decode(self, key: str, found: Any) -> Dict[str, Dict[str, Any]]:
        """``{peer id: data}`` from a DHT get of ``key``: verified owners, valid schema, newest first.

        The DHT process has already checked signatures; here the owner's peer id is derived from
        its public key, the envelope and schema are checked again, and per (key, owner) the record
        with the highest ``seq`` seen so far wins until it expires, whether this read returned it or not.
        """
        out: Dict[str, Dict[str, Any]] = {}
        now = _dht_time()
        kind = kind_of(key)
        items = found.value.items() if found is not None and isinstance(found.value, dict) else ()
        for subkey, item in items:
            peer = self.owner_of(subkey)
            if peer is None:
                self._reject("subkey names no owner")
                continue
            env, why = _decode_envelope(getattr(item, "value", None))
            if env is None:
                self._reject(why)
                continue
            if env["k"] != kind:
                self._reject(f"a {env['k']} record under a {kind} key")
                continue
            problem = _check_data(kind, env["d"]) or _check_semantics(kind, peer, env["d"])
            if problem is not None:
                self._reject(problem)
                continue
            expiration = float(getattr(item, "expiration_time", now))
            with self._lock:
                prev = self._latest.get((key, peer))
                if prev is not None and prev[0] > env["s"] and prev[1] > now:
                    self.stale += 1  # an older record (replayed, or from a lagging node): keep the newer
                    out[peer] = dict(prev[2])
                    continue
                self._latest[(key, peer)] = (env["s"], expiration, env["d"])
            out[peer] = dict(env["d"])
        # A DHT read returns one node's copy of the dictionary (the one that expires last), which can lack
        # records other nodes hold (right after a partition heals, the far side's node answers with only
        # its own peers). A record we verified stays in the view until it expires, read again or not.
        with self._lock:
            for (k, peer), (_, expiration, data) in self._latest.items():
                if k == key and peer not in out and expiration > now:
                    out[peer] = dict(data)
        self._sweep(now)
        return out

    @staticmethod
    def owner_of(subkey: Any) -> Optional[str]:
        """The peer id a record's subkey names as its owner (None when it names none)."""
        if not isinstance(subkey, (bytes, bytearray)):
            return None
        m = _OWNER.match(bytes(subkey))
        return peer_id_of_public_key(m.group(1)) if m else None

    def _reject(self, why: str) -> None:
        with self._lock:
            self.rejected[why] += 1

    def _sweep(self, now: float) -> None:
        with self._lock:
            if len(self._latest) < 4096:
                return
            for k in [k for k, v in self._latest.items() if v[1] <= now]:
                del self._latest[k]


def run_fingerprint(claims: Dict[str, Dict[str, Any]], mine: Dict[str, Any],
                    progress: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The fingerprint record a joining peer must match: ours, or the run's when it differs.

    Claims are counted by standing, not by identities alone (identities cost nothing). The first of
    these tiers that holds any claim decides: peers that trained in the run (their live progress
    record names the group of their last sync), then peers with a live progress record:

    * if one of them claims ours, ours is the run's: there are peers of our configuration to train
      with, and identities claiming other fingerprints (however many, with or without a faked
      history) lock nobody out;
    * else the fingerprint most of them claim is the run's (we are refused with what differs).

    With neither (nobody has published progress yet: peers starting together), every claim counts:
    the most claimed fingerprint is the run's, ours winning ties. With no claims at all, ours is the
    run's.
    """
    progress = progress or {}
    live = {pid for pid, v in progress.items() if isinstance(v, dict) and not v.get("gone")}
    trained = established({pid: progress[pid] for pid in live}, "")
    for tier in (trained, live):
        counted = {pid: v for pid, v in claims.items() if pid in tier}
        if counted:
            if any(v.get("fp") == mine.get("fp") for v in counted.values()):
                return mine
            break
    else:
        counted = claims
    if not counted:
        return mine
    counts: Counter = Counter(v.get("fp") for v in counted.values())
    best, n = max(counts.items(), key=lambda kv: (kv[1], kv[0] == mine.get("fp")))
    if counts.get(mine.get("fp"), 0) >= n:
        return mine
    return next(v for v in counted.values() if v.get("fp") == best)


def note_val_loss(history: Dict[str, Any], outer_step: int, val_loss: float) -> None:
    """Add (outer step, validation loss) to a history record's ``vr``/``vl`` (in place); a later value
    for the same outer step replaces the earlier one; only the last VAL_HISTORY steps are kept; a
    non-finite loss is left out (the progress record's ``val_loss`` still shows it)."""
    if not isinstance(val_loss, (int, float)) or not math.isfinite(val_loss):
        return
    steps, losses = list(history.get("vr") or []), list(history.get("vl") or [])
    if steps and steps[-1] == outer_step:
        del steps[-1], losses[-1]
    steps.append(int(outer_step))
    losses.append(float(val_loss))
    history["vr"], history["vl"] = steps[-VAL_HISTORY:], losses[-VAL_HISTORY:]


def note_failure(history: Dict[str, Any], outer_step: int, fragment: int, reason: str,
                 when: Optional[float] = None) -> None:
    """Add a failed round to a history record's ``fr``/``ff``/``ft``/``fw`` (in place), keeping the
    last FAIL_HISTORY; the reason is cut to FAIL_REASON_CHARS characters."""
    reason = " ".join(str(reason or "unknown").split())
    if len(reason) > FAIL_REASON_CHARS:
        reason = reason[:FAIL_REASON_CHARS - 1] + "…"
    new = {"fr": int(outer_step), "ff": int(fragment), "ft": float(time.time() if when is None else when),
           "fw": reason}
    for k, v in new.items():
        history[k] = (list(history.get(k) or []) + [v])[-FAIL_HISTORY:]


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()
