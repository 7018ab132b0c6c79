"""The hivemind data-parallel baseline, on 127.0.0.1: it really is lockstep synchronous data
parallelism (one batch per peer per step, every step averaged, replicas equal) and writes
metrics.jsonl in the format of ``p2pdiloco join``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("hivemind")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny-diloco.toml")  # tiny-cpu.toml + the blocking fp32 scheme


def _start(argv, log_path, cwd):
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(argv, stdout=subprocess.PIPE if "bootstrap" in argv else log, stderr=log, cwd=cwd,
                            env=env, start_new_session=True, text=True)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.mark.slow  # ~40 s on an idle 2-core machine; run with: make test-slow
@pytest.mark.timeout(300)
def test_hivemind_dp_is_lockstep_data_parallel(tmp_path):
    procs = []
    try:
        boot = _start([sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--identity", str(tmp_path / "b.key")],
                      tmp_path / "boot.log", tmp_path)
        procs.append(boot)
        maddr = ""
        deadline = time.time() + 90
        while "/p2p/" not in maddr and time.time() < deadline:
            maddr = boot.stdout.readline().strip()
        assert "/p2p/" in maddr, (tmp_path / "boot.log").read_text()[-2000:]
        steps = 3
        peers = []
        for i in range(2):
            argv = [sys.executable, "-m", "p2pdiloco.bench.hivemind_dp", "--initial-peers", maddr, "--config", TINY,
                    "--peers", "2", "--steps", str(steps), "--eval-every", "2", "--iface", "lo",
                    "--set", f"data.shard={i}", "--set", "data.num_shards=2", "--set", "swarm.run_id=dp-test",
                    "--set", f"train.run_dir={tmp_path / f'p{i}'}", "--summary-json", str(tmp_path / f"s{i}.json")]
            peers.append(_start(argv, tmp_path / f"p{i}.log", tmp_path))
        procs += peers
        for i, p in enumerate(peers):
            assert p.wait(200) == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
    finally:
        for p in procs:
            _kill(p)

    finals = []
    for i in range(2):
        events = [json.loads(line) for line in (tmp_path / f"p{i}" / "metrics.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert kinds == ["start"] + ["sync"] * steps + ["summary"]
        syncs = events[1:-1]
        # lockstep: one batch of this peer in every global step, and every step averaged
        assert [e["step"] for e in syncs] == [1, 2, 3] and [e["outer_step"] for e in syncs] == [1, 2, 3]
        assert all(e["ok"] and e["samples"] == 8 for e in syncs)
        assert [e["val_loss"] is not None for e in syncs] == [False, True, True]  # every 2 steps and at the end
        summary = events[-1]
        assert summary["inner_steps"] == steps and summary["failed_syncs"] == 0
        assert summary["val_loss_end"] < summary["val_loss_start"]
        assert summary["bytes_sent"] > steps * 842_496 * 4 / 2  # loopback counters: gradients went through
        assert json.loads((tmp_path / f"s{i}.json").read_text())["inner_steps"] == steps
        finals.append(summary["val_loss_end"])
    # the same averaged gradients on both replicas (hivemind's averages differ by ~1 ULP)
    assert finals[0] == pytest.approx(finals[1], abs=1e-4)
