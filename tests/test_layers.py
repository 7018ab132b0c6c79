"""The layer order of p2pdiloco/layers.py holds: imports go down or sideways, never up; no import
cycle between p2pdiloco modules; imports inside functions only where layers.py says why."""
from __future__ import annotations

import subprocess
import sys

import pytest

from p2pdiloco import layers

from conftest import ROOT


@pytest.fixture(scope="module")
def imports():
    return layers.read_imports()


def test_every_module_is_read(imports):
    assert "p2pdiloco.config" in imports and "p2pdiloco.swarm.node" in imports
    assert "p2pdiloco.errors" in imports["p2pdiloco.config"].top


def test_no_module_imports_a_higher_layer(imports):
    assert layers.upward_imports(imports) == []


def test_no_import_cycle(imports):
    assert layers.cycles(imports) == []


def test_function_level_imports_only_where_allowed(imports):
    assert layers.lazy_imports(imports) == []


def test_the_rules_catch_what_they_forbid():
    """An upward import, a cycle and a function-level import of a p2pdiloco module are each reported."""
    fake = {
        "p2pdiloco.errors": layers.Imports(top={"p2pdiloco.config"}),
        "p2pdiloco.config": layers.Imports(top={"p2pdiloco.errors"}),
        "p2pdiloco.model": layers.Imports(lazy={"p2pdiloco.data"}, lazy_third_party={"json"}),
        "p2pdiloco.data": layers.Imports(),
    }
    assert layers.upward_imports(fake) == ["p2pdiloco.errors (foundation) imports p2pdiloco.config (config)"]
    assert layers.cycles(fake) == [["p2pdiloco.config", "p2pdiloco.errors"]]
    assert layers.lazy_imports(fake) == ["p2pdiloco.model imports p2pdiloco.data inside a function",
                                         "p2pdiloco.model imports json inside a function"]


def test_every_module_has_a_layer_and_the_table_is_ordered(imports):
    assert layers.unplaced(imports) == []
    assert layers.layer_of("p2pdiloco.newly_added") is None
    names = [name for name, _, _ in layers.LAYERS]
    assert len(names) == len(set(names))
    assert layers.layer_of("p2pdiloco.errors") < layers.layer_of("p2pdiloco.config") < \
        layers.layer_of("p2pdiloco.diloco.core") < layers.layer_of("p2pdiloco.swarm.node") < \
        layers.layer_of("p2pdiloco.run_identity") < layers.layer_of("p2pdiloco.cli")
    assert layers.layer_of("p2pdiloco.local.worker") > layers.layer_of("p2pdiloco.local.group")


def test_the_command_prints_the_picture():
    r = subprocess.run([sys.executable, "-m", "p2pdiloco.layers"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no cycle" in r.stdout and "config -> " in r.stdout


def test_no_function_is_over_80_lines_outside_the_benchmarks():
    """A function a reader must hold in mind at once stays short; benchmarks (one long scenario each) are
    exempt."""
    import ast

    from p2pdiloco.layers import module_files

    long = []
    for name, path in module_files().items():
        if name.startswith("p2pdiloco.bench"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long
