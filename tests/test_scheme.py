"""The default scheme: what a peer with no ``--set`` runs, how ``scheme=NAME`` and explicit keys
combine, config files that build on another (``base``), and the demo's summary of what ran and what it saved."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from p2pdiloco.config import DEFAULT_SCHEME, SCHEMES, RunConfig, describe_scheme, load_config, scheme_of
from p2pdiloco.diloco.core import fp32_allreduce_bytes
from p2pdiloco.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CPU = os.path.join(ROOT, "peers", "tiny-cpu.toml")


def _get(cfg, dotted):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def test_dataclass_defaults_are_the_documented_default_scheme():
    cfg = RunConfig()
    for key, value in SCHEMES[DEFAULT_SCHEME].items():
        assert _get(cfg, key) == value, key
    assert scheme_of(cfg) == DEFAULT_SCHEME == "streaming"
    # the mission's scheme: streaming fragments, overlap, a 4-bit codec
    assert cfg.streaming.fragments > 1 and cfg.streaming.tau > 0 and cfg.compression.codec == "e3m0"
    cfg.validate()  # the defaults are a valid configuration on their own (H divisible by P, tau < H/P)


@pytest.mark.parametrize("path", sorted(os.listdir(os.path.join(ROOT, "peers"))))
def test_every_shipped_peer_config_fits_the_default_scheme(path):
    """H divisible by the fragments, tau < H/P, enough blocks (the llama profiles' tokenizer file is made by
    the user first, so the vocabulary check is left out)."""
    cfg = load_config(os.path.join(ROOT, "peers", path), validate=False)
    for name in ("inner", "outer", "streaming", "compression"):
        getattr(cfg, name).validate()
    cfg.streaming.check_schedule(cfg.inner.sync_every, cfg.model.num_blocks())
    assert describe_scheme(cfg)


def test_tiny_cpu_without_sets_runs_the_default_scheme_and_one_set_gives_blocking_fp32():
    assert scheme_of(load_config(TINY_CPU)) == "streaming"
    cfg = load_config(TINY_CPU, ["scheme=diloco"])
    assert scheme_of(cfg) == "diloco"
    assert (cfg.streaming.fragments, cfg.streaming.tau, cfg.streaming.alpha, cfg.compression.codec) == (1, 0, 0.0, "fp32")
    assert describe_scheme(cfg).startswith("DiLoCo (blocking), fp32 on the wire")


@pytest.mark.parametrize("sets", [["scheme=diloco", "compression.codec=nf4"], ["compression.codec=nf4", "scheme=diloco"]])
def test_an_explicit_key_wins_over_the_scheme_whatever_the_order(sets):
    cfg = load_config(TINY_CPU, sets)
    assert cfg.compression.codec == "nf4" and cfg.streaming.fragments == 1
    assert scheme_of(cfg) is None and "nf4" in describe_scheme(cfg)


def test_a_scheme_in_a_file_and_a_base_file(tmp_path):
    child = tmp_path / "mine.toml"
    child.write_text(f'base = "{TINY_CPU}"\nscheme = "diloco"\n[inner]\nlr = 1e-3\n')
    cfg = load_config(str(child))
    base = load_config(TINY_CPU)
    assert cfg.inner.lr == 1e-3 and cfg.inner.sync_every == base.inner.sync_every == 20  # the base's keys kept
    assert cfg.model == base.model and scheme_of(cfg) == "diloco"
    cfg = load_config(str(child), ["scheme=streaming"])  # the command line's scheme replaces the file's
    assert scheme_of(cfg) == "streaming" and cfg.streaming.fragments == 4 and cfg.inner.lr == 1e-3


def test_config_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown scheme 'fp32'.*streaming, diloco.*--set scheme=diloco"):
        load_config(None, ["scheme=fp32"])
    loop = tmp_path / "a.toml"
    loop.write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(str(loop))
    orphan = tmp_path / "b.toml"
    orphan.write_text('base = "missing.toml"\n')
    with pytest.raises(ConfigError, match=r"missing.toml not found \(named as base by"):
        load_config(str(orphan))
    # the default's tau cannot run with H = 8 and 4 fragments: the message names the fix
    with pytest.raises(ConfigError, match=r"streaming.tau \(4\) must be smaller than .* = 2"):
        load_config(TINY_CPU, ["inner.sync_every=8"])


def test_delay_and_eager_drop_the_default_tau_but_refuse_an_explicit_one():
    cfg = load_config(TINY_CPU, ["streaming.mode=eager"])
    assert (cfg.streaming.tau, cfg.streaming.alpha) == (0, 0.0)
    assert describe_scheme(cfg).startswith("Streaming DiLoCo, 4 fragments, eager (paper)")
    with pytest.raises(ConfigError, match="apply to streaming.mode='tau' only"):
        load_config(TINY_CPU, ["streaming.mode=delay", "streaming.tau=2"])


def test_fp32_allreduce_bytes_is_the_butterfly_formula():
    assert fp32_allreduce_bytes(1000, 1) == 0
    assert fp32_allreduce_bytes(1000, 2) == 4000          # half out, half of the mean back
    assert fp32_allreduce_bytes(1200, 4) == 2 * 3 * 4 * 300


@pytest.mark.timeout(300)
def test_demo_runs_the_default_scheme_and_says_what_it_saved(tmp_path):
    """`p2pdiloco demo` (what the README's first command runs): the volunteers get no scheme --set, run the
    default scheme (their run_config.json), and the summary names it and the bytes saved against fp32."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "demo", "--peers", "2", "--outer-steps", "1",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = describe_scheme(load_config(TINY_CPU))
    assert f"scheme: {want}\n" in proc.stdout  # said before training
    for i in range(2):
        ran = json.loads((out / f"peer{i}" / "run_config.json").read_text())
        assert ran["streaming"]["fragments"] == 4 and ran["streaming"]["tau"] == 4
        assert ran["compression"]["codec"] == "e3m0" and ran["outer"]["lr"] == SCHEMES["streaming"]["outer.lr"]
    m = re.search(rf"scheme: {re.escape(want)}; syncs sent ([\d.]+ [KMG]?B) per peer, an fp32 all-reduce of the same "
                  r"syncs ([\d.]+ [KMG]?B): ([\d.]+)x fewer bytes", proc.stdout)
    assert m, proc.stdout[-2000:]
    # 4-bit E3M0 carries 4.5 bits per value (4 + one fp16 scale per 64): 32 / 4.5 = 7.1x, less the framing
    assert 6.0 <= float(m.group(3)) <= 7.2
    assert "all peers hold identical global parameters: yes" in proc.stdout


def test_a_model_preset_on_the_command_line_applies_in_order():
    assert load_config(None, ["model.n_layers=2", "model.preset=tiny", "scheme=diloco"]).model.n_layers == 4
    assert load_config(None, ["model.preset=tiny", "model.n_layers=2", "scheme=diloco"]).model.n_layers == 2
