"""Sampling transforms act on the distribution tokens are drawn from, and every stream uses it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from rlfw.model.distribution import Transforms, process_logits
from rlfw.types import Sample
from tests.rollout._helpers import VOCAB, engine, model, request

CASES = [
    Transforms(temperature=0.5),
    Transforms(top_k=5),
    Transforms(top_p=0.3),
    Transforms(min_p=0.5),
    Transforms(temperature=1.5, top_k=20, top_p=0.8, min_p=0.1),
]


@pytest.mark.parametrize("transforms", CASES, ids=str)
def test_tokens_lie_in_the_kept_set_and_streams_are_normalised_over_it(transforms: Transforms) -> None:
    m = model("tiny_dense")
    samples = engine(m, transforms=transforms, topk_logprobs=VOCAB).generate(
        request([3, 6], n=2, max_new_tokens=8)
    )
    narrowing = not (transforms.top_k == 0 and transforms.top_p == 1.0 and transforms.min_p == 0.0)
    for s in samples:
        with torch.no_grad():
            logits = m(s.tokens[None])[0, s.prompt_P.shape[0] - 1 : -1]
        kept = torch.isfinite(process_logits(logits, transforms))  # [T, V]
        assert kept[torch.arange(len(s.response_T)), s.response_T].all(), "a token outside the kept set"
        finite = torch.isfinite(s.topk_logp)
        assert torch.equal(finite.sum(-1), kept.sum(-1)), "top-k carries -inf exactly where tokens were cut"
        mass = torch.where(finite, s.topk_logp.exp(), torch.zeros(())).sum(-1)
        torch.testing.assert_close(mass, torch.ones_like(mass), rtol=0, atol=1e-5)
        assert (s.sampler_logp > -torch.inf).all()
        if narrowing:
            assert (kept.sum(-1) < VOCAB).all(), "the case must actually cut tokens"
    if transforms.top_k:
        assert all((torch.isfinite(s.topk_logp).sum(-1) <= transforms.top_k).all() for s in samples)


def test_temperature_changes_the_recorded_distribution() -> None:
    """The streams are log-probs of the processed distribution, not of the raw logits."""
    m = model("tiny_dense")
    forced = [torch.tensor([40, 41, 42])]
    (hot,) = engine(m, transforms=Transforms(temperature=2.0)).generate(request([4]), forced_responses=forced)
    (raw,) = engine(m).generate(request([4]), forced_responses=forced)
    with torch.no_grad():
        logits = m(hot.tokens[None])[0, 3:-1]
    expected = torch.log_softmax(logits / 2.0, dim=-1)[torch.arange(3), hot.response_T]
    torch.testing.assert_close(hot.sampler_logp, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(hot.sampler_logp, raw.sampler_logp)


def _greedy_tokens(m: Any, s: Sample, transforms: Transforms) -> torch.Tensor:
    with torch.no_grad():
        logits = m(s.tokens[None])[0, s.prompt_P.shape[0] - 1 : -1]
    return process_logits(logits, transforms).argmax(-1)


def test_a_greedy_request_takes_the_most_likely_token_whatever_the_seed() -> None:
    """Evaluation's greedy responses: every token is the argmax of the processed distribution at its
    position, and the seed does not matter."""
    m = model("tiny_dense")
    transforms = Transforms(temperature=1.5, top_k=20)
    e = engine(m, transforms=transforms)
    base = request([3, 6], n=1, max_new_tokens=8)
    runs = [e.generate(replace(base, seed=seed, greedy=True)) for seed in (1, 2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.response_T, b.response_T)
        assert torch.equal(a.response_T, _greedy_tokens(m, a, transforms))
    sampled = e.generate(replace(base, seed=1))
    assert any(not torch.equal(s.response_T, _greedy_tokens(m, s, transforms)) for s in sampled)
