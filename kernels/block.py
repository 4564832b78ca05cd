"""A dense decoder block over an engine's KV cache in one compiled call (CPU, fp32, no autograd).

The per-op path runs about fifteen kernel calls per block, each behind Python and torch dispatch; on a
small model's decode step (a few dozen rows) that dispatch is about a third of the step's time.
:func:`cached_block` hands the block's operands to ``kernels/csrc/block.cpp``, which makes the same kernel
calls in the same order (RMSNorm, the packed linears, the q/k norms, RoPE, the cache write, the
attention, SiLU-mul, the residual adds), so its output is the per-op path's bit for bit (tested). It
serves only where every one of those kernels would serve the per-op path and the weights are packed
(an engine's, after :func:`rlfw.kernels.matmul.pack_frozen`); elsewhere it returns ``None`` and the
caller runs the ops one by one. The cache is the built-in engine's slotted one (:class:`CacheWrite`) or,
for the shared model inside vLLM, a layer's paged cache read through vLLM's block table
(:class:`PagedWrite`, ``paged_block`` in the same source), where a row computed once for a prefix
several requests share writes its K/V to each of their slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.kernels import cpu_native, matmul
from rlfw.kernels.autograd import needs_grad
from rlfw.kernels.threads import widened

_per_op_depth = 0  # how many per_op() contexts are open


@contextmanager
def per_op() -> Iterator[None]:
    """Within: :func:`cached_block` serves nothing, so every block runs its ops one by one (the path to
    compare against, or to step through)."""
    global _per_op_depth
    _per_op_depth += 1
    try:
        yield
    finally:
        _per_op_depth -= 1


@dataclass(frozen=True)
class CacheWrite:
    """One forward's K/V destination for a layer: the cache tensors ``[slots, S, Hkv, D]``, which batch
    entries ``(rows, cols)`` hold a valid token, where each goes (``dest`` slot, ``pos`` position), the
    queries' positions ``[B, T]`` and the cache row each batch entry reads (``slots [B]``)."""

    k_cache: Tensor
    v_cache: Tensor
    rows: Tensor
    cols: Tensor
    dest: Tensor
    pos: Tensor
    q_pos: Tensor
    slots: Tensor


@dataclass(frozen=True)
class PagedWrite:
    """One forward's K/V destination and reads for a layer inside vLLM: its paged cache tensor
    ``[blocks, Hkv, block, 2 * D]`` (vLLM's CPU layout), each of the step's ``N`` tokens' cache slot
    ``slot_mapping [N]`` (negative: padding), and what :func:`rlfw.kernels.attention.paged_attention` reads
    for each of the ``U`` rows computed: its sequence ``seq [U]`` and position ``q_pos [U]``, and the
    sequences' ``block_table [R, MB]`` (int64). ``rows [N]``: the computed row whose K/V each token's slot
    gets, where tokens of a prefix two requests share are computed once; ``None``: token ``i`` is row
    ``i``."""

    kv_cache: Tensor
    slot_mapping: Tensor
    seq: Tensor
    q_pos: Tensor
    block_table: Tensor
    rows: Tensor | None = None


@dataclass(frozen=True)
class BlockShape:
    """The block's head layout and its norms' epsilon."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def cached_block(
    x: Tensor,
    weights: Sequence[Tensor],
    norms: Sequence[Tensor],
    shape: BlockShape,
    cos: Tensor,
    sin: Tensor,
    cache: CacheWrite | PagedWrite,
) -> Tensor | None:
    """The block's output ``[B, T, H]``, or ``None`` where the compiled call does not serve.

    ``weights``: q, k, v, o, gate, up and down projections ``[N, K]``; ``norms``: the input and
    post-attention RMSNorm weights, then the q and k norm weights if the model has them. ``cache``: the
    built-in engine's slotted cache, or a layer's paged cache inside vLLM (``x [1, U, H]``, the rows
    computed for a step's flat batch)."""
    if _per_op_depth or x.dim() != 3 or x.numel() == 0 or len(weights) != 7 or len(norms) not in (2, 4):
        return None
    caches = (cache.kv_cache,) if isinstance(cache, PagedWrite) else (cache.k_cache, cache.v_cache)
    tensors = (x, *weights, *norms, cos, sin, *caches)
    if not cpu_native.serves(*tensors) or needs_grad(*tensors):
        return None
    panels = [matmul.frozen_panels(w) for w in weights]
    if any(p is None for p in panels) or not all(t.is_contiguous() for t in (cos, sin, *caches)):
        return None  # cos, sin and the caches are read in place
    where: tuple[Tensor, ...]  # the cache tensors the call writes and reads
    indices: tuple[Tensor, ...]  # where each token's K/V goes and what each query reads
    if isinstance(cache, PagedWrite):
        computed, tokens = x.shape[1], cache.slot_mapping.shape[0]
        rows = torch.arange(tokens) if cache.rows is None else cache.rows
        if x.shape[0] != 1 or rows.shape[0] != tokens or cache.q_pos.shape[0] != computed:
            return None
        if cache.rows is None and tokens != computed:
            return None  # a padded batch: the per-op path leaves the padding rows to vLLM
        blocks, hkv, block, width = cache.kv_cache.shape
        call = cpu_native.module().paged_block
        where = (cache.kv_cache.view(blocks, hkv, 2 * block, width // 2),)  # kernels.attention._kv_pairs
        indices = (cache.slot_mapping, rows, cache.seq, cache.q_pos, cache.block_table)
    else:
        call = cpu_native.module().cached_block
        where = (cache.k_cache, cache.v_cache)
        indices = (cache.rows, cache.cols, cache.dest, cache.pos, cache.q_pos, cache.slots)
    outs = [int(w.shape[0]) for w in weights]
    block_args = (x.contiguous(), panels, outs, [n.contiguous() for n in norms], float(shape.eps))
    heads = (shape.heads, shape.kv_heads, shape.head_dim)
    with widened():
        out: Tensor = call(
            *block_args,
            *heads,
            cos,
            sin,
            *where,
            *(i.to(torch.long).contiguous() for i in indices),
            shape.head_dim**-0.5,
        )
    return out
