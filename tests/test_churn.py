"""Churn soak, marked slow: run with

    python -m pytest -m slow tests/test_churn.py -s

Peers are SIGKILLed, leave, join and restart from their checkpoints at random for three minutes
(p2pdiloco/bench/churn.py; ``python -m p2pdiloco.bench.churn --minutes 5`` runs it standalone).
"""
from __future__ import annotations

import json
import os

import pytest

from p2pdiloco.bench.churn import run

pytestmark = [pytest.mark.slow]

MAX_GAP_S = 60  # W: an outer step completes at least this often, whatever the churn


@pytest.mark.timeout(600)
def test_churn_soak(tmp_path):
    report = run(minutes=3, peers=4, min_peers=2, max_peers=5, every=12, out=str(tmp_path), seed=1, settings=[])
    print(json.dumps(report, indent=1))
    events = report["events"]
    assert events.get("kill", 0) >= 3 and events.get("join", 0) + events.get("restart", 0) >= 3, events  # it churned
    assert report["outer_steps"] >= 30, report
    assert report["longest_gap_s"] < MAX_GAP_S, report
    assert report["digest_agreement"], report["disagreements"]
    assert "exited" not in events, "a peer exited on its own during the soak"
    assert all(code == 0 for code in report["final_exit_codes"].values()), report["final_exit_codes"]
    # nothing left behind in any process group the soak started
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp_path).encode() in f.read():
                    alive.append(pid)
        except OSError:
            pass
    assert not alive, f"processes left behind: {alive}"
