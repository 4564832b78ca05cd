"""``kernels=invariant``: ops whose result for a row depends only on that row.

Two backends compute the same reduction orders at the tile level:

* ``torch``: the exact torch path (default on CPU), see the module of each op;
* ``vllm``: on CUDA, vLLM's batch-invariant kernels (persistent matmul, RMSNorm, log-softmax) with rlfw's
  Triton attention (default on CUDA when vLLM is installed; see :mod:`rlfw.kernels.vllm_ops`), so the
  trainer runs the kernels the vLLM engine runs;
* ``triton``: rlfw's Triton kernels (default on CUDA without vLLM; on CPU only under
  ``TRITON_INTERPRET=1``, for tests).
  RoPE, SiLU-mul and the router are elementwise or tiny and reuse the torch path on every backend.

Within one backend every op is batch-invariant, so trainer grad forward, trainer scoring, engine
prefill and engine decode agree bit for bit. The two backends agree to rounding, not bitwise (the
order *inside* a tile belongs to the library or the compiler).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from rlfw.kernels import attention as attn
from rlfw.kernels import block, cpu_native, elementwise, grads, matmul, norm, router, softmax
from rlfw.kernels.autograd import InvariantLinear, needs_grad, recompute_backward
from rlfw.kernels.block import BlockShape, CacheWrite, PagedWrite

BACKENDS = ("auto", "torch", "triton", "vllm")


def _resolve_backend(backend: str) -> str:
    from rlfw.kernels import vllm_ops

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a backend; allowed values: {', '.join(BACKENDS)}")
    if backend == "auto":
        if not torch.cuda.is_available():
            return "torch"
        return "vllm" if vllm_ops.available() else "triton"
    if backend == "vllm" and not vllm_ops.available():
        raise ValueError("backend='vllm' needs a CUDA device and vLLM's batch-invariant kernels installed")
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' without CUDA needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return backend


class InvariantOps:
    """Batch-invariant implementation of :class:`~rlfw.kernels.registry.Ops`."""

    name = "invariant"

    def __init__(self, backend: str = "auto") -> None:
        self.backend = _resolve_backend(backend)
        if self.backend == "vllm":
            from rlfw.kernels import vllm_ops

            self._linear = vllm_ops.linear
            self._rms_norm = vllm_ops.rms_norm
            self._attention = vllm_ops.attention
            self._attention_grads = vllm_ops.attention_backward
            self._log_softmax = vllm_ops.log_softmax
            self._token_logp = vllm_ops.token_logp
        elif self.backend == "triton":
            from rlfw.kernels import triton_ops

            self._linear = triton_ops.linear
            self._rms_norm = triton_ops.rms_norm
            self._attention = triton_ops.attention
            self._attention_grads = triton_ops.attention_backward
            self._log_softmax = triton_ops.log_softmax
            self._token_logp = triton_ops.token_logp
        else:
            self._linear = matmul.linear
            self._rms_norm = norm.rms_norm
            self._attention = attn.attention
            self._attention_grads = grads.attention_grads
            self._log_softmax = softmax.log_softmax
            self._token_logp = softmax.token_logp

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        if not needs_grad(x, weight):
            return self._linear(x, weight)  # the forward of InvariantLinear, without its bookkeeping
        out: Tensor = InvariantLinear.apply(x, weight, self._linear)
        return out

    def prepare_weights(self, weights: Iterable[Tensor], refresh: bool = False) -> None:
        """On the CPU kernels: pack the weights once (:func:`rlfw.kernels.matmul.pack_frozen`)."""
        if self.backend == "torch":
            matmul.pack_frozen(weights, refresh)

    def held_weights(self, weights: Iterable[Tensor]) -> AbstractContextManager[None]:
        """On the CPU kernels: each weight packed once within (:func:`rlfw.kernels.matmul.held`)."""
        return matmul.held(weights) if self.backend == "torch" else nullcontext()

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._rms_norm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return elementwise.rope(x, cos, sin)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return elementwise.silu_mul(gate, up)

    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        q_pos: Tensor,
        scale: float,
        rows: Tensor | None = None,
    ) -> Tensor:
        if rows is not None and self.backend == "torch":  # the engine's cache, read in place
            return attn.attention(q, k_cache, v_cache, q_pos, scale, rows)
        k_cache, v_cache = attn.take_rows(k_cache, v_cache, rows, q_pos)
        training = needs_grad(q, k_cache, v_cache)
        if training and self.backend == "torch" and cpu_native.serves(q, k_cache, v_cache):
            out: Tensor = attn.CompiledBackward.apply(q, k_cache, v_cache, q_pos, scale)
            return out
        if self.backend == "torch":  # bf16 on CPU: the reference recomputed under autograd
            return recompute_backward(
                self._attention, attn.attention_reference, q, k_cache, v_cache, q_pos, scale
            )
        return grads.attention(self._attention, q, k_cache, v_cache, q_pos, scale, self._attention_grads)

    def log_softmax(self, logits: Tensor) -> Tensor:
        return self._log_softmax(logits)

    def token_logp(self, logits: Tensor, ids: Tensor) -> Tensor:
        return self._token_logp(logits, ids)

    def entropy(self, logits: Tensor) -> Tensor:
        return softmax.entropy_from_logp(self.log_softmax(logits))

    def cached_block(
        self,
        x: Tensor,
        weights: Sequence[Tensor],
        norms: Sequence[Tensor],
        shape: BlockShape,
        cos: Tensor,
        sin: Tensor,
        cache: CacheWrite | PagedWrite,
    ) -> Tensor | None:
        """On the CPU kernels: the block's kernel calls made in one compiled call (same bits)."""
        if self.backend != "torch":
            return None
        return block.cached_block(x, weights, norms, shape, cos, sin, cache)

    def router_topk(self, logits: Tensor, k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
        return router.router_topk(logits, k, norm_topk_prob)

    def router_weights(self, logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
        return router.router_weights(logits, ids, norm_topk_prob)

    def describe(self) -> dict[str, Any]:
        """Every bit-relevant choice, JSON-serialisable (input to the execution contract hash)."""
        from rlfw.kernels.describe import describe_invariant

        return describe_invariant(self.backend)
