"""The names of everything a run keeps in the DHT and of the streams its peers open: formatted and
parsed here only.

DHT keys (values: signed msgpack maps, :mod:`.records`; the subkey is the writer's peer id)::

    <run>:fingerprint              {fp, fields, since}   the configuration every peer must share
    <run>:progress  [peer id]      {step, round, next_sync, ...}   refreshed every progress_period
    <run>:history  [peer id]       {vr, vl, fr, ff, ft, fw}   recent losses and failed rounds (dashboard)
    <run>:mm:<frag>:<round>  [peer id]    {t, reach[, via]}   ready for that round (matchmaking)
    <run>:group:<frag>:<round>  [leader id]  {members, base}  the one group of that round

Stream protocols (libp2p handlers) are ``p2pdiloco.<run>.<name>``: ``join`` (matchmaking), ``part``
(all-reduce), ``state`` (state download).
"""
from __future__ import annotations

__all__ = ["progress_key", "history_key", "fingerprint_key", "ready_key", "group_key", "kind_of", "handler_name",
           "RECORD_KINDS"]

#: the record kinds :func:`kind_of` names (each has a schema in :mod:`.records`)
RECORD_KINDS = ("progress", "history", "fingerprint", "ready", "group", "generic")


def progress_key(run_id: str) -> str:
    """Every live peer's progress record (subkey: its peer id)."""
    return f"{run_id}:progress"


def history_key(run_id: str) -> str:
    """Every peer's recent validation losses and failed rounds (subkey: its peer id): read by dashboards
    only, so the progress records that matchmaking reads again and again stay small."""
    return f"{run_id}:history"


def fingerprint_key(run_id: str) -> str:
    """The run's configuration fingerprint claims (subkey: the claiming peer)."""
    return f"{run_id}:fingerprint"


def ready_key(run_id: str, frag: int, round_: int) -> str:
    """The ready records of one (fragment, round) (subkey: the ready peer)."""
    return f"{run_id}:mm:{frag}:{round_}"


def group_key(run_id: str, frag: int, round_: int) -> str:
    """The group record of one (fragment, round) (subkey: its leader)."""
    return f"{run_id}:group:{frag}:{round_}"


def kind_of(key: str) -> str:
    """The record kind stored under ``key``: one of :data:`RECORD_KINDS` (anything not formatted by
    this module is ``generic``)."""
    if key.endswith(":progress"):
        return "progress"
    if key.endswith(":history"):
        return "history"
    if key.endswith(":fingerprint"):
        return "fingerprint"
    if ":mm:" in key:
        return "ready"
    if ":group:" in key:
        return "group"
    return "generic"


def handler_name(run_id: str, name: str) -> str:
    """The stream protocol of one of the run's handlers (``join``, ``part``, ``state``)."""
    return f"p2pdiloco.{run_id}.{name}"
