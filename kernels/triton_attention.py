"""Triton attention over the slotted KV cache, the same tile walk as :mod:`rlfw.kernels.attention`.

One program owns ``ATTN_BLOCK_R`` query rows of one (batch entry, KV head) and walks KV tiles of
``KV_TILE`` slots from position 0 upwards with the online softmax of the torch path: masked slots at
``-inf``, fully invisible tiles selected out, slots past the batch row's last position zeroed, ``+ 0.0``
after each ``p @ v``. Every query row's state evolves independently of the other rows in its program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlfw.kernels.attention import KV_TILE, group_queries, ungroup
from rlfw.kernels.triton_config import ATTN_BLOCK_R
from rlfw.kernels.triton_dot import INTERPRETED, tile_dot


@triton.jit
def _load_kv(ptr, b, h, slots, dd, S, D, last, stride_b, stride_s, stride_h):
    mask = (slots[:, None] < S) & (slots[:, None] <= last) & (dd[None, :] < D)
    offs = b * stride_b + slots[:, None] * stride_s + h * stride_h + dd[None, :]
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, last_ptr, o_ptr, R, S, D, HKV, cap_tiles, scale,
    stride_kb, stride_ks, stride_kh,
    TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_EXACT: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    row_mask = rows < R
    q_offs = (bh * R + rows[:, None]) * D + dd[None, :]
    q_mask = row_mask[:, None] & (dd[None, :] < D)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)  # tl.dot takes one dtype
    pos = tl.load(pos_ptr + bh * R + rows, mask=row_mask, other=-1)
    last = tl.load(last_ptr + b)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    # Tiles up to this program's last query position: the tiles after it would leave every row's state
    # as it is (see the module), so the bound changes no bits; it is found here, not on the host, so a
    # launch never waits for the device.
    n_tiles = tl.minimum((tl.max(pos, axis=0) + TILE) // TILE, cap_tiles)
    for j in range(0, n_tiles):
        lo = j * TILE
        slots = lo + tl.arange(0, TILE)
        k = _load_kv(k_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
        v = _load_kv(v_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
        s = tile_dot(q, tl.trans(k), ROW_EXACT) * scale
        s = tl.where(slots[None, :] <= pos[:, None], s, float("-inf"))
        active = pos >= lo
        m_new = tl.maximum(m, tl.max(s, axis=1) + 0.0)
        m_ref = tl.where(active, m_new, 0.0)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        denom_new = denom * alpha + tl.sum(p, axis=1)
        acc_new = acc * alpha[:, None] + (tile_dot(p, v, ROW_EXACT) + 0.0)
        m = tl.where(active, m_new, m)
        denom = tl.where(active, denom_new, denom)
        acc = tl.where(active[:, None], acc_new, acc)
    out = tl.where((pos >= 0)[:, None], acc / tl.maximum(denom, 1.0)[:, None], 0.0)
    tl.store(o_ptr + q_offs, out, mask=row_mask[:, None] & (dd[None, :] < D))


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """See :meth:`rlfw.kernels.registry.Ops.attention`; the result is in ``q.dtype``."""
    b, t, hq, d = q.shape
    s_cap, hkv = k_cache.shape[1], k_cache.shape[2]
    qg = group_queries(q, hkv).contiguous()
    pos = q_pos[:, None, :, None].expand(b, hkv, t, hq // hkv).reshape(b, hkv, -1).contiguous()
    last = q_pos.amax(-1).contiguous() if t > 0 else q_pos.new_full((b,), -1)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty_like(qg)
    r = qg.shape[2]
    grid = (b * hkv, triton.cdiv(r, ATTN_BLOCK_R))
    _attention_kernel[grid](
        qg, k_cache, v_cache, pos, last, out, r, s_cap, d, hkv, triton.cdiv(s_cap, KV_TILE), scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        TILE=KV_TILE, BLOCK_R=ATTN_BLOCK_R, BLOCK_D=max(16, triton.next_power_of_2(d)), ROW_EXACT=INTERPRETED,
    )  # fmt: skip
    return ungroup(out, t).to(q.dtype)
