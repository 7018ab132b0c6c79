"""The package's layer order, and the import graph drawn against it.

A module may import modules of its own layer or of a lower one, never of a higher one, and the
imports between p2pdiloco modules (those inside functions included) form no cycle. Inside a
function a module imports only what would make a light path heavy: a third-party package of
:data:`LAZY_THIRD_PARTY`, or, in the modules of :data:`LAZY_INTERNAL`, a p2pdiloco module that pulls
in torch or hivemind. ``tests/test_layers.py`` enforces all three rules;
``python -m p2pdiloco.layers`` (or ``make deps``) prints each module's imports grouped by layer and
whether there is a cycle.

Layers, low to high (a module belongs to the layer of its longest matching prefix):
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

PACKAGE = "p2pdiloco"

#: (layer, what it holds, module prefixes). The order is the rule: imports go down or sideways.
#: config sits above model, data and compression because it assembles their section dataclasses
#: (ModelConfig, DataConfig, RobustConfig) into RunConfig; run identity sits above swarm because the
#: fingerprint carries swarm.protocol's PROTOCOL_VERSION, and swarm only compares fingerprints.
LAYERS: List[Tuple[str, str, Tuple[str, ...]]] = [
    ("foundation", "errors, exact arithmetic, tensor digests, the snapshot layout, short peer ids, metrics, "
     "addresses, fault hooks, checkpoint files",
     ("errors", "exact", "digest", "snapshot", "ids", "metrics", "addresses", "faults", "checkpoint")),
    ("models and data", "the model builders (tiny GPT, Hugging Face), tokenizers, corpora and batch streams",
     ("model", "hf", "tokenizer", "sources", "text", "tokenized", "data")),
    ("compression", "gradient codecs and the robust aggregator", ("compression",)),
    ("config", "RunConfig and BootstrapConfig: TOML and --set land here", ("config",)),
    ("diloco", "fragments, outer optimizer state, overlap, reducers, the DiLoCo object", ("diloco",)),
    ("swarm", "DHT node, identity, records, matchmaking, all-reduce, state transfer", ("swarm", "identity")),
    ("run identity", "the run fingerprint, export and sampling of a trained run", ("run_identity", "export")),
    ("dashboard", "the live view of a run's records and its web server", ("dashboard",)),
    ("local group", "the K local processes of one peer: messages, group, FSDP shards, launch",
     ("local.messages", "local.group", "local.fsdp", "local.launch")),
    ("train", "the training loop of one peer", ("train",)),
    ("local workers", "the loop of a local worker process", ("local.worker", "local")),
    ("entry points", "library API, demo, command line, benchmarks, this module",
     ("api", "demo", "cli", "bench", "layers", "")),  # "": the package itself (its lazy exports)
]

#: third-party packages a function may import (not at module level), and why
LAZY_THIRD_PARTY: Dict[str, str] = {
    "torch": "bootstrap, status and dashboard must start without importing torch (seconds, GBs)",
    "transformers": "1.6 s to import; only Hugging Face models, BPE training and export need it",
    "tokenizers": "only BPE runs need it (it comes with transformers)",
    "datasets": "only JSONL/Parquet record sources need it (slow import)",
    "safetensors": "only pretrained weights and export need it",
    "bitsandbytes": "only its 8-bit codec needs it (loads CUDA libraries)",
    "hivemind": "imports torch; the torch-free paths (bootstrap key files, status) must not",
    "cryptography": "only key files need it, beside hivemind's crypto_pb2",
    "multihash": "only peer ids from key files need it, beside hivemind",
    "numba": "JIT compiler, seconds to import; only the fused 4-bit codec uses it",
    "matplotlib": "only plots (demo, benchmarks) need it",
    "psutil": "optional (it comes with hivemind): process and interface checks fall back without it",
}

#: modules whose functions may import p2pdiloco modules, and why (every other module imports its
#: p2pdiloco dependencies at module level, so the graph above is the whole truth)
LAZY_INTERNAL: Dict[str, str] = {
    "p2pdiloco.cli": "bootstrap, status and dashboard must not import torch: each command imports its own path",
    "p2pdiloco.demo": "the demo launcher starts processes and must not import torch itself",
    "p2pdiloco.dashboard.server": "swarm.node imports hivemind (torch); the page server runs without it",
    "p2pdiloco.bench": "each benchmark imports only what its own row runs (torch, hivemind, netns tools)",
    "p2pdiloco.identity": "key files are read and written without hivemind, which swarm.signing imports",
}

#: imports tolerated while a move is under way: (importer, imported) -> what removes it. Empty when
#: the tree is settled; a new entry needs a reason and an owner.
PENDING: Dict[Tuple[str, str], str] = {}

#: standard-library and light third-party modules imported inside functions, tolerated while a move
#: is under way: importer -> modules
PENDING_LAZY_THIRD_PARTY: Dict[str, Set[str]] = {
    "p2pdiloco.compression.fused": {"types"},
}


@dataclass
class Imports:
    """What one module imports: p2pdiloco modules (at module level, inside functions) and others."""

    top: Set[str] = field(default_factory=set)
    lazy: Set[str] = field(default_factory=set)
    lazy_third_party: Set[str] = field(default_factory=set)


def package_root() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def module_files(root: Optional[str] = None) -> Dict[str, str]:
    """Every module of the package: dotted name -> file path."""
    root = root or package_root()
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), os.path.dirname(root))[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


class _Reader(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: Set[str]):
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.depth = 0
        self.found = Imports()

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def _add(self, name: str) -> None:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            while name not in self.known and "." in name:  # `from .x import function` -> module x
                name = name.rpartition(".")[0]
            (self.found.lazy if self.depth else self.found.top).add(name)
        elif self.depth:
            self.found.lazy_third_party.add(name.partition(".")[0])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        if base == "__future__":
            return
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self._add(full if full in self.known else base)


def read_imports(files: Optional[Dict[str, str]] = None) -> Dict[str, Imports]:
    """Every module's imports, read with ``ast`` (nothing is imported)."""
    files = files or module_files()
    known = set(files)
    out = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        reader = _Reader(module, path.endswith("__init__.py"), known)
        reader.visit(tree)
        reader.found.top.discard(module)
        reader.found.lazy.discard(module)
        out[module] = reader.found
    return out


def layer_of(module: str) -> Optional[int]:
    """Index in :data:`LAYERS` of the module's layer (the longest matching prefix wins), None when no
    prefix matches: a new module must be placed in the table."""
    rel = module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else ""
    best, best_len = None, -1
    for i, (_, _, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (rel == prefix or (prefix and rel.startswith(prefix + "."))) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def unplaced(imports: Dict[str, Imports]) -> List[str]:
    """Modules that no layer of :data:`LAYERS` holds, one line each."""
    return [f"{m} has no layer: add it to p2pdiloco/layers.py LAYERS" for m in sorted(imports) if layer_of(m) is None]


def edges(imports: Dict[str, Imports]) -> Iterable[Tuple[str, str]]:
    for module, found in sorted(imports.items()):
        for target in sorted(found.top | found.lazy):
            yield module, target


def upward_imports(imports: Dict[str, Imports]) -> List[str]:
    """Imports of a higher layer, one line each (PENDING ones excepted)."""
    out = []
    for module, target in edges(imports):
        if (module, target) in PENDING or target == PACKAGE or None in (layer_of(module), layer_of(target)):
            continue
        if layer_of(target) > layer_of(module):
            out.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    return out


def lazy_imports(imports: Dict[str, Imports]) -> List[str]:
    """Function-level imports that no rule allows, one line each."""
    out = []
    for module, found in sorted(imports.items()):
        allowed_internal = any(module == m or module.startswith(m + ".") for m in LAZY_INTERNAL)
        for target in sorted(found.lazy):
            if not allowed_internal and (module, target) not in PENDING:
                out.append(f"{module} imports {target} inside a function")
        for name in sorted(found.lazy_third_party):
            if name not in LAZY_THIRD_PARTY and name not in PENDING_LAZY_THIRD_PARTY.get(module, ()):
                if not module.startswith(PACKAGE + ".bench"):
                    out.append(f"{module} imports {name} inside a function")
    return out


def cycles(imports: Dict[str, Imports]) -> List[List[str]]:
    """The import graph's cycles (strongly connected components of more than one module, or a module
    importing itself), PENDING edges left out."""
    graph: Dict[str, List[str]] = {m: [] for m in imports}
    for module, target in edges(imports):
        if (module, target) not in PENDING and target in graph:
            graph[module].append(target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else module


def report(imports: Optional[Dict[str, Imports]] = None) -> Tuple[str, bool]:
    """The dependency picture as text, and whether the rules hold."""
    imports = imports or read_imports()
    lines = []
    for i, (name, what, _) in enumerate(LAYERS):
        members = sorted(m for m in imports if layer_of(m) == i)
        if not members:
            continue
        lines.append(f"{i}. {name}: {what}")
        for m in members:
            found = imports[m]
            deps = [_short(t) + ("*" if t in found.lazy and t not in found.top else "")
                    for t in sorted(found.top | found.lazy) if t != PACKAGE]
            lines.append(f"    {_short(m) or PACKAGE} -> {', '.join(deps) or '-'}")
    lines.append("(* imported inside a function)")
    problems = unplaced(imports) + upward_imports(imports) + lazy_imports(imports)
    found_cycles = cycles(imports)
    problems += ["cycle: " + " <-> ".join(map(_short, c)) for c in found_cycles]
    if PENDING:
        lines.append(f"{len(PENDING)} import(s) tolerated while moves are under way (layers.PENDING)")
    lines.append("no cycle" if not found_cycles else f"{len(found_cycles)} cycle(s)")
    lines += problems
    return "\n".join(lines), not problems


__doc__ = (__doc__ or "") + "\n".join(f"{i}. **{name}**: {what}" for i, (name, what, _) in enumerate(LAYERS))


def main() -> int:
    text, ok = report()
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
