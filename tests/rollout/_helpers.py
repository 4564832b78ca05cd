"""Shared builders for the rollout tests: tiny models, prompts, and the trainer's scoring forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from rlfw.kernels.invariant import InvariantOps
from rlfw.model import Transformer, build_preset
from rlfw.model.distribution import Transforms, process_logits
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest, Sample

PRESETS = ["tiny_dense", "tiny_moe"]
VOCAB = 96


def bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(torch.int32)


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@contextmanager
def counted(kind: type | None = None) -> Iterator[list[int]]:
    """Count the blocks computed in one call (``[calls, served, served on shared rows]``) while inside;
    with ``kind``, a call counts as served only if its cache is of that kind (the slotted ``CacheWrite``
    or vLLM's paged ``PagedWrite``). Shared rows: a ``PagedWrite`` whose tokens of a prefix several
    requests share were computed once (its ``rows``)."""
    calls = [0, 0, 0]
    original = InvariantOps.cached_block

    def spy(self, x, weights, norms, shape, cos, sin, cache):  # type: ignore[no-untyped-def]
        out = original(self, x, weights, norms, shape, cos, sin, cache)
        served = out is not None and (kind is None or isinstance(cache, kind))
        calls[0] += 1
        calls[1] += served
        calls[2] += served and getattr(cache, "rows", None) is not None
        return out

    InvariantOps.cached_block = spy  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        InvariantOps.cached_block = original  # type: ignore[method-assign]


def model(preset: str = "tiny_dense", kernels: str = "invariant", seed: int = 7) -> Transformer:
    return build_preset(preset, seed=seed, kernels=kernels)


def prompts(lengths: list[int], seed: int = 0) -> list[Tensor]:
    """Random prompts avoiding the low ids, which tests use as stop tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, VOCAB, (n,), generator=g) for n in lengths]


def request(
    lengths: list[int], n: int = 1, max_new_tokens: int = 8, first_id: int = 100
) -> GenerationRequest:
    ps = prompts(lengths)
    return GenerationRequest(
        list(range(first_id, first_id + len(ps))), ps, n=n, max_new_tokens=max_new_tokens
    )


def engine(m: Transformer, **kwargs: object) -> NativeEngine:
    """An engine with test defaults (no stop tokens, 4 slots, 64 positions); kwargs override them."""
    args: dict[str, object] = dict(max_slots=4, max_model_len=64, stop_ids=(), seed=0, topk_logprobs=8)
    return NativeEngine(m, **(args | kwargs))  # type: ignore[arg-type]


def trainer_logp(m: Transformer, samples: list[Sample], transforms: Transforms) -> list[Tensor]:
    """The trainer's scoring forward: one padded no-cache batch over every full sequence, transforms
    replayed, ``ops.token_logp`` gathered at the response tokens."""
    seqs = [s.tokens for s in samples]
    width = max(len(t) for t in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(seqs):
        ids[i, : len(t)], mask[i, : len(t)] = t, 1
    with torch.no_grad():
        logits = m(ids, mask)
    out = []
    for i, s in enumerate(samples):
        p, n = s.prompt_P.shape[0], s.response_T.shape[0]
        processed = process_logits(logits[i, p - 1 : p - 1 + n], transforms)
        out.append(m.ops.token_logp(processed, s.response_T))
    return out


def score_tokens(m: Transformer, samples: list[Sample], whole_prompt: bool = False) -> int:
    """The tokens the prefill stream feeds for ``samples``: the last prompt token (the whole prompt with
    ``whole_prompt``) and the response, less the response's last token, which only an MoE model feeds
    (for its routing record)."""
    last = 0 if m.args.is_moe else 1
    return sum((s.prompt_P.numel() if whole_prompt else 1) + s.response_T.numel() - last for s in samples)
