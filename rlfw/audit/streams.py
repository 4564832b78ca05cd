"""The five log-prob cases on the same prompts and continuations, computed the way each case runs.

``trainer_grad`` and ``trainer_score`` run the full sequences without a cache (with and without
autograd); ``engine_prefill`` runs them through the slotted KV cache in one prefill; ``engine_decode``
prefills the prompts and then feeds the continuation one token per step; ``sampler`` reads the decode
steps' hidden states through the sampler's head at its precision. Every case applies the same
declared sampling transforms before taking log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.model import Transformer
from rlfw.rollout.sampling import Transforms, draw, process_logits, sampler_head, step_seed


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


def decode(
    model: Transformer, seqs: list[Tensor], prompt_lens: list[int], t: Transforms, precision: str
) -> tuple[list[Tensor], list[Tensor]]:
    """(decode, sampler) log-probs of each response token, one decode step per token."""
    n = len(seqs)
    cache = model.new_cache(n, max(s.shape[0] for s in seqs))
    prompts, pmask = pad_right([s[:p] for s, p in zip(seqs, prompt_lens, strict=True)])
    dec: list[list[Tensor]] = [[] for _ in range(n)]
    smp: list[list[Tensor]] = [[] for _ in range(n)]
    with torch.no_grad():
        h = model.hidden_states(prompts, pmask, cache=cache)
        last = h[torch.arange(n), torch.tensor(prompt_lens) - 1][:, None]
        for step in range(max(s.shape[0] - p for s, p in zip(seqs, prompt_lens, strict=True))):
            _score_step(model, last, seqs, prompt_lens, step, t, precision, dec, smp)
            tokens, mask = _next_inputs(seqs, prompt_lens, step)
            if not mask.any():
                break
            last = model.hidden_states(tokens, mask, cache=cache)
    return [torch.cat(x) for x in dec], [torch.cat(x) for x in smp]


def _score_step(
    model: Transformer,
    h: Tensor,
    seqs: list[Tensor],
    prompt_lens: list[int],
    step: int,
    t: Transforms,
    precision: str,
    dec: list[list[Tensor]],
    smp: list[list[Tensor]],
) -> None:
    logits = model.ops.linear(h, model.output_weight)[:, 0]
    s_logits = logits if precision == "fp32" else sampler_head(h[:, 0], model.output_weight, precision)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        if p + step < s.shape[0]:
            target = s[p + step : p + step + 1]
            dec[i].append(model.ops.token_logp(process_logits(logits[i : i + 1], t), target))
            smp[i].append(model.ops.token_logp(process_logits(s_logits[i : i + 1], t), target))


def _next_inputs(seqs: list[Tensor], prompt_lens: list[int], step: int) -> tuple[Tensor, Tensor]:
    """The response token each row feeds next (masked out once its response is consumed)."""
    tokens = torch.zeros(len(seqs), 1, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        if p + step + 1 < s.shape[0]:
            tokens[i, 0], mask[i, 0] = s[p + step], 1
    return tokens, mask


def all_cases(
    model: Transformer, seqs: list[Tensor], prompt_lens: list[int], t: Transforms, precision: str
) -> dict[str, list[Tensor]]:
    decode_lp, sampler_lp = decode(model, seqs, prompt_lens, t, precision)
    return {
        "trainer_grad": full_sequence(model, seqs, prompt_lens, t, grad=True, cache=False),
        "trainer_score": full_sequence(model, seqs, prompt_lens, t, grad=False, cache=False),
        "engine_prefill": full_sequence(model, seqs, prompt_lens, t, grad=False, cache=True),
        "engine_decode": decode_lp,
        "sampler": sampler_lp,
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
