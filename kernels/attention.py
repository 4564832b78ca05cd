"""Causal attention over the slotted KV cache with a fixed KV tile aligned to position 0.

A query at position ``p`` reduces over KV tiles ``0 .. p // KV_TILE`` in ascending order with an online
softmax (running max, running sum, rescaling), in fp32. The tiles a query visits, their width and the
order of every reduction are functions of ``p`` alone, so the same query gives the same bits in a
full-sequence pass, a chunked prefill, a one-token decode step, any cache capacity and any batch:

* scores ``q . k`` and ``p @ v`` go through :func:`block_matmul` (rows independent of their neighbours);
* every tile is padded to the full ``KV_TILE`` slots, so a tile cut short by the cache end reduces like
  a full one;
* a tile entirely after ``p`` leaves the query's state untouched (selected out, not multiplied by 0);
* slots after the last position a batch row asks for are zeroed before use, so stale or non-finite cache
  contents cannot leak through ``0 * v``; masked slots inside that range add exact signed zeros, and
  the ``+ 0.0`` after each tile product removes the only trace they can leave (the sign of a zero).

Queries are grouped per KV head (GQA): rows are ``(t, g)`` pairs of one batch entry and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfw.kernels.matmul import block_matmul
from rlfw.kernels.reduce import row_max, row_sum

KV_TILE = 32


@dataclass
class _State:
    """Online-softmax state per query row: running max ``m``, running sum ``denom``, unnormalised ``acc``."""

    m: Tensor
    denom: Tensor
    acc: Tensor


def group_queries(q: Tensor, hkv: int) -> Tensor:
    """``q [B, T, Hq, D] -> [B, Hkv, T*G, D]`` fp32, rows ordered ``(t, g)``."""
    b, t, hq, d = q.shape
    return q.float().reshape(b, t, hkv, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)


def ungroup(out: Tensor, t: int) -> Tensor:
    """Inverse of :func:`group_queries`: ``[B, Hkv, T*G, D] -> [B, T, Hq, D]``."""
    b, hkv, _, d = out.shape
    return out.reshape(b, hkv, t, -1, d).permute(0, 2, 1, 3, 4).reshape(b, t, -1, d)


def _kv_tile(cache: Tensor, lo: int, last_pos: Tensor) -> Tensor:
    """Slots ``lo .. lo+KV_TILE`` as ``[B, Hkv, KV_TILE, D]`` fp32, zero past the cache end and past
    ``last_pos [B]``."""
    tile = cache[:, lo : lo + KV_TILE].float()
    tile = F.pad(tile, (0, 0, 0, 0, 0, KV_TILE - tile.shape[1]))
    slots = torch.arange(lo, lo + KV_TILE, device=cache.device)
    keep = slots[None, :] <= last_pos[:, None]
    return torch.where(keep[:, :, None, None], tile, 0.0).transpose(1, 2)


def _tile_step(st: _State, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, lo: int, scale: float) -> _State:
    """Fold one KV tile into the state of the rows that can see at least one of its slots."""
    slots = torch.arange(lo, lo + KV_TILE, device=q.device)
    s = block_matmul(q, k.transpose(-1, -2)) * scale
    s = torch.where(slots <= pos[..., None], s, float("-inf"))
    active = pos >= lo
    m_new = torch.maximum(st.m, row_max(s))
    m_ref = torch.where(active, m_new, 0.0)
    alpha = torch.exp(st.m - m_ref)
    p = torch.exp(s - m_ref[..., None])
    denom_new = st.denom * alpha + row_sum(p)
    acc_new = st.acc * alpha[..., None] + (block_matmul(p, v) + 0.0)
    return _State(
        m=torch.where(active, m_new, st.m),
        denom=torch.where(active, denom_new, st.denom),
        acc=torch.where(active[..., None], acc_new, st.acc),
    )


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """See :meth:`rlfw.kernels.registry.Ops.attention`; the result is in ``q.dtype``."""
    b, t, _, d = q.shape
    s_cap, hkv = k_cache.shape[1], k_cache.shape[2]
    qg = group_queries(q, hkv)
    pos = q_pos[:, None, :, None].expand(b, hkv, t, q.shape[2] // hkv).reshape(b, hkv, -1)
    last_pos = q_pos.amax(-1) if t > 0 else q_pos.new_full((b,), -1)
    st = _State(
        m=torch.full(pos.shape, float("-inf"), device=q.device),
        denom=torch.zeros(pos.shape, device=q.device),
        acc=torch.zeros(*pos.shape, d, device=q.device),
    )
    n_tiles = min(-(-s_cap // KV_TILE), (int(last_pos.max()) + KV_TILE) // KV_TILE) if b > 0 else 0
    for j in range(n_tiles):
        lo = j * KV_TILE
        st = _tile_step(
            st, qg, _kv_tile(k_cache, lo, last_pos), _kv_tile(v_cache, lo, last_pos), pos, lo, scale
        )
    # A visible row has denom >= 1 (its max term is exp(0)); the clamp only touches padding rows (denom == 0).
    out = torch.where((pos >= 0)[..., None], st.acc / st.denom.clamp_min(1.0)[..., None], 0.0)
    return ungroup(out, t).to(q.dtype)


def attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """Plain masked-softmax attention in fp32 (differentiable, no tiling): the math the tiled op rounds.

    Used for the backward pass. Padding queries see slot 0 only, so every softmax is finite; their
    output is zeroed.
    """
    hkv = k_cache.shape[2]
    qg = group_queries(q, hkv)
    t = q.shape[1]
    pos = q_pos[:, None, :, None].expand(q.shape[0], hkv, t, q.shape[2] // hkv).reshape(q.shape[0], hkv, -1)
    slots = torch.arange(k_cache.shape[1], device=q.device)
    visible = (slots <= pos[..., None]) | ((pos[..., None] < 0) & (slots == 0))
    s = torch.matmul(qg, k_cache.float().permute(0, 2, 3, 1)) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.matmul(p, v_cache.float().transpose(1, 2))
    out = out.masked_fill((pos < 0)[..., None], 0.0)
    return ungroup(out, t).to(q.dtype)
