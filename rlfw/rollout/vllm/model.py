"""rlfw's shared model as an out-of-tree vLLM model (architecture ``RlfwForCausalLM``).

vLLM keeps what it owns: the paged KV cache, the scheduler, its attention backend and its sampler.
Everything else in the forward is the shared model itself: embeddings, every linear layer (through
``ops.linear``), RMSNorm, RoPE, SwiGLU, the MoE router and the fixed-order expert combine, and the LM
head, from the same :class:`~rlfw.model.Transformer` modules the trainer runs, on the op set the run
selects (``kernels=invariant|default``). Under ``kernels=invariant`` on CPU the attention too is the
shared one, over vLLM's paged cache (:mod:`rlfw.rollout.vllm.attention`), so every op of the engine's
forward is the trainer's; elsewhere vLLM's own attention backend runs. ``rlfw audit engine=vllm``
checks the result and localises what differs. On the CPU kernels a dense block then runs in one compiled
call over vLLM's cache (:class:`PagedContext`), as in the built-in engine: the same kernel calls in the
same order, without a Python call per op. There a step's tokens whose whole prefix another request of
the step also feeds take that request's row (:func:`shared_prefixes`): vLLM enters each sample of a GRPO
group as a request of its own and its prefix cache keeps whole blocks only, so without this a group's
prompt would be computed once per sample, in the prefill step and again in the rescoring pass. Each row
is the same bits whatever else the call computes (the kernels are batch-invariant), so the records do not
change.

Registration: the ``vllm.general_plugins`` entry point ``rlfw`` calls :func:`register` in every process
vLLM starts; a checkpoint selects the model with ``hf_overrides={"architectures": [ARCHITECTURE],
"rlfw_kernels": "invariant"}`` (the engine does this for ``engine.vllm.model=rlfw``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from rlfw.kernels.block import PagedWrite
from rlfw.model.config import ModelArgs, args_from_hf_config
from rlfw.model.layers import Attention as RlfwAttention
from rlfw.model.layers import Block, ForwardContext
from rlfw.model.packing import computed_rows, shared_prefixes
from rlfw.model.routing import RouterTrace
from rlfw.model.transformer import Transformer, rope_tables

ARCHITECTURE = "RlfwForCausalLM"
KERNELS_KEY = "rlfw_kernels"  # hf_config attribute naming the op set


def register() -> None:
    """Make ``RlfwForCausalLM`` known to vLLM (idempotent; the entry point calls it)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:RlfwForCausalLM")


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    d = dict(hf_config.to_dict())
    # vLLM rewrites `architectures`; the shared model reads the real family from model_type.
    d.pop("architectures", None)
    return d


class PagedAttention(RlfwAttention):
    """The shared attention block (projections, q/k norms, RoPE) around vLLM's paged attention layer."""

    def __init__(self, args: ModelArgs, layer: int, vllm_config: Any, kernels: str) -> None:
        from vllm.model_executor.layers.attention import Attention as VllmAttention
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        super().__init__(args, layer)
        self.attn = VllmAttention(
            args.num_heads,
            args.head_dim,
            args.head_dim**-0.5,
            num_kv_heads=args.num_kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"model.layers.{layer}.self_attn.attn",
        )
        if kernels == "invariant" and isinstance(self.attn.impl, CPUAttentionBackendImpl):
            from rlfw.rollout.vllm.attention import SharedPagedAttention

            self.attn.impl = SharedPagedAttention.replacing(self.attn.impl)

    @property
    def shared(self) -> bool:
        """Whether the layer's attention is the shared one (what the compiled block computes)."""
        from rlfw.rollout.vllm.attention import SharedPagedAttention

        return isinstance(self.attn.impl, SharedPagedAttention)

    def step(self) -> tuple[Any, Tensor, Tensor] | None:
        """vLLM's attention metadata, cache tensor and slot mapping for this layer in the running step;
        ``None`` where the shared attention does not serve it (vLLM's own backend, its warm-up pass, a
        layer that shares another's cache, a non-causal step), so the block runs op by op."""
        from vllm.forward_context import is_forward_context_available
        from vllm.model_executor.layers.attention.attention import get_attention_context

        if not self.shared or self.attn.kv_sharing_target_layer_name is not None:
            return None
        if not is_forward_context_available():
            return None
        metadata, _, kv_cache, slot_mapping = get_attention_context(self.attn.layer_name)
        if metadata is None or slot_mapping is None:
            return None
        if not metadata.causal or metadata.dynamic_causal is not None:
            return None  # the per-op path names what is unsupported
        return metadata, kv_cache, slot_mapping

    def paged_write(
        self, steps: dict[int, tuple[Tensor, Tensor, Tensor]], shared: SharedPrefixes | None = None
    ) -> PagedWrite | None:
        """This step's cache write and reads for the layer, as the shared attention would make them
        (``steps``: each metadata's token sequences, positions and block table, found once per forward);
        with ``shared``, for the rows computed (:func:`shared_prefixes`). ``None`` where that attention
        does not serve (:meth:`step`), or the step is not the one ``shared`` was found for."""
        from rlfw.rollout.vllm.attention import token_positions

        found = self.step()
        if found is None:
            return None
        metadata, kv_cache, slot_mapping = found
        key = id(metadata)
        if shared is not None and key != shared.step:
            return None
        if key not in steps:
            n = metadata.num_actual_tokens
            seq, pos = token_positions(metadata.query_start_loc, metadata.seq_lens, n)
            if shared is not None:
                seq, pos = seq[shared.keep], pos[shared.keep]
            steps[key] = (seq, pos, metadata.block_table.to(torch.long).contiguous())
        seq, pos, table = steps[key]
        return PagedWrite(kv_cache, slot_mapping, seq, pos, table, None if shared is None else shared.rows)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        n, ops = x.shape[1], ctx.ops
        q = self.q_proj(x, ctx).view(1, n, self.num_heads, self.head_dim)
        k = self.k_proj(x, ctx).view(1, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, ctx)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ctx), self.k_norm(k, ctx)
        q, k = ops.rope(q, ctx.cos, ctx.sin), ops.rope(k, ctx.cos, ctx.sin)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
        return self.o_proj(out.view(1, n, -1), ctx)


@dataclass(frozen=True)
class SharedPrefixes:
    """The rows a step computes when requests share a prefix: ``keep [U]``, the first token of each
    distinct prefix, and ``rows [N]``, each token's row among them; ``step`` names vLLM's metadata."""

    keep: Tensor
    rows: Tensor
    step: int


@dataclass
class PagedContext(ForwardContext):
    """A forward inside vLLM: each layer's cache write is the paged one vLLM set up for this step; with
    ``shared``, for the rows computed once for prefixes several requests share."""

    layers: Sequence[PagedAttention] = ()
    steps: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)
    shared: SharedPrefixes | None = None

    def cache_write(self, layer: int) -> PagedWrite | None:
        return self.layers[layer].paged_write(self.steps, self.shared) if self.layers else None

    def sharing(self, input_ids: Tensor) -> PagedContext | None:
        """This forward's context on the rows of :func:`shared_prefixes` (positions and RoPE tables cut to
        them, ``shared`` set), or
        ``None`` where no prefix is shared or the blocks may not run in one call (an MoE model records
        every position's routing; a step the shared attention does not serve)."""
        from rlfw.rollout.vllm.attention import request_spans

        if not self.layers or self.routing is not None or self.ops.name != "invariant":
            return None
        found = self.layers[0].step()
        if found is None:
            return None
        metadata, _, slot_mapping = found
        n = input_ids.shape[0]
        if metadata.num_actual_tokens != n or slot_mapping.shape[0] != n:
            return None  # a padded batch
        starts, q_len, first = request_spans(metadata.query_start_loc, metadata.seq_lens)
        if int(((first == 0) & (q_len > 1)).sum()) < 2:
            return None  # decode steps, and steps with fewer than two new prompts
        source = shared_prefixes(input_ids.tolist(), starts.tolist(), first.tolist())
        if source is None:
            return None
        kept, rows = computed_rows(source)
        keep = kept.nonzero()[:, 0]
        plan = SharedPrefixes(keep, rows, id(metadata))
        pos, cos, sin = self.positions[:, keep], self.cos[:, keep], self.sin[:, keep]
        return replace(self, positions=pos, cos=cos, sin=sin, steps={}, shared=plan)


class RlfwForCausalLM(Transformer):
    """The shared :class:`~rlfw.model.Transformer` with vLLM's paged attention in each layer.

    Parameters keep the HF checkpoint names (``model.layers.N...``), so checkpoints and the trainer's
    published state dicts load with no renaming. vLLM hands the forward a flat batch of ``N`` tokens
    from many sequences; the shared blocks see it as one ``[1, N]`` row and vLLM's attention layer
    (``model.layers.N.self_attn.attn``) keeps the sequences apart.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        hf = vllm_config.model_config.hf_config
        kernels = getattr(hf, KERNELS_KEY, "invariant")
        super().__init__(args_from_hf_config(_hf_dict(hf)), kernels=kernels)
        for i, block in enumerate(self.model.layers):
            assert isinstance(block, Block)
            block.self_attn = PagedAttention(self.args, i, vllm_config, kernels)
        self._repack = True  # weights (re)loaded since the last forward

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Final-norm hidden states ``[N, hidden]`` for vLLM's flat batch of ``N`` tokens."""
        if self._repack:  # vLLM writes weights through .data, so pack them afresh (see load_weights)
            self.prepare_for_inference(refresh=True)
            self._repack = False
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_input_ids(input_ids)
        pos = positions[None].to(torch.long)
        cos, sin = rope_tables(pos, self.args.head_dim, self.args.rope_theta)
        trace = RouterTrace() if self.args.is_moe else None
        layers = [block.self_attn for block in self.model.layers]
        ctx = PagedContext(self.ops, pos, cos, sin, routing=trace, layers=layers)  # type: ignore[arg-type]
        x = inputs_embeds[None]
        narrow = ctx.sharing(input_ids) if input_ids is not None else None
        rows: Tensor | None = None  # while blocks run on shared prefixes' rows: each token's row
        if narrow is not None and narrow.shared is not None:  # exact: no row's bits depend on its batch
            x, rows = x[:, narrow.shared.keep], narrow.shared.rows
        for block in self.model.layers:
            if rows is not None:
                assert isinstance(block, Block)
                assert narrow is not None
                out = block.in_one_call(x, narrow)
                if out is not None:
                    x = out
                    continue
                x, rows = x[:, rows], None  # the rest op by op, every token on its own row
            x = block(x, ctx)
        if trace is not None:
            publish_routing(trace.stacked()[0])
        out = self.model.norm(x, ctx)[0]
        out = out if rows is None else out[rows]
        from rlfw.rollout.vllm import tap

        if tap.SCORING[0]:  # the engine rescores: the tap scores each request's rows with this head
            tap.SCORING_HEAD[:] = [self.full_logits]
            tap.STEP_HIDDEN[:] = per_request(out)
        return out

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """The LM head through ``ops.linear``, as in the trainer's scoring forward. While the engine
        generates with a reduced-precision sampler (:class:`~rlfw.rollout.vllm.tap.SamplerHead`), vLLM
        gets the sampler head's logits (the built-in engine's :func:`~rlfw.rollout.sampling.sampler_head`
        on the same hidden states) and the decode tap gets these full-precision ones."""
        from rlfw.rollout.sampling import sampler_head
        from rlfw.rollout.vllm import tap

        full = self.full_logits(hidden_states)
        tap.STEP_DECODE_LOGITS.clear()
        precision = tap.SAMPLER_PRECISION[0]
        if precision == "fp32":
            return full
        tap.STEP_DECODE_LOGITS.append(full)
        return sampler_head(hidden_states, self.output_weight, precision, self.ops.linear)

    def full_logits(self, hidden_states: Tensor) -> Tensor:
        """The full-precision LM head through ``ops.linear``, as in the trainer's scoring forward."""
        return self.ops.linear(hidden_states, self.output_weight)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load checkpoint tensors into the parameters of the same name; unknown names are refused.

        Goes through each parameter's ``weight_loader`` (vLLM's protocol): an in-place reload swaps the
        parameters for placeholders and counts what the loaders write before copying it into place.
        Those writes bypass version counters, so the next forward packs every weight again for the CPU
        kernels (:meth:`~rlfw.model.Transformer.prepare_for_inference` with ``refresh``).
        """
        self._repack = True
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(
                    f"checkpoint tensor {name!r} has no parameter in {ARCHITECTURE}; "
                    "is the checkpoint of a supported architecture (Qwen3, Llama, Qwen3-MoE)?"
                )
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def per_request(rows: Tensor) -> list[Tensor]:
    """``rows [N, ...]`` of vLLM's flat batch of ``N`` tokens split per request: vLLM lays a step's tokens
    out request by request in its batch order (``query_start_loc``), the order in which the decode tap
    sees the requests' logits rows. Empty outside a step (vLLM's warm-up and profiling passes)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return []
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    if metadata is None:
        return []
    starts = metadata.query_start_loc.tolist()
    return [rows[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def publish_routing(ids: Tensor) -> None:
    """Hand this step's expert ids (``[N, n_moe_layers, k]`` for vLLM's flat batch of ``N`` tokens) to
    the decode tap, per request (:func:`per_request`)."""
    from rlfw.rollout.vllm import tap

    tap.STEP_ROUTING[:] = per_request(ids.cpu())
