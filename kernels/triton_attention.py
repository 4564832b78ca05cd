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

from rlfw.kernels.attention import KV_TILE, group_positions, group_queries, ungroup
from rlfw.kernels.triton_config import ATTN_BLOCK_R
from rlfw.kernels.triton_dot import INTERPRETED, tile_dot


@triton.jit
def _kv_offsets(b, h, slots, dd, stride_b, stride_s, stride_h):
    # In 64 bits (b and h are): a cache of 2^31 elements or more is within reach on one GPU.
    return b * stride_b + slots[:, None].to(tl.int64) * stride_s + h * stride_h + dd[None, :]


@triton.jit
def _load_kv(ptr, b, h, slots, dd, S, D, last, stride_b, stride_s, stride_h):
    mask = (slots[:, None] < S) & (slots[:, None] <= last) & (dd[None, :] < D)
    offs = _kv_offsets(b, h, slots, dd, stride_b, stride_s, stride_h)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_rows(ptr, bh, rows, dd, R, D):
    mask = (rows[:, None] < R) & (dd[None, :] < D)
    return tl.load(ptr + (bh * R + rows[:, None]) * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, bh, rows, dd, R, D, value):
    mask = (rows[:, None] < R) & (dd[None, :] < D)
    tl.store(ptr + (bh * R + rows[:, None]) * D + dd[None, :], value, mask=mask)


@triton.jit
def _row_block(
    pos_ptr, last_ptr, R, S, HKV, TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    # This program's query rows of one (batch entry, KV head), their positions, the batch row's last
    # position (slots after it are read as zeros, whatever the buffer holds) and the KV tiles up to the
    # block's last query position. The tiles after it would leave every row's state as it is (see the
    # module), so the bound changes no bits; it is found here, not on the host, so a launch never waits
    # for the device.
    bh = tl.program_id(0).to(tl.int64)  # offsets from it are 64-bit: B * H * R * D may pass 2^31
    b = bh // HKV
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    pos = tl.load(pos_ptr + bh * R + rows, mask=rows < R, other=-1)
    last = tl.load(last_ptr + b)
    n_tiles = tl.minimum((tl.max(pos, axis=0) + TILE) // TILE, tl.cdiv(S, TILE))
    return bh, b, bh % HKV, rows, tl.arange(0, BLOCK_D), pos, last, n_tiles


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, last_ptr, o_ptr, R, S, D, HKV, scale,
    stride_kb, stride_ks, stride_kh,
    TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_EXACT: tl.constexpr,
):  # fmt: skip
    bh, b, h, rows, dd, pos, last, n_tiles = _row_block(pos_ptr, last_ptr, R, S, HKV, TILE, BLOCK_R, BLOCK_D)
    q = _load_rows(q_ptr, bh, rows, dd, R, D)  # fp32: tl.dot takes one dtype
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
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
    _store_rows(o_ptr, bh, rows, dd, R, D, out)


def _grouped(q: Tensor, q_pos: Tensor, hkv: int) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' view of the queries: grouped fp32 rows ``[B, Hkv, R, D]``, each row's position
    ``[B, Hkv, R]`` and each batch row's last position ``[B]``."""
    qg = group_queries(q, hkv).contiguous()
    pos = group_positions(q_pos, hkv, q.shape[2]).contiguous()
    last = q_pos.amax(-1).contiguous() if q.shape[1] > 0 else q_pos.new_full((q.shape[0],), -1)
    return qg, pos, last


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """See :meth:`rlfw.kernels.registry.Ops.attention`; the result is in ``q.dtype``."""
    b, t, _, d = q.shape
    s_cap, hkv = k_cache.shape[1], k_cache.shape[2]
    qg, pos, last = _grouped(q, q_pos, hkv)
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty_like(qg)
    r = qg.shape[2]
    grid = (b * hkv, triton.cdiv(r, ATTN_BLOCK_R))
    _attention_kernel[grid](
        qg, k_cache, v_cache, pos, last, out, r, s_cap, d, hkv, scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        TILE=KV_TILE, BLOCK_R=ATTN_BLOCK_R, BLOCK_D=max(16, triton.next_power_of_2(d)), ROW_EXACT=INTERPRETED,
    )  # fmt: skip
    return ungroup(out, t).to(q.dtype)


@triton.jit
def _attention_backward_rows_kernel(
    q_ptr, k_ptr, v_ptr, go_ptr, pos_ptr, last_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, R, S, D, HKV, scale,
    stride_kb, stride_ks, stride_kh,
    TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_EXACT: tl.constexpr,
):  # fmt: skip
    # Rows of one (batch entry, KV head): the softmax statistics in one pass over the visible KV tiles, then
    # dq = scale * (sum_s p dp k - delta * sum_s p k) and delta = sum_s p dp in a second.
    bh, b, h, rows, dd, pos, last, n_tiles = _row_block(pos_ptr, last_ptr, R, S, HKV, TILE, BLOCK_R, BLOCK_D)
    q = _load_rows(q_ptr, bh, rows, dd, R, D)
    go = _load_rows(go_ptr, bh, rows, dd, R, D)
    m = tl.full((BLOCK_R,), -1.0e30, tl.float32)  # finite: rows that see nothing (padding) stay at 0
    denom = tl.zeros((BLOCK_R,), tl.float32)
    for j in range(0, n_tiles):
        slots = j * TILE + tl.arange(0, TILE)
        k = _load_kv(k_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
        visible = slots[None, :] <= pos[:, None]
        s = tl.where(visible, tile_dot(q, tl.trans(k), ROW_EXACT) * scale, -1.0e30)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        denom = denom * tl.exp(m - m_new) + tl.sum(p, axis=1)
        m = m_new
    inv = tl.where(denom > 0, 1.0 / tl.maximum(denom, 1.0e-30), 0.0)
    pdk = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    pk = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    delta = tl.zeros((BLOCK_R,), tl.float32)
    for j in range(0, n_tiles):
        slots = j * TILE + tl.arange(0, TILE)
        k = _load_kv(k_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
        v = _load_kv(v_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
        visible = slots[None, :] <= pos[:, None]
        s = tl.where(visible, tile_dot(q, tl.trans(k), ROW_EXACT) * scale, -1.0e30)
        p = tl.where(visible, tl.exp(s - m[:, None]), 0.0) * inv[:, None]
        pdp = p * tile_dot(go, tl.trans(v), ROW_EXACT)
        delta += tl.sum(pdp, axis=1)
        pdk += tile_dot(pdp, k, ROW_EXACT)
        pk += tile_dot(p, k, ROW_EXACT)
    dq = (pdk - delta[:, None] * pk) * scale
    _store_rows(dq_ptr, bh, rows, dd, R, D, dq)
    tl.store(m_ptr + bh * R + rows, m, mask=rows < R)
    tl.store(l_ptr + bh * R + rows, inv, mask=rows < R)
    tl.store(delta_ptr + bh * R + rows, delta, mask=rows < R)


@triton.jit
def _attention_backward_slots_kernel(
    q_ptr, k_ptr, v_ptr, go_ptr, pos_ptr, last_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr,
    R, S, D, HKV, scale, stride_kb, stride_ks, stride_kh,
    TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_EXACT: tl.constexpr,
):  # fmt: skip
    # One KV tile of one (batch entry, KV head) against every query row: dv = sum_r p go and
    # dk = scale * sum_r p (dp - delta) q, with the rows' statistics from the kernel above.
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HKV
    h = bh % HKV
    slots = tl.program_id(1) * TILE + tl.arange(0, TILE)
    dd = tl.arange(0, BLOCK_D)
    last = tl.load(last_ptr + b)
    k = _load_kv(k_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
    v = _load_kv(v_ptr, b, h, slots, dd, S, D, last, stride_kb, stride_ks, stride_kh)
    dk = tl.zeros((TILE, BLOCK_D), tl.float32)
    dv = tl.zeros((TILE, BLOCK_D), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < R
        q = _load_rows(q_ptr, bh, rows, dd, R, D)
        go = _load_rows(go_ptr, bh, rows, dd, R, D)
        pos = tl.load(pos_ptr + bh * R + rows, mask=row_mask, other=-1)
        m = tl.load(m_ptr + bh * R + rows, mask=row_mask, other=0.0)
        inv = tl.load(l_ptr + bh * R + rows, mask=row_mask, other=0.0)
        delta = tl.load(delta_ptr + bh * R + rows, mask=row_mask, other=0.0)
        visible = slots[None, :] <= pos[:, None]
        s = tl.where(visible, tile_dot(q, tl.trans(k), ROW_EXACT) * scale, -1.0e30)
        p = tl.where(visible, tl.exp(s - m[:, None]), 0.0) * inv[:, None]  # [rows, slots]
        dp = tile_dot(go, tl.trans(v), ROW_EXACT)
        ds = p * (dp - delta[:, None])
        dv += tile_dot(tl.trans(p), go, ROW_EXACT)
        dk += tile_dot(tl.trans(ds), q, ROW_EXACT)
    offs = _kv_offsets(b, h, slots, dd, stride_kb, stride_ks, stride_kh)
    mask = (slots[:, None] < S) & (dd[None, :] < D)
    tl.store(dk_ptr + offs, dk * scale, mask=mask)
    tl.store(dv_ptr + offs, dv, mask=mask)


def attention_backward(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, grad: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`attention` (the math of
    :func:`~rlfw.kernels.attention.attention_reference`) for the output gradient ``grad``: two launches
    in fp32, the probabilities recomputed tile by tile and never stored whole (memory linear in the
    sequence length). Padding queries (negative position) get and give zero gradients; slots after a
    batch row's last position are read as zeros, as in the forward."""
    b, t, _, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    qg, pos, last = _grouped(q, q_pos, hkv)
    # padding queries' output gradients are dropped here, not multiplied by their zero probabilities
    # (0 * inf is NaN)
    go = group_queries(grad, hkv).masked_fill((pos < 0)[..., None], 0.0).contiguous()
    k, v = k.contiguous(), v.contiguous()
    r = qg.shape[2]
    dq = torch.empty_like(qg)
    stats = torch.empty(3, b, hkv, r, dtype=torch.float32, device=q.device)  # max, 1 / sum, delta
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    meta = {
        "TILE": KV_TILE,
        "BLOCK_R": ATTN_BLOCK_R,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "ROW_EXACT": INTERPRETED,
    }
    _attention_backward_rows_kernel[(b * hkv, triton.cdiv(r, ATTN_BLOCK_R))](
        qg, k, v, go, pos, last, dq, stats[0], stats[1], stats[2], r, s_len, d, hkv, scale,
        k.stride(0), k.stride(1), k.stride(2), **meta,
    )  # fmt: skip
    if s_len:  # no slots, no dk or dv (and dq is 0: no row sees anything)
        _attention_backward_slots_kernel[(b * hkv, triton.cdiv(s_len, KV_TILE))](
            qg, k, v, go, pos, last, stats[0], stats[1], stats[2], dk, dv, r, s_len, d, hkv, scale,
            k.stride(0), k.stride(1), k.stride(2), **meta,
        )  # fmt: skip
    return ungroup(dq, t).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
