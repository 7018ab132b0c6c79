"""What ``p2pdiloco status`` prints: a table of the live peers, or their records as JSON.

The records are strangers' (schema-checked, records.py): any field may be absent or null, a count
may be as large as 2**62, a number may be NaN, an infinity or 1e308, a string as long as the schema
allows. Every cell below is made from whatever the record holds, never raises, and stays short;
a value that is not what the column shows prints ``-``.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List

from ..ids import short_id
from ..metrics import format_bytes
from .view import json_safe, local_workers

__all__ = ["status_json", "status_table"]

_COLUMNS = (("peer", "<8"), ("reach", "<8"), ("workers", ">7"), ("outer", ">5"), ("step", ">7"),
            ("samples/s", ">9"), ("share", ">5"), ("samples", ">9"), ("sent", ">9"), ("recv", ">9"),
            ("relayed", ">8"), ("last sync", ">9"), ("loss", ">7"), ("val", ">7"))


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> str:
    """A counter (outer step, step, samples): digits up to a billion, then 3 significant figures."""
    if not isinstance(v, int) or isinstance(v, bool):
        return "-"
    return str(v) if abs(v) < 10**9 else f"{v:.3g}"


def _bytes(v: Any) -> str:
    if not _is_num(v) or not math.isfinite(v):
        return "-"
    return format_bytes(v) if abs(v) < 1e15 else f"{v:.2g} B"


def _fixed(v: Any, digits: int, nonfinite: bool = False) -> str:
    """``v`` with ``digits`` decimals, magnitudes from a million on in 3 significant figures; NaN and
    infinities as such when ``nonfinite`` (a diverged loss is news), else ``-``."""
    if not _is_num(v):
        return "-"
    if not math.isfinite(v):
        return str(float(v)) if nonfinite else "-"  # nan, inf, -inf
    return f"{v:.{digits}f}" if abs(v) < 1e6 else f"{v:.3g}"


def _share(v: Any) -> str:
    return f"{100 * v:.0f}%" if _is_num(v) and 0 <= v <= 1 else "-"


def _ago(last: Any, now: float) -> str:
    if not _is_num(last) or not math.isfinite(last):
        return "never"
    ago = now - last
    if ago < -5:
        return "future"  # the peer's clock, or its claim, is ahead of ours
    if ago < 1e5:
        return f"{max(ago, 0):.0f}s ago"
    return f"{ago / 86400:.0f}d ago" if ago < 1e7 * 86400 else "long ago"


def status_table(peers: Dict[str, Dict[str, Any]], now: float) -> List[str]:
    """The table's lines (header first) for ``{peer id: record}`` of live peers, sorted by peer id."""
    lines = [" ".join(f"{name:{fmt}}" for name, fmt in _COLUMNS)]
    for pid, v in sorted(peers.items(), key=lambda kv: kv[0]):
        reach = v.get("reach")
        reach = reach[:8] if isinstance(reach, str) and reach else "?"  # public / private / relayed
        cells = (short_id(pid), reach, str(local_workers(v)), _count(v.get("round")), _count(v.get("step")),
                 _fixed(v.get("rate"), 1), _share(v.get("share")), _count(v.get("samples")),
                 _bytes(v.get("sent")), _bytes(v.get("recv")),
                 _bytes(v.get("rb")) if v.get("reach") == "relayed" else "-", _ago(v.get("last_sync"), now),
                 _fixed(v.get("loss"), 3, True), _fixed(v.get("val_loss"), 3, True))
        lines.append(" ".join(f"{c:{fmt}}" for c, (_, fmt) in zip(cells, _COLUMNS)))
    return lines


def status_json(peers: Dict[str, Dict[str, Any]]) -> str:
    """The records as strict JSON (a NaN or an infinity as null), keyed by full peer id."""
    return json.dumps(json_safe(peers), indent=1, allow_nan=False, default=str)
