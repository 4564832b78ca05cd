"""The op interface and the registry behind the ``kernels`` config switch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import Tensor

from rlfw.kernels.block import BlockShape, CacheWrite, PagedWrite


class Ops(Protocol):
    """Every op the shared model runs on the log-probability path.

    Implementations must give the same answer (to rounding) as :class:`~rlfw.kernels.default.DefaultOps`;
    an implementation that promises batch invariance must also give the same *bits* for a row whatever
    the rows around it.
    """

    name: str

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x [..., K] @ weight[N, K].T -> [..., N]`` in ``x.dtype``."""
        ...

    def prepare_weights(self, weights: Iterable[Tensor], refresh: bool = False) -> None:
        """A hint that ``weights`` will serve many :meth:`linear` calls unchanged (an engine's model
        between weight updates): an implementation may keep them in a faster layout. Never changes a
        result. ``refresh=True``: the weights were written in a way no version counter sees (through
        ``.data``), so rebuild whatever was kept for them."""
        ...

    def held_weights(self, weights: Iterable[Tensor]) -> AbstractContextManager[None]:
        """A context within which ``weights`` do not change (a train step's micro-batches, before the
        optimizer step): an implementation may keep faster layouts of them for the forward and backward
        passes while it lasts, and drops them on exit. Never changes a result."""
        ...

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dim, fp32 accumulation, result cast back to ``x.dtype``."""
        ...

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate-half RoPE. ``x [B, T, H, D]``; ``cos``/``sin`` fp32 ``[B, T, D]``; math in fp32."""
        ...

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up`` elementwise."""
        ...

    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        q_pos: Tensor,
        scale: float,
        rows: Tensor | None = None,
    ) -> Tensor:
        """Causal attention over a slotted cache.

        ``q [B, T, Hq, D]``; ``k_cache``/``v_cache [B, S, Hkv, D]`` (Hq a multiple of Hkv, GQA);
        ``q_pos [B, T]`` int64, the position of each query. Key slot ``s`` is visible to a query iff
        ``s <= q_pos``. Queries with ``q_pos < 0`` (padding) return zeros. Output ``[B, T, Hq, D]``.
        With ``rows [B]`` (int64) the caches are ``[R, S, Hkv, D]``, every row of an engine's cache, and
        batch entry ``b`` reads row ``rows[b]``: the same result as passing ``k_cache[rows]``.
        """
        ...

    def log_softmax(self, logits: Tensor) -> Tensor:
        """Row log-softmax over the last dim, computed and returned in fp32."""
        ...

    def token_logp(self, logits: Tensor, ids: Tensor) -> Tensor:
        """fp32 log-prob of ``ids [...]`` under ``logits [..., V]``."""
        ...

    def entropy(self, logits: Tensor) -> Tensor:
        """fp32 entropy of each row of ``logits [..., V]``."""
        ...

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
        """A dense block's forward over an engine's KV cache in one call, with the bits of the per-op path
        (:mod:`rlfw.kernels.block`), or ``None`` where this op set has no such call for these operands
        (the caller then runs the ops one by one)."""
        ...

    def router_topk(self, logits: Tensor, k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
        """Softmax router over ``logits [N, E]`` in fp32; top-k with ties broken to the lowest index.

        Returns ``(weights [N, k] fp32, ids [N, k] int64)``, ids in descending weight order.
        """
        ...

    def router_weights(self, logits: Tensor, ids: Tensor, norm_topk_prob: bool) -> Tensor:
        """Gate weights of given experts ``ids [N, k]`` (R3 replay): fp32 softmax gathered at ``ids``."""
        ...

    def describe(self) -> dict[str, Any]:
        """Every bit-relevant choice of this op set (JSON-serialisable), for the execution contract."""
        ...


KERNEL_CHOICES = ("default", "invariant")


def get_ops(name: str) -> Ops:
    """The op set for ``kernels=name``."""
    if name == "default":
        from rlfw.kernels.default import DefaultOps

        return DefaultOps()
    if name == "invariant":
        from rlfw.kernels.invariant import InvariantOps

        return InvariantOps()
    raise ValueError(f"kernels={name!r} is not a kernel set; allowed values: {', '.join(KERNEL_CHOICES)}")
