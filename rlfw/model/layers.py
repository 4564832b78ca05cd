"""Attention, MLP and MoE blocks of the shared model.

Every op on the log-probability path goes through ``ctx.ops``, so one switch picks the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from rlfw.kernels import Ops
from rlfw.kernels.block import BlockShape, CacheWrite, PagedWrite
from rlfw.model.cache import KVCache
from rlfw.model.config import ModelArgs
from rlfw.model.packing import PackedRows
from rlfw.model.routing import RouterTrace


@dataclass
class ForwardContext:
    """What one forward call shares across layers.

    ``positions [B, T]``: each token's position in its sequence, ``-1`` for padding. ``cos``/``sin``
    ``[B, T, head_dim]`` fp32 RoPE tables at those positions. ``cache``/``slots``: the KV cache rows this
    batch reads and extends (prefill and decode); without a cache, K/V go to a temporary buffer of the
    same layout, so training and scoring reduce over keys exactly as the engine does. ``packed``: a
    cache-less forward over only the tokens it computes (:class:`~rlfw.model.packing.PackedRows`), the
    positions and tables then theirs, ``[1, N]``.
    """

    ops: Ops
    positions: Tensor
    cos: Tensor
    sin: Tensor
    cache: KVCache | None = None
    slots: Tensor | None = None
    routing: RouterTrace | None = None
    packed: PackedRows | None = None

    @property
    def valid(self) -> Tensor:
        return self.positions >= 0

    @cached_property
    def _kv_writes(self) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Where each valid token's K/V goes, the same for every layer (so found once per forward): its
        ``(row, column)`` in the batch, the destination row (cache slot, or batch row without a cache) and
        position, and the span of positions a cache-less buffer needs."""
        valid = self.valid
        rows, cols = valid.nonzero(as_tuple=True)
        pos = self.positions[rows, cols]
        dest = rows if self.cache is None else self._slots[rows]
        span = int(self.positions.max().item()) + 1 if self.cache is None and len(rows) else 1
        return rows, cols, dest, pos, span

    @property
    def _slots(self) -> Tensor:
        assert self.slots is not None, "a forward over an engine's KV cache needs the batch's slots"
        return self.slots

    def store_kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write this step's K/V ``[B, T, H_kv, D]`` at their positions; return the caches to attend over
        and which of their rows each batch entry reads: the whole engine cache and the batch's slots (read
        in place, nothing gathered), or, without a cache, a ``[B, S, H_kv, D]`` buffer and None."""
        rows, cols, dest, pos, span = self._kv_writes
        if self.cache is None:
            shape = (k.shape[0], span, k.shape[2], k.shape[3])
            k_all = k.new_zeros(shape).index_put((dest, pos), k[rows, cols])
            v_all = v.new_zeros(shape).index_put((dest, pos), v[rows, cols])
            return k_all, v_all, None
        self.cache.k[layer][dest, pos] = k[rows, cols]
        self.cache.v[layer][dest, pos] = v[rows, cols]
        return self.cache.k[layer], self.cache.v[layer], self._slots

    def unpacked(self, x: Tensor) -> Tensor:
        """``x`` per batch entry ``[B, T, ...]``: laid out from the computed tokens when packed."""
        return x if self.packed is None else self.packed.unpack(x)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Causal attention of this step's ``q [B, T, Hq, D]`` over the sequence so far, after storing
        its ``k``/``v [B, T, H_kv, D]`` (:meth:`store_kv`); ``[B, T, Hq, D]``."""
        if self.packed is not None:
            return self.packed.attention(self.ops, q, k, v, scale)
        k_all, v_all, rows = self.store_kv(layer, k, v)
        return self.ops.attention(q, k_all, v_all, self.positions, scale, rows)

    def cache_write(self, layer: int) -> CacheWrite | PagedWrite | None:
        """Where :meth:`store_kv` would write this layer's K/V and what the attention reads, for a block
        computed in one call (:meth:`Ops.cached_block`); ``None`` without an engine cache."""
        if self.cache is None:
            return None
        rows, cols, dest, pos, _ = self._kv_writes
        k, v = self.cache.k[layer], self.cache.v[layer]
        return CacheWrite(k, v, rows, cols, dest, pos, self.positions, self._slots)


class Linear(nn.Module):
    """A bias-free linear layer whose matmul is ``ctx.ops.linear``.

    The matmul runs inside this module's own forward (not in its parent's), so frameworks that gather
    parameters per module, such as ZeRO-3, see every weight used where it is used.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if not self.weight.is_meta:  # on the meta device the weights are loaded later (see on_meta)
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return ctx.ops.linear(x, self.weight)


def on_meta() -> bool:
    """Whether modules are being built on the meta device (``from_pretrained``). Their weights are loaded
    afterwards, so they skip the random init: torch's meta kernel for ``normal_`` imports
    ``torch._dynamo`` on its first call, 2 s of every actor's start-up on a CPU."""
    return torch.empty(0).is_meta


def _linear(in_features: int, out_features: int) -> Linear:
    return Linear(in_features, out_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return ctx.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention with optional per-head q/k RMSNorm (Qwen3) and RoPE."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = _linear(args.hidden_size, args.num_heads * args.head_dim)
        self.k_proj = _linear(args.hidden_size, args.num_kv_heads * args.head_dim)
        self.v_proj = _linear(args.hidden_size, args.num_kv_heads * args.head_dim)
        self.o_proj = _linear(args.num_heads * args.head_dim, args.hidden_size)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        b, t, _ = x.shape
        ops = ctx.ops
        q = self.q_proj(x, ctx).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x, ctx).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, ctx).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ctx), self.k_norm(k, ctx)
        q, k = ops.rope(q, ctx.cos, ctx.sin), ops.rope(k, ctx.cos, ctx.sin)
        out = ctx.attend(self.layer, q, k, v, self.head_dim**-0.5)
        return self.o_proj(out.reshape(b, t, -1), ctx)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden_size, intermediate_size)
        self.up_proj = _linear(hidden_size, intermediate_size)
        self.down_proj = _linear(intermediate_size, hidden_size)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return self.down_proj(ctx.ops.silu_mul(self.gate_proj(x, ctx), self.up_proj(x, ctx)), ctx)


class MoE(nn.Module):
    """Qwen3-MoE sparse block: softmax top-k router, SwiGLU experts combined in ascending expert order.

    The combine accumulates ``weight * expert(x)`` in fp32, expert 0 first, and casts once at the end:
    a fixed order makes the sum independent of which other tokens share an expert.
    """

    def __init__(self, args: ModelArgs, moe_index: int) -> None:
        super().__init__()
        self.moe_index = moe_index
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = _linear(args.hidden_size, args.num_experts)
        self.experts = nn.ModuleList(
            MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def route(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """Gate weights fp32 ``[B, T, k]`` and expert ids ``[B, T, k]``: the router's or replayed."""
        logits = self.gate(x, ctx).float()
        flat = logits.reshape(-1, logits.shape[-1])
        replay = ctx.routing.replay_ids(self.moe_index) if ctx.routing is not None else None
        if replay is None:
            weights, ids = ctx.ops.router_topk(flat, self.top_k, self.norm_topk_prob)
        else:
            ids = replay.reshape(-1, self.top_k).to(torch.long)
            check_replayed_ids(ids, len(self.experts), self.moe_index)
            weights = ctx.ops.router_weights(flat, ids, self.norm_topk_prob)
            if ctx.routing is not None:
                own = ctx.ops.router_topk(flat.detach(), self.top_k, self.norm_topk_prob)[1]
                ctx.routing.own.append(own.reshape(*x.shape[:-1], self.top_k))
        shape = (*x.shape[:-1], self.top_k)
        ids = ids.reshape(shape)
        if ctx.routing is not None:
            ctx.routing.recorded.append(ids.detach())
        return weights.reshape(shape), ids

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        weights, ids = self.route(x, ctx)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_ids, flat_w = ids.reshape(-1, self.top_k), weights.reshape(-1, self.top_k)
        out = torch.zeros(flat_x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            token, slot = (flat_ids == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat_x[token], ctx).float() * flat_w[token, slot, None]
            out = out.index_add(0, token, y)
        return out.to(x.dtype).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module
        if args.is_moe_layer(layer):
            self.mlp = MoE(args, args.moe_layers.index(layer))
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        fused = self.in_one_call(x, ctx)
        if fused is not None:
            return fused
        x = x + self.self_attn(self.input_layernorm(x, ctx), ctx)
        return x + self.mlp(self.post_attention_layernorm(x, ctx), ctx)

    def in_one_call(self, x: Tensor, ctx: ForwardContext) -> Tensor | None:
        """An engine's forward over its cache through :meth:`Ops.cached_block` (the same ops in one call,
        the same bits), where the op set has that call for a dense block; else ``None``."""
        cache = ctx.cache_write(self.self_attn.layer)  # None for the trainer's forwards: no cache
        if cache is None or ctx.routing is not None or not isinstance(self.mlp, MLP) or _hooked(self):
            return None
        a, m = self.self_attn, self.mlp
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if a.q_norm is not None and a.k_norm is not None:
            norms += [a.q_norm, a.k_norm]
        if len({n.eps for n in norms}) != 1:
            return None
        projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        weights = [p.weight for p in projections]
        shape = BlockShape(a.num_heads, a.num_kv_heads, a.head_dim, norms[0].eps)
        return ctx.ops.cached_block(x, weights, [n.weight for n in norms], shape, ctx.cos, ctx.sin, cache)


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook watches ``module`` or a module inside it (a call for the whole block would
    skip the inner modules' forwards, and so their hooks)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def check_replayed_ids(ids: Tensor, num_experts: int, moe_index: int) -> None:
    """Replayed expert ids must name experts of this layer: an id out of range means the routing record
    belongs to another model (or was corrupted), and clamping it would silently route to the wrong expert."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        bad = ids[(ids < 0) | (ids >= num_experts)]
        raise ValueError(
            f"router replay: MoE layer {moe_index} got expert id {int(bad[0])}, outside "
            f"0..{num_experts - 1}; the routed_experts record does not belong to this model (replay it only "
            "on the checkpoint that generated it)"
        )
