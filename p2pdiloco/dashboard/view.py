"""What the dashboard shows, built from successive reads of the run's progress records.

The dashboard is just another DHT reader: every ``period`` seconds it reads ``<run>:progress`` (the
same read as ``p2pdiloco status``), ``<run>:history`` (each peer's recent losses and failed rounds,
kept out of the progress records that matchmaking reads) and the run's fingerprint (for the sequence
length). What a single read cannot say, it accumulates here, in memory and bounded:

* validation loss per outer step, per peer: from each peer's short history (``vr``/``vl``,
  records.py) plus what earlier reads showed, so the plot reaches back before the dashboard started
  and keeps a peer's points after it left;
* swarm-wide tokens/s and bytes/s over time: each peer's rate over its records of the last 10 s
  (difference of ``samples``/``sent``/``recv`` over the difference of ``t``), summed over live peers;
* recent failed rounds with their reason (``fr``/``ff``/``ft``/``fw``), kept after the peer drops
  them from its record or leaves.

Everything here comes from strangers' records (schema-checked, but their content is whatever a peer
claims): it is data for the page to show as text, never markup. Every value a record may legally
hold must keep both the work per read and the document bounded: the view keeps at most MAX_PEERS
peers and MAX_VAL_TOTAL loss points, and the document (:meth:`SwarmView.document_bytes`, the
``/api/swarm`` JSON, docs/dashboard.md) is built once per read, with each peer's record cut to
RECORD_JSON_CHARS and the loss series thinned to DOC_VAL_POINTS, so that serving it is a copy of
bytes whatever the number of viewers.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..swarm.records import ProgressRecord

__all__ = ["SwarmView", "digest_agreement", "json_safe", "live_records", "local_workers"]

#: bounds on what the view keeps (records come from strangers: a flood of peers must not grow memory)
MAX_PEERS = 512
MAX_VAL_POINTS = 1000
#: loss points kept over all peers; past it, every peer's series is cut to its newest share
MAX_VAL_TOTAL = 100_000
MAX_RATE_POINTS = 3600
MAX_FAILURES = 200
#: a peer's records its rates are measured over, at most (its ``t`` may advance by a hair per record)
MAX_RATE_RECORDS = 64
#: a peer's rate counts in the swarm's sum while it was updated at most this many periods ago
RATE_FRESH_PERIODS = 4.0
#: seconds of a peer's records its rates are measured over
RATE_WINDOW = 10.0
#: the document's bounds: a peer's record as JSON (an honest one is under 2,000 characters; a larger
#: one is cut to the fields that fit, _shown_record), loss points over all series and per series, rate
#: points, failures, characters of a digest in ``digests``
RECORD_JSON_CHARS = 4096
DOC_VAL_POINTS = 8000
DOC_SERIES_POINTS = 500
DOC_RATE_POINTS = 1200
DOC_FAILURES = 50
DOC_DIGEST_CHARS = 64
#: what the bounds above add up to (``/api/swarm`` never exceeds it; tests/test_dashboard.py checks the worst case)
MAX_DOCUMENT_BYTES = 4 << 20
#: a progress record's named fields, in the schema's order (shown before any other field)
_NAMED = list(ProgressRecord.__fields__)
_NAMED_SET = set(_NAMED)


def live_records(records: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The live peers of a read of ``<run>:progress``: those that did not say goodbye (as ``status``)."""
    return {pid: v for pid, v in records.items() if not v.get("gone")}


def local_workers(v: Dict[str, Any]) -> int:
    """The local workers training a peer's replica (``lw``, join --local-workers), as
    ``status`` counts them: 1 for a record without a valid ``lw`` (an older peer, a stranger's junk)."""
    lw = v.get("lw")
    return lw if isinstance(lw, int) and not isinstance(lw, bool) and 0 < lw <= 4096 else 1


def _history_fields(h: Any) -> Dict[str, Any]:
    """A history record's fields (``vr``/``vl``, ``fr``/``ff``/``ft``/``fw``); none for anything else."""
    return {k: h[k] for k in ("vr", "vl", "fr", "ff", "ft", "fw") if k in h} if isinstance(h, dict) else {}


def _num(v: Any) -> Optional[float]:
    """A finite number or None (JSON has no NaN: the page's JSON.parse would refuse the document)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if math.isfinite(v) else None


def json_safe(v: Any) -> Any:
    """``v`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list):
        return [json_safe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    return v


def _dumps(v: Any) -> str:
    """Strict JSON (ASCII: its length is its size in bytes); NaN and infinities must be gone."""
    return json.dumps(v, allow_nan=False, separators=(",", ":"), default=str)


def _piece(x: Any, room: int) -> Optional[Tuple[Any, int]]:
    """(``x`` with NaN and infinities as None, the length of its JSON) if that JSON takes at most
    ``room`` characters, else None; the work is bounded by ``room`` whatever ``x`` holds (a lower
    bound of its size is checked before it is encoded)."""
    if isinstance(x, str):
        if len(x) + 2 > room:
            return None
    elif isinstance(x, list):
        least = 1 + len(x)
        for item in x:
            least += len(item) + 2 if isinstance(item, str) else 1
            if least > room:
                return None
    text = json.dumps(x, separators=(",", ":"), default=str)
    if "NaN" in text or "Infinity" in text:
        x = json_safe(x)
        text = _dumps(x)
    return (x, len(text)) if len(text) <= room else None


def _shown_record(v: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """A peer's record as the document shows it (NaN as None), at most RECORD_JSON_CHARS of JSON, and
    the fields left out: the named fields of a progress record that fit, then the others, by name,
    until one does not fit."""
    kept: Dict[str, Any] = {}
    used = 2  # {}
    named = [k for k in _NAMED if k in v]
    others = sorted(str(k) for k in v if k not in _NAMED_SET)
    for i, k in enumerate(named + others):
        key = len(_dumps(k)) + 2  # "k": and a comma
        piece = _piece(v[k], RECORD_JSON_CHARS - used - key)
        if piece is None:
            if i >= len(named):
                break
            continue
        kept[k] = piece[0]
        used += key + piece[1]
    return kept, [k for k in v if k not in kept]


def _thin(points: List[Any], n: int) -> List[Any]:
    """At most ``n`` (>= 2) of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= n:
        return points
    last = len(points) - 1
    return [points[round(i * last / (n - 1))] for i in range(n)]


class SwarmView:
    """Accumulates reads of one run's records; thread-safe (a poller writes, HTTP handlers read).

    :param run_id: the run whose records are read.
    :param period: seconds between reads (the page polls as often).
    :param clock: wall clock (tests pass their own).

    Until :meth:`attach` gives it the DHT reads, the view is an empty swarm "connecting to the DHT".
    """

    def __init__(self, run_id: str, period: float = 2.0, clock: Callable[[], float] = time.time):
        self.run_id = run_id
        self.period = period
        self._read_progress: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None
        self._read_fingerprint: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None
        self._read_history: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: Dict[str, Dict[str, Any]] = {}          # the listed live peers' records, as shown
        self._omitted: Dict[str, int] = {}                    # peer → how many fields its shown record leaves out
        self._peers_total = 0                                  # live peers in the last read, listed or not
        self._val: Dict[str, Dict[int, float]] = {}          # peer → outer step → validation loss
        self._seen: Dict[str, float] = {}                     # peer → when we last read its record
        self._first: Dict[str, float] = {}                    # peer → when we first listed it
        self._last: Dict[str, List[Tuple[float, int, int, int]]] = {}  # peer → its recent (t, samples, sent, recv)
        self._rate: Dict[str, Tuple[float, float, float, float]] = {}  # peer → (t, samples/s, sent/s, recv/s)
        self._rates: List[Dict[str, Any]] = []
        self._failures: Dict[Tuple[str, float], Dict[str, Any]] = {}
        self._seq_len: Optional[int] = None
        self._fingerprint_read = 0.0
        self._reads = 0
        self._last_read: Optional[float] = None
        self._error: Optional[str] = "connecting to the DHT"
        self._version = 0                                      # grows with every change of the view
        self._body: Tuple[int, bytes] = (-1, b"")              # (version, the document's bytes)
        self._build_lock = threading.Lock()
        #: documents built so far (each serves every request until the view changes)
        self.builds = 0

    # ---- reading --------------------------------------------------------------------------------------
    def attach(self, read_progress: Callable[[], Dict[str, Dict[str, Any]]],
               read_fingerprint: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None,
               read_history: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None) -> None:
        """Where to read: ``read_progress`` returns ``{peer id: record}`` of ``<run>:progress`` (may
        raise); ``read_fingerprint`` the claims under ``<run>:fingerprint`` (for ``model.seq_len``);
        ``read_history`` the records under ``<run>:history``, folded into the live peers' records."""
        self._read_progress, self._read_fingerprint = read_progress, read_fingerprint
        self._read_history = read_history

    def refresh(self) -> None:
        """One read of the run's records, folded into the view, and the document built for it. A
        failed read is reported in the document (``dht.error``), never raised: the page keeps showing
        the last good read."""
        now = self._clock()
        if self._read_progress is None:
            return
        try:
            records = live_records(self._read_progress())
        except Exception as e:  # the DHT may be unreachable for a moment
            with self._lock:
                self._error = f"DHT read failed: {type(e).__name__}: {e}"[:300]
                self._version += 1
            self.document_bytes()
            return
        seq_len = self._seq_len
        if (seq_len is None and records and self._read_fingerprint is not None
                and now - self._fingerprint_read >= 2 * self.period):
            self._fingerprint_read = now
            try:
                seq_len = _seq_len_of(self._read_fingerprint())
            except Exception:
                seq_len = None
        with self._lock:
            self._seq_len = seq_len
            self.fold(records, now, self._history())
            self._reads += 1
            self._last_read = now
            self._error = None
        self.document_bytes()

    def _history(self) -> Dict[str, Dict[str, Any]]:
        if self._read_history is None:
            return {}
        try:
            return self._read_history()
        except Exception:  # the losses and failures shown so far stay; the next read may find them
            return {}

    def fold(self, records: Dict[str, Dict[str, Any]], now: float,
             history: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """Fold one read (``{peer id: record}``, live peers only, and ``history``: their history records)
        into the view's memory (lock held or unshared). A peer is shown with its progress record; its
        losses and failures come from its history record (a progress record's own ``vr``/``vl``/``fr``...
        when it has none: the view's unit tests give them so).

        At most MAX_PEERS peers are listed: those listed longest (a flood of new identities does not
        push out the peers already shown), then by peer id."""
        self._peers_total = len(records)
        if len(records) > MAX_PEERS:
            listed = sorted(records, key=lambda pid: (self._first.get(pid, now), pid))[:MAX_PEERS]
            records = {pid: records[pid] for pid in listed}
        self._peers, self._omitted = {}, {}
        for pid, v in records.items():
            self._peers[pid], omitted = _shown_record(v)
            if omitted:
                self._omitted[pid] = len(omitted)
            self._first.setdefault(pid, now)
            self._seen[pid] = now
            full = {**_history_fields((history or {}).get(pid)), **v}  # its own fields win (both have a t)
            self._fold_val(pid, full)
            self._fold_rate(pid, v, now)
            self._fold_failures(pid, full)
        self._bound_val()
        self._forget(now)
        fresh = [r for pid, r in self._rate.items()
                 if pid in records and now - r[0] <= RATE_FRESH_PERIODS * self.period + 10]
        samples = sum(r[1] for r in fresh)
        self._rates.append({"t": round(now, 3), "peers": self._peers_total, "samples_per_s": round(samples, 3),
                            "sent_per_s": round(sum(r[2] for r in fresh), 1),
                            "recv_per_s": round(sum(r[3] for r in fresh), 1)})
        del self._rates[:-MAX_RATE_POINTS]
        self._version += 1

    def _fold_val(self, pid: str, v: Dict[str, Any]) -> None:
        points = self._val.setdefault(pid, {})
        steps, losses = v.get("vr"), v.get("vl")
        if isinstance(steps, list) and isinstance(losses, list):
            for s, loss in zip(steps, losses):
                if isinstance(s, int) and not isinstance(s, bool) and _num(loss) is not None:
                    points[s] = float(loss)
        elif isinstance(v.get("round"), int) and _num(v.get("val_loss")) is not None:
            # a peer without the history fields (older version): its latest (outer step, loss) pair
            points[v["round"]] = float(v["val_loss"])
        if len(points) > MAX_VAL_POINTS + MAX_VAL_POINTS // 8:  # trimmed in batches: a sort per 125 new points
            _keep_newest(points, MAX_VAL_POINTS)

    def _bound_val(self) -> None:
        """Keep MAX_VAL_TOTAL loss points over all peers: past it, each series keeps its newest
        share (at least 16 points, a record's history)."""
        if sum(len(p) for p in self._val.values()) <= MAX_VAL_TOTAL:
            return
        share = max(16, int(0.9 * MAX_VAL_TOTAL / len(self._val)))
        for points in self._val.values():
            if len(points) > share:
                _keep_newest(points, share)

    def _fold_rate(self, pid: str, v: Dict[str, Any], now: float) -> None:
        """The peer's rates over its records of the last RATE_WINDOW seconds (bytes move in bursts at
        syncs: a rate between two consecutive records would jump between 0 and the link speed)."""
        t, samples, sent, recv = _num(v.get("t")), v.get("samples"), v.get("sent"), v.get("recv")
        if t is None or not all(isinstance(x, int) and not isinstance(x, bool) for x in (samples, sent, recv)):
            return
        seen = self._last.setdefault(pid, [])
        if seen and t <= seen[-1][0]:
            return  # the same record as last time (or an older one)
        if seen and min(samples - seen[-1][1], sent - seen[-1][2], recv - seen[-1][3]) < 0:
            seen.clear()  # counters went back: the peer restarted
            self._rate.pop(pid, None)
        seen.append((t, samples, sent, recv))
        while len(seen) > 2 and (seen[1][0] <= t - RATE_WINDOW or len(seen) > MAX_RATE_RECORDS):
            seen.pop(0)
        if len(seen) >= 2:
            first, dt = seen[0], t - seen[0][0]
            self._rate[pid] = (now, (samples - first[1]) / dt, (sent - first[2]) / dt, (recv - first[3]) / dt)

    def _fold_failures(self, pid: str, v: Dict[str, Any]) -> None:
        cols = [v.get(k) for k in ("fr", "ff", "ft", "fw")]
        if not all(isinstance(c, list) for c in cols):
            return
        for step, frag, t, why in zip(*cols):
            if _num(t) is None:
                continue
            self._failures[(pid, float(t))] = {"peer": pid, "outer_step": step, "fragment": frag,
                                               "t": float(t), "reason": str(why)}
        if len(self._failures) > MAX_FAILURES:
            for k in sorted(self._failures, key=lambda k: k[1])[:len(self._failures) - MAX_FAILURES]:
                del self._failures[k]

    def _forget(self, now: float) -> None:
        """Bound memory: keep the history of at most MAX_PEERS peers, the most recently seen."""
        if len(self._seen) <= MAX_PEERS:
            return
        for pid in sorted(self._seen, key=self._seen.get)[:len(self._seen) - MAX_PEERS]:
            for d in (self._seen, self._first, self._val, self._last, self._rate):
                d.pop(pid, None)

    # ---- the document ------------------------------------------------------------------------------------
    def document(self) -> Dict[str, Any]:
        """The ``/api/swarm`` JSON (docs/dashboard.md): no NaN or infinity anywhere (null instead),
        within the document's bounds (DOC_*)."""
        with self._lock:
            peers = dict(self._peers)
            series = {pid: sorted(pts.items()) for pid, pts in self._val.items() if pts}
            rates = [dict(r, tokens_per_s=round(r["samples_per_s"] * self._seq_len, 1) if self._seq_len else None)
                     for r in _thin(self._rates, DOC_RATE_POINTS)]
            failures = sorted(self._failures.values(), key=lambda f: -f["t"])[:DOC_FAILURES]
            doc = {"run_id": self.run_id, "time": round(self._clock(), 3), "period": self.period,
                   "dht": {"ok": self._error is None, "error": self._error, "reads": self._reads,
                           "last_read": self._last_read},
                   "seq_len": self._seq_len, "peers_total": self._peers_total, "omitted": dict(self._omitted)}
        per_series = max(16, min(DOC_SERIES_POINTS, DOC_VAL_POINTS // max(1, len(series))))
        val = {pid: [list(p) for p in _thin(pts, per_series)] for pid, pts in series.items()}  # finite (_fold_val)
        doc = json_safe(doc)
        doc.update(peers=peers, val_loss=val, rates=json_safe(rates), digests=digest_agreement(peers),
                   failures=failures, local_workers={pid: local_workers(v) for pid, v in peers.items()})
        return doc

    def published(self) -> bytes:
        """The document of the last read, as served to every request: never built here, except once
        for a view that has not been read yet."""
        version, body = self._body
        return body if version >= 0 else self.document_bytes()

    def document_bytes(self) -> bytes:
        """The document as UTF-8 JSON, built at most once per change of the view (a read): every
        request until the next read is served these same bytes."""
        with self._build_lock:
            version, body = self._body
            if version == self._version:
                return body
            version = self._version
            body = _dumps(self.document()).encode()
            self._body = (version, body)
            self.builds += 1
            return body


def _keep_newest(points: Dict[int, float], n: int) -> None:
    for s in sorted(points)[:len(points) - n]:
        del points[s]


def digest_agreement(peers: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """How many live peers hold each digest at the latest synced step any of them reports.

    ``{"step": S or None, "groups": [{"digest", "peers": [ids]}] (largest first), "elsewhere": [ids
    of peers at another step or without a digest]}``. Peers of a step hold bitwise identical state,
    so one group is the healthy answer; two groups at one step is a bug (or a liar). A digest is
    shown by its first DOC_DIGEST_CHARS characters (groups are formed on the whole digest)."""
    at = {pid: v.get("synced_step") for pid, v in peers.items()
          if isinstance(v.get("synced_step"), int) and isinstance(v.get("digest"), str) and v.get("digest")}
    if not at:
        return {"step": None, "groups": [], "elsewhere": sorted(peers)}
    step = max(at.values())
    members = sorted(pid for pid, s in at.items() if s == step)
    holders: Dict[str, List[str]] = {}
    for pid in members:
        holders.setdefault(peers[pid]["digest"], []).append(pid)
    groups = [{"digest": d[:DOC_DIGEST_CHARS], "peers": ids}
              for d, ids in sorted(holders.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    return {"step": step, "groups": groups, "elsewhere": sorted(set(peers) - set(members))}


def _seq_len_of(claims: Dict[str, Dict[str, Any]]) -> Optional[int]:
    """``model.seq_len`` of the fingerprint most peers claim (records.run_fingerprint's rule), or None."""
    counts = Counter(v.get("fp") for v in claims.values() if isinstance(v.get("fp"), str))
    if not counts:
        return None
    best = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    for v in claims.values():
        fields = v.get("fields")
        if v.get("fp") == best and isinstance(fields, dict):
            s = fields.get("model.seq_len")
            return s if isinstance(s, int) and not isinstance(s, bool) and s > 0 else None
    return None
