"""What the dashboard shows, built from successive reads of the run's progress records.

The dashboard is just another DHT reader: every ``period`` seconds it reads ``<run>:progress`` (the
same read as ``p2pdiloco status``) and the run's fingerprint (for the sequence length). What a
single read cannot say, it accumulates here, in memory and bounded:

* validation loss per outer step, per peer: from each record's short history (``vr``/``vl``,
  records.py) plus what earlier reads showed, so the plot reaches back before the dashboard started
  and keeps a peer's points after it left;
* swarm-wide tokens/s and bytes/s over time: each peer's rate over its records of the last 10 s
  (difference of ``samples``/``sent``/``recv`` over the difference of ``t``), summed over live peers;
* recent failed rounds with their reason (``fr``/``ff``/``ft``/``fw``), kept after the peer drops
  them from its record or leaves.

Everything here comes from strangers' records (schema-checked, but their content is whatever a peer
claims): it is data for the page to show as text, never markup. :meth:`SwarmView.document` is the
``/api/swarm`` JSON (docs/dashboard.md).
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["SwarmView", "digest_agreement", "json_safe", "live_records", "local_workers"]

#: bounds on what the view keeps (records come from strangers: a flood of peers must not grow memory)
MAX_PEERS = 512
MAX_VAL_POINTS = 2000
MAX_RATE_POINTS = 3600
MAX_FAILURES = 200
#: a peer's rate counts in the swarm's sum while it was updated at most this many periods ago
RATE_FRESH_PERIODS = 4.0
#: seconds of a peer's records its rates are measured over
RATE_WINDOW = 10.0


def live_records(records: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The live peers of a read of ``<run>:progress``: those that did not say goodbye (as ``status``)."""
    return {pid: v for pid, v in records.items() if not v.get("gone")}


def local_workers(v: Dict[str, Any]) -> int:
    """The local workers training a peer's replica (``lw``, join --local-workers; issue 20), as
    ``status`` counts them: 1 for a record without a valid ``lw`` (an older peer, a stranger's junk)."""
    lw = v.get("lw")
    return lw if isinstance(lw, int) and not isinstance(lw, bool) and 0 < lw <= 4096 else 1


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
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: Dict[str, Dict[str, Any]] = {}
        self._val: Dict[str, Dict[int, float]] = {}          # peer → outer step → validation loss
        self._seen: Dict[str, float] = {}                     # peer → when we last read its record
        self._last: Dict[str, List[Tuple[float, int, int, int]]] = {}  # peer → its recent (t, samples, sent, recv)
        self._rate: Dict[str, Tuple[float, float, float, float]] = {}  # peer → (t, samples/s, sent/s, recv/s)
        self._rates: List[Dict[str, Any]] = []
        self._failures: Dict[Tuple[str, float], Dict[str, Any]] = {}
        self._seq_len: Optional[int] = None
        self._fingerprint_read = 0.0
        self._reads = 0
        self._last_read: Optional[float] = None
        self._error: Optional[str] = "connecting to the DHT"

    # ---- reading --------------------------------------------------------------------------------------
    def attach(self, read_progress: Callable[[], Dict[str, Dict[str, Any]]],
               read_fingerprint: Optional[Callable[[], Dict[str, Dict[str, Any]]]] = None) -> None:
        """Where to read: ``read_progress`` returns ``{peer id: record}`` of ``<run>:progress`` (may
        raise); ``read_fingerprint`` the claims under ``<run>:fingerprint`` (for ``model.seq_len``)."""
        self._read_progress, self._read_fingerprint = read_progress, read_fingerprint

    def refresh(self) -> None:
        """One read of the run's records, folded into the view. A failed read is reported in the
        document (``dht.error``), never raised: the page keeps showing the last good read."""
        now = self._clock()
        if self._read_progress is None:
            return
        try:
            records = live_records(self._read_progress())
        except Exception as e:  # the DHT may be unreachable for a moment
            with self._lock:
                self._error = f"DHT read failed: {type(e).__name__}: {e}"[:300]
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
            self.fold(records, now)
            self._reads += 1
            self._last_read = now
            self._error = None

    def fold(self, records: Dict[str, Dict[str, Any]], now: float) -> None:
        """Fold one read (``{peer id: record}``, live peers only) into the history (lock held or unshared)."""
        self._peers = {pid: dict(v) for pid, v in records.items()}
        for pid, v in records.items():
            self._seen[pid] = now
            self._fold_val(pid, v)
            self._fold_rate(pid, v, now)
            self._fold_failures(pid, v)
        self._forget(now)
        fresh = [r for pid, r in self._rate.items()
                 if pid in records and now - r[0] <= RATE_FRESH_PERIODS * self.period + 10]
        samples = sum(r[1] for r in fresh)
        self._rates.append({"t": round(now, 3), "peers": len(records), "samples_per_s": round(samples, 3),
                            "sent_per_s": round(sum(r[2] for r in fresh), 1),
                            "recv_per_s": round(sum(r[3] for r in fresh), 1)})
        del self._rates[:-MAX_RATE_POINTS]

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
        if len(points) > MAX_VAL_POINTS:
            for s in sorted(points)[:len(points) - MAX_VAL_POINTS]:
                del points[s]

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
        while len(seen) > 2 and seen[1][0] <= t - RATE_WINDOW:
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
            for d in (self._seen, self._val, self._last, self._rate):
                d.pop(pid, None)

    # ---- the document ------------------------------------------------------------------------------------
    def document(self) -> Dict[str, Any]:
        """The ``/api/swarm`` JSON (docs/dashboard.md): no NaN or infinity anywhere (null instead)."""
        with self._lock:
            peers = {pid: dict(v) for pid, v in self._peers.items()}
            val = {pid: [[s, pts[s]] for s in sorted(pts)] for pid, pts in self._val.items() if pts}
            rates = [dict(r, tokens_per_s=round(r["samples_per_s"] * self._seq_len, 1) if self._seq_len else None)
                     for r in self._rates]
            failures = sorted(self._failures.values(), key=lambda f: -f["t"])[:50]
            doc = {"run_id": self.run_id, "time": round(self._clock(), 3), "period": self.period,
                   "dht": {"ok": self._error is None, "error": self._error, "reads": self._reads,
                           "last_read": self._last_read},
                   "seq_len": self._seq_len}
        doc.update(peers=peers, val_loss=val, rates=rates, digests=digest_agreement(peers), failures=failures,
                   local_workers={pid: local_workers(v) for pid, v in peers.items()})
        return json_safe(doc)


def digest_agreement(peers: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """How many live peers hold each digest at the latest synced step any of them reports.

    ``{"step": S or None, "groups": [{"digest", "peers": [ids]}] (largest first), "elsewhere": [ids
    of peers at another step or without a digest]}``. Peers of a step hold bitwise identical state,
    so one group is the healthy answer; two groups at one step is a bug (or a liar)."""
    at = {pid: v.get("synced_step") for pid, v in peers.items()
          if isinstance(v.get("synced_step"), int) and isinstance(v.get("digest"), str) and v.get("digest")}
    if not at:
        return {"step": None, "groups": [], "elsewhere": sorted(peers)}
    step = max(at.values())
    members = sorted(pid for pid, s in at.items() if s == step)
    counts = Counter(peers[pid]["digest"] for pid in members)
    groups = [{"digest": d, "peers": [pid for pid in members if peers[pid]["digest"] == d]}
              for d, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
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
