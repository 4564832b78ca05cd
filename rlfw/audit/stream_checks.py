"""The five log-prob cases on the same prompts and continuations, computed the way each case runs.

``trainer_grad`` and ``trainer_score`` run the full sequences without a cache (with and without
autograd), as the trainer does. ``engine_prefill``, ``engine_decode`` and ``sampler`` come from the
engine itself, teacher-forced on the continuations: its decode loop, its sampler head at the sampler's
precision and its final prefill. Every case applies the same declared sampling transforms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.model import Transformer
from rlfw.model.distribution import Transforms, process_logits
from rlfw.rollout.native import NativeEngine
from rlfw.rollout.sampling import draw, step_seed
from rlfw.types import GenerationRequest, Sample


def pad_right(seqs: list[Tensor]) -> tuple[Tensor, Tensor]:
    width = max(s.shape[0] for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : s.shape[0]], mask[i, : s.shape[0]] = s, 1
    return ids, mask


def _response_logp(
    model: Transformer, logits: Tensor, seqs: list[Tensor], prompt_lens: list[int], t: Transforms
) -> list[Tensor]:
    """Log-probs of each response token, read from full-sequence logits (position p predicts p+1)."""
    out = []
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        rows = logits[i, p - 1 : s.shape[0] - 1]
        out.append(model.ops.token_logp(process_logits(rows, t), s[p:]))
    return out


def full_sequence(
    model: Transformer, seqs: list[Tensor], prompt_lens: list[int], t: Transforms, *, grad: bool, cache: bool
) -> list[Tensor]:
    ids, mask = pad_right(seqs)
    if grad:
        model.train()
        logits = model(ids, mask)
        model.eval()
        return [x.detach() for x in _response_logp(model, logits, seqs, prompt_lens, t)]
    with torch.no_grad():
        kv = model.new_cache(len(seqs), ids.shape[1]) if cache else None
        logits = model(ids, mask, cache=kv)
        return _response_logp(model, logits, seqs, prompt_lens, t)


def engine_cases(engine: NativeEngine, seqs: list[Tensor], prompt_lens: list[int]) -> dict[str, list[Tensor]]:
    """Prefill, decode and sampler streams from the engine, teacher-forced on the given continuations."""
    prompts = [s[:p] for s, p in zip(seqs, prompt_lens, strict=True)]
    forced = [s[p:] for s, p in zip(seqs, prompt_lens, strict=True)]
    samples = engine.generate(
        GenerationRequest(list(range(len(seqs))), prompts, n=1), forced_responses=forced
    )
    return sample_streams(samples)


def sample_streams(samples: list[Sample]) -> dict[str, list[Tensor]]:
    """The engine's three cases, read from its samples."""
    return {
        "engine_prefill": [x.prefill_logp for x in samples],
        "engine_decode": [x.decode_logp for x in samples],
        "sampler": [x.sampler_logp for x in samples],
    }


def trainer_cases(
    model: Transformer, seqs: list[Tensor], prompt_lens: list[int], t: Transforms
) -> dict[str, list[Tensor]]:
    """The trainer's grad and scoring forwards over the full sequences."""
    return {
        "trainer_grad": full_sequence(model, seqs, prompt_lens, t, grad=True, cache=False),
        "trainer_score": full_sequence(model, seqs, prompt_lens, t, grad=False, cache=False),
    }


def sample_continuations(
    model: Transformer, prompts: list[Tensor], lengths: list[int], t: Transforms, seed: int
) -> list[Tensor]:
    """Prompt + a sampled continuation per prompt, drawn from the processed distribution.

    Drawn tokens always lie in the kept set of the transforms, so every case's log-prob is finite.
    """
    seqs = [p.clone() for p in prompts]
    with torch.no_grad():
        for step in range(max(lengths)):
            live = [i for i, n in enumerate(lengths) if step < n]
            ids, mask = pad_right([seqs[i] for i in live])
            logits = model(ids, mask)
            last = logits[torch.arange(len(live)), mask.sum(1) - 1]
            seeds = torch.tensor([step_seed(seed, i, step) for i in live])
            for i, tok in zip(live, draw(process_logits(last, t), seeds).tolist(), strict=True):
                seqs[i] = torch.cat([seqs[i], torch.tensor([tok])])
    return seqs
