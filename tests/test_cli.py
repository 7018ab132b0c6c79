"""The CLI as a user meets it: clear one-line errors (exit 2, no traceback) and the bootstrap peer."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, cli_argv

GOOD_ID = "12D3KooWDpRStW72pM3afxX2pdVtxRjYjPCdC3TE2ZtEqpvEK3FF"


def run_cli(*args: str, timeout: float = 90, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          start_new_session=True)


def assert_user_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr
    error_lines = [l for l in res.stderr.splitlines() if l.startswith("error: ")]
    assert len(error_lines) == 1, res.stderr
    for needle in needles:
        assert needle in error_lines[0], error_lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("addr, needle", [
    ("/ip4/999.0.0.1/tcp/1/p2p/" + GOOD_ID, "not a valid multiaddr"),
    ("not-an-address", "not a valid multiaddr"),
    ("/ip4/127.0.0.1/tcp/31337", "no /p2p/<peer id>"),
    ("/ip4/127.0.0.1/tcp/1/p2p/xyz", "not a valid multiaddr"),
])
def test_malformed_address(addr, needle, tmp_path):
    assert_user_error(run_cli("join", "--initial-peers", addr, "--config", TINY, cwd=tmp_path), needle)


@pytest.mark.timeout(90)
def test_unreachable_bootstrap_gives_up_after_bounded_wait(tmp_path):
    t0 = time.time()
    res = run_cli("join", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{GOOD_ID}", "--config", TINY,
                  "--set", "swarm.bootstrap_timeout=3", cwd=tmp_path)
    assert_user_error(res, "none of the initial peers answered within 3 s")
    # it kept trying for the whole bounded wait (not giving up at the first refusal), then stopped
    assert 3 <= time.time() - t0 < 60


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needles", [
    (["--config", "missing.toml"], ["missing.toml not found"]),
    (["--config", TINY, "--set", "inner.sync_evry=5"], ["unknown config key inner.sync_evry", "sync_every"]),
    (["--config", TINY, "--set", "nosuch.key=1"], ["unknown config section [nosuch]"]),
    (["--config", TINY, "--set", "inner.sync_every=0"], ["inner.sync_every (0) must be a positive integer"]),
    (["--config", TINY, "--set", "inner.sync_every=ten"], ["inner.sync_every: 'ten' is not a valid int"]),
    (["--config", TINY, "--set", "model.d_model=130"], ["model.d_model (130)", "n_heads"]),
    (["--config", TINY, "--set", "outer.momentum=1.5"], ["outer.momentum (1.5) must be in [0, 1)"]),
    (["--config", TINY, "--set", "compression.codec=zip"], ["unknown codec 'zip'"]),
    (["--config", TINY, "--set", "model.preset=huge"], ["unknown model preset 'huge'"]),
    (["--config", TINY, "--set", "train.device=tpu9"], ["train.device"]),
    (["--config", TINY, "--set", "swarm.run_id=a b"], ["swarm.run_id"]),
])
def test_config_errors(args, needles, tmp_path, monkeypatch, capsys):
    """In process (``cli.main``, the console script's function): each case is refused while the
    configuration is read, before anything starts; a subprocess per case cost ~6 s of imports. The
    real process's exit status and stderr are checked by the other tests here (unknown key in a file)."""
    from p2pdiloco import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["join", *args])
    err = capsys.readouterr().err
    assert_user_error(subprocess.CompletedProcess(["p2pdiloco", "join", *args], code, "", err), *needles)


@pytest.mark.timeout(60)
def test_unknown_key_in_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner]\nsync_every = 5\nlearning_rate = 0.1\n")
    assert_user_error(run_cli("join", "--config", str(bad), cwd=tmp_path), "unknown config key inner.learning_rate")
    bad.write_text("[inner\n")
    assert_user_error(run_cli("join", "--config", str(bad), cwd=tmp_path), "not valid TOML")


@pytest.mark.timeout(120)
def test_bootstrap_identity_addresses_and_clean_shutdown(procs, tmp_path):
    key = tmp_path / "boot.key"
    p = procs.start("bootstrap", "--identity", str(key), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", name="b1")
    addr = _first_address(procs, p, "b1")
    assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", addr), addr
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    peer_id = addr.rsplit("/", 1)[1]

    # a second process with the same identity is refused with a clear message
    clash = run_cli("bootstrap", "--identity", str(key), cwd=tmp_path, timeout=60)
    assert_user_error(clash, "already in use")

    os.killpg(p.pid, signal.SIGTERM)
    assert procs.wait(p, 30) == 0
    assert "shutting down" in procs.err("b1")

    # same key file -> same peer id, on a fixed port given with --host-maddrs
    p2 = procs.start("bootstrap", "--identity", str(key), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", name="b2")
    assert _first_address(procs, p2, "b2").endswith("/p2p/" + peer_id)
    os.killpg(p2.pid, signal.SIGINT)
    assert procs.wait(p2, 30) == 0


@pytest.mark.timeout(60)
def test_world_readable_key_is_refused(tmp_path):
    key = tmp_path / "k.key"
    res = run_cli("bootstrap", "--identity", str(key), "--host-maddrs", "/ip4/127.0.0.1/tcp/0/p2p/x",
                  cwd=tmp_path, timeout=60)  # malformed listen address: refused before any key is made
    assert_user_error(res, "not a valid multiaddr")
    assert not key.exists()
    key.write_bytes(b"\x08\x00\x12\x01x")
    os.chmod(key, 0o644)
    assert_user_error(run_cli("bootstrap", "--identity", str(key), cwd=tmp_path, timeout=60), "chmod 600")


def _first_address(procs, p, name: str, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = [l for l in procs.out(name).splitlines() if "/p2p/" in l]
        if lines:
            return lines[0].strip()
        assert p.poll() is None, procs.err(name)
        time.sleep(0.2)
    raise AssertionError("no address printed")
