"""The engine's log-prob streams, checked as bits.

Under ``kernels=invariant`` and an fp32 sampler, every stream of every token equals the trainer's scoring
forward bit for bit, whatever the batch the token was decoded in: that is what makes the decode and
trainer factors of the ratio exactly 1 (design §2, §4). If a change breaks these tests, the measured
mismatch of a training run stops being zero where the contract promises zero.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.model import build_preset
from rlfw.model.distribution import Transforms, process_logits
from rlfw.rollout import native
from tests.rollout._helpers import PRESETS, engine, model, request, same_bits, score_tokens, trainer_logp

MIXED_LENGTHS = [1, 7, 3, 12, 5]  # length 1: a prompt with nothing to prefill


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "transforms", [Transforms(), Transforms(temperature=0.7, top_k=30, top_p=0.9, min_p=0.02)], ids=str
)
def test_fp32_streams_are_bit_identical_to_each_other_and_to_the_trainer(
    preset: str, transforms: Transforms
) -> None:
    m = model(preset)
    # 5 prompts x 3 samples on 4 slots: sequences of different lengths enter and leave the batch.
    eng = engine(m, transforms=transforms, max_slots=4, stop_ids=(8, 9, 10))
    samples = eng.generate(request(MIXED_LENGTHS, n=3, max_new_tokens=10))
    assert len(samples) == 15
    assert len({s.response_T.shape[0] for s in samples}) > 1, "stop tokens should vary the lengths"
    for s, q in zip(samples, trainer_logp(m, samples, transforms), strict=True):
        assert same_bits(s.sampler_logp, s.decode_logp), (s.prompt_id, s.sample_index)
        assert same_bits(s.decode_logp, s.prefill_logp), (s.prompt_id, s.sample_index)
        assert same_bits(s.prefill_logp, q), (s.prompt_id, s.sample_index)
        assert torch.isfinite(s.sampler_logp).all()


def test_streams_stay_bitwise_across_a_kv_tile_boundary() -> None:
    """A 30-token prompt decoding 12 tokens crosses the attention kernel's 32-slot KV tile."""
    m = model("tiny_dense")
    eng = engine(m, max_slots=2)
    samples = eng.generate(request([30, 2], n=2, max_new_tokens=12))
    for s, q in zip(samples, trainer_logp(m, samples, Transforms()), strict=True):
        assert same_bits(s.sampler_logp, q) and same_bits(s.decode_logp, q) and same_bits(s.prefill_logp, q)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_reduced_precision_sampler_isolates_the_sampler_factor(preset: str, precision: str) -> None:
    m = model(preset)
    eng = engine(m, precision=precision, max_slots=3)
    samples = eng.generate(request([4, 9, 2], n=2, max_new_tokens=8))
    sampler_factor = torch.cat([s.decode_logp - s.sampler_logp for s in samples])
    for s, q in zip(samples, trainer_logp(m, samples, Transforms()), strict=True):
        assert same_bits(s.decode_logp, s.prefill_logp), "decode factor must stay exactly 0"
        assert same_bits(s.prefill_logp, q), "trainer factor must stay exactly 0"
    assert (sampler_factor != 0).float().mean() > 0.5, "the sampler's precision must show"
    bound = {"bf16": 0.05, "fp8": 0.5}[precision]  # measured max: bf16 ~4e-3, fp8 ~3e-2 on the tiny models
    assert sampler_factor.abs().max() < bound


def test_prefill_stream_equals_the_no_cache_path() -> None:
    """The engine scores finished sequences through their cache slot, keeping the prompt rows its
    prefill wrote and running the response; under invariant kernels that is the same bits as the
    model's no-cache path over the whole row (checked one sequence at a time, unbatched)."""
    m = model("tiny_moe")
    eng = engine(m)
    samples = eng.generate(request([6, 3, 9, 4, 2], n=2, max_new_tokens=9))
    for s in samples:
        (alone,) = trainer_logp(m, [s], Transforms())
        assert same_bits(s.prefill_logp, alone)
    # the prompt rows were kept: the forward covered the last prompt token and the response
    assert eng.counts.score_tokens == score_tokens(m, samples)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_stream_scored_in_groups_keeps_its_bits(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finished sequences are scored a few at a time (``SCORE_ROWS`` padded rows per forward); with a
    budget that splits one retirement into several forwards the prefill stream and its top-k head are the
    bits of one forward over all of them."""
    reqs = request([6, 3, 9, 4, 2, 7], n=2, max_new_tokens=9)
    whole = engine(model(preset), max_slots=12).generate(reqs)
    monkeypatch.setattr(native, "SCORE_ROWS", 20)  # 1-2 sequences per forward here
    eng = engine(model(preset), max_slots=12)
    grouped = eng.generate(reqs)
    assert eng.counts.score_tokens == score_tokens(eng.model, grouped)
    for a, b in zip(whole, grouped, strict=True):
        assert same_bits(a.prefill_logp, b.prefill_logp)
        assert same_bits(a.prefill_topk_logp, b.prefill_topk_logp)


def test_score_groups_bound_the_padded_rows() -> None:
    lengths = [10, 12, 30, 5, 5, 5, 5, 50]
    groups = native.score_groups(lengths, 40)
    assert groups == [[0, 1], [2], [3, 4, 5, 6], [7]]  # consecutive, each within 40 padded rows
    assert native.score_groups([100], 40) == [[0]]  # too long for the budget: alone
    assert native.score_groups([], 40) == []


def test_default_kernels_agree_to_rounding() -> None:
    """kernels=default makes no bitwise promise, but the streams must still be the same distribution."""
    m = model("tiny_dense", kernels="default")
    samples = engine(m, max_slots=3).generate(request([5, 8, 2], n=2, max_new_tokens=8))
    for s, q in zip(samples, trainer_logp(m, samples, Transforms()), strict=True):
        for stream in (s.sampler_logp, s.decode_logp, s.prefill_logp):
            torch.testing.assert_close(stream, q, rtol=0, atol=1e-5)


def test_topk_comes_from_the_sampler_distribution() -> None:
    m = model("tiny_dense")
    eng = engine(m, precision="fp8", topk_logprobs=5)
    (s,) = eng.generate(request([4], max_new_tokens=6))
    assert s.topk_ids.shape == (6, 5) and s.topk_logp.shape == (6, 5)
    assert (s.topk_logp[:, :-1] >= s.topk_logp[:, 1:]).all(), "top-k is sorted, most likely first"
    for t in range(6):  # where the drawn token is in the top-k, its logprob is the sampler's
        hit = s.topk_ids[t] == s.response_T[t]
        if hit.any():
            assert same_bits(s.topk_logp[t][hit][0], s.sampler_logp[t])


def test_bf16_model_streams_are_bit_identical_to_the_trainer() -> None:
    m = build_preset("tiny_moe", dtype=torch.bfloat16, seed=7, kernels="invariant")
    samples = engine(m, max_slots=2).generate(request([3, 8], n=2, max_new_tokens=6))
    for s, q in zip(samples, trainer_logp(m, samples, Transforms()), strict=True):
        assert same_bits(s.sampler_logp, q) and same_bits(s.decode_logp, q) and same_bits(s.prefill_logp, q)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_reduced_precision_sampler_is_batch_invariant_too(precision: str) -> None:
    """The sampler head runs its matmul through the invariant kernels, so a sequence's sampler stream
    (and hence its seeded draws) does not depend on the sequences decoded with it."""
    m = model("tiny_dense")
    together = engine(m, precision=precision, max_slots=6).generate(request([4, 9, 2], n=2, max_new_tokens=8))
    for slots in (1, 4):
        apart = engine(m, precision=precision, max_slots=slots).generate(
            request([4, 9, 2], n=2, max_new_tokens=8)
        )
        for a, b in zip(together, apart, strict=True):
            assert torch.equal(a.response_T, b.response_T)
            assert same_bits(a.sampler_logp, b.sampler_logp) and same_bits(a.topk_logp, b.topk_logp)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_engine_streams_at_the_sampler_top_k(precision: str) -> None:
    """The decode and prefill streams are also recorded at the sampler's top-k ids (dlc's reference over
    the head): under invariant kernels both equal the trainer's log-probs at those ids bit for bit, and
    with an fp32 sampler the decode head is the sampler's own head."""
    m = model("tiny_dense")
    t = Transforms(temperature=0.8, top_k=20)
    samples = engine(m, precision=precision, max_slots=3, topk_logprobs=6, transforms=t).generate(
        request([4, 9, 2], n=2, max_new_tokens=7)
    )
    for s in samples:
        assert s.decode_topk_logp is not None and s.prefill_topk_logp is not None
        logits = m(s.tokens[None])[0, s.prompt_P.shape[0] - 1 : -1]
        trainer_head = m.ops.log_softmax(process_logits(logits, t)).gather(-1, s.topk_ids)
        assert same_bits(s.prefill_topk_logp, trainer_head)
        assert same_bits(s.decode_topk_logp, trainer_head)
        if precision == "fp32":
            assert same_bits(s.decode_topk_logp, s.topk_logp)
        else:
            assert not same_bits(s.decode_topk_logp, s.topk_logp)  # the sampler's precision shows
