"""The shared attention inside vLLM on CPU, and the shared log-softmax for vLLM's sampler.

vLLM keeps its scheduler, its paged KV cache, its block tables, prefix cache and chunked prefill. What
this module replaces, under ``kernels=invariant`` on CPU, is the arithmetic:

* :class:`SharedPagedAttention` is the attention backend implementation of every layer of the registered
  model: it writes K/V into vLLM's cache tensor (:func:`~rlfw.kernels.attention.paged_store`) and
  attends through vLLM's block tables with :func:`~rlfw.kernels.attention.paged_attention`, which gives
  a query the bits of the invariant attention over the engine's slotted cache and of the trainer's
  forward. vLLM's metadata (query start offsets, sequence lengths, block table, slot mapping) is used as
  vLLM built it, so prefix-cached blocks and chunked prompts are read where vLLM put them.
* :func:`shared_log_softmax` routes ``aten::_log_softmax`` on CPU to the invariant log-softmax while vLLM
  runs a request: vLLM's sampler (the sampler stream, ``processed_logprobs``) then reduces each row in
  the order the trainer and the decode stream do. This is how vLLM's own batch-invariant mode swaps its
  log-softmax on GPUs, scoped here to vLLM's calls. With transforms given it applies rlfw's sampling
  transforms first, for vLLM's prompt log-probs, which are of the raw logits. (The engine's rescoring
  pass no longer asks for them under shared numerics: the decode tap scores the prefill forward's hidden
  states, :class:`~rlfw.rollout.vllm.tap.Scoring`; they remain the tested equivalent.)

On GPUs vLLM's attention stays (its batch-invariant mode is the shared kernel there), so the contract
claims these pairs bitwise for the CPU engine only.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from rlfw.kernels.attention import paged_attention, paged_store
from rlfw.kernels.softmax import log_softmax
from rlfw.model.distribution import Transforms, process_logits, row_blocks


class SharedPagedAttention(CPUAttentionBackendImpl):
    """vLLM's CPU attention implementation with rlfw's invariant arithmetic over vLLM's own cache."""

    @classmethod
    def replacing(cls, impl: CPUAttentionBackendImpl) -> SharedPagedAttention:
        """This implementation with the settings vLLM gave ``impl`` (heads, scale, cache dtype)."""
        unsupported = {
            "sliding window": impl.sliding_window != -1,
            "ALiBi": impl.alibi_slopes is not None,
            "logit soft-capping": bool(impl.logits_soft_cap),
            "attention sinks": impl.sinks is not None,
            "a quantized KV cache": impl.is_fp8_kv_cache,
            "non-decoder attention": impl.attn_type != "decoder",
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise ValueError(
                f"the shared attention inside vLLM does not support {', '.join(found)}; "
                "use kernels=default with engine=vllm for this model"
            )
        shared = cls.__new__(cls)
        shared.__dict__.update(impl.__dict__)
        return shared

    def do_kv_cache_update(
        self, layer: torch.nn.Module, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor
    ) -> None:
        n = slot_mapping.shape[0]
        paged_store(kv_cache, key[:n], value[:n], slot_mapping)

    def forward(  # type: ignore[override]
        self,
        layer: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: Any,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the shared attention")
        if attn_metadata is None:  # vLLM's warm-up pass
            return output
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise NotImplementedError("the shared attention inside vLLM is causal only")
        n = attn_metadata.num_actual_tokens
        seq, pos = token_positions(attn_metadata.query_start_loc, attn_metadata.seq_lens, n)
        out = paged_attention(query[:n], kv_cache, seq, pos, attn_metadata.block_table, self.scale)
        output[:n].copy_(out.view(output[:n].shape))
        return output


def request_spans(query_start_loc: Tensor, seq_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each request's first token in the step's flat batch ``starts [R + 1]`` (int64), its count of query
    tokens ``q_len [R]`` and the position of its first query token ``first [R]``.

    vLLM lays a step's tokens out request by request (``query_start_loc [R + 1]``); request ``r``'s
    ``seq_lens[r]`` counts its tokens up to and including this step's, so its first query token sits at
    position ``seq_lens[r] - q_len[r]``.
    """
    starts = query_start_loc.to(torch.long)
    q_len = starts[1:] - starts[:-1]
    return starts, q_len, seq_lens[: q_len.shape[0]].to(torch.long) - q_len


def token_positions(query_start_loc: Tensor, seq_lens: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Each of the batch's ``n`` query tokens' request index and position (:func:`request_spans`: the
    ``j``-th query token of request ``r`` sits at ``first[r] + j``)."""
    starts, q_len, first = request_spans(query_start_loc, seq_lens)
    seq = torch.repeat_interleave(torch.arange(q_len.shape[0]), q_len)[:n]
    pos = torch.arange(n) - starts[:-1][seq] + first[seq]
    return seq, pos


_IN_PLACE = threading.Lock()  # held while the override is registered


def _log_softmax_cpu(transforms: Transforms | None) -> Any:
    """``aten::_log_softmax`` on CPU as the invariant log-softmax of the ``transforms``-processed row
    (fp32 inside; ``x``'s dtype out unless ``half_to_float``)."""

    def impl(x: Tensor, dim: int, half_to_float: bool) -> Tensor:
        rows = x.movedim(dim, -1)
        flat = rows.reshape(-1, rows.shape[-1])
        out = torch.empty(flat.shape, dtype=torch.float32)
        # a few rows of a real vocabulary at a time, in cache, each block written where it belongs (a
        # row's bits do not depend on its block)
        for r in row_blocks(*flat.shape):
            log_softmax(flat[r] if transforms is None else process_logits(flat[r], transforms), out=out[r])
        out = out.reshape(rows.shape)
        return out.to(torch.float32 if half_to_float else x.dtype).movedim(-1, dim).contiguous()

    return impl


def _topk_cpu(
    x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> tuple[Tensor, Tensor]:
    """``aten::topk`` on CPU as the built-in engine's top-k: the ``k`` largest, largest first, ties to
    the lower id (torch leaves the order of tied entries open). Rows of fp32 logits take
    :func:`~rlfw.rollout.streams.stable_topk`'s compiled pass; any other call the first ``k`` of a stable
    sort, which holds the same values torch's top-k would."""
    from rlfw.rollout.streams import stable_topk, takes_compiled_topk

    if k == 0:  # vLLM's prompt log-probs of the tokens alone ask for none
        none = x.narrow(dim, 0, 0)
        return torch.empty_like(none), torch.empty(none.shape, dtype=torch.long)
    if largest and dim in (-1, 1) and takes_compiled_topk(x, k):
        ids, top = stable_topk(x, k)
        return top, ids
    values, ids = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), ids.narrow(dim, 0, k)


@contextlib.contextmanager
def shared_log_softmax(enabled: bool = True, transforms: Transforms | None = None) -> Iterator[None]:
    """While inside, every CPU ``log_softmax`` in this process is the invariant one, of the rows after
    ``transforms`` when given, and every CPU ``topk`` the built-in engine's (:func:`_topk_cpu`: vLLM's
    top-k log-probs then break ties as the native engine's do, and the compiled kernel skips torch's
    per-row heap over a real vocabulary). A no-op when not ``enabled``. Not re-entrant: vLLM runs one
    call at a time in this process."""
    if not enabled:
        yield
        return
    if not _IN_PLACE.acquire(blocking=False):
        raise RuntimeError("shared_log_softmax is already in place in this process")
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
            lib.impl("_log_softmax", _log_softmax_cpu(transforms), "CPU")
            lib.impl("topk", _topk_cpu, "CPU")
        yield
    finally:
        lib._destroy()
        _IN_PLACE.release()
