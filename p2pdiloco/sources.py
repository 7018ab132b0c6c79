"""Where corpus text comes from: the files of a ``data.source``, read in a fixed order.

* ``"stdlib"`` (:data:`STDLIB_SOURCE`): the ``.py`` files of the running Python's standard library
  (:func:`stdlib_files`).
* a directory: its regular files, recursively, hidden ones left out (:func:`directory_files`).
* records: JSONL/JSON/Parquet files or a glob of them (:func:`is_records_source`,
  :func:`records_files`), read one record at a time with ``datasets`` (:func:`iter_documents`).

Everything is in sorted relative-path order so every peer reads the same bytes. The byte-level
corpus (:mod:`p2pdiloco.text`) and the tokenized one (:mod:`p2pdiloco.tokenized`) both read here.
"""
from __future__ import annotations

import glob as globlib
import logging
import os
import sysconfig
from typing import Iterator, List, Tuple

from .errors import ConfigError

__all__ = ["STDLIB_SOURCE", "stdlib_files", "directory_files", "looks_binary", "read_bounded",
           "is_records_source", "records_files", "iter_documents"]

logger = logging.getLogger(__name__)

#: The reserved ``source`` value naming the built-in standard-library corpus.
STDLIB_SOURCE = "stdlib"

_STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3",
        "turtledemo", "__pycache__", "_bundled", "lib-dynload",
    }
)
_BINARY_SNIFF_BYTES = 8192



def stdlib_files() -> Tuple[str, List[Tuple[str, str]]]:
    """(root, sorted [(relative posix path, absolute path)]) of the stdlib corpus."""
    root = sysconfig.get_paths()["stdlib"]
    found: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                full = os.path.join(dirpath, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort()
    return root, found


def directory_files(root: str) -> List[Tuple[str, str]]:
    """Sorted [(relative posix path, absolute path)] of the regular files below ``root``, hidden
    files and directories left out."""
    found: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.isfile(full):
                continue
            found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    found.sort()
    return found


def looks_binary(data: bytes) -> bool:
    """A NUL byte in the first 8 KiB (git's heuristic)."""
    return b"\x00" in data[:_BINARY_SNIFF_BYTES]


def read_bounded(
    files: List[Tuple[str, str]], max_bytes: int, skip_binary: bool
) -> List[Tuple[str, bytes]]:
    """Read files in order until ``max_bytes`` bytes are taken (the last one possibly truncated)."""
    taken: List[Tuple[str, bytes]] = []
    remaining = max_bytes
    for rel, full in files:
        if remaining <= 0:
            break
        with open(full, "rb") as f:
            data = f.read(max(remaining, _BINARY_SNIFF_BYTES) if skip_binary else remaining)
        if skip_binary and looks_binary(data):
            logger.debug("skipping binary-looking file %s", full)
            continue
        if not data:
            continue
        data = data[:remaining]
        taken.append((rel, data))
        remaining -= len(data)
    return taken


_RECORD_EXTS = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def is_records_source(source: str) -> bool:
    """True when ``source`` names JSONL/JSON/Parquet files (or a glob of them)."""
    s = source.lower()
    return s.endswith(_RECORD_EXTS) or any(c in source for c in "*?[")


def records_files(source: str) -> List[str]:
    """The files a records source names, sorted; :class:`ConfigError` when none or one is unreadable."""
    files = sorted(globlib.glob(source)) if any(c in source for c in "*?[") else [source]
    files = [f for f in files if not os.path.isdir(f)]
    if not files:
        raise ConfigError(f"data.source {source!r} matches no file; give a .jsonl/.parquet file or a glob of them")
    for f in files:
        if not os.path.isfile(f):
            raise ConfigError(f"data.source file {f} does not exist")
        if not os.access(f, os.R_OK):
            raise ConfigError(f"data.source file {f} is not readable (permissions); fix them or leave it out")
        if not f.lower().endswith(_RECORD_EXTS):
            raise ConfigError(f"data.source file {f} is not .jsonl, .json or .parquet; records sources take those only")
    return files


def iter_documents(path: str, text_field: str) -> Iterator[Tuple[int, str]]:
    """(index, text) of every record of one file, streamed with ``datasets`` (one record in memory)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    builder = "parquet" if path.lower().endswith(".parquet") else "json"
    try:
        ds = datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", streaming=True)
        for i, rec in enumerate(ds):
            if text_field not in rec:
                raise ConfigError(f"record {i} of {path} has no field {text_field!r} (it has: "
                                  f"{', '.join(sorted(rec)[:12])}); set data.text_field to the field holding the text")
            text = rec[text_field]
            if not isinstance(text, str):
                raise ConfigError(f"record {i} of {path}: field {text_field!r} is {type(text).__name__}, not text; "
                                  "set data.text_field to a string field")
            yield i, text
    except ConfigError:
        raise
    except Exception as e:  # datasets/pyarrow raise many types for a malformed file
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"cannot read {path} as {builder} records ({type(e).__name__}: {msg}); fix or remove "
                          "the file") from None
