"""The one structured message between the local workers, in a fixed format: nothing they exchange is
unpickled.

Every other message is a tensor whose shape and dtype both sides derive from the model (:mod:`.group`).
Rank 0's start (the *brief*, :meth:`.group.LocalLeader.brief`) is a msgpack map, its length (one
int64) and then its bytes (uint8) broadcast from rank 0, decoded by :func:`decode_brief`, which checks
every field before anything uses it and raises :class:`~p2pdiloco.errors.WireError` naming the first
field that is wrong::

    v              BRIEF_VERSION (int)
    run_dir        the peer's run folder (str)
    me, peer       rank 0's short and full peer id (str)
    shard          the peer's data shard (int >= 0)
    batches_drawn  the stream position rank 0 resumed at (int >= 0)
    opt            the inner optimiser's state without its tensors (:func:`.group._split_state`):
                   {"state": {parameter index: {name: tensor spec | number}},
                    "param_groups": [{name: None | bool | number | str | tuple/list of numbers}]}

A tensor spec is a map of one key, ``"\\x00tensor"``, holding ``[shape, dtype, device]``; a tuple
(AdamW's betas) a map of one key, ``"\\x00tuple"``, holding its items; decoded, they are the skeleton's
own forms (``("__tensor__", shape, dtype, device)`` and a tuple). No msgpack ext type is accepted (every
decode in p2pdiloco forbids them). Sizes are bounded (:data:`MAX_BRIEF_BYTES` and the ``MAX_*``
limits) before anything is allocated.
"""
from __future__ import annotations

from typing import Any, Dict, List

import msgpack

from ..errors import WireError

__all__ = ["BRIEF_VERSION", "MAX_BRIEF_BYTES", "encode_brief", "decode_brief"]

BRIEF_VERSION = 1
#: the largest brief a worker accepts (bytes): a skeleton costs ~150 bytes per parameter tensor
MAX_BRIEF_BYTES = 16 << 20
#: the longest string (bytes; a path may be this long) and the most items of one array or map
MAX_STR = 4096
MAX_ITEMS = 1 << 20
#: a tensor spec: at most this many dimensions, each at most this long
MAX_NDIM, MAX_DIM = 8, 1 << 40
#: dtypes a tensor spec may name (torch attribute names) and the devices
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
DEVICES = ("cpu", "cuda")
#: the keys that mark a tensor spec and a tuple (a NUL first: no optimiser state or group field is named so)
_TAG_TENSOR, _TAG_TUPLE = "\x00tensor", "\x00tuple"
_INFO = {"run_dir": str, "me": str, "peer": str, "shard": int, "batches_drawn": int}
_TENSOR = "__tensor__"


def encode_brief(info: Dict[str, Any], skeleton: Any) -> bytes:
    """Rank 0's brief: ``info`` (exactly the fields of the module docstring but ``v`` and ``opt``) and
    the optimiser state's skeleton. Raises ValueError for a field the format has no place for."""
    if set(info) != set(_INFO):
        raise ValueError(f"the local workers' brief needs exactly the fields {sorted(_INFO)}, not {sorted(info)}")
    return msgpack.packb({"v": BRIEF_VERSION, **info, "opt": _to_wire(skeleton)}, use_bin_type=True)


def _to_wire(x: Any) -> Any:
    if isinstance(x, tuple) and len(x) == 4 and x[0] == _TENSOR:
        return {_TAG_TENSOR: [list(x[1]), x[2], x[3]]}
    if isinstance(x, tuple):
        return {_TAG_TUPLE: [_to_wire(v) for v in x]}
    if isinstance(x, dict):
        if any(isinstance(k, str) and k.startswith("\x00") for k in x):
            raise ValueError("the local workers' brief cannot carry a field name starting with NUL")
        return {k: _to_wire(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_wire(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise ValueError(f"the local workers' brief cannot carry a {type(x).__name__}")


def _tagged(v: Any, tag: str) -> Any:
    """The payload of a tagged map ``{tag: payload}``, or None when ``v`` is not one."""
    if isinstance(v, dict) and len(v) == 1 and tag in v:
        return v[tag]
    return None


def _unpack(data: bytes) -> Any:
    """msgpack with every size bounded and no ext type."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, max_str_len=MAX_STR,
                           max_bin_len=0, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS, max_ext_len=0)


def decode_brief(data: bytes) -> Dict[str, Any]:
    """The brief's fields (``opt``: the skeleton) from its bytes; raises :class:`WireError` on anything
    malformed: undecodable bytes, a missing, unknown or mistyped field, an out-of-range value."""
    if len(data) > MAX_BRIEF_BYTES:
        raise WireError(f"the local workers' brief is {len(data)} bytes (limit {MAX_BRIEF_BYTES})")
    try:
        msg = _unpack(bytes(data))
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's errors for truncated, oversized or odd input vary
        raise WireError(f"the local workers' brief is undecodable ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(msg, dict):
        raise WireError(f"the local workers' brief is a {type(msg).__name__}, not a map")
    fields = set(_INFO) | {"v", "opt"}
    if set(msg) != fields:
        missing, extra = fields - set(msg), set(msg) - fields
        raise WireError(f"the local workers' brief has fields {sorted(map(repr, msg))}: "
                        f"missing {sorted(missing)}, unknown {sorted(map(repr, extra))}")
    if msg["v"] != BRIEF_VERSION or type(msg["v"]) is not int:
        raise WireError(f"the local workers' brief is of version {msg['v']!r}, this worker reads {BRIEF_VERSION} "
                        "(every local worker runs the same p2pdiloco)")
    for name, kind in _INFO.items():
        v = msg[name]
        if type(v) is not kind or (kind is int and not 0 <= v < 1 << 62):
            raise WireError(f"the local workers' brief: {name} = {v!r:.80} is not a{' non-negative' * (kind is int)} "
                            f"{kind.__name__}")
    return {**{name: msg[name] for name in _INFO}, "opt": _skeleton(msg["opt"])}


def _skeleton(opt: Any) -> Dict[str, Any]:
    where = "opt"
    if not isinstance(opt, dict) or set(opt) != {"state", "param_groups"}:
        raise WireError(f"the local workers' brief: {where} is not a map of 'state' and 'param_groups'")
    state, groups = opt["state"], opt["param_groups"]
    if not isinstance(state, dict):
        raise WireError(f"the local workers' brief: {where}.state is not a map")
    out_state: Dict[int, Dict[str, Any]] = {}
    for i, entry in state.items():
        if type(i) is not int or not 0 <= i < MAX_ITEMS:
            raise WireError(f"the local workers' brief: {where}.state has key {i!r:.80} (not a parameter index)")
        if not isinstance(entry, dict):
            raise WireError(f"the local workers' brief: {where}.state[{i}] is not a map")
        out_state[i] = {}
        for k, v in entry.items():
            at = f"{where}.state[{i}].{k!r:.40}"
            if type(k) is not str:
                raise WireError(f"the local workers' brief: {at}: the name is not a string")
            spec = _tagged(v, _TAG_TENSOR)
            out_state[i][k] = _tensor(spec, at) if spec is not None else _number(v, at)
    if not isinstance(groups, list):
        raise WireError(f"the local workers' brief: {where}.param_groups is not a list")
    out_groups: List[Dict[str, Any]] = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise WireError(f"the local workers' brief: {where}.param_groups[{g}] is not a map")
        checked = {}
        for k, v in group.items():
            at = f"{where}.param_groups[{g}].{k!r:.40}"
            if type(k) is not str:
                raise WireError(f"the local workers' brief: {at}: the name is not a string")
            items = _tagged(v, _TAG_TUPLE)
            if isinstance(items, list):
                checked[k] = tuple(_number(x, f"{at}[{j}]") for j, x in enumerate(items))
            elif isinstance(v, list):
                checked[k] = [_number(x, f"{at}[{j}]") for j, x in enumerate(v)]
            elif v is None or type(v) is str:
                checked[k] = v
            else:
                checked[k] = _number(v, at)
        params = checked.get("params")
        if not isinstance(params, list) or not all(type(p) is int and 0 <= p < MAX_ITEMS for p in params):
            raise WireError(f"the local workers' brief: {where}.param_groups[{g}].params is not a list of "
                            "parameter indices")
        out_groups.append(checked)
    return {"state": out_state, "param_groups": out_groups}


def _number(v: Any, at: str) -> Any:
    if type(v) in (bool, int, float):
        return v
    raise WireError(f"the local workers' brief: {at} = {v!r:.80} is not a number")


def _tensor(spec: Any, at: str) -> tuple:
    if not isinstance(spec, list) or len(spec) != 3:
        raise WireError(f"the local workers' brief: {at}: a tensor spec that is not a list of 3 items")
    shape, dtype, device = spec
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise WireError(f"the local workers' brief: {at}: shape {shape!r:.80} is not a list of at most "
                        f"{MAX_NDIM} sizes")
    if dtype not in DTYPES:
        raise WireError(f"the local workers' brief: {at}: dtype {dtype!r:.40} is not one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise WireError(f"the local workers' brief: {at}: device {device!r:.40} is not one of {', '.join(DEVICES)}")
    return (_TENSOR, tuple(shape), dtype, device)
