"""The benchmark: its bookkeeping on fixtures (fast, no root), and an end-to-end smoke run of the
real command across an emulated WAN (``netem``: needs root, ``ip`` and ``tc``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from p2pdiloco.bench.hivemind_dp import _count_partial_averages, read_iface_bytes
from p2pdiloco.bench.run import BASELINES, MATRICES, MATRIX_SETS, MODES, format_table, summarize_mode, windowed_peak

_missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_missing),
    reason="the emulated WAN needs root and iproute2 (ip, tc)"
    + (f"; missing: {', '.join(_missing)}" if _missing else "; not running as root"),
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROC_NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0
  eth0: 5000000    4000    0    0    0     0          0         0  7000000    5000    0    0    0     0       0          0
"""


def test_read_iface_bytes(tmp_path):
    path = tmp_path / "dev"
    path.write_text(_PROC_NET_DEV)
    assert read_iface_bytes("eth0", str(path)) == (7_000_000, 5_000_000)  # (tx, rx)
    assert read_iface_bytes("eth1", str(path)) is None
    assert read_iface_bytes("eth0", str(tmp_path / "missing")) is None


def test_partial_averages_are_counted_across_fork():
    """hivemind reports a partial average only as a warning, in its forked averager process."""
    import logging
    import multiprocessing

    counter = _count_partial_averages()

    def child():
        log = logging.getLogger("hivemind.averaging.partition")
        log.warning("Averaging: received 66.7% results")
        log.warning("something else")

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and counter.value == 1


def test_every_matrix_names_known_modes():
    for name, modes in MATRICES.items():
        assert modes, name
        for mode in modes:
            assert mode in MODES or mode in BASELINES, (name, mode)
    assert not set(MODES) & set(BASELINES)


def test_every_mode_is_a_valid_configuration():
    from p2pdiloco.config import load_config

    for mode, overrides in MODES.items():  # the bench resolves round_samples=auto per run (4 peers here)
        sets = [s.replace("round_samples=auto", "round_samples=3840") for s in overrides]
        load_config("peers/tiny-cpu.toml", [*MATRIX_SETS["long"], *sets])  # raises ConfigError naming the key


def _ev(event, t, **kw):
    return {"event": event, "time": t, **kw}


def _peer(t0, shift, val_at, sync_s):
    """Two syncs after steps 5 and 10; validation losses from ``val_at``."""
    return [
        _ev("start", t0 + shift, val_loss=5.0, step=0),
        _ev("sync", t0 + 10, step=5, fragment=0, outer_step=1, ok=True, val_loss=val_at[0], sync_seconds=sync_s),
        _ev("sync", t0 + 15, step=10, fragment=0, outer_step=2, ok=False, val_loss=val_at[0], sync_seconds=1.0),
        _ev("sync", t0 + 20, step=10, fragment=0, outer_step=2, ok=True, val_loss=val_at[1], sync_seconds=sync_s),
        _ev("summary", t0 + 20, inner_steps=10, bytes_sent=900, failed_syncs=1, val_loss_end=val_at[1]),
    ]


def test_summarize_mode_on_fixture():
    t0 = 1000.0
    peers = [_peer(t0, 0, (4.0, 3.0), 2.0), _peer(t0, 0.5, (4.0, 3.0), 3.0)]
    # interface samples: (time, [(tx, rx) per host]) - 2 peers and the bootstrap host
    samples = [(t0 - 1, [(50, 0), (70, 0), (0, 0)]),
               (t0 + 0.4, [(100, 10), (100, 10), (0, 0)]),
               (t0 + 10.0, [(600, 500), (400, 300), (0, 0)]),
               (t0 + 10.5, [(1100, 900), (600, 500), (0, 0)]),
               (t0 + 20.5, [(1200, 1000), (1300, 1100), (9, 9)])]
    m = summarize_mode(peers, samples, tokens_per_step=8 * 128, baseline=False)
    assert m["wall_seconds"] == pytest.approx(19.5)            # from the last start to the last summary
    assert m["tokens"] == 2 * 10 * 8 * 128
    assert [c["tokens"] for c in m["curve"]] == [0, 2 * 5 * 1024, 2 * 10 * 1024]
    assert [c["val_loss"] for c in m["curve"]] == [5.0, 4.0, 3.0]   # failed syncs carry no point
    assert m["curve"][1]["seconds"] == pytest.approx(9.5)
    # bytes from the last sample at/before training start to the last one
    assert m["bytes_sent_per_peer"] == pytest.approx(((1200 - 100) + (1300 - 100)) / 2)
    assert m["bytes_sent_per_peer_max"] == 1200
    assert m["peak_bytes_per_s_max"] == pytest.approx(500 / 0.5)
    # over 1 s: from t0 + 10.0 to the next sample at least 1 s later (t0 + 20.5), per peer, averaged
    assert m["peak_bytes_per_s_by_window"]["1"] == pytest.approx(((1200 - 600) + (1300 - 400)) / 10.5 / 2)
    assert m["peak_bytes_per_s_by_window"]["8"] <= m["peak_bytes_per_s_by_window"]["0.5"]
    assert m["counted_bytes_sent_per_peer"] == 900
    # utilization = 1 - (time blocked in syncs) / wall, per peer, averaged
    assert m["utilization_per_peer"] == [pytest.approx(1 - 5 / 19.5, abs=1e-4), pytest.approx(1 - 7 / 19.5, abs=1e-4)]
    assert m["failed_syncs"] == 2
    assert m["val_loss_final"] == 3.0 and m["val_loss_final_spread"] == 0.0
    # the final loss is the peers' val_loss_end (the global model after finish()), not the last sync's
    ended = [evs[:-1] + [dict(evs[-1], val_loss_end=v)] for evs, v in zip(peers, (2.5, 2.7))]
    m_end = summarize_mode(ended, samples, tokens_per_step=8 * 128, baseline=False)
    assert m_end["val_loss_final"] == pytest.approx(2.6) and m_end["curve"][-1]["val_loss"] == 3.0
    baseline = summarize_mode(peers, samples, tokens_per_step=1024, baseline=True)
    assert baseline["counted_bytes_sent_per_peer"] is None   # hivemind counts nothing of its own
    # overlapped modes: the loop's own total of time blocked on the network wins over sync durations
    for evs in peers:
        evs[-1].update(network_wait_seconds=1.5, compute_seconds=9.75)
    m = summarize_mode(peers, samples, tokens_per_step=1024, baseline=False)
    assert m["utilization"] == pytest.approx(1 - 1.5 / 19.5)
    assert m["compute_fraction"] == pytest.approx(0.5)


def test_windowed_peak_tells_one_burst_from_several_small_ones():
    """Same bytes, 0.5 s samples: one 4 MB burst in 1 s every 8 s, or a 1 MB burst in 0.25 s every 2 s.
    At 0.5 s both fill the link (the small burst's 0.25 s is inside one sample); from the length of
    the big burst up to the interval between small bursts, the peak differs by the burst size."""
    def series(burst_bytes, burst_s, every):
        pts, total, t = [], 0.0, 0.0
        while t <= 32.0:
            phase = t % every
            total_at = (t // every) * burst_bytes + burst_bytes * min(phase / burst_s, 1.0)
            pts.append((t, total_at))
            t += 0.5
        return pts

    whole, quarter = series(4e6, 1.0, 8.0), series(1e6, 0.25, 2.0)
    assert windowed_peak(whole, 0.5) == pytest.approx(4e6)          # the link rate, both
    assert windowed_peak(quarter, 0.5) == pytest.approx(2e6)        # 1 MB in the first sample after the burst
    assert windowed_peak(whole, 1.0) == pytest.approx(4e6)
    assert windowed_peak(whole, 2.0) / windowed_peak(quarter, 2.0) == pytest.approx(4.0, rel=0.3)
    assert windowed_peak(whole, 32.0) == pytest.approx(windowed_peak(quarter, 32.0), rel=0.1)  # equal bytes
    assert windowed_peak(whole, 64.0) == 0.0                         # no span that long
    assert windowed_peak([], 1.0) == 0.0


def test_format_table_marks_skipped_modes_and_ratios():
    ok = {"status": "ok", "tokens": 1000, "val_loss_final": 3.0, "wall_seconds": 10.0, "bytes_sent_per_peer": 1e6,
          "counted_bytes_sent_per_peer": None, "peak_bytes_per_s_per_peer": 1e5, "utilization": 0.5,
          "time_to_target_seconds": 9.0}
    results = {"modes": {
        "hivemind-dp": ok,
        "diloco-fp32": dict(ok, val_loss_final=3.03, bytes_sent_per_peer=1e4, counted_bytes_sent_per_peer=9e3),
        "diloco-nf4": {"status": "skipped", "note": "rejected by the CLI: unknown codec 'nf4'"},
    }}
    table = format_table(results)
    lines = table.splitlines()
    assert len({line.count("|") for line in lines}) == 1       # every row has every column
    assert "100.0x" in lines[3] and "+1.0%" in lines[3]
    assert "skipped" in lines[4] and "unknown codec" in lines[4]


def test_in_process_overlap_comparison_runs_each_variant_and_peers_agree():
    """bench.eager: the network taken out, every peer of a variant ends on one global copy, the
    variants differ (eager restarts from its estimate), and an unknown variant is a clear error."""
    from p2pdiloco.bench.eager import main, run_variant
    from conftest import TINY

    sets = ["model.d_model=32", "model.n_heads=2", "model.seq_len=32", "inner.batch_size=2", "inner.sync_every=4"]
    runs = {v: run_variant(TINY, sets, v, peers=2, outer_steps=2, eval_batches=2) for v in ("blocking", "eager@0.5")}
    assert all(r["peers_agree"] and len(r["val_after_each_outer_step"]) == 2 for r in runs.values()), runs
    assert runs["eager@0.5"]["outer_lr"] == 0.5
    assert runs["blocking"]["final_val_loss"] != runs["eager@0.5"]["final_val_loss"]
    assert main(["--variants", "blocking,guess"]) == 2


@needs_root
@pytest.mark.netem
@pytest.mark.timeout(300)
def test_long_matrix_smoke_extrapolates_data_parallelism_from_a_short_networked_run(tmp_path):
    """The real command, the long-horizon matrix in small (its settings, two of its modes: the hivemind
    baseline and the default scheme; the other two are the same machinery with other --set values) on
    2 peers and a shaped link. The harness: results, table and plots are written, the link was shaped,
    the interface saw at least the counted bytes, every namespace is gone afterwards. The long matrix:
    the networked hivemind baseline runs 3 of the 20 steps; data parallelism's curve over all 20 comes
    from the in-process reference, checked against the networked validations over the steps both ran;
    time and bytes are the networked run's per step x 20."""
    from p2pdiloco.bench.run import MATRICES

    def netns():
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        return {line.split()[0] for line in listed.splitlines() if line.strip()}

    assert MATRICES["long"] == ("hivemind-dp", "diloco-fp32", "default", "streaming4-tau4-nf4-lowrank")
    out = tmp_path / "long"
    rate = 50
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco.bench.run", "--matrix", "long", "--modes", "hivemind-dp,default",
         "--peers", "2", "--rate", str(rate),
         "--delay", "5", "--steps", "20", "--dp-steps", "3", "--set", "inner.sync_every=20",
         "--set", "train.eval_batches=2", "--set", "data.max_bytes=400000", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the harness tears its network down on SIGTERM
            proc.wait(30)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # the harness names its namespaces after its pid (other harnesses may be running alongside)
    assert not [ns for ns in netns() if ns.startswith(f"pdwan-{proc.pid}-")]
    assert "network: 3 namespaces" in stdout
    assert "default: starting" in stdout and "| default | ok |" in stdout
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "bytes_vs_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "table.md").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] in ("tbf + relay", "tbf + netem")
    modes = results["modes"]
    assert set(modes) == {"hivemind-dp", "default", "dp-reference"}
    assert all(m["status"] == "ok" for m in modes.values()), {k: m.get("note") for k, m in modes.items()}
    net, ref = modes["hivemind-dp"], modes["dp-reference"]
    assert net["tokens"] == 2 * 3 * 8 * 128 and ref["tokens"] == 2 * 20 * 8 * 128 == modes["default"]["tokens"]
    check = ref["check_against_networked"]
    assert check["matched"] >= 2, check  # steps 1, 2, 3 were validated over the network
    # the same math; measured here: the networked run lags by ~1% over its first steps (its first update is
    # smaller: between an lr of 0.05x and 0.1x where ours is the warm-up's 0.1x; not traced, docs/benchmark.md)
    assert check["max_rel_diff"] < 0.02, check
    assert ref["wall_seconds"] == pytest.approx(20 * ref["seconds_per_step"], rel=0.01)
    assert ref["bytes_sent_per_peer"] == pytest.approx(20 / 3 * net["bytes_sent_per_peer"], rel=0.01)
    # the default scheme ran (4 fragments, 4-bit: one outer step's syncs against 20 fp32 gradient all-reduces)
    # and the table compares it with dp-reference
    default = modes["default"]
    counted = default["counted_bytes_sent_per_peer"]
    assert 0 < counted < ref["bytes_sent_per_peer"] / 20, (default, ref)
    assert counted <= default["bytes_sent_per_peer"] <= 1.3 * counted + 2e6  # what we counted, plus headers
    for m in (net, default):
        assert m["peak_bytes_per_s_max"] <= 1.2 * rate * 1e6 / 8  # the link was shaped
    assert default["val_loss_final"] < default["val_loss_start"] and 0 < default["utilization"] <= 1
    assert "| dp-reference | ok |" in stdout and "+0.0%" in stdout.split("| dp-reference |")[1].split("\n")[0]
    assert results["target_rule"]
