"""Batch-invariant matmul: the fixed-order C++ kernel on CPU, BLAS with fixed tiles elsewhere.

On CPU tensors :func:`linear` runs :mod:`rlfw.kernels.cpu_native`'s kernel, which reduces every output
element in one order of its own (see ``kernels/csrc/linear.cpp``): no padding, no K tiles, and no
dependence on the BLAS library's shape-specific paths (its narrow-output kernels broke invariance for
outputs 2-11 wide with an inner size not a multiple of 4). On other devices, and for the attention's
score and value products, the BLAS path below stays.

Measured on CPU (torch 2.13, MKL): ``F.linear`` in fp32 gives a row different bits when it is alone
(a GEMV) than inside a batch, and with two threads the blocked GEMM splits long reductions differently
for different row counts. Two fixed choices remove both effects:

* rows are zero-padded to a multiple of :data:`ROW_BLOCK` (no copy when they already are), so the
  library never sees a one-row (GEMV) problem and every GEMM has ``M`` a multiple of 16 with ``N`` and
  ``K`` fixed by the weight;
* the reduction dim is cut into fixed :data:`K_TILE` slices whose partial products are added in
  ascending order in fp32 (no split-K chosen by the library); ``K <= K_TILE`` is a single GEMM.

bf16 operands are widened to fp32 (exact), multiplied and accumulated in fp32 and rounded to bf16 once
at the end, so bf16 invariance follows from fp32 invariance rather than from rounding hiding changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfw.kernels import cpu_native
from rlfw.kernels.threads import widened

ROW_BLOCK = 16
K_TILE = 256


def k_tiled_matmul(a: Tensor, b: Tensor) -> Tensor:
    """fp32 ``a [..., M, K] @ b [..., K, N]`` with partial products over fixed K tiles added in
    ascending order (``M`` is already a multiple of :data:`ROW_BLOCK`)."""
    k = a.shape[-1]
    if k <= K_TILE:
        return torch.matmul(a, b)
    acc = torch.matmul(a[..., :K_TILE], b[..., :K_TILE, :])
    for k0 in range(K_TILE, k, K_TILE):
        acc = acc + torch.matmul(a[..., k0 : k0 + K_TILE], b[..., k0 : k0 + K_TILE, :])
    return acc


class _Packed(NamedTuple):
    ref: weakref.ref[Tensor]
    version: int
    data_ptr: int
    panels: Tensor


_PACKED: dict[int, _Packed] = {}


def pack_frozen(weights: Iterable[Tensor], refresh: bool = False) -> None:
    """Pack CPU weights that will serve many calls unchanged (an engine's, until its next weight update)
    into the kernel's panel layout once, so :func:`linear` stops packing, or reading in place, per call.

    Same bits as the unpacked paths (each element is the same fma chain). A packed copy is used only
    while the tensor is the same object at the same version counter and storage, so a weight changed
    in place (``load_state_dict``, an optimizer step) or given new storage (``p.data = ...``) falls back
    to the per-call path until it is packed again. Writes through ``p.data`` in place bump no counter
    (vLLM's in-place weight reload is one), so only an owner that sees every write may pack, and it must
    pack with ``refresh=True`` after such a write: the built-in engine packs after each update, the model
    inside vLLM at the first forward after each ``load_weights``.

    Costs one fp32 copy of each weight; a weight still packed at its version is skipped (unless
    ``refresh``), so calling this before every forward costs a lookup per weight when nothing changed.
    """
    for w in weights:
        if w.device.type != "cpu" or w.dim() != 2 or (not refresh and _packed(w) is not None):
            continue  # not for this kernel, or packed at this version already
        fp32 = w.detach().float().contiguous()
        panels = cpu_native.module().pack(fp32)
        _PACKED[id(w)] = _Packed(weakref.ref(w, _forget(id(w))), w._version, w.data_ptr(), panels)


def _forget(key: int) -> Callable[[weakref.ref[Tensor]], None]:
    def forget(_: weakref.ref[Tensor]) -> None:
        _PACKED.pop(key, None)

    return forget


def _packed(weight: Tensor) -> Tensor | None:
    entry = _PACKED.get(id(weight))
    if entry is None or entry.ref() is not weight:
        return None
    if entry.version != weight._version or entry.data_ptr != weight.data_ptr():
        return None
    return entry.panels


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``, fp32 accumulation, invariant rows."""
    if x.device.type != "cpu":
        return blas_linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    rows = (rows.float() if rows.dtype != torch.float32 else rows).contiguous()
    panels = _packed(weight) if not (torch.is_grad_enabled() and weight.requires_grad) else None
    if panels is not None:
        with widened():
            out = cpu_native.module().linear_packed(rows, panels, weight.shape[0])
    else:
        w = weight.float() if weight.dtype != torch.float32 else weight
        with widened():
            out = cpu_native.module().linear(rows, w.contiguous())
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def grad_input(grad: Tensor, weight: Tensor) -> Tensor:
    """``grad [M, N] @ weight [N, K] -> [M, K]`` in fp32 (a linear's input gradient) through the compiled
    kernel: the same bits at any thread count, so a trainer may widen it while a neighbour idles."""
    return _fixed_order(grad, weight)


def grad_weight(grad: Tensor, x: Tensor) -> Tensor:
    """``grad [M, N].T @ x [M, K] -> [N, K]`` in fp32 (a linear's weight gradient, each element reduced
    over the ``M`` rows in ascending order) through the compiled kernel, like :func:`grad_input`. The
    transposed gradient is made by the compiled tiled copy (torch's strided copy of a transpose ran at
    about 1 GB/s on the trainer's shapes)."""
    g = (grad.float() if grad.dtype != torch.float32 else grad).contiguous()
    with widened():
        gt: Tensor = cpu_native.module().transpose(g)
    return _fixed_order(gt, x)


def _fixed_order(a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]`` by the compiled kernel (fp32, CPU): ``b`` is read as it lies."""
    a = (a.float() if a.dtype != torch.float32 else a).contiguous()
    b = (b.float() if b.dtype != torch.float32 else b).contiguous()
    with widened():
        out: Tensor = cpu_native.module().linear_t(a, b)
    return out


def blas_linear(x: Tensor, weight: Tensor) -> Tensor:
    """The BLAS path: rows as one 2-D GEMM (``M`` padded to a multiple of 16) against the transposed
    weight, K in fixed tiles; ``F.linear`` on 2-D fp32 operands is that GEMM."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if rows.dtype != torch.float32:
        rows = rows.float()
    w = weight if weight.dtype == torch.float32 else weight.float()
    pad = (-m) % ROW_BLOCK
    rows = F.pad(rows, (0, 0, 0, pad)) if pad else rows.contiguous()
    out = F.linear(rows, w) if rows.shape[1] <= K_TILE else k_tiled_matmul(rows, w.t())
    if pad:
        out = out[:m]
    out = out.view(*x.shape[:-1], w.shape[0])
    return out if out.dtype == x.dtype else out.to(x.dtype)
