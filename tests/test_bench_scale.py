"""bench.scale: the per-sync figures from the peers' metrics (fixtures), and the real command end to end
(``slow``: a bootstrap and two volunteers, about a minute)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2pdiloco.bench.scale import format_table, summarize


def _sync(frag, rnd, digest, ok=True, size=3, sent=1000, wait=0.5, secs=2.0):
    return {"event": "sync", "fragment": frag, "outer_step": rnd, "digest": digest, "ok": ok, "group_size": size,
            "sync_bytes_sent": sent, "group_wait_seconds": wait, "sync_seconds": secs}


def test_summarize_counts_per_sync_by_kind_and_finds_splits():
    ledger = {"find:progress": [10, 1000, 9000], "store:history": [2, 600, 40], "find:ready": [8, 800, 1200],
              "store:ready+group": [1, 100, 0], "find:node": [3, 300, 300], "ping:-": [1, 50, 50]}
    a = [_sync(0, 1, "d1"), _sync(1, 1, "e1"), _sync(0, 2, "d2", ok=False), {"event": "summary", "dht_ledger": ledger}]
    b = [_sync(0, 1, "d1"), _sync(1, 1, "OTHER", sent=3000), {"event": "summary", "dht_ledger": ledger}]
    c = [_sync(0, 1, "d1")]  # killed before its summary: its syncs count, its DHT bytes are unknown
    row = summarize(3, [a, b, c], {0: 4, 1: 6, 2: 5})
    assert (row["ok_syncs"], row["failed_syncs"], row["split_rounds"]) == (5, 1, 1)  # (1, 1): d/e vs OTHER
    assert row["peers_reporting"] == 2 and row["group_sizes"] == [3]
    total = sum(req + resp for _, req, resp in ledger.values())  # 13,440 bytes over 2 ok syncs, both peers
    assert row["dht_bytes_per_sync"] == round(total / 2, 1)
    kinds = row["dht_bytes_per_sync_by_kind"]
    assert kinds["progress"] == 5000.0 and kinds["history"] == 320.0 and kinds["ready"] == 1050.0
    assert kinds["node"] == 350.0 and kinds["group"] == 0.0  # ready+group counts under its first kind
    assert row["allreduce_bytes_per_sync"] == 1400.0 and row["connections_max"] == 6
    table = format_table([row])
    assert "| 3 | 5 / 1 / 1 | 3 | 6.7 KB |" in table and "5.0 KB / 0.3 KB / 1.1 KB / 0.0 KB / 0.3 KB" in table


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scale_benchmark_end_to_end(tmp_path):
    out = tmp_path / "scale"
    r = subprocess.run([sys.executable, "-m", "p2pdiloco.bench.scale", "--peers", "2", "--outer-steps", "2",
                        "--set", "inner.sync_every=20", "--out", str(out)], capture_output=True, text=True,
                       timeout=380, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["ok_syncs"] >= 2 and row["failed_syncs"] == 0 and row["group_sizes"] == [2]
    assert row["dht_bytes_per_sync"] > 0 and row["dht_bytes_per_sync_by_kind"]["progress"] > 0
    # each peer wrote its ledger at its first sync: the traffic after it, and its reads by purpose
    assert 0 < row["dht_bytes_per_sync_after_first"] and row["reads_per_sync_after_first"]
    assert row["connections_max"] >= 1 and (out / "scale.png").exists() and "| 2 |" in (out / "table.md").read_text()


def test_summarize_leaves_each_peers_start_out_of_the_traffic_after_its_first_sync():
    """The ledger a peer writes at its first sync is its start's: after-first figures are the summary's
    less that one, per later ok sync; reads by purpose likewise (a purpose a peer never read counts 0)."""
    first = {"find:progress": [4, 400, 3600], "find:ready": [2, 200, 300]}
    final = {"find:progress": [10, 1000, 9000], "find:ready": [8, 800, 1200], "find:node": [3, 300, 300]}
    a = [_sync(0, 1, "d1"), {"event": "dht_ledger", "dht_ledger": first, "time": 100.0,
                             "dht_reads": {"progress:start": 3, "progress:formation": 1}},
         _sync(1, 1, "e1"), _sync(0, 2, "d2"),
         {"event": "summary", "dht_ledger": final, "time": 140.0,
          "dht_reads": {"progress:start": 3, "progress:formation": 3, "ready:ready poll": 4}}]
    b = [_sync(0, 1, "d1"), _sync(1, 1, "e1"), {"event": "summary", "dht_ledger": final}]  # no first-sync ledger
    row = summarize(2, [a, b], {})
    # a: progress 10,000 - 4,000 = 6,000 bytes, ready 2,000 - 500, node 600, over its 2 later syncs
    assert row["dht_bytes_per_sync_after_first"] == round((6000 + 1500 + 600) / 2, 1)
    later = row["dht_bytes_per_sync_after_first_by_kind"]
    assert (later["progress"], later["ready"], later["node"]) == (3000.0, 750.0, 300.0)
    assert row["reads_per_sync_after_first"] == {"progress:formation": 1.0, "progress:start": 0.0,
                                                 "ready:ready poll": 2.0}
    assert row["dht_bytes_per_sync"] == round((12600 / 3 + 12600 / 2) / 2, 1)  # the whole run, as before
    # and per second: 8,100 bytes over the 40 s from a's first sync to its end, 20 s between its syncs
    assert row["dht_bytes_per_s_after_first"] == round(8100 / 40, 1) and row["seconds_per_sync_after_first"] == 20.0
    table = format_table([row])
    assert "| 4.0 KB | 3.0 KB / 0.0 KB / 0.8 KB / 0.0 KB / 0.3 KB | 20.0 | 0.2 KB |" in table
    assert "| peers | progress:formation | progress:start | ready:ready poll |" in table
    assert "| 2 | 1.00 | 0.00 | 2.00 |" in table


def test_slow_volunteers_get_the_fault_hooks_slow_rule():
    """--slow F: every volunteer's environment carries a rule the fault hook accepts (each inner step F times
    slower, every step); without it, only the ledger."""
    from p2pdiloco.bench.scale import _peer_env
    from p2pdiloco.faults import ENV_VAR, parse_faults

    assert _peer_env(1.0) == {"P2PDILOCO_DHT_LEDGER": "1"}
    (rule,) = parse_faults(_peer_env(3.5)[ENV_VAR])
    assert (rule.phase, rule.action, rule.factor, rule.times) == ("step", "slow", 3.5, 0)


@pytest.mark.timeout(240)
def test_a_benchmark_stopped_by_a_kill_stops_its_volunteers(tmp_path):
    """SIGTERM to the benchmark (each volunteer runs in a session of its own: the signal reaches none of
    them) ends the run through its cleanup: every volunteer, its DHT process and p2p daemon end too."""
    import signal
    import time

    import psutil

    p = subprocess.Popen([sys.executable, "-m", "p2pdiloco.bench.scale", "--peers", "2", "--outer-steps", "50",
                          "--set", "inner.sync_every=20", "--out", str(tmp_path / "scale")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    tag = f"swarm.run_id=scale-2-{p.pid}"
    boot_key = str(tmp_path / "scale" / "n2" / "boot.key")  # on the bootstrap peer's command line

    def volunteers(mark: str = tag):
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(mark in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        return found

    try:
        deadline = time.time() + 150
        while len(volunteers()) < 2 and time.time() < deadline and p.poll() is None:
            time.sleep(0.5)
        started = volunteers()
        assert len(started) == 2, "the volunteers did not start"
        while time.time() < deadline and not all(v.children(recursive=True) for v in started):
            time.sleep(0.5)  # their DHT processes and daemons up
        boot = volunteers(boot_key)
        family = {v.pid for v in started + boot}
        for v in started:
            family |= {c.pid for c in v.children(recursive=True)}
        assert boot and len(family) > 4  # its DHT process and daemon, the volunteers' own children too
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130 and "interrupted" in err, err[-2000:]

        def alive():
            left = []
            for pid in family:
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        left.append(pid)
                except psutil.NoSuchProcess:
                    pass
            return left

        # killed at once; a daemon whose parent was killed ends by itself (lifeline.py) within seconds
        deadline = time.time() + 15
        while alive() and time.time() < deadline:
            time.sleep(0.5)
        assert not alive(), f"still running after the benchmark ended: {alive()}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for v in volunteers() + volunteers(boot_key):
            v.kill()
