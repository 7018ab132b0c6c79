"""Machine-readable metrics (one JSON object per line) and the human progress line."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, TextIO

__all__ = ["MetricsWriter", "NoMetrics", "format_bytes", "read_metrics"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"  # pragma: no cover


class MetricsWriter:
    """Appends events to ``<run_dir>/metrics.jsonl``; every line has ``event`` and ``time``."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f: TextIO = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        self._f.close()


class NoMetrics(MetricsWriter):
    """A writer that keeps nothing: a library peer's events are its reports and log lines."""

    def __init__(self) -> None:
        self.path = ""

    def write(self, event: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str, event: Optional[str] = None) -> list:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                if event is None or rec.get("event") == event:
                    out.append(rec)
    return out
