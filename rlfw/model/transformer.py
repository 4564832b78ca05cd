"""The shared transformer: one module for training, scoring, prefill and decode."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlfw.kernels import Ops, get_ops
from rlfw.model.cache import KVCache
from rlfw.model.config import ModelArgs
from rlfw.model.layers import Block, ForwardContext, Linear, RMSNorm, on_meta
from rlfw.model.packing import PackedRows
from rlfw.model.routing import RouterTrace


class Backbone(nn.Module):
    """Embeddings, blocks and final norm, named as in HF checkpoints (``model.*``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        shape = (args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if on_meta() else None)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 ``cos``/``sin`` ``[B, T, head_dim]`` at ``positions [B, T]`` (padding, -1, reads 0)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.clamp(min=0).float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


VALUE_HEAD = "value_head.weight"

# A row-wise reader of scored logits: ``read(logits [m, V], row_of [c] | None, entries)`` -> tensors
# ``[c, ...]`` for the scored entries ``entries`` (a slice of the ``n`` in row-major order), entry ``i``
# of the slice reading logits row ``row_of[i]`` (``None``: row ``i``). See :meth:`Transformer.forward`.
RowReader = Callable[[Tensor, Tensor | None, slice], tuple[Tensor, ...]]


class Transformer(nn.Module):
    """Qwen3 / Llama dense and Qwen3-MoE causal LM.

    The mode is set by the arguments, not by a flag: with grad enabled it is the training forward, under
    ``torch.no_grad`` the scoring forward; with a ``cache`` it is a prefill (T > 1) or decode (T == 1)
    step that extends the cache rows ``slots``. All four run the same code and the same ops.
    """

    def __init__(self, args: ModelArgs, kernels: str = "default") -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        self.ops: Ops = get_ops(kernels)
        self.value_head: Linear | None = None

    def attach_value_head(self) -> None:
        """Grow a scalar value head on the final hidden states (PPO's critic; zero-initialised).

        It is not part of the HF causal-LM checkpoint: engines never have one, and weight publishing
        leaves it out (:data:`VALUE_HEAD` names its parameter).
        """
        self.value_head = Linear(self.args.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        self.value_head.to(self.model.embed_tokens.weight.dtype)

    def set_kernels(self, name: str) -> None:
        """Switch the op set (``kernels=invariant|default``) without touching the weights."""
        self.ops = get_ops(name)

    @property
    def output_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init for tiny models built from config (no checkpoint)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def prepare_for_inference(self, refresh: bool = False) -> None:
        """Let the op set keep this model's matrices in a faster layout for the many forwards of an
        engine (packed panels on the CPU kernels). Call again after loading new weights; until then a
        weight changed through its version counter takes the slower per-call path, never a stale copy.
        ``refresh=True`` after writes through ``.data`` (which no counter sees)."""
        self.ops.prepare_weights((p for p in self.parameters() if p.dim() == 2), refresh)

    def weights_held(self) -> AbstractContextManager[None]:
        """A context within which this model's weights do not change (a train step's micro-batches, up
        to the optimizer step): the op set may keep its matrices in a faster layout until it exits (the
        CPU kernels pack each once instead of per call)."""
        return self.ops.held_weights(p for p in self.parameters() if p.dim() == 2)

    def new_cache(self, num_slots: int, capacity: int, max_capacity: int | None = None) -> KVCache:
        """A cache of ``num_slots`` rows of ``capacity`` positions, growing to ``max_capacity``."""
        p = self.model.embed_tokens.weight
        a = self.args
        return KVCache(
            a.num_layers, num_slots, capacity, a.num_kv_heads, a.head_dim, p.dtype, p.device, max_capacity
        )

    def positions(self, attention_mask: Tensor, cache: KVCache | None, slots: Tensor | None) -> Tensor:
        """Position of each token, ``-1`` for padding; left and right padding give the same positions."""
        mask = attention_mask.to(torch.long)
        pos = mask.cumsum(dim=1) - 1
        if cache is not None:
            assert slots is not None
            pos = pos + cache.lengths[slots][:, None]
            cache.reserve(int(pos.max().item()) + 1 if mask.any() else 0)
        return pos.masked_fill(mask == 0, -1)

    @staticmethod
    def packing(
        input_ids: Tensor, positions: Tensor, cache: KVCache | None, routing: RouterTrace | None
    ) -> PackedRows | None:
        """The tokens a forward computes, where it does not compute every batch entry: without a cache
        (training, scoring) each distinct token once (:class:`~rlfw.model.packing.PackedRows`), except
        with routing records (MoE), which are laid out per batch entry."""
        return PackedRows.of(input_ids, positions) if cache is None and routing is None else None

    def _run(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        routing: RouterTrace | None = None,
    ) -> tuple[Tensor, ForwardContext]:
        """Final-norm hidden states and the call's context: ``[B, T, hidden]``, or ``[1, N, hidden]`` for
        the ``N`` tokens computed when the context is packed (``ctx.unpacked`` lays them out)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if cache is not None and slots is None:
            slots = torch.arange(input_ids.shape[0], device=input_ids.device)
        positions = self.positions(attention_mask, cache, slots)
        packed = self.packing(input_ids, positions, cache, routing)
        if packed is not None:
            input_ids, positions = packed.ids, packed.positions
        cos, sin = rope_tables(positions, self.args.head_dim, self.args.rope_theta)
        ctx = ForwardContext(self.ops, positions, cos, sin, cache, slots, routing, packed)
        if routing is not None:
            routing.recorded.clear()
            routing.own.clear()
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x, ctx)
        if cache is not None:
            assert slots is not None
            cache.lengths[slots] += attention_mask.to(torch.long).sum(dim=1)
        return self.model.norm(x, ctx), ctx

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        routing: RouterTrace | None = None,
    ) -> Tensor:
        """Final-norm hidden states ``[B, T, hidden]``; see :meth:`forward` for the arguments."""
        h, ctx = self._run(input_ids, attention_mask, cache=cache, slots=slots, routing=routing)
        return ctx.unpacked(h)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        routing: RouterTrace | None = None,
        with_values: bool = False,
        scored: Tensor | None = None,
        read: RowReader | None = None,
        chunk_rows: int = 0,
    ) -> Tensor | tuple[Tensor, ...] | tuple[Tensor | tuple[Tensor, ...], Tensor]:
        """Logits ``[B, T, V]`` for ``input_ids [B, T]`` (and values ``[B, T]`` with ``with_values``).

        ``attention_mask [B, T]`` (1 = token, 0 = padding, left or right). ``cache``/``slots``: extend
        these cache rows (prefill or decode); the new tokens continue each row after its cached length.
        ``routing``: record the MoE expert ids, or replay given ones (R3). ``with_values``: also return
        the value head's estimate at every position (needs :meth:`attach_value_head`).
        ``scored [B, T]`` (bool): return the logits of these entries only, ``[n, V]`` for the ``n`` true
        entries in row-major order (a loss reads the response positions alone; with a real vocabulary
        the other positions' logits would be most of the forward's memory). Under batch-invariant
        kernels each row has the bits it has in the full ``[B, T, V]``.
        ``read`` (with ``scored``): return ``read``'s outputs over the scored entries rather than their
        logits, concatenated ``[n, ...]``; it is given the logits of the distinct computed tokens and
        which row each entry reads, so no row is copied per entry. With ``chunk_rows > 0`` it runs over
        chunks of that many entries and, when a gradient is recorded, each chunk's logits are recomputed
        in the backward, so no ``[n, V]`` tensor is ever held (a real vocabulary's logits would be most
        of a training step's memory). ``read`` must be row-wise; each output then has the unchunked bits.
        """
        if with_values and self.value_head is None:
            raise ValueError("with_values=True needs a value head: call attach_value_head() (algo=ppo does)")
        h, ctx = self._run(input_ids, attention_mask, cache=cache, slots=slots, routing=routing)
        # The heads run on the computed tokens; nothing keeps their packed output after the gather to
        # [B, T] (or to the scored entries), so the peak is that of the logits returned.
        if read is not None:
            if scored is None:
                raise ValueError("read= needs scored=: the entries whose logits it reads")
            logits: Tensor | tuple[Tensor, ...] = self._read_scored(h, ctx, scored, read, chunk_rows)
        else:
            logits = self._head(h, ctx) if scored is None else self._scored_logits(h, ctx, scored)
        if not with_values:
            return logits
        assert self.value_head is not None
        return logits, ctx.unpacked(self.value_head(h, ctx)).squeeze(-1).float()

    def _head(self, h: Tensor, ctx: ForwardContext) -> Tensor:
        """The LM head over every batch entry, ``[B, T, V]``."""
        return ctx.unpacked(self._lm_head(h, ctx))

    def _scored_logits(self, h: Tensor, ctx: ForwardContext, scored: Tensor) -> Tensor:
        """The LM head at the ``scored [B, T]`` entries, ``[n, V]``: each distinct computed token among
        them once (samples of a group that drew the same first tokens share those rows), then one row
        per entry."""
        rows, entry_row = self._scored_rows(h, ctx, scored)
        logits = self._lm_head(rows, ctx)
        return logits if entry_row is None else logits[entry_row]

    def _scored_rows(self, h: Tensor, ctx: ForwardContext, scored: Tensor) -> tuple[Tensor, Tensor | None]:
        """The hidden rows ``[m, hidden]`` of the distinct computed tokens at the ``scored`` entries, and
        each entry's row among them (``None``: one row per entry, in order)."""
        if ctx.packed is None:
            return h[scored], None
        rows, inverse = torch.unique(ctx.packed.at[scored], return_inverse=True)
        return h[0, rows], inverse

    def _read_scored(
        self, h: Tensor, ctx: ForwardContext, scored: Tensor, read: RowReader, chunk_rows: int
    ) -> tuple[Tensor, ...]:
        """``read`` over the scored entries' logits, in chunks of ``chunk_rows`` entries (all at once
        if 0). A chunk computed with a gradient keeps only its inputs: the backward recomputes its logits."""
        rows, entry_row = self._scored_rows(h, ctx, scored)
        n = int(scored.sum())
        if chunk_rows <= 0 or n <= chunk_rows:
            return read(self._lm_head(rows, ctx), entry_row, slice(0, n))

        def chunk(rows: Tensor, entries: slice) -> tuple[Tensor, ...]:
            if entry_row is None:
                return read(self._lm_head(rows[entries], ctx), None, entries)
            # each distinct row of the chunk once, as in the unchunked head
            at, row_of = torch.unique(entry_row[entries], return_inverse=True)
            return read(self._lm_head(rows[at], ctx), row_of, entries)

        parts = []
        for start in range(0, n, chunk_rows):
            entries = slice(start, min(start + chunk_rows, n))
            if torch.is_grad_enabled():
                parts.append(checkpoint(chunk, rows, entries, use_reentrant=False, preserve_rng_state=False))
            else:
                parts.append(chunk(rows, entries))
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))

    def _lm_head(self, h: Tensor, ctx: ForwardContext) -> Tensor:
        if self.lm_head is None:  # tied: the embedding matrix is the head
            return self.ops.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h, ctx)
