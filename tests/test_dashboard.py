"""The web dashboard, end to end through the real CLI and a real browser.

A bootstrap peer and a dashboard start first (the page shows an empty swarm, not an error), then
two volunteers (one also serving the dashboard itself, ``join --dashboard-port``) and a stranger
who stores a crafted progress record with markup in its failed-round reason (and, valid too, a
null round and a one-ulp loss range at outer steps 2**53 and 2**53 + 2). Headless Chromium
loads the page until it lists both volunteers and a validation-loss plot of at least 2 points; the
stranger's ``<script>`` is shown as text and never runs; a screenshot is saved. ``/api/swarm`` is
checked against ``p2pdiloco status --json`` read just before and just after it.

Records at the schema's edges (one-ulp loss ranges, outer steps at 2**53, null rounds, NaN, 1e308,
counts of 2**62, the largest records, more peers than the dashboard lists): the page's chart code
under node, ``status`` and ``status --json``, the document's size and cost at the view's limits, the
server's connection bounds (idle, flooding and dripping clients), and in Chromium, pages served from
a view fed those records directly.

Chromium is installed from the system's packages (apt-get) when missing and we are root; without
root and without Chromium the test is skipped with that reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List

import pytest

from conftest import TINY
from p2pdiloco.config import load_config
from p2pdiloco.dashboard import Dashboard, SwarmView
from p2pdiloco.metrics import read_metrics
from p2pdiloco.swarm import records

RUN = "dashtest"
SETTINGS = ["inner.sync_every=10", "inner.batch_size=4", f"swarm.run_id={RUN}", "train.progress_bar=false",
            "swarm.min_peers_to_start=2"]
#: what a stranger puts in its own record: would mark the page if the browser ever ran it
PAYLOAD = ('<script>document.body.dataset.pwned="script"</script>'
           '<img src=x onerror="document.body.dataset.pwned=\'img\'">')
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless_shell")

STRANGER = r"""
import sys, time
from p2pdiloco.swarm.node import SwarmNode
addr, run, payload = sys.argv[1:4]
node = SwarmNode([addr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=30, client_mode=True)
print(node.peer_id_str, flush=True)
record = {"reach": "public", "lw": 3, "round": None}
history = {"fr": [3], "ff": [0], "ft": [time.time()], "fw": [payload],
           "vr": [2**53, 2**53 + 2], "vl": [1.0, 1.0000000000000002]}  # valid, at the schema's edges
while True:  # killed by the test's teardown
    node.store(f"{run}:progress", dict(record, t=time.time()), ttl=8, subkey=node.peer_id_str)
    node.store(f"{run}:history", dict(history, t=time.time()), ttl=8, subkey=node.peer_id_str)
    time.sleep(1.5)
"""


# ---- the records' history fields and the view, without a network --------------------------------------
def test_history_fields_are_small_and_readable_by_older_peers():
    rec: Dict[str, Any] = {}
    for step in range(40):
        records.note_val_loss(rec, step, 5.0 - step / 10)
    records.note_val_loss(rec, 39, 1.0)  # a later measurement of the same outer step replaces it
    records.note_val_loss(rec, 40, float("nan"))  # not kept (val_loss still shows it)
    for k in range(6):
        records.note_failure(rec, k, 1, "x" * 500 if k == 5 else f"reason {k}", when=100.0 + k)
    assert rec["vr"] == list(range(24, 40)) and rec["vl"][-1] == 1.0 and len(rec["vl"]) == records.VAL_HISTORY
    assert rec["fr"] == [2, 3, 4, 5] and rec["ft"] == [102.0, 103.0, 104.0, 105.0]
    assert len(rec["fw"][-1]) == records.FAIL_REASON_CHARS and rec["fw"][0] == "reason 2"
    assert records._check_data("history", rec) is None
    assert records._check_data("history", {}) is None
    # a peer of the previous version checks unknown fields only as "small scalars or short lists"
    assert records.GenericRecord.parse_obj(rec)
    import msgpack
    assert len(msgpack.packb(rec)) < 600
    too_long = dict(rec, vr=list(range(17)), vl=[1.0] * 17)
    assert "vr" in records._check_data("history", too_long)
    assert "fw" in records._check_data("history", dict(rec, fw=["<b>"] * 3 + ["y" * 161]))


def test_the_view_takes_each_peers_history_from_its_history_record():
    """Losses and failures come from ``<run>:history``, joined to the live peers' progress records: a
    history without a live progress record shows nothing, and a failed history read costs nothing
    else."""
    clock = [1000.0]
    view = SwarmView("r", period=2.0, clock=lambda: clock[0])
    progress = {"A": {"t": 1000.0, "samples": 0, "sent": 0, "recv": 0, "round": 1, "val_loss": 4.0},
                "B": {"t": 1000.0, "samples": 0, "sent": 0, "recv": 0, "round": 1, "val_loss": 4.2}}
    history = {"A": {"vr": [0, 1], "vl": [5.5, 4.0], "fr": [1], "ff": [2], "ft": [999.0], "fw": ["owner left"],
                     "t": 5.0},
               "C": {"vr": [7], "vl": [1.0]}}  # C has no live progress record: not shown
    reads = {"history": 0}

    def read_history():
        reads["history"] += 1
        if reads["history"] == 2:
            raise ConnectionError("DHT down for a moment")
        return history

    view.attach(lambda: progress, None, read_history)
    view.refresh()
    doc = view.document()
    assert doc["val_loss"] == {"A": [[0, 5.5], [1, 4.0]], "B": [[1, 4.2]]}, doc["val_loss"]
    assert [(f["peer"], f["outer_step"], f["reason"]) for f in doc["failures"]] == [("A", 1, "owner left")]
    assert set(doc["peers"]) == {"A", "B"} and doc["peers"]["A"] == progress["A"]  # shown: the progress record
    clock[0] += 2.0
    view.refresh()  # the history read fails: the progress read still counts, what was shown stays
    doc = view.document()
    assert doc["dht"]["ok"] and doc["val_loss"]["A"] == [[0, 5.5], [1, 4.0]] and reads["history"] == 2


def test_local_workers_of_a_record():
    from p2pdiloco.dashboard.view import local_workers

    assert [local_workers(v) for v in ({"lw": 8}, {}, {"lw": True}, {"lw": 0}, {"lw": "8"}, {"lw": 10**9})] == \
        [8, 1, 1, 1, 1, 1]


def test_view_rates_history_failures_and_no_nan():
    clock = [1000.0]
    reads = []
    view = SwarmView("r", period=2.0, clock=lambda: clock[0])
    view.refresh()  # not attached yet: an empty swarm that says it is connecting
    doc = view.document()
    assert doc["peers"] == {} and not doc["dht"]["ok"] and "connecting" in doc["dht"]["error"]
    view.attach(lambda: reads[-1], lambda: {"x": {"fp": "f", "fields": {"model.seq_len": 64}}})

    def read(recs):
        reads.append(recs)
        view.refresh()
        clock[0] += 2.0

    a = {"t": 1000.0, "samples": 0, "sent": 0, "recv": 0, "round": 0, "val_loss": 5.5, "vr": [0], "vl": [5.5],
         "synced_step": 0, "digest": "aa"}
    old = {"t": 1000.0, "samples": 0, "sent": 0, "recv": 0, "round": 2, "val_loss": float("nan"),
           "synced_step": 20, "digest": "bb"}  # a peer of the previous version: no history fields
    read({"A": dict(a, lw=2), "B": old, "G": {"gone": True}})
    # each peer's local workers (join --local-workers): its lw, 1 without one (as status counts)
    assert view.document()["local_workers"] == {"A": 2, "B": 1}
    read({"A": dict(a, t=1002.0, samples=40, sent=4000, recv=2000, round=1, vr=[0, 1], vl=[5.5, 4.0]),
          "B": dict(old, t=1002.0, samples=10, sent=1000, recv=1000, round=3, val_loss=4.5)})
    read({"A": dict(a, t=1004.0, samples=80, sent=8000, recv=4000, round=1, vr=[0, 1], vl=[5.5, 4.0],
                    fr=[2], ff=[0], ft=[1003.5], fw=["matchmaking timed out"], synced_step=20, digest="cc")})
    doc = json.loads(json.dumps(view.document(), allow_nan=False))  # valid JSON for the browser
    assert set(doc["peers"]) == {"A"}  # B left, G said goodbye
    assert doc["local_workers"] == {"A": 1}  # A's latest record has no lw: one worker (as status counts)
    assert doc["val_loss"] == {"A": [[0, 5.5], [1, 4.0]], "B": [[3, 4.5]]}  # B's points stay after it left
    assert [r["peers"] for r in doc["rates"]] == [2, 2, 1]
    # A: 40 samples / 2 s; B: 10 / 2 s; tokens = samples * seq_len; B's rate is dropped once it left
    assert doc["rates"][1]["samples_per_s"] == 25.0 and doc["rates"][1]["tokens_per_s"] == 25.0 * 64
    assert doc["rates"][1]["sent_per_s"] == 2500.0 and doc["rates"][2]["samples_per_s"] == 20.0
    assert doc["failures"] == [{"peer": "A", "outer_step": 2, "fragment": 0, "t": 1003.5,
                                "reason": "matchmaking timed out"}]
    assert doc["digests"] == {"step": 20, "groups": [{"digest": "cc", "peers": ["A"]}], "elsewhere": []}
    # a restarted peer (counters back to 0) has no rate until its next record, not a negative one
    read({"A": dict(a, t=1006.0, samples=4, sent=10, recv=10)})
    assert view.document()["rates"][-1]["samples_per_s"] == 0
    # a failed read is reported, the last good view kept
    reads.append(None)
    view._read_progress = lambda: 1 / 0
    view.refresh()
    doc = view.document()
    assert not doc["dht"]["ok"] and "ZeroDivisionError" in doc["dht"]["error"] and set(doc["peers"]) == {"A"}


def test_server_routes_headers_and_port_in_use():
    from p2pdiloco.dashboard import Dashboard
    from p2pdiloco.errors import UserError

    view = SwarmView("r")
    dash = Dashboard(view, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(dash.url, timeout=10) as r:
            page = r.read().decode()
            csp = r.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "/static/dashboard.js" in page
        assert _get(dash.url + "api/swarm")["peers"] == {}
        for path, code in (("static/../server.py", 404), ("nope", 404)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(dash.url + path, timeout=10)
            assert e.value.code == code
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(dash.url + "api/swarm", data=b"x"), timeout=10)
        assert e.value.code == 405
        with urllib.request.urlopen(urllib.request.Request(dash.url + "api/swarm", method="HEAD"), timeout=10) as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) > 0 and r.read() == b""
        for raw, code in ((b"NONSENSE\r\n\r\n", 400), (b"GET / HTTP/1.1\r\nX: " + b"y" * 20000 + b"\r\n\r\n", 431)):
            with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
                s.sendall(raw)
                assert s.recv(64).startswith(f"HTTP/1.1 {code} ".encode())
        with pytest.raises(UserError, match="port is in use.*--port"):
            Dashboard(view, "127.0.0.1", dash.port)
    finally:
        dash.close()


@pytest.mark.timeout(60)
def test_cli_errors_are_one_line(procs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        peer = "/ip4/127.0.0.1/tcp/1/p2p/QmVQvgh1Ujy2QG8t7PRbDz2a6TWDHFwy8wrGSEpjVYiGrk"
        for name, args, words in (("busy", ["--port", str(busy)], f"127.0.0.1:{busy}: the port is in use"),
                                  ("range", ["--port", "70000"], "--port (70000) must be a TCP port"),
                                  ("addr", ["--port", "0", "--initial-peers", "/ip4/1.2.3.4/tcp/x"], "initial peer")):
            argv = ["dashboard", "--initial-peers", peer, *args] if name != "addr" else ["dashboard", *args]
            p = procs.start(*argv, name=name)
            assert procs.wait(p, 30) == 2
            err = procs.err(name)
            assert words in err and "Traceback" not in err and err.count("error:") == 1, err
    p = procs.start("join", "--config", TINY, "--dashboard-port", "70000", name="join")
    assert procs.wait(p, 30) == 2 and "train.dashboard_port (70000)" in procs.err("join")


# ---- records at the edges of the schema: the page's chart code, status, the server's bounds ------------
B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
BIG = 2**62  # the largest count the schema allows
MAXF = 1.7976931348623157e308
ONE_ULP = [1.0, 1.0000000000000002]  # two losses one ulp apart
AT_2_53 = [2**53, 2**53 + 2]  # two outer steps where a double's ulp is 2


def _pid(i: int) -> str:
    tail = ""
    for _ in range(8):
        tail = B58[i % 58] + tail
        i //= 58
    return "12D3KooW" + "x" * 36 + tail


def _valid(rec: Dict[str, Any]) -> Dict[str, Any]:
    """``rec``, asserted to be a progress record every node accepts (schema and size)."""
    import msgpack

    assert records._check_data("progress", rec) is None, records._check_data("progress", rec)
    assert len(msgpack.packb({"k": "progress", "s": 1, "d": rec})) < records.MAX_RECORD
    return rec


def _extreme_record(i: int, read: int) -> Dict[str, Any]:
    """A schema-valid progress record with every field at an edge: null round, counts of 2**62, NaN,
    infinities and 1e308, failure reasons of 160 four-byte characters (12 bytes each as escaped
    JSON), and other fields a peer may add (whose JSON is much larger than their msgpack)."""
    rec: Dict[str, Any] = {
        "step": BIG, "round": None, "next_sync": BIG, "synced_step": BIG, "samples": read * 1000 + i,
        "sent": BIG - 10**6 + read, "recv": read, "sps": MAXF, "rate": -MAXF, "share": float("nan"), "lw": 4096,
        "pos": float("inf"), "pt": -0.0, "loss": float("nan"), "val_loss": float("-inf"), "last_sync": -MAXF,
        "t": 1000.0 + 2 * read + i * 1e-6, "digest": f"{i:064x}", "reach": "relayed",
        "vr": [BIG - 10**6 + 16 * read + j for j in range(16)], "vl": [MAXF if j % 2 else -MAXF for j in range(16)],
        "fr": [BIG] * 4, "ff": [BIG] * 4, "ft": [1e9 + 4 * read + j + i * 1e-3 for j in range(4)],
        "fw": ["\U0001F600" * records.FAIL_REASON_CHARS] * 4,
    }
    rec.update({f"a{k:02d}": ["\x00" * 4] * 64 for k in range(16)})
    rec.update({f"b{k:02d}": MAXF for k in range(40)})
    return rec


def _view_at_limits(peers: int = 600) -> SwarmView:
    """A view filled to its bounds by hostile records: more live peers than it lists, every rate point,
    the loss points of every listed peer up to the total, the failures; the next refresh reads the
    same peers again."""
    from p2pdiloco.dashboard import view as v

    clock = [1000.0]
    view = SwarmView("limits", period=2.0, clock=lambda: clock[0])
    for _ in range(v.MAX_RATE_POINTS):
        view.fold({}, clock[0])
        clock[0] += 2.0
    _valid(_extreme_record(peers - 1, 0))
    read = [0]

    def progress():
        read[0] += 1
        clock[0] += 2.0
        return {_pid(i): _extreme_record(i, read[0]) for i in range(peers)}

    view.attach(progress)
    for _ in range(14):  # 16 new loss points per listed peer each: past the total the view keeps (100,000)
        view.refresh()
    return view


def test_chart_scales_are_bounded_for_any_values():
    """dashboard.js's tick and axis code under node: one-ulp ranges, steps at 2**53, subnormal spans,
    +-1e308 and 300,000 points all return at once with finite, ordered scales (a tick loop that
    adds a step below the values' resolution never ends; a spread of 300k arguments overflows)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the browser test covers the same code)")
    js = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "p2pdiloco", "dashboard",
                      "static", "dashboard.js")
    script = r"""
const m = require(process.argv[1]);
const MAXF = Number.MAX_VALUE, out = [];
const ranges = [[1, 1.0000000000000002], [2 ** 53, 2 ** 53 + 2], [0, 5e-324], [-MAXF, MAXF], [MAXF / 2, MAXF],
                [1e-300, 1.0000000000000002e-300], [4611686018427387904, 4611686018427387904], [0, 1]];
for (const [lo, hi] of ranges) for (const count of [2, 4, 17]) out.push({lo, hi, count, ticks: m.ticks(lo, hi, count)});
const big = [];
for (let i = 0; i < 300000; i++) big.push([i, (i % 7) / 3]);
const series = [[[2 ** 53, 1], [2 ** 53 + 2, 1.0000000000000002]], [[3, 1], [4, 1.0000000000000002]],
                [[2 ** 53, 2.5], [2 ** 53 + 2, 2]], [[0, 0], [1, 5e-324]], [[0, MAXF], [4611686018427387904, MAXF]],
                [[0, -MAXF], [1, MAXF]], [[7, 3]], big];
const axes = [];
for (const pts of series) for (const opts of [{integerX: true}, {zeroY: true}, {xTime: true, zeroY: true}]) {
  axes.push(m.axes([{points: pts}], opts, 17));
}
console.log(JSON.stringify({ticks: out, axes, time: m.timeTicks(0, 1e300, 10)}));
"""
    r = subprocess.run([node, "-e", script, js], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    for t in got["ticks"]:
        assert 1 <= len(t["ticks"]) <= 64, t
        assert all(t["lo"] <= v <= t["hi"] * (1 + 1e-12) for v in t["ticks"]), t
    for a in got["axes"]:
        assert all(isinstance(a[k], (int, float)) for k in ("x0", "x1", "y0", "y1")), a  # JSON null: not finite
        assert a["x1"] > a["x0"] and a["y1"] > a["y0"] and len(a["xs"]) <= 64 and 1 <= len(a["ys"]) <= 64, a
    assert len(got["time"]) <= 64


def _status_main(monkeypatch, capsys, peers: Dict[str, Dict[str, Any]], *flags: str):
    import p2pdiloco.swarm.node as node
    from p2pdiloco.cli import main

    class FakeNode:  # the DHT read: the records every node accepted
        def __init__(self, *args, **kwargs):
            pass

        def get_subkeys(self, key, why="other"):
            return peers

        def shutdown(self):
            pass

    monkeypatch.setattr(node, "SwarmNode", FakeNode)
    t0 = time.perf_counter()
    code = main(["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + "Qm" + "C" * 44, *flags])
    out = capsys.readouterr()
    return code, out.out, out.err, time.perf_counter() - t0


def test_status_prints_any_valid_record(monkeypatch, capsys):
    """``status`` and ``status --json`` on records at the schema's edges (a null round, NaN, infinities,
    1e308, counts of 2**62) and on the largest reads: exit 0, one short line per peer, strict JSON."""
    odd = {_pid(0): _valid({"round": None, "step": None, "samples": None, "sent": None, "loss": None, "t": 1.0}),
           _pid(1): _valid(_extreme_record(1, 1)),
           _pid(2): _valid({"round": BIG, "step": BIG, "samples": BIG, "sent": BIG, "recv": BIG, "rate": MAXF,
                            "share": 1.0, "loss": MAXF, "val_loss": float("nan"), "last_sync": MAXF,
                            "vr": AT_2_53, "vl": ONE_ULP}),
           _pid(3): _valid({"rate": float("nan"), "last_sync": float("inf"), "lw": 7, "reach": "public"})}
    code, out, err, _ = _status_main(monkeypatch, capsys, odd)
    assert code == 0 and "Traceback" not in err, err
    head, *rows = out.splitlines()
    assert len(rows) == 4 and all(len(line) <= 132 for line in rows), out
    cells = {row.split()[0]: row.split() for row in rows}
    assert cells[_pid(0)[-6:]][3:5] == ["-", "-"]  # null round and step
    assert cells[_pid(1)[-6:]][2:5] == ["4096", "-", "4.61e+18"] and cells[_pid(1)[-6:]][-2:] == ["nan", "-inf"]
    assert cells[_pid(2)[-6:]][3] == "4.61e+18" and cells[_pid(2)[-6:]][-2:] == ["1.8e+308", "nan"]
    assert cells[_pid(2)[-6:]][-3] == "future" and cells[_pid(3)[-6:]][-3] == "never"

    code, out, err, _ = _status_main(monkeypatch, capsys, odd, "--json")
    assert code == 0 and "Traceback" not in err, err
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in status --json"))  # strict JSON
    assert set(doc) == set(odd) and doc[_pid(0)]["round"] is None and doc[_pid(1)]["loss"] is None
    assert doc[_pid(1)]["fw"] == odd[_pid(1)]["fw"] and doc[_pid(2)]["vr"] == AT_2_53

    # the most one DHT answer holds (4 MiB, the p2p daemon's message limit): 64 records of ~60 KB, or
    # 20,000 small ones
    many = {_pid(i): _extreme_record(i, 1) if i < 64 else dict(odd[_pid(i % 4)]) for i in range(20_064)}
    for flags in ((), ("--json",)):
        code, out, err, took = _status_main(monkeypatch, capsys, many, *flags)
        assert code == 0 and "Traceback" not in err, err
        assert (len(out.splitlines()) == 20_065) if not flags else (len(json.loads(out)) == 20_064)
        assert took < 60, f"status {' '.join(flags)} took {took:.1f} s for 20,064 peers"


def _closed_by(socks: List[socket.socket], deadline: float) -> bool:
    """Whether the server closed every one of ``socks`` (EOF or reset) before ``deadline`` (monotonic)."""
    for s in socks:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if s.recv(1) != b"":
                return False
        except ConnectionResetError:
            pass
        except socket.timeout:
            return False
    return True


def test_idle_connections_time_out_and_threads_stay_bounded(monkeypatch):
    """Idle connections are closed after the idle timeout; 200 connections that send nothing (or half
    a request) hold no thread each and are all closed, while a request made meanwhile is answered; a
    connection that sends a byte now and then is closed at the lifetime limit."""
    import threading

    from p2pdiloco.dashboard import server

    monkeypatch.setattr(server, "IDLE_TIMEOUT", 1.0, raising=False)
    monkeypatch.setattr(server, "MAX_LIFETIME", 3.0, raising=False)
    dash = Dashboard(SwarmView("idle"), "127.0.0.1", 0)
    socks: List[socket.socket] = []
    try:
        few = [socket.create_connection(("127.0.0.1", dash.port), timeout=10) for _ in range(5)]
        socks += few
        time.sleep(0.5)
        for s in few:  # still open half-way to the timeout
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_PEEK)
        assert _closed_by(few, time.monotonic() + 3.0), "idle connections still open 3.5 s after the 1 s timeout"
        assert dash.httpd.timed_out == 5

        base = threading.active_count()
        for k in range(200):
            s = socket.create_connection(("127.0.0.1", dash.port), timeout=10)
            if k % 2:
                s.sendall(b"GET /api/swarm HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
        time.sleep(0.3)
        threads = threading.active_count()
        assert threads <= base + 2, f"{threads - base} more threads for 200 idle connections"
        assert _get(dash.url + "api/swarm")["run_id"] == "idle"  # answered during the flood
        drip = socket.create_connection(("127.0.0.1", dash.port), timeout=10)
        t_drip = time.monotonic()
        assert _closed_by(socks[5:], time.monotonic() + 3.0), "idle connections still open after the timeout"
        ended = dash.httpd.evicted + dash.httpd.timed_out - 5
        assert ended >= 200, f"only {ended} of the 200 idle connections were closed by the server"

        ended = None
        while ended is None and time.monotonic() - t_drip < 8:
            try:
                drip.sendall(b"G")
                drip.settimeout(0.5)
                if drip.recv(1) == b"":
                    ended = time.monotonic() - t_drip
            except socket.timeout:
                pass
            except OSError:
                ended = time.monotonic() - t_drip
        assert ended is not None and 2.5 <= ended < 5.0, f"a dripping connection lived {ended} s (limit 3 s)"
        assert _get(dash.url + "api/swarm")["run_id"] == "idle"
    finally:
        for s in socks:
            s.close()
        dash.close()


@pytest.mark.timeout(120)
def test_document_at_the_record_limits_is_bounded_and_built_once():
    """A full view (more peers than listed, each record with every field at an edge, every loss and rate
    point the view keeps): one read folded and its document served take well under a second of CPU,
    the document stays under 4 MiB (docs/dashboard.md), and serving it to many requests builds nothing."""
    from p2pdiloco.dashboard import Dashboard, view as v

    view = _view_at_limits()
    dash = Dashboard(view, "127.0.0.1", 0)
    try:
        cpu = time.process_time()  # every thread of ours (the server's too), not other processes' load
        view.refresh()  # one more read of the 600 peers
        with urllib.request.urlopen(dash.url + "api/swarm", timeout=60) as r:
            body = r.read()
        cpu = time.process_time() - cpu
        print(f"document at the limits: {len(body)} bytes, one read folded and served in {cpu:.2f} s of CPU")
        assert len(body) <= 4 << 20, f"/api/swarm is {len(body)} bytes"
        assert cpu < 1.0, f"one read at the limits took {cpu:.2f} s of CPU"
        builds = view.builds
        t0 = time.perf_counter()
        for _ in range(20):
            with urllib.request.urlopen(dash.url + "api/swarm", timeout=10) as r:
                assert r.read() == body
        took = time.perf_counter() - t0
    finally:
        dash.close()
    assert view.builds == builds, "a request built the document again"
    assert took < 10, f"20 requests took {took:.1f} s"
    assert len(body) <= v.MAX_DOCUMENT_BYTES
    doc = json.loads(body)
    assert doc["peers_total"] == 600 and len(doc["peers"]) == v.MAX_PEERS
    assert all(n > 0 for n in doc["omitted"].values()) and len(doc["omitted"]) == v.MAX_PEERS
    assert sum(len(p) for p in doc["val_loss"].values()) <= max(16 * v.MAX_PEERS, v.DOC_VAL_POINTS)
    assert len(doc["rates"]) <= v.DOC_RATE_POINTS and len(doc["failures"]) == v.DOC_FAILURES
    assert sum(len(p) for p in view._val.values()) <= v.MAX_VAL_TOTAL + 16 * v.MAX_PEERS


def _edge_pages() -> Dict[str, Dict[str, Dict[str, Any]]]:
    """Reads of ``<run>:progress`` that each put one edge of the schema alone on the page."""
    plain = {"t": 1.0, "reach": "public", "round": None}
    return {
        "a one-ulp loss range at outer steps 2**53 and 2**53 + 2": {_pid(1): _valid(dict(plain, vr=AT_2_53, vl=ONE_ULP))},
        "a one-ulp loss range": {_pid(1): _valid(dict(plain, vr=[3, 4], vl=ONE_ULP))},
        "outer steps 2**53 and 2**53 + 2": {_pid(1): _valid(dict(plain, vr=AT_2_53, vl=[2.5, 2.0]))},
        "a subnormal loss range": {_pid(1): _valid(dict(plain, vr=[0, 1], vl=[0.0, 5e-324]))},
        "every field at an edge": {_pid(i): _valid(_extreme_record(i, 1)) for i in range(4)},
    }


@pytest.mark.timeout(400)
def test_page_renders_records_at_the_schema_edges(tmp_path, chromium):
    """In Chromium, each page of records that the DHT accepts renders completely within the load's
    timeout: one-ulp loss ranges, outer steps where a double's ulp is 2, a subnormal range, every
    field at an edge (null round, NaN, 1e308, 2**62), and a view filled to its limits (600 peers
    of such records). A tick loop that never ends freezes the page (the load times out)."""
    browser = Browser(chromium, tmp_path)
    pages = {name: (lambda recs=recs: recs) for name, recs in _edge_pages().items()}
    pages["the view's limits"] = None
    for name, read in pages.items():
        if read is None:
            view, listed, total = _view_at_limits(), 512, 600
        else:
            view, listed, total = SwarmView(RUN), len(read()), len(read())
            view.attach(read)
            view.refresh()
        dash = Dashboard(view, "127.0.0.1", 0)
        try:
            t0 = time.monotonic()
            dom = browser.dom(dash.url, timeout=60)
            took = time.monotonic() - t0
        finally:
            dash.close()
        rows = _rows(dom)
        points = re.search(r'id="loss-chart"[^>]*data-points="(\d+)"', dom)
        assert len(rows) == listed and 'class="pill ok"' in dom and f'id="t-peers">{total}<' in dom, (name, rows)
        assert points and int(points.group(1)) >= 2 and "<svg" in dom.split('id="loss-chart"', 1)[1][:400], name
        print(f"{name}: rendered in {took:.1f} s")


# ---- end to end ----------------------------------------------------------------------------------------
def _find_browser():
    return next((p for p in map(shutil.which, _BROWSERS) if p), None)


@pytest.fixture(scope="module")
def chromium():
    exe = _find_browser()
    if exe is None:
        if os.geteuid() != 0:
            pytest.skip("headless Chromium is not installed and installing it needs root (apt-get install chromium)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=600, capture_output=True)
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium",
                            "fonts-dejavu-core"], env=env, timeout=900, capture_output=True, text=True)
        exe = _find_browser()
        assert exe is not None, f"apt-get install chromium failed: {r.stderr[-2000:]}"
    return exe


class Browser:
    """One headless Chromium run per page load (its own profile), with a hard timeout."""

    def __init__(self, exe: str, tmp):
        self.exe, self.tmp, self.n = exe, tmp, 0

    def _run(self, url: str, *extra: str, timeout: float = 60) -> str:
        self.n += 1
        argv = [self.exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--hide-scrollbars", f"--user-data-dir={self.tmp}/chromium-{self.n}",
                "--window-size=1280,1240", "--virtual-time-budget=4000", *extra, url]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the page did not finish loading in {timeout} s (a script that never returns?)")
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its process group: the browser's helper processes too
            except ProcessLookupError:
                pass
            p.wait()
            shutil.rmtree(f"{self.tmp}/chromium-{self.n}", ignore_errors=True)
        assert p.returncode == 0, f"chromium failed ({p.returncode}): {err[-2000:]}"
        return out

    def dom(self, url: str, timeout: float = 60) -> str:
        """The page's DOM after its script ran (serialized by the browser)."""
        return self._run(url, "--dump-dom", timeout=timeout)

    def screenshot(self, url: str, path: str) -> None:
        self._run(url, f"--screenshot={path}")


def _get(url: str) -> Dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        return json.loads(r.read())


def _wait_for_line(procs, name: str, pattern: str, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, procs.out(name))
        if m:
            return m.group(0)
        p = next(p for p in procs.procs if p.name == name)
        assert p.poll() is None, f"{name} exited early: {procs.err(name)[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{name} printed nothing matching {pattern!r} in {timeout}s: {procs.err(name)[-2000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(dom: str) -> List[str]:
    """Peer ids of the rows of the live-peers table."""
    body = dom.split('id="peers"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<tr data-peer="([1-9A-HJ-NP-Za-km-z]+)"', body)


def _cells(dom: str, pid: str) -> List[str]:
    """The texts of the cells of ``pid``'s row in the live-peers table."""
    body = dom.split('id="peers"', 1)[1].split("</table>", 1)[0]
    row = body.split(f'<tr data-peer="{pid}"', 1)[1].split("</tr>", 1)[0]
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def _loss_points(dom: str, ids: List[str]) -> int:
    """The most points any of ``ids`` has in the validation-loss plot (each point a circle titled by its peer)."""
    chart = dom.split('id="loss-chart"', 1)[1].split('id="tokens-chart"', 1)[0]
    return max((chart.count(f"<title>{pid[-6:]}: outer step ") for pid in ids), default=0)


def _status(procs, addr: str, name: str) -> Dict[str, Any]:
    st = procs.start("status", "--initial-peers", addr, "--run-id", RUN, "--json", name=name)
    assert procs.wait(st, 60) == 0, procs.err(name)
    return json.loads(procs.out(name))


COUNTERS = ("step", "round", "samples", "sent", "recv", "synced_step")


def _consistent(before: Dict[str, Any], api: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """What in ``api`` (the dashboard's read) disagrees with ``status --json`` read just before and after:
    the same peers; each growing counter between its two status values; every other field that
    did not change between the two status reads, equal (NaN is null in the API)."""
    problems = []
    if not set(before) == set(api) == set(after):
        return [f"peers differ: status before {sorted(before)}, api {sorted(api)}, status after {sorted(after)}"]
    for pid in api:
        b, a, c = before[pid], api[pid], after[pid]
        for k in set(b) | set(a) | set(c):
            if k in COUNTERS and all(isinstance(x.get(k), int) for x in (b, a, c)):
                if not b[k] <= a[k] <= c[k]:
                    problems.append(f"{pid[-6:]}.{k}: status {b[k]} then {c[k]}, api {a[k]}")
            elif b.get(k) == c.get(k) and k != "t":
                want = b.get(k)
                if isinstance(want, float) and want != want:
                    want = None
                if a.get(k) != want:
                    problems.append(f"{pid[-6:]}.{k}: status {want!r}, api {a.get(k)!r}")
    return problems


@pytest.mark.timeout(150, func_only=True)
def test_dashboard_in_a_browser(procs, tmp_path, chromium):
    browser = Browser(chromium, tmp_path)
    addr = procs.bootstrap()
    procs.start("dashboard", "--initial-peers", addr, "--run-id", RUN, "--port", "0", name="dash")
    url = _wait_for_line(procs, "dash", r"http://127\.0\.0\.1:\d+/", 60)

    # before any volunteer: an empty swarm, not an error
    deadline = time.time() + 30
    while not (doc := _get(url + "api/swarm"))["dht"]["ok"]:
        assert time.time() < deadline, f"the dashboard never read the DHT: {doc['dht']}"
        time.sleep(0.5)
    assert doc["peers"] == {} and doc["run_id"] == RUN and doc["failures"] == []
    dom = browser.dom(url)
    assert _rows(dom) == [] and 'id="t-peers">0<' in dom and "No live peers in this run yet" in dom
    assert 'class="pill ok"' in dom, "the page should say it reads the DHT fine"

    own_port = _free_port()
    vols = [procs.start("join", "--initial-peers", addr, "--config", TINY,
                        *sum((["--set", s] for s in SETTINGS + [f"data.shard={i}", f"train.run_dir={tmp_path}/p{i}"]), []),
                        *(["--dashboard-port", str(own_port)] if i == 1 else []), name=f"p{i}")
            for i in range(2)]
    ids = []
    deadline = time.time() + 90
    while len(ids) < 2:
        assert time.time() < deadline and all(p.poll() is None for p in vols), \
            f"volunteers did not start: {procs.err('p0')[-1500:]} {procs.err('p1')[-1500:]}"
        ids = [r["peer"] for i in range(2) if (tmp_path / f"p{i}" / "metrics.jsonl").exists()
               for r in read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"), "start")]
        time.sleep(0.5)
    stranger = procs.start_argv([sys.executable, "-c", STRANGER, addr, RUN, PAYLOAD], name="stranger")
    liar = _wait_for_line(procs, "stranger", r"(?m)^[1-9A-HJ-NP-Za-km-z]{40,}$", 60)

    # the page: both volunteers listed, a loss plot of at least 2 points, the stranger's markup as text
    deadline = time.time() + 90
    while True:
        dom = browser.dom(url)
        rows = _rows(dom)
        if set(ids) <= set(rows) and _loss_points(dom, ids) >= 2 and liar in rows and "&lt;script&gt;" in dom \
                and all(_cells(dom, pid)[6].endswith("%") for pid in ids):
            break
        assert time.time() < deadline, (
            f"the page never showed both volunteers {ids}, the stranger {liar}, >= 2 loss points and the "
            f"stranger's markup as text: rows {rows}, {_loss_points(dom, ids)} points, escaped markup "
            f"{'&lt;script&gt;' in dom}, a stranger's element {'<img' in dom}; {procs.err('dash')[-1500:]}")
    for pid in ids:  # each peer's samples/s and its share of the last round (two equal peers: ~half)
        cells = _cells(dom, pid)
        assert float(cells[5]) > 0 and 20 <= int(cells[6].rstrip("%")) <= 80, cells
        assert cells[2] == "1", cells  # one local worker each (no lw in their records' place: 1)
    assert _cells(dom, liar)[2] == "3"  # the stranger's record says 3 local workers
    browser.screenshot(url, str(tmp_path / "dashboard.png"))
    with open(tmp_path / "dashboard.png", "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, "no screenshot"
    print(f"screenshot: {tmp_path / 'dashboard.png'}")

    failures = dom.split('id="failures"', 1)[1].split("</table>", 1)[0]
    assert PAYLOAD.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in failures, \
        "the stranger's reason should be shown, as text"
    assert "data-pwned" not in dom, "the stranger's markup ran"
    assert dom.count("<script") == 1 and "<img" not in dom, "the stranger's markup became elements"

    # the peer's own dashboard (join --dashboard-port) reads the same swarm
    deadline = time.time() + 30
    while not set(ids) <= set((own := _get(f"http://127.0.0.1:{own_port}/api/swarm"))["peers"]):
        assert time.time() < deadline, f"the peer's own dashboard never listed both volunteers: {own['peers']}"
        time.sleep(1)

    # /api/swarm against `status --json` read just before and just after it
    for attempt in range(3):
        before = _status(procs, addr, f"status{attempt}a")
        t_before = time.time()
        while (doc := _get(url + "api/swarm"))["dht"]["last_read"] <= t_before:
            time.sleep(0.2)  # a read of the dashboard's that began after status's
        after = _status(procs, addr, f"status{attempt}b")
        problems = _consistent(before, doc["peers"], after)
        if not problems:
            break
    assert not problems, problems  # three tries: two DHT readers can see records a moment apart
    assert set(ids) | {liar} == set(doc["peers"])

    # the derived parts of the document
    cfg = load_config(TINY, SETTINGS)
    assert doc["seq_len"] == cfg.model.seq_len
    for pid in ids:
        steps = [s for s, _ in doc["val_loss"][pid]]
        assert len(steps) >= 2 and steps == sorted(set(steps)) and steps[0] == 0
    assert max(r["tokens_per_s"] or 0 for r in doc["rates"]) > 0
    assert max(r["sent_per_s"] for r in doc["rates"]) > 0
    dg = doc["digests"]
    assert dg["groups"] and all(doc["peers"][p]["synced_step"] == dg["step"] and doc["peers"][p]["digest"] == g["digest"]
                                for g in dg["groups"] for p in g["peers"])
    assert liar in dg["elsewhere"]
    assert [f["reason"] for f in doc["failures"] if f["peer"] == liar] == [PAYLOAD]
    assert doc["val_loss"][liar] == [[2**53, 1.0], [2**53 + 2, 1.0000000000000002]]

    # status (the table) reads the stranger's null round too
    st = procs.start("status", "--initial-peers", addr, "--run-id", RUN, name="status-table")
    assert procs.wait(st, 60) == 0 and "Traceback" not in procs.err("status-table"), procs.err("status-table")
    row = next(line.split() for line in procs.out("status-table").splitlines() if line.startswith(liar[-6:]))
    assert row[2:4] == ["3", "-"], row  # 3 local workers, no outer step
    assert stranger.poll() is None and all(p.poll() is None for p in vols)
