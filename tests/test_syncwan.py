"""bench.syncwan (sync at scale on the emulated WAN), at a tiny size: 2 peers in their own
namespaces, 200k values, one 100 Mbit/s link with 50 ms one-way delay, ours fp32 / e3m0 / e3m0 +
low-rank and hivemind fp32. Every result is checked (bitwise identical on both peers, error within
the codec's bound) and the limits are the formulas' for that payload. About 30 s on the idle 2-core
machine; marker ``netem`` (root, ip, tc)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from p2pdiloco.bench import syncwan
from p2pdiloco.compression import get_codec

_missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or bool(_missing),
                                reason="the emulated WAN needs root and iproute2 (ip, tc)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_limits_are_the_formulas():
    e = get_codec("e3m0").encoded_size(100_000_000)  # 4.5 bits a value
    lim = syncwan.limits(e, peers=4, rate_mbit=100, delay_ms=50)
    assert lim["limit_a"] == pytest.approx(0.75 * e * 8 / 100e6 + 0.1)
    assert lim["limit_b"] == pytest.approx(2 * 0.75 * e * 8 / 100e6 + 0.1)
    assert syncwan.limits(e, 4, 1000, 50, phases=3)["round_trips_s"] == pytest.approx(0.3)


def test_lowrank_shapes_hold_about_numel_values():
    for numel in (200_000, 100_000_000):
        shapes = syncwan.lowrank_shapes(numel)
        total = sum(s[0] * (s[1] if len(s) == 2 else 1) for s in shapes)
        assert abs(total - numel) / numel < 0.1 and len(shapes[-1]) == 1
    assert syncwan.lowrank_shapes(100_000_000)[0] == (4096, 4096)


def test_not_root_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert syncwan.main(["--peers", "2", "--numel", "1K", "--rates", "100", "--out", str(tmp_path)]) == 2
    assert "error: the emulated WAN needs root" in capsys.readouterr().err


@pytest.mark.netem
@needs_root
@pytest.mark.timeout(150)
def test_tiny_sync_on_the_emulated_wan(tmp_path):
    numel, peers, rate, delay = 200_000, 2, 100.0, 50.0
    argv = [sys.executable, "-m", "p2pdiloco.bench.syncwan", "--peers", str(peers), "--numel", "200K",
            "--rates", "100", "--delay", "50", "--codecs", "fp32,e3m0,e3m0+lowrank", "--hivemind", "fp32",
            "--repeat", "1", "--probe-seconds", "0", "--timeout", "60", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "limit a" in proc.stdout and "load average at start" in proc.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["git"]["commit"] and res["machine"]["cores"] and res["links"][0]["backend"]
    rows = {(r["impl"], r["codec"]): r for r in res["rows"]}
    assert set(rows) == {("p2pdiloco", "fp32"), ("p2pdiloco", "e3m0"), ("p2pdiloco", "e3m0+lowrank"),
                         ("hivemind", "fp32")}
    rtt = 2 * delay / 1000
    for (impl, codec), r in rows.items():
        assert r["identical"], (impl, codec)       # both peers hold the same bytes
        assert r["seconds"] >= rtt                  # the sync crossed the delayed link
        assert r["usage"]["window_s"] > 0 and r["bound"] in ("link", "relay", "CPU", "other")
        if codec.endswith("+lowrank"):
            # DiLoCo's reducer: a header (fp32), then P and Q with e3m0, each phase one round trip
            assert [p[0] for p in r["phases"]] == ["hdr", "p", "q"]
            assert [p[2] for p in r["phases"]] == ["fp32", "e3m0", "e3m0"]
            assert r["encoded_bytes"] == sum(get_codec(p[2]).encoded_size(p[1]) for p in r["phases"])
            assert r["ranks"] == [3]                # the synthetic matrices' rank, agreed
            assert r["max_rel_err"] < 0.5 and r["within_bound"] is None
            k = 3
        else:
            assert r["encoded_bytes"] == get_codec(codec).encoded_size(numel)
            assert r["within_bound"] and r["max_rel_err"] <= r["error_bound"]
            k = 1
        e = r["encoded_bytes"]
        assert r["limit_a"] == pytest.approx((peers - 1) / peers * e * 8 / (rate * 1e6) + k * rtt, abs=1e-4)
        assert r["limit_b"] == pytest.approx(2 * (peers - 1) / peers * e * 8 / (rate * 1e6) + k * rtt, abs=1e-4)
        assert r["x_limit_b"] == pytest.approx(r["seconds"] / r["limit_b"], abs=0.01)
    assert rows[("p2pdiloco", "fp32")]["max_rel_err"] < 1e-6
    assert rows[("p2pdiloco", "e3m0")]["max_rel_err"] > 0  # lossy, and checked against the exact mean
