"""The emulated WAN harness: namespaces come and go cleanly, shaping is really in effect,
and hivemind's DHT (p2pd) works across namespaces. Needs root, ``ip`` and ``tc``."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from p2pdiloco.bench.wan import (
    EmulatedWAN,
    LinkSpec,
    cleanup_stale,
    measure_rtt,
    measure_throughput,
)
from p2pdiloco.errors import ConfigError

_missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_missing),
    reason="the emulated WAN needs root and iproute2 (ip, tc)"
    + (f"; missing: {', '.join(_missing)}" if _missing else "; not running as root"),
)
pytestmark = [pytest.mark.netem, pytest.mark.timeout(120)]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rate_mbit=0), "rate_mbit"),
        (dict(rate_mbit=float("nan")), "rate_mbit"),
        (dict(delay_ms=-1), "delay_ms"),
        (dict(delay_ms=10, jitter_ms=20), "jitter_ms"),
        (dict(loss_pct=100), "loss_pct"),
        (dict(loss_pct="1"), "loss_pct"),
    ],
)
def test_linkspec_rejects_impossible_values(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LinkSpec(**kwargs).validate()


def test_wan_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="LinkSpecs"):
        EmulatedWAN(3, [LinkSpec(), LinkSpec()])
    with pytest.raises(ConfigError, match="n_hosts"):
        EmulatedWAN(0, LinkSpec())


@needs_root
def test_namespaces_created_and_removed():
    with EmulatedWAN(3, LinkSpec(rate_mbit=100)) as wan:
        created = set(wan.namespaces)
        assert len(created) == 4 and created <= _netns()
        assert len({h.address for h in wan.hosts}) == 3
        for h in wan.hosts:  # loopback up, address on eth0
            out = h.run(["ip", "-o", "addr", "show"]).stdout
            assert "127.0.0.1" in out and h.address in out
        assert measure_rtt(wan.hosts[0], wan.hosts[2], count=2) < 5
    # only our own namespaces: other harnesses (a benchmark, a parallel test) may exist meanwhile
    assert not (created & _netns())


@needs_root
def test_namespaces_and_processes_removed_when_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedWAN(2, LinkSpec(rate_mbit=10, delay_ms=5)) as wan:
            created = set(wan.namespaces)
            proc = wan.hosts[0].popen(["sleep", "600"])
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert created and not (created & _netns())


@needs_root
def test_sigterm_tears_down_and_still_terminates():
    script = textwrap.dedent(
        """
        import sys, time
        from p2pdiloco.bench.wan import EmulatedWAN, LinkSpec
        with EmulatedWAN(2, LinkSpec(rate_mbit=10, delay_ms=5)) as wan:
            print(" ".join(wan.namespaces), flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 3 and set(names) <= _netns()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (set(names) & _netns())


@needs_root
def test_cleanup_stale_removes_only_dead_owners():
    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = "pdwantest-"
    stale, alive = f"{prefix}{dead.pid}-0-sw", f"{prefix}{os.getpid()}-0-sw"
    for ns in (stale, alive):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert cleanup_stale(prefix) == [stale]
        remaining = _netns()
        assert stale not in remaining and alive in remaining
    finally:
        for ns in (stale, alive):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_root
@pytest.mark.parametrize("rate", [10, 50])
def test_throughput_is_shaped(rate):
    with EmulatedWAN(2, LinkSpec(rate_mbit=rate)) as wan:
        measured = measure_throughput(wan.hosts[0], wan.hosts[1], seconds=2.5)
    assert 0.8 * rate <= measured <= 1.2 * rate, f"configured {rate} Mbit/s, measured {measured:.2f}"


@needs_root
def test_delay_gives_expected_rtt_and_rate_holds():
    with EmulatedWAN(2, LinkSpec(rate_mbit=20, delay_ms=50)) as wan:
        rtt = measure_rtt(wan.hosts[0], wan.hosts[1])
        measured = measure_throughput(wan.hosts[1], wan.hosts[0], seconds=3)
    assert 75 <= rtt <= 125, f"expected RTT ≈ 100 ms (2 × 50 ms one-way), measured {rtt:.1f} ms"
    assert 16 <= measured <= 24, f"configured 20 Mbit/s with 100 ms RTT, measured {measured:.2f}"


_DHT_SERVER = """
import sys, time, hivemind
from hivemind.utils import get_dht_time
dht = hivemind.DHT(host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"], start=True)
assert dht.store("wan-key", "from-h0", get_dht_time() + 600)
print(" ".join(str(m) for m in dht.get_visible_maddrs()), flush=True)
time.sleep(90)
"""

_DHT_CLIENT = """
import sys, hivemind
dht = hivemind.DHT(host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"], initial_peers=sys.argv[2:], start=True)
found = dht.get("wan-key", latest=True)
print("VALUE", found.value if found is not None else None, flush=True)
dht.shutdown()
"""


@needs_root
def test_hivemind_dht_across_namespaces(tmp_path):
    pytest.importorskip("hivemind")
    with EmulatedWAN(2, LinkSpec(rate_mbit=100, delay_ms=5)) as wan:
        h0, h1 = wan.hosts
        err0 = open(tmp_path / "h0.err", "w")
        server = h0.popen([sys.executable, "-c", _DHT_SERVER, h0.address], stdout=subprocess.PIPE, stderr=err0, text=True)
        maddrs = server.stdout.readline().split()
        assert maddrs and all(h0.address in m for m in maddrs), (tmp_path / "h0.err").read_text()[-2000:]
        client = h1.run([sys.executable, "-c", _DHT_CLIENT, h1.address, *maddrs], timeout=60, check=False)
        assert "VALUE from-h0" in client.stdout, client.stderr[-2000:]
    assert server.poll() is not None
