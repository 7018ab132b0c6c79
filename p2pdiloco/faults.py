"""Fault injection: make a real peer process fail or stall at a precise (inner step, phase).

Part of the design, not a test-only patch (the torchft ``EventInjector`` idea): the hooks live in
the code paths they break, cost one dictionary lookup when no fault is installed, and every
firing is *counted* and reported before the fault acts, so a test can assert that the fault it
placed really happened (a killed peer's ``metrics.jsonl`` still shows its ``fault`` event).

Rules come from the environment variable ``P2PDILOCO_FAULTS``, read by ``p2pdiloco join``
(:func:`install_from_env`): JSON, one object or a list of objects::

    P2PDILOCO_FAULTS='[{"phase": "allreduce.part_sent", "action": "kill", "round": 2}]'

Keys of a rule (anything else is refused with :class:`ConfigError` naming the key):

    phase    where it fires, one of PHASES (below)
    action   what it does, one of ACTIONS (below)
    step     fire only once the peer's inner step is >= step (default: any step)
    frag     all-reduce phases: only this fragment (default: any)
    round    all-reduce phases: only this round of the fragment (default: any)
    times    how many times the rule fires (default 1; 0 = every time it matches)
    seconds  how long ``stall`` sleeps (default 3600: "forever" for a test)
    code     exit status for ``exit`` (default 1)
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Union

from .errors import ConfigError, SyncFailed

__all__ = [
    "ENV_VAR",
    "PHASES",
    "ACTIONS",
    "Fault",
    "parse_faults",
    "install",
    "install_from_env",
    "clear",
    "set_sink",
    "set_step",
    "fire",
    "afire",
    "counters",
    "tamper_bytes",
]

logger = logging.getLogger(__name__)

ENV_VAR = "P2PDILOCO_FAULTS"

#: where a fault can be placed
PHASES = {
    "step": "right after an inner step (the training loop)",
    "allreduce.send": "the sync's group is final and this peer is about to send its parts",
    "allreduce.half_sent": "half the chunks (rounded up) of one of this peer's parts are sent: mid-part",
    "allreduce.part_sent": "one of this peer's parts reached its owner: the middle of an all-reduce",
    "checkpoint.write": "the checkpoint's temp file is written but not yet renamed into place",
    "state.serve": "a donor is about to send its state to a joining peer",
}

#: what a fault does
ACTIONS = {
    "stall": "sleep `seconds`: at state.serve only that reply waits (a very slow donor); in the all-reduce "
             "phases the peer's whole network thread stops (a frozen peer); at step and checkpoint.write "
             "the training loop stops",
    "fail": "raise SyncFailed at that point",
    "kill": "SIGKILL this peer and its DHT/daemon children, as a crashed machine",
    "exit": "os._exit(code) without any cleanup",
    "tamper": "corrupt the bytes about to be sent (state.serve only)",
    "signal": "send this process SIGTERM (the user's Ctrl-C or `kill` at exactly that point)",
    "slow": "step only: sleep (factor - 1) times this inner step's compute time, a machine `factor` times "
            "slower (with times 0, every step; reported at the first firing and every 100th, all counted)",
}


@dataclass
class Fault:
    """One rule. ``fired`` counts its firings."""

    phase: str
    action: str
    step: Optional[int] = None
    frag: Optional[int] = None
    round: Optional[int] = None
    times: int = 1
    seconds: float = 3600.0
    factor: float = 1.0
    code: int = 1
    fired: int = 0

    def matches(self, phase: str, step: int, frag: Optional[int], round_: Optional[int]) -> bool:
        if phase != self.phase or (self.times and self.fired >= self.times):
            return False
        if self.step is not None and step < self.step:
            return False
        if self.frag is not None and frag != self.frag:
            return False
        return self.round is None or round_ == self.round


_rules: List[Fault] = []
_lock = threading.Lock()
_step = 0
_sink: Optional[Callable[..., None]] = None
_counts: Dict[str, int] = {}


def parse_faults(spec: Union[str, Dict[str, Any], List[Dict[str, Any]]]) -> List[Fault]:
    """Rules from JSON text, one dict, or a list of dicts; ConfigError naming what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_VAR} is not valid JSON ({e}); example: "
                              '[{"phase": "step", "action": "stall", "step": 10, "seconds": 5}]') from None
    items = [spec] if isinstance(spec, dict) else spec
    if not isinstance(items, list):
        raise ConfigError(f"{ENV_VAR} must be a JSON object or a list of objects")
    known = {f.name for f in fields(Fault)} - {"fired"}
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ConfigError(f"{ENV_VAR}: every fault must be an object, got {item!r}")
        unknown = sorted(set(item) - known)
        if unknown:
            raise ConfigError(f"{ENV_VAR}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        fault = Fault(**item)
        if fault.phase not in PHASES:
            raise ConfigError(f"{ENV_VAR}: unknown phase {fault.phase!r}; phases: {', '.join(PHASES)}")
        if fault.action not in ACTIONS:
            raise ConfigError(f"{ENV_VAR}: unknown action {fault.action!r}; actions: {', '.join(ACTIONS)}")
        if fault.action == "slow" and (fault.phase != "step" or not isinstance(fault.factor, (int, float))
                                       or isinstance(fault.factor, bool) or not fault.factor >= 1):
            raise ConfigError(f"{ENV_VAR}: action 'slow' applies to phase 'step' with a factor >= 1, got phase "
                              f"{fault.phase!r} factor {fault.factor!r}")
        if fault.action == "tamper" and fault.phase != "state.serve":
            raise ConfigError(f"{ENV_VAR}: action 'tamper' only applies to phase 'state.serve'")
        for name in ("step", "frag", "round"):
            v = getattr(fault, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{ENV_VAR}: {name} must be a non-negative integer, got {v!r}")
        if not isinstance(fault.times, int) or fault.times < 0:
            raise ConfigError(f"{ENV_VAR}: times must be a non-negative integer, got {fault.times!r}")
        if not isinstance(fault.seconds, (int, float)) or fault.seconds < 0:
            raise ConfigError(f"{ENV_VAR}: seconds must be >= 0, got {fault.seconds!r}")
        out.append(fault)
    return out


def install(rules: Union[str, List[Fault], List[Dict[str, Any]], Dict[str, Any]]) -> List[Fault]:
    """Replace the installed rules (parsed when not already Faults); returns them."""
    parsed = rules if isinstance(rules, list) and all(isinstance(r, Fault) for r in rules) else parse_faults(rules)
    with _lock:
        _rules[:] = parsed
        _counts.clear()
    if parsed:
        logger.warning(f"fault injection armed: {len(parsed)} rule(s): "
                       + "; ".join(f"{r.action} at {r.phase}" for r in parsed))
    return parsed


def install_from_env() -> List[Fault]:
    spec = os.environ.get(ENV_VAR, "").strip()
    return install(spec) if spec else install([])


def clear() -> None:
    install([])
    set_sink(None)
    set_step(0)


def set_sink(sink: Optional[Callable[..., None]]) -> None:
    """``sink(**event)`` receives every firing (the loop writes it to metrics.jsonl)."""
    global _sink
    _sink = sink


def set_step(step: int) -> None:
    """The peer's current inner step (the training loop keeps it current)."""
    global _step
    _step = int(step)


def counters() -> Dict[str, int]:
    """Firings so far, by ``"<phase>:<action>"``."""
    with _lock:
        return dict(_counts)


def _match(phase: str, frag: Optional[int], round_: Optional[int], step: Optional[int] = None) -> Optional[Fault]:
    if not _rules:  # the common case: one list check
        return None
    step = _step if step is None else int(step)
    with _lock:
        for rule in _rules:
            if rule.matches(phase, step, frag, round_):
                rule.fired += 1
                key = f"{phase}:{rule.action}"
                _counts[key] = _counts.get(key, 0) + 1
                count = _counts[key]
                break
        else:
            return None
    if rule.action == "slow" and count > 1 and count % 100:
        return rule  # counted; a throttle fires every step, reported at the first firing and every 100th
    event = dict(phase=phase, action=rule.action, step=step, frag=frag, round=round_, count=count)
    logger.warning(f"injected fault: {rule.action} at {phase} (step {step}, fragment {frag}, round {round_}, "
                   f"firing {count})")
    if _sink is not None:
        try:
            _sink(**event)
        except Exception as e:  # a broken sink must not hide the fault
            logger.error(f"fault sink failed: {e}")
    return rule


def _act(rule: Fault) -> None:
    if rule.action == "fail":
        raise SyncFailed(f"injected fault at {rule.phase}")
    if rule.action == "kill":
        _crash()
    if rule.action == "exit":
        _flush_logs()
        os._exit(rule.code)
    if rule.action == "signal":
        os.kill(os.getpid(), signal.SIGTERM)


def fire(phase: str, *, frag: Optional[int] = None, round: Optional[int] = None,
         busy: float = 0.0, step: Optional[int] = None) -> Optional[Fault]:
    """Run the matching rule's action here (stalls with time.sleep); returns the rule, or None.

    ``tamper`` is returned to the caller, which owns the bytes (see :func:`tamper_bytes`). ``busy``: the
    compute seconds of the inner step just taken (``slow`` sleeps a multiple of it). ``step``: the inner
    step the work at ``phase`` belongs to, where that is not the loop's current one (a background thread).
    """
    rule = _match(phase, frag, round, step)
    if rule is not None:
        if rule.action == "stall":
            time.sleep(rule.seconds)
        elif rule.action == "slow":
            time.sleep((rule.factor - 1) * max(0.0, busy))
        _act(rule)
    return rule


async def afire(phase: str, *, frag: Optional[int] = None, round: Optional[int] = None) -> Optional[Fault]:
    """:func:`fire` for coroutines: a stall awaits, so only this coroutine stops."""
    rule = _match(phase, frag, round)
    if rule is not None:
        if rule.action == "stall":
            await asyncio.sleep(rule.seconds)
        _act(rule)
    return rule


def tamper_bytes(payload: bytes) -> bytes:
    """Flip one bit in the middle: a change no length check notices, every digest does."""
    if not payload:
        return payload
    b = bytearray(payload)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _crash() -> None:
    """SIGKILL our own children (DHT process, p2p daemon), then ourselves: nothing gets to clean up."""
    _flush_logs()
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # pragma: no cover - the signal is delivered before this returns
