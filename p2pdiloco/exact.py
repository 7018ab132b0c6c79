"""Hardware-independent arithmetic for every value that all peers must hold bit for bit.

Volunteers' machines differ: ATen picks its CPU kernels at start-up by the CPU's instruction set
(``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512``, NEON on ARM), BLAS libraries pick their
own, and GPUs run others still. Two kernels of one operation agree bitwise only when IEEE-754 fixes
the result of each element. What this module relies on, and why it is exact:

* **One operation per rounding.** ``+``, ``-``, ``*``, ``/`` and ``sqrt`` of two fp32 (or fp64)
  values are correctly rounded by IEEE-754, so every kernel (scalar, any SIMD width, CUDA) gives
  the same bits for each element. Element-wise torch ops with *no* ``alpha`` and no fused forms are
  used: ``torch.add(a, b, alpha=c)`` and ``addcmul``/``lerp`` may compile to a fused multiply-add on
  one kernel path and to a multiply then an add on another (measured: the outer Nesterov step
  differs between ``default`` and ``avx2``). A scalar multiplier is applied with its own ``mul``.
* **Fixed-order sums.** A reduction (``sum``, ``norm``, ``matmul``, QR) adds in an order that depends
  on the vector width and thread count. :func:`fixed_sum` adds in one order on every machine: a
  pairwise tree of element-wise adds (halves of a zero-padded power-of-two length).
* **Scalars in Python.** Scalars derived from tensors (a norm, its reciprocal) are computed in Python
  floats (IEEE double, no contraction in CPython; ``math.sqrt`` is correctly rounded) and applied by
  one multiply. A CUDA kernel divides by a scalar through its reciprocal, so dividing by a
  Python scalar is avoided.
* **Random numbers from integers.** ``torch.randn``/``normal_``/``uniform_`` take a vectorised
  path that differs between kernel builds (measured: different weights from the same seed under
  ``default`` and ``avx2``). :func:`exact_normal_` draws integers (identical everywhere) and
  turns them into approximately normal values with exact operations only.

These functions are the ones the swarm's agreed state goes through: the outer optimiser
(:mod:`p2pdiloco.diloco.outer`), the low-rank reconstruction and orthonormalisation
(:mod:`p2pdiloco.compression.lowrank`), the owner's fp32 mean (:mod:`p2pdiloco.compression.robust`)
and the model's initialisation. Everything else a peer computes (its inner steps, the encoding of
its own part) may differ between machines without breaking agreement.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["fixed_sum", "exact_dot", "exact_orthonormalize", "exact_outer_sum", "exact_normal_", "axpy_"]


def fixed_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum of ``x`` along ``dim`` in one order on every machine: a pairwise tree of element-wise adds.

    The length is padded with zeros to a power of two (adding 0.0 is exact), then halved repeatedly:
    ``x[:h] + x[h:]``. Each add is one IEEE operation per element, so the result is the same bits on
    any kernel or device; the error is that of pairwise summation (O(log n) ulps).
    """
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n == 0:
        return torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = torch.cat([x, x.new_zeros((size - n, *x.shape[1:]))])
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = torch.add(x[:h], x[h:])
    return x[0]


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Dot product of two vectors (flattened) with exact element products and :func:`fixed_sum`."""
    return float(fixed_sum(torch.mul(a.reshape(-1), b.reshape(-1))))


def axpy_(y: torch.Tensor, x: torch.Tensor, a: float) -> torch.Tensor:
    """``y ← y + a·x`` as a multiply and then an add (never fused), in place; returns ``y``."""
    return y.add_(torch.mul(x, a))


def exact_orthonormalize(p: torch.Tensor, rel_tol: float = 1e-10) -> torch.Tensor:
    """Orthonormal basis of ``p``'s columns, fp64, bitwise identical on every machine.

    Modified Gram–Schmidt, twice over (re-orthogonalisation keeps it as orthogonal as Householder QR
    in fp64), with :func:`exact_dot` and scalars applied by one multiply. Column ``k`` spans what
    columns ``0..k`` add, with a positive coefficient on its own direction: the same basis as QR with
    ``diag(R) >= 0``, to rounding. A column that adds nothing new (norm below ``rel_tol`` times the
    largest column's) becomes zero instead of an arbitrary direction: ``P Pᵀ`` stays a projection.
    """
    q = p.detach().to(torch.float64).clone()
    if q.numel() == 0:
        return q
    scale = max(math.sqrt(exact_dot(q[:, k], q[:, k])) for k in range(q.shape[1]))
    for k in range(q.shape[1]):
        v = q[:, k].clone()
        for _ in range(2):
            for j in range(k):
                c = exact_dot(q[:, j], v)
                if c != 0.0:
                    v = torch.sub(v, torch.mul(q[:, j], c))
        norm = math.sqrt(exact_dot(v, v))
        if norm == 0.0 or not math.isfinite(norm) or norm <= rel_tol * scale:
            q[:, k] = 0.0
        else:
            q[:, k] = torch.mul(v, 1.0 / norm)
    return q


def exact_outer_sum(p: torch.Tensor, q: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``p @ q.T`` for a thin ``p`` (rows × r) and ``q`` (cols × r), bitwise identical on every machine.

    ``Σ_k p[:, k] ⊗ q[:, k]`` accumulated over ``k`` in order, each term an exact element-wise product
    (``p`` and ``q`` in fp64) added with one rounding: the same bits whatever the BLAS or device. Costs
    ``r`` passes over the output instead of one matmul; the ranks here are small (≤ 32).
    """
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    out = torch.zeros(p64.shape[0], q64.shape[0], dtype=torch.float64, device=p64.device)
    for k in range(p64.shape[1]):
        out.add_(torch.mul(p64[:, k:k + 1], q64[:, k].unsqueeze(0)))
    return out if out_dtype is None else out.to(out_dtype)


_IH_TERMS = 4  # Irwin–Hall: the sum of 4 uniforms, variance 4/12
_IH_SCALE = math.sqrt(12.0 / _IH_TERMS)
_U_BITS = 30


@torch.no_grad()
def exact_normal_(tensor: torch.Tensor, std: float = 1.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Fill ``tensor`` with approximately N(0, std²) values that are the same bits on every machine.

    Integers from the CPU generator (``torch.randint`` draws the same integers under every kernel
    build), turned into uniforms ``(k + 0.5)·2⁻³⁰`` (exact in fp64), summed four at a time in a fixed
    order and centred and scaled (Irwin–Hall: mean 0, variance std², bounded at ±3.46·std) with one
    rounding per operation. Consumes the generator (the global one when ``None``) as ``randint`` does.
    """
    n = tensor.numel()
    k = torch.randint(0, 1 << _U_BITS, (_IH_TERMS, n), generator=generator, dtype=torch.int64)
    u = torch.mul(torch.add(k.to(torch.float64), 0.5), 2.0 ** -_U_BITS)
    s = u[0]
    for i in range(1, _IH_TERMS):
        s = torch.add(s, u[i])
    z = torch.mul(torch.sub(s, _IH_TERMS / 2), _IH_SCALE * float(std))
    tensor.copy_(z.view(tensor.shape).to(tensor.dtype))
    return tensor
