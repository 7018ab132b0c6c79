"""Throughput of every registered codec, beside bitsandbytes' NF4 and a plain memory copy.

    python -m p2pdiloco.bench.codecs [--numel N] [--repeat R] [--json out.json] [--device cpu]

Throughput is GB/s of fp32 input (4 bytes per value, 1 GB = 1e9 bytes), the median of R runs,
for ``encode`` (tensor -> bytes) and ``decode`` (bytes -> fp32 tensor, with validation). The
bitsandbytes rows time ``quantize_4bit`` / ``dequantize_4bit`` (blocksize 64) on tensors, without
serialization. ``copy`` is ``torch.Tensor.copy_`` of the fp32 input into a preallocated tensor, the
memory-bandwidth limit. ``ratio`` = fp32 bytes / encoded bytes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from ..compression import CODECS

__all__ = ["run", "main"]


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(numel: int, repeat: int, device: str = "cpu") -> List[Dict[str, object]]:
    """Measure every codec; return one dict per row (name, encode/decode GB/s, ratio)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    gb = 4 * numel / 1e9
    rows: List[Dict[str, object]] = []
    for name, codec in CODECS.items():
        data = codec.encode(x)
        enc = _median_seconds(lambda: codec.encode(x), repeat)
        dec = _median_seconds(lambda: codec.decode(data, numel), repeat)
        rows.append({"name": name, "encode_gbps": gb / enc, "decode_gbps": gb / dec, "ratio": 4 * numel / len(data)})
    try:
        import bitsandbytes.functional as bnbf

        q, state = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4")
        enc = _median_seconds(lambda: bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4"), repeat)
        dec = _median_seconds(lambda: bnbf.dequantize_4bit(q, state), repeat)
        size = q.numel() * q.element_size() + state.absmax.numel() * state.absmax.element_size()
        rows.append({"name": "bnb-nf4", "encode_gbps": gb / enc, "decode_gbps": gb / dec, "ratio": 4 * numel / size})
    except Exception as e:  # bitsandbytes missing or without a backend for this device
        rows.append({"name": "bnb-nf4", "error": f"{type(e).__name__}: {e}"})
    dst = torch.empty_like(x)
    cp = _median_seconds(lambda: dst.copy_(x), repeat)
    rows.append({"name": "copy", "encode_gbps": gb / cp, "decode_gbps": gb / cp, "ratio": 1.0})
    return rows


def _table(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'codec':<9} {'encode GB/s':>12} {'decode GB/s':>12} {'ratio':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<9} {r['error']}")
        else:
            lines.append(f"{r['name']:<9} {r['encode_gbps']:>12.3f} {r['decode_gbps']:>12.3f} {r['ratio']:>7.2f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="fp32 values per call (default 16M = 64 MiB)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is reported")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--device", default="cpu", help="device of the input tensor (cpu, cuda)")
    args = ap.parse_args(argv)
    rows = run(args.numel, args.repeat, args.device)
    header = f"numel={args.numel} repeat={args.repeat} device={args.device} threads={torch.get_num_threads()}"
    print(header)
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "repeat": args.repeat, "device": args.device, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
