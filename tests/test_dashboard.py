"""The web dashboard (issue 21), end to end through the real CLI and a real browser.

A bootstrap peer and a dashboard start first (the page shows an empty swarm, not an error), then
two volunteers (one also serving the dashboard itself, ``join --dashboard-port``) and a stranger
who stores a crafted progress record with markup in its failed-round reason. Headless Chromium
loads the page until it lists both volunteers and a validation-loss plot of at least 2 points; the
stranger's ``<script>`` is shown as text and never runs; a screenshot is saved. ``/api/swarm`` is
checked against ``p2pdiloco status --json`` read just before and just after it.

Chromium is installed from the system's packages (apt-get) when missing and we are root; without
root and without Chromium the test is skipped with that reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
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
from p2pdiloco.dashboard import SwarmView
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
record = {"reach": "public", "lw": 3, "fr": [3], "ff": [0], "ft": [time.time()], "fw": [payload]}
while True:  # killed by the test's teardown
    node.store(f"{run}:progress", dict(record, t=time.time()), ttl=8, subkey=node.peer_id_str)
    time.sleep(1.5)
"""


# ---- the records' history fields and the view, without a network --------------------------------------
def test_history_fields_are_small_and_readable_by_older_peers():
    rec: Dict[str, Any] = {"step": 30, "round": 3}
    for step in range(40):
        records.note_val_loss(rec, step, 5.0 - step / 10)
    records.note_val_loss(rec, 39, 1.0)  # a later measurement of the same outer step replaces it
    records.note_val_loss(rec, 40, float("nan"))  # not kept (val_loss still shows it)
    for k in range(6):
        records.note_failure(rec, k, 1, "x" * 500 if k == 5 else f"reason {k}", when=100.0 + k)
    assert rec["vr"] == list(range(24, 40)) and rec["vl"][-1] == 1.0 and len(rec["vl"]) == records.VAL_HISTORY
    assert rec["fr"] == [2, 3, 4, 5] and rec["ft"] == [102.0, 103.0, 104.0, 105.0]
    assert len(rec["fw"][-1]) == records.FAIL_REASON_CHARS and rec["fw"][0] == "reason 2"
    assert records._check_data("progress", rec) is None
    assert records._check_data("progress", {"step": 1}) is None  # the old fields alone still do
    # a peer of the previous version checks unknown fields only as "small scalars or short lists"
    assert records.GenericRecord.parse_obj(rec)
    import msgpack
    assert len(msgpack.packb(rec)) < 600
    too_long = dict(rec, vr=list(range(17)), vl=[1.0] * 17)
    assert "vr" in records._check_data("progress", too_long)
    assert "fw" in records._check_data("progress", dict(rec, fw=["<b>"] * 3 + ["y" * 161]))


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
    # each peer's local workers (join --local-workers; issue 20): its lw, 1 without one (as status counts)
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

    def _run(self, url: str, *extra: str) -> str:
        self.n += 1
        argv = [self.exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--hide-scrollbars", f"--user-data-dir={self.tmp}/chromium-{self.n}",
                "--window-size=1280,1240", "--virtual-time-budget=4000", *extra, url]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60, start_new_session=True)
        finally:
            shutil.rmtree(f"{self.tmp}/chromium-{self.n}", ignore_errors=True)
        assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-2000:]}"
        return r.stdout

    def dom(self, url: str) -> str:
        """The page's DOM after its script ran (serialized by the browser)."""
        return self._run(url, "--dump-dom")

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


def _loss_points(dom: str) -> int:
    chart = dom.split('id="loss-chart"', 1)[1].split('id="tokens-chart"', 1)[0]
    return len(re.findall(r'<circle[^>]*class="pt"', chart))


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
        if set(ids) <= set(rows) and _loss_points(dom) >= 2 and liar in rows and "&lt;script&gt;" in dom \
                and all(_cells(dom, pid)[6].endswith("%") for pid in ids):
            break
        assert time.time() < deadline, (
            f"the page never showed both volunteers {ids}, the stranger {liar}, >= 2 loss points and the "
            f"stranger's markup as text: rows {rows}, {_loss_points(dom)} points, escaped markup "
            f"{'&lt;script&gt;' in dom}, a stranger's element {'<img' in dom}; {procs.err('dash')[-1500:]}")
    for pid in ids:  # issue 23: each peer's samples/s and its share of the last round (two equal peers: ~half)
        cells = _cells(dom, pid)
        assert float(cells[5]) > 0 and 20 <= int(cells[6].rstrip("%")) <= 80, cells
        assert cells[2] == "1", cells  # one local worker each (no lw in their records' place: 1)
    assert _cells(dom, liar)[2] == "3"  # the stranger's record says 3 local workers (issue 20)
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
    assert stranger.poll() is None and all(p.poll() is None for p in vols)
