"""Causal attention over the slotted KV cache with a fixed KV tile aligned to position 0.

A query at position ``p`` reduces over KV tiles ``0 .. p // KV_TILE`` in ascending order with an online
softmax (running max, running sum, rescaling), in fp32. The tiles a query visits, their width and the
order of every reduction are functions of ``p`` alone, so the same query gives the same bits in a
full-sequence pass, a chunked prefill, a one-token decode step, any cache capacity and any batch:

* ``p @ v`` is one GEMM per (batch entry, KV head, tile) with the query rows zero-padded to a multiple
  of 16 (the linear's rule: only ``M`` varies, ``N`` and ``K`` are fixed). The scores of a group of up
  to :data:`TILE_GROUP` tiles are one GEMM whose columns each get the bits of a ``KV_TILE``-wide GEMM
  (sgemm's per-output reduction over ``K = head_dim`` does not depend on ``N``; a test checks it);
* the K/V window is padded to whole tiles, so a tile cut short by the cache end reduces like a full one;
* slots after the last position a batch row asks for are zeroed before use, so stale or non-finite cache
  contents cannot leak through ``0 * v``; masked slots inside that range add exact signed zeros, and
  the ``+ 0.0`` after each tile product removes the only trace they can leave (the sign of a zero);
* a tile entirely after ``p`` leaves the query's state bit-identical: its running max does not move, so
  the rescale factor is ``exp(0) = 1`` and the tile adds exact ``+0.0`` (the state is never ``-0.0``).

Speed on CPU, where a small op costs microseconds of dispatch: every tile of a group goes through the
same tensor ops, and only the two-op rescaling recurrence walks the tiles one by one. Masking is
arithmetic, not ``torch.where`` (a branchy per-element select, measured 10x slower than an add here):
a 0 / ``-2**100`` bias before the max and a 1 / 0 factor after ``exp``. ``exp`` never sees ``-inf`` (its
scalar fallback for out-of-range inputs measured 25x slower); its argument is clamped at 0, which
changes no visible slot (their scores never exceed the running max) and keeps masked slots finite
before the 0 factor. Scores and values of slots a batch row has written are assumed finite, as for any
attention. What depends only on the positions (masks, tile count, the K/V window buffers) is built once
per positions tensor and shared by the layers of a forward pass.

Queries are grouped per KV head (GQA): rows are ``(t, g)`` pairs of one batch entry and KV head.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfw.kernels import cpu_native
from rlfw.kernels.matmul import ROW_BLOCK, k_tiled_matmul
from rlfw.kernels.threads import widened

KV_TILE = 32
TILE_GROUP = 16
"""Tiles whose scores are held at once (bounds memory at ``rows x 512`` fp32 per KV head)."""
_BIG = 2.0**100
"""Finite stand-in for ``-inf`` in the max: far below any score; ``position * _BIG`` stays finite."""


def group_queries(q: Tensor, hkv: int, pad_to: int = 1) -> Tensor:
    """``q [B, T, Hq, D] -> [B, Hkv, T*G, D]`` fp32, rows ordered ``(t, g)``, followed by zero rows up to
    a multiple of ``pad_to``."""
    b, t, hq, d = q.shape
    g = hq // hkv
    rows = t * g
    pad = (-rows) % pad_to
    if t == 1:  # decode: the rows of a KV head are already adjacent
        grouped = q.reshape(b, hkv, g, d)
        grouped = grouped if grouped.dtype == torch.float32 else grouped.float()
        return F.pad(grouped, (0, 0, 0, pad)) if pad else grouped.contiguous()
    grouped = q.reshape(b, t, hkv, g, d).permute(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D] view
    if not pad:
        return grouped.to(torch.float32, memory_format=torch.contiguous_format).reshape(b, hkv, rows, d)
    out = torch.zeros(b, hkv, rows + pad, d, dtype=torch.float32, device=q.device)
    out[:, :, :rows].unflatten(2, (t, g)).copy_(grouped)
    return out


def group_positions(q_pos: Tensor, hkv: int, hq: int) -> Tensor:
    """``q_pos [B, T] -> [B, Hkv, T*G]``: the position of each row of :func:`group_queries` (unpadded)."""
    b, t = q_pos.shape
    return q_pos[:, None, :, None].expand(b, hkv, t, hq // hkv).reshape(b, hkv, -1)


def ungroup(out: Tensor, t: int) -> Tensor:
    """Inverse of :func:`group_queries`: ``[B, Hkv, T*G, D] -> [B, T, Hq, D]``."""
    b, hkv, _, d = out.shape
    if t == 1:
        return out.reshape(b, 1, -1, d)
    return out.reshape(b, hkv, t, -1, d).permute(0, 2, 1, 3, 4).reshape(b, t, -1, d)


@functools.lru_cache(maxsize=16)
def _causal(c: int, device: torch.device) -> Tensor:
    """``[c, c]``: 0 on and below the diagonal, ``-_BIG`` above; a running max over ``c`` tiles is then
    one ``amax`` (adding 0 is exact, and only the maxima of fully masked tiles lie near ``-_BIG``)."""
    return torch.ones(c, c, device=device).tril_().sub_(1.0).mul_(_BIG)


@dataclass(eq=False)
class _Plan:
    """What depends only on the query positions and the cache length: shared by every layer of a call.

    ``bias [Bq, 1, Rp, n_tiles * KV_TILE]``: 0 where slot <= position, ``-_BIG`` elsewhere;
    ``visible [Bq, 1, n_tiles, Rp, KV_TILE]``: 1 / 0 in tile-major layout (``Bq`` is 1 when every batch
    row has the same positions). ``valid [Bq, 1, Rp, 1]``: real queries, only when some are padding.
    """

    n_tiles: int
    rows: int
    last_pos: Tensor
    uniform_last: int | None
    bias: Tensor
    visible: Tensor
    valid: Tensor | None
    windows: dict[str, Tensor] = field(default_factory=dict)

    def kv_window(self, cache: Tensor, which: str) -> Tensor:
        """Slots ``0 .. n_tiles*KV_TILE - 1`` of ``cache [B, S, Hkv, D]`` as contiguous fp32
        ``[B, Hkv, n_tiles*KV_TILE, D]``, zero past the cache end and past each row's last position.

        The window is a buffer kept for the plan's lifetime: every layer of a call has the same window
        shape, and the zeros past the copied span stay in place. Calls sharing a plan run one at a time.
        """
        width = self.n_tiles * KV_TILE
        n = min(cache.shape[1], width)
        if self.uniform_last is not None:
            n = min(n, self.uniform_last + 1)
        win = cache[:, :n].transpose(1, 2)
        buf = self.windows.get(which)
        if buf is None or buf.shape != (win.shape[0], win.shape[1], width, win.shape[3]):
            buf = torch.zeros(win.shape[0], win.shape[1], width, win.shape[3], device=cache.device)
            self.windows[which] = buf
        span = buf if n == width else buf[:, :, :n]
        span.copy_(win)
        if self.uniform_last is None:
            stale = torch.arange(n, device=cache.device) > self.last_pos[:, None]
            span.masked_fill_(stale[:, None, :, None], 0.0)
        return buf


def _plan(q_pos: Tensor, s_cap: int, group: int) -> _Plan | None:
    b, t = q_pos.shape
    if b == 0 or t == 0:
        return None
    last_pos = q_pos.amax(-1)
    top, low, first = torch.stack((last_pos.max(), last_pos.min(), q_pos.min())).tolist()
    n_tiles = min(-(-s_cap // KV_TILE), (top + KV_TILE) // KV_TILE)
    if n_tiles <= 0:
        return None
    rows = t * group
    shared = b == 1 or (t == 1 and top == low) or bool((q_pos == q_pos[:1]).all())
    pos = (q_pos[:1] if shared else q_pos).repeat_interleave(group, dim=1).float()  # exact below 2**24
    pos = F.pad(pos, (0, (-rows) % ROW_BLOCK), value=-1.0)[:, None, :, None]  # [Bq, 1, Rp, 1]
    slots = torch.arange(n_tiles * KV_TILE, device=q_pos.device, dtype=torch.float32)
    # (pos - slot) * 2**100 is exact: 0 on the diagonal, at least 2**100 in size elsewhere.
    bias = (pos * _BIG - slots * _BIG).clamp_(-_BIG, 0.0)
    tiles = bias.view(*bias.shape[:3], n_tiles, KV_TILE).transpose(2, 3)
    return _Plan(
        n_tiles=n_tiles,
        rows=rows,
        last_pos=last_pos,
        uniform_last=top if top == low else None,
        bias=bias,
        visible=tiles.div(_BIG).add_(1.0).contiguous(),
        valid=pos >= 0 if first < 0 else None,
    )


_last: tuple[Any, ...] = ()
"""``(weakref to q_pos, key, plan)`` of the latest call: the layers of a forward pass share ``q_pos``.
The plan (and its window buffers) is dropped when that ``q_pos`` is freed."""


def _forget(ref: weakref.ref[Tensor]) -> None:
    global _last
    if _last and _last[0] is ref:
        _last = ()


def _cached_plan(q_pos: Tensor, s_cap: int, group: int) -> _Plan | None:
    global _last
    key = (q_pos._version, s_cap, group, KV_TILE, TILE_GROUP, ROW_BLOCK)
    last = _last
    if last and last[0]() is q_pos and last[1] == key:
        plan: _Plan | None = last[2]
        return plan
    plan = _plan(q_pos, s_cap, group)
    _last = (weakref.ref(q_pos, _forget), key, plan)
    return plan


def _tile_group(
    plan: _Plan, qg: Tensor, k: Tensor, v: Tensor, g0: int, g1: int, carry: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Tiles ``g0 .. g1-1`` at once: the running max ``m [B, Hkv, c, Rp]`` (continuing from ``carry``,
    the previous group's last) and, per tile, ``p @ v`` with the row sum of ``p`` appended as column
    ``D`` (``[B, Hkv, c, Rp, D + 1]``)."""
    b, hkv, rp, d = qg.shape
    c = g1 - g0
    bias, visible = plan.bias, plan.visible
    if c != plan.n_tiles:
        lo, hi = g0 * KV_TILE, g1 * KV_TILE
        k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        bias, visible = bias[:, :, :, lo:hi], visible[:, :, g0:g1]
    s = k_tiled_matmul(qg, k.transpose(2, 3)).mul_(scale)  # [B, Hkv, Rp, c*32]
    masked = torch.add(s, bias)
    # The running max of the tile maxima (the sign of a zero max cannot reach a result: m only enters
    # as exp(x - m), and x - (+0) and x - (-0) differ only when x is a zero, whose exp is 1 either way).
    tile_max = masked.view(b, hkv, rp, c, KV_TILE).amax(-1)
    if c > 1:
        tile_max = torch.add(tile_max.unsqueeze(3), _causal(c, tile_max.device)).amax(-1)
    m = tile_max.transpose(2, 3)  # [B, Hkv, c, Rp]
    if carry is not None:
        m = torch.maximum(m, carry.unsqueeze(2))
    # p in tile-major layout, written over the dead ``masked`` buffer.
    p = masked.view(b, hkv, c, rp, KV_TILE)
    torch.sub(s.view(b, hkv, rp, c, KV_TILE).transpose(2, 3), m.unsqueeze(4), out=p)
    p.clamp_max_(0.0).exp_().mul_(visible)
    pv = torch.cat((torch.matmul(p, v.view(b, hkv, c, KV_TILE, d)), p.sum(-1, keepdim=True)), -1)
    return m, pv.add_(0.0)


def attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float, rows: Tensor | None = None
) -> Tensor:
    """See :meth:`rlfw.kernels.registry.Ops.attention`; the result is in ``q.dtype``.

    On CPU tensors the compiled kernel (``kernels/csrc/attention.cpp``) computes each query row alone
    over exactly its visible positions, reading fp32 cache rows in place through ``rows``; elsewhere the
    tiled torch path below (:func:`tiled_attention`) on the gathered rows.
    """
    if q.device.type == "cpu":
        if rows is None or k_cache.dtype != torch.float32:  # a bf16 cache: gather, then widen the rows
            k_cache, v_cache = take_rows(k_cache, v_cache, rows, q_pos)
            rows = torch.arange(q.shape[0])
        with widened():  # one thread per block of query tokens: the same bits at any count
            out = cpu_native.module().attention(
                _f32(q),
                _f32(k_cache),
                _f32(v_cache),
                q_pos.to(torch.long).contiguous(),
                rows.to(torch.long).contiguous(),
                float(scale),
            )
        return out if out.dtype == q.dtype else out.to(q.dtype)
    k_cache, v_cache = take_rows(k_cache, v_cache, rows, q_pos)
    return tiled_attention(q, k_cache, v_cache, q_pos, scale)


class CompiledBackward(torch.autograd.Function):
    """:func:`attention` on the batch's own fp32 K/V (training) with the compiled backward: one pass per
    (batch entry, KV head) that recomputes each query's softmax and accumulates ``dq``, ``dk``, ``dv``,
    instead of differentiating :func:`attention_reference` under autograd. The forward is the CPU kernel
    itself, so the trainer's forward bits do not change."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
        q_pos = q_pos.to(torch.long).contiguous()
        ctx.save_for_backward(q, k, v, q_pos)
        ctx.scale = scale
        return attention(q, k, v, q_pos, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, q_pos = ctx.saved_tensors
        with widened():  # one thread per (batch entry, KV head): the same bits at any thread count
            dq, dk, dv = cpu_native.module().attention_backward(
                q.contiguous(), k.contiguous(), v.contiguous(), q_pos, float(ctx.scale), grad.contiguous()
            )
        return dq, dk, dv, None, None


def paged_attention(
    q: Tensor, kv_cache: Tensor, seq: Tensor, q_pos: Tensor, block_table: Tensor, scale: float
) -> Tensor:
    """:func:`attention` over a paged cache (CPU): the same bits for the same query and K/V.

    ``q [N, Hq, D]``: query tokens of many sequences; ``kv_cache [blocks, Hkv, block, 2 * D]`` (vLLM's
    CPU cache tensor, fp32 or bf16): per block and KV head, the block's ``block`` key rows, then its
    ``block`` value rows (the storage read as ``[blocks, Hkv, 2 * block, D]``), as :func:`paged_store`
    writes them; token ``i``
    belongs to sequence ``seq[i]``, whose blocks are row ``seq[i]`` of ``block_table``, at position
    ``q_pos[i]`` (negative: padding, zeros). Returns ``[N, Hq, D]`` in ``q.dtype``.
    """
    blocks, hkv, block, width = kv_cache.shape
    with widened():
        out = cpu_native.module().paged_attention(
            _f32(q),
            _kv_pairs(kv_cache).contiguous(),
            seq.to(torch.long).contiguous(),
            q_pos.to(torch.long).contiguous(),
            block_table.to(torch.long).contiguous(),
            float(scale),
        )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _kv_pairs(kv_cache: Tensor) -> Tensor:
    """``[blocks, Hkv, block, 2D]`` viewed as ``[blocks, Hkv, 2 * block, D]``: a block's keys, then its values
    (the kernel's view). The storage is the same; only the reading of a row differs."""
    blocks, hkv, block, width = kv_cache.shape
    return kv_cache.view(blocks, hkv, 2 * block, width // 2)


def paged_store(kv_cache: Tensor, key: Tensor, value: Tensor, slots: Tensor) -> None:
    """Write ``key``/``value [N, Hkv, D]`` at cache slots ``slots [N]`` (block * block_size + offset;
    negative: padding, skipped) in :func:`paged_attention`'s layout, in place."""
    blocks, hkv, block, width = kv_cache.shape
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    slots = slots.to(torch.long)
    pairs = _kv_pairs(kv_cache).view(blocks, hkv, 2, block, width // 2)
    b, j = slots // block, slots % block
    pairs[b, :, 0, j] = key.to(kv_cache.dtype)
    pairs[b, :, 1, j] = value.to(kv_cache.dtype)


def take_rows(k_cache: Tensor, v_cache: Tensor, rows: Tensor | None, q_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The batch's own cache rows ``[B, span, Hkv, D]`` (span: the last visible position + 1) from an
    engine's whole cache; the caches themselves when ``rows`` is None."""
    if rows is None:
        return k_cache, v_cache
    span = int(q_pos.max().item()) + 1 if bool((q_pos >= 0).any()) else 1
    return k_cache[rows, :span], v_cache[rows, :span]


def _f32(t: Tensor) -> Tensor:
    return (t if t.dtype == torch.float32 else t.float()).contiguous()


def tiled_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """The tiled torch path (non-CPU devices): KV tiles aligned to position 0, online softmax."""
    t, hkv = q.shape[1], k_cache.shape[2]
    plan = _cached_plan(q_pos, k_cache.shape[1], q.shape[2] // hkv)
    if plan is None:
        return q.new_zeros(q.shape)
    qg = group_queries(q, hkv, pad_to=ROW_BLOCK)  # [B, Hkv, Rp, D]
    k, v = plan.kv_window(k_cache, "k"), plan.kv_window(v_cache, "v")  # [B, Hkv, W, D]
    # acc [B, Hkv, Rp, D + 1]: the unnormalised output with the softmax denominator as its last column.
    m: Tensor | None = None
    acc = qg  # replaced by the first tile's state
    for g0 in range(0, plan.n_tiles, TILE_GROUP):
        m_group, pv = _tile_group(plan, qg, k, v, g0, min(g0 + TILE_GROUP, plan.n_tiles), m, scale)
        tiles = list(pv.unbind(2))
        if m is None:
            acc, m_prev, m_group_rest = tiles.pop(0), m_group[:, :, :-1], m_group[:, :, 1:]
        else:
            m_prev, m_group_rest = torch.cat((m.unsqueeze(2), m_group[:, :, :-1]), 2), m_group
        if tiles:
            alpha = torch.exp(m_prev - m_group_rest).unsqueeze(4)
            for a, tile in zip(alpha.unbind(2), tiles, strict=True):
                acc = acc.mul_(a).add_(tile)
        m = m_group[:, :, -1]
    d = q.shape[-1]
    # A visible row has denominator >= 1 (its max term is exp(0)); padding rows have all zeros.
    out = acc[:, :, :, :d].div_(acc[:, :, :, d:].clamp_min_(1.0))
    if plan.valid is not None:
        out = torch.where(plan.valid, out, 0.0)
    if out.shape[2] != plan.rows:
        out = out[:, :, : plan.rows]
    out = ungroup(out, t)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """Plain masked-softmax attention in fp32 (differentiable, no tiling): the math the tiled op rounds.

    Used for the backward pass. Padding queries see slot 0 only, so every softmax is finite; their
    output is zeroed.
    """
    qg, pos, p = reference_probabilities(q, k_cache, q_pos, scale)
    out = torch.matmul(p, v_cache.float().transpose(1, 2))
    out = out.masked_fill((pos < 0)[..., None], 0.0)
    return ungroup(out, q.shape[1]).to(q.dtype)


def reference_probabilities(
    q: Tensor, k_cache: Tensor, q_pos: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The attention probabilities of :func:`attention_reference` (differentiable): ``(qg, pos, p)``, the
    grouped fp32 queries ``[B, Hkv, R, D]`` (rows ``(t, g)``), each row's position ``[B, Hkv, R]`` and the
    masked softmax over the slots ``[B, Hkv, R, S]``. Padding queries (negative position) see slot 0."""
    hkv = k_cache.shape[2]
    qg = group_queries(q, hkv)
    pos = group_positions(q_pos, hkv, q.shape[2])
    slots = torch.arange(k_cache.shape[1], device=q.device)
    visible = (slots <= pos[..., None]) | ((pos[..., None] < 0) & (slots == 0))
    s = torch.matmul(qg, k_cache.float().permute(0, 2, 3, 1)) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return qg, pos, p
