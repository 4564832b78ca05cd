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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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
        panels = cpu_native.module().pack(_fp32(w.detach()))
        _PACKED[id(w)] = _Packed(weakref.ref(w, _forget(id(w))), w._version, w.data_ptr(), panels)


def _forget(key: int) -> Callable[[weakref.ref[Tensor]], None]:
    def forget(_: weakref.ref[Tensor]) -> None:
        _PACKED.pop(key, None)

    return forget


def frozen_panels(weight: Tensor) -> Tensor | None:
    """``weight``'s panels from :func:`pack_frozen`, or ``None`` where it has none at its current version."""
    return _packed(weight)


def _packed(weight: Tensor) -> Tensor | None:
    entry = _PACKED.get(id(weight))
    if entry is None or entry.ref() is not weight:
        return None
    if not _unchanged(entry.version, entry.data_ptr, weight):
        return None
    return entry.panels


def _unchanged(version: int, data_ptr: int, weight: Tensor) -> bool:
    """Whether ``weight`` still has the version counter and storage a packed copy was made at."""
    return version == weight._version and data_ptr == weight.data_ptr()


def _fp32(t: Tensor) -> Tensor:
    """``t`` as the compiled kernels take it: fp32 and contiguous (no dispatch when it already is)."""
    return (t.float() if t.dtype != torch.float32 else t).contiguous()


class _Held:
    """The panels kept for one weight within :func:`held`: the forward's, and the input gradient's
    (the weight's transpose), each packed at first use; valid at one version counter and storage."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.version = weight._version
        self.data_ptr = weight.data_ptr()
        self.panels: dict[bool, Tensor] = {}  # transposed? -> panels


HELD_BYTES = 1 << 30
"""At most this much of packed copies is kept within :func:`held` (weights past it pack per call)."""

_HELD: dict[int, _Held] | None = None
_held_bytes = 0


@contextmanager
def held(weights: Iterable[Tensor]) -> Iterator[None]:
    """Within: ``weights`` do not change (a train step's micro-batches, before the optimizer step), so the
    CPU kernels pack each of them once, at its first use, for the forward (:func:`linear`) and once for
    the input gradient (:func:`grad_input`), instead of once per call. Dropped on exit.

    Same bits as the per-call paths (each element is the same fma chain). A weight written in place
    within (a bumped version counter) or given new storage is packed again rather than read stale; as
    with :func:`pack_frozen`, writes through ``.data`` in place bump nothing, so none may happen within.
    The copies (two fp32 ones per weight, so up to four times a bf16 weight) count toward the peak
    memory while the context lasts; at most :data:`HELD_BYTES` of them are kept, the weights past it
    pack per call as before. Within another :func:`held`, the new weights join the outer one's.
    """
    global _HELD, _held_bytes
    chosen = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
    if _HELD is not None:  # nested: the outer context keeps its panels and owns the budget
        for w in chosen:
            _HELD.setdefault(id(w), _Held(w))
        yield
        return
    _HELD, _held_bytes = {id(w): _Held(w) for w in chosen}, 0
    try:
        yield
    finally:
        _HELD, _held_bytes = None, 0


def _held_panels(weight: Tensor, transposed: bool) -> Tensor | None:
    """``weight``'s panels kept within :func:`held` (packed now if this is their first use), or ``None``
    outside it, for a weight it does not hold, or past its byte budget."""
    global _held_bytes
    if _HELD is None:
        return None
    entry = _HELD.get(id(weight))
    if entry is None or entry.weight is not weight:
        return None
    if not _unchanged(entry.version, entry.data_ptr, weight):
        _held_bytes -= sum(t.numel() * 4 for t in entry.panels.values())
        entry = _HELD[id(weight)] = _Held(weight)
    panels = entry.panels.get(transposed)
    if panels is None:
        n, k = weight.shape[::-1] if transposed else weight.shape  # the panels' outputs and inner size
        size = -(-n // 16) * 16 * k * 4  # padded to whole 16-wide panels
        if _held_bytes + size > HELD_BYTES:
            return None
        native = cpu_native.module()
        fp32 = _fp32(weight.detach())
        with widened():
            panels = native.pack_t(fp32) if transposed else native.pack(fp32)
        entry.panels[transposed] = panels
        _held_bytes += size
    return panels


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``, fp32 accumulation, invariant rows."""
    if x.device.type != "cpu":
        return blas_linear(x, weight)
    rows = _fp32(x.reshape(-1, x.shape[-1]))
    panels = _packed(weight) if not (torch.is_grad_enabled() and weight.requires_grad) else None
    if panels is None:
        panels = _held_panels(weight, transposed=False)
    if panels is not None:
        with widened():
            out = cpu_native.module().linear_packed(rows, panels, weight.shape[0])
    else:
        w = _fp32(weight)
        with widened():
            out = cpu_native.module().linear(rows, w)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def grad_input(grad: Tensor, weight: Tensor) -> Tensor:
    """``grad [M, N] @ weight [N, K] -> [M, K]`` in fp32 (a linear's input gradient) through the compiled
    kernel: the same bits at any thread count, so a trainer may widen it while a neighbour idles. Within
    :func:`held` the weight's transposed panels are packed once, not per call."""
    panels = _held_panels(weight, transposed=True)
    if panels is None:
        return _fixed_order(grad, weight)
    g = _fp32(grad)
    with widened():
        out: Tensor = cpu_native.module().linear_packed(g, panels, weight.shape[1])
    return out


def grad_weight(grad: Tensor, x: Tensor) -> Tensor:
    """``grad [M, N].T @ x [M, K] -> [N, K]`` in fp32 (a linear's weight gradient, each element reduced
    over the ``M`` rows in ascending order) through the compiled kernel, like :func:`grad_input`. The
    kernel transposes the gradient a block of rows at a time into a buffer that stays in cache, rather
    than making the whole transposed copy first."""
    g, rows = _fp32(grad), _fp32(x)
    with widened():
        out: Tensor = cpu_native.module().linear_tn(g, rows)
    return out


def _fixed_order(a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]`` by the compiled kernel (fp32, CPU): ``b`` is read as it lies."""
    a, b = _fp32(a), _fp32(b)
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
