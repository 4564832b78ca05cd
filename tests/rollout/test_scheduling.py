"""Continuous batching, seeding, group prefill sharing, stop tokens and length limits."""

from __future__ import annotations

import pytest
import torch

from rlfw.rollout.native import NativeEngine
from rlfw.rollout.requests import RequestError
from rlfw.types import GenerationRequest
from tests.rollout._helpers import engine, model, prompts, request, same_bits


def _tokens(samples: list) -> dict[tuple[int, int], list[int]]:
    return {(s.prompt_id, s.sample_index): s.response_T.tolist() for s in samples}


def test_same_seed_same_tokens_whatever_the_slots_and_the_batch() -> None:
    m = model("tiny_moe")
    base = _tokens(engine(m, max_slots=16, seed=5).generate(request([3, 8, 5], n=2, max_new_tokens=10)))
    for slots in (1, 3):
        got = _tokens(engine(m, max_slots=slots, seed=5).generate(request([3, 8, 5], n=2, max_new_tokens=10)))
        assert got == base, slots
    # The same prompts inside a bigger request (other prompts around them, other slot assignment).
    ps = prompts([3, 8, 5])
    bigger = GenerationRequest(
        [100, 7, 101, 9, 102], [ps[0], *prompts([6], 9), ps[1], *prompts([2], 8), ps[2]], 2, 10
    )
    got = _tokens(engine(m, max_slots=3, seed=5).generate(bigger))
    assert {k: v for k, v in got.items() if k[0] >= 100} == base


def test_different_seed_different_tokens() -> None:
    m = model("tiny_dense")
    a = _tokens(engine(m, seed=1).generate(request([4, 6], n=2, max_new_tokens=10)))
    b = _tokens(engine(m, seed=2).generate(request([4, 6], n=2, max_new_tokens=10)))
    c = _tokens(engine(m, seed=1).generate(GenerationRequest([100, 101], prompts([4, 6]), 2, 10, seed=2)))
    assert a != b
    assert c == b, "a request's own seed replaces the engine's"
    assert a[(100, 0)] != a[(100, 1)], "samples of one group draw independently"


def test_a_finished_sequence_frees_its_slot_at_once() -> None:
    """2 slots, forced lengths [1, 5, 2, 2]: continuous batching needs 5 steps (static batches: 7).

    step 1: A B -> A done; step 2: C B; step 3: C B -> C done; step 4: D B; step 5: D B -> both done.
    """
    m = model("tiny_dense")
    eng = engine(m, max_slots=2)
    forced = [torch.full((n,), 20 + i) for i, n in enumerate([1, 5, 2, 2])]
    eng.start(request([3, 4, 2, 5]), forced_responses=forced)
    steps, running = 0, []
    while not eng.finished():
        eng.step()
        steps += 1
        running.append(len(eng.running))
    assert steps == 5
    assert running == [1, 2, 1, 2, 0]  # sequences still running after each step


def test_group_shares_one_prompt_prefill_and_matches_unshared_bits() -> None:
    m = model("tiny_moe")
    p = prompts([9])[0]
    forced = [torch.randint(8, 96, (6,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    shared = engine(m, max_slots=2)  # 4 samples on 2 slots: later samples copy from the snapshot
    grouped = shared.generate(GenerationRequest([100], [p], n=4, max_new_tokens=6), forced_responses=forced)
    assert shared.counts.prefill_tokens == 8, "the prompt (minus its last token) is prefilled once"
    alone = engine(m, max_slots=2)
    single = alone.generate(GenerationRequest([200, 201, 202, 203], [p] * 4, n=1), forced_responses=forced)
    assert alone.counts.prefill_tokens == 4 * 8
    for g, s in zip(grouped, single, strict=True):
        assert torch.equal(g.response_T, s.response_T)
        for name in ("sampler_logp", "decode_logp", "prefill_logp", "topk_logp"):
            assert same_bits(getattr(g, name), getattr(s, name)), name
        assert g.routed_experts is not None and s.routed_experts is not None
        assert torch.equal(g.routed_experts, s.routed_experts)


def test_stop_tokens_end_a_response() -> None:
    m = model("tiny_dense")
    stops = set(range(8, 60))  # most of the vocabulary: responses stop early
    samples = engine(m, stop_ids=stops).generate(request([3, 5, 4], n=3, max_new_tokens=20))
    for s in samples:
        tokens = s.response_T.tolist()
        if s.finish_reason == "stop":
            assert tokens[-1] in stops and not stops & set(tokens[:-1])
        else:
            assert len(tokens) == 20 and not stops & set(tokens)
    assert any(s.finish_reason == "stop" for s in samples)


def test_max_new_tokens_and_max_model_len_cap_the_response() -> None:
    m = model("tiny_dense")
    eng = engine(m, max_model_len=14)
    samples = eng.generate(request([10, 3], max_new_tokens=6))
    assert [s.response_T.shape[0] for s in samples] == [4, 6]  # 10 + 4 fills the cache; 3 + 6 does not
    assert all(s.finish_reason == "length" for s in samples)


def test_prompt_too_long_is_refused_with_the_limit_named() -> None:
    eng = engine(model("tiny_dense"), max_model_len=14)
    with pytest.raises(RequestError, match=r"prompt 101 has 14 tokens but max_model_len=14"):
        eng.start(request([3, 14]))
    with pytest.raises(RequestError, match="exceeds max_model_len=14"):
        eng.start(request([10]), forced_responses=[torch.arange(8, 13)])
    assert eng.finished(), "a refused request queues nothing"


def test_bad_requests_are_refused() -> None:
    eng = engine(model("tiny_dense"))
    with pytest.raises(RequestError, match="unique"):
        eng.start(GenerationRequest([1, 1], prompts([2, 3])))
    with pytest.raises(RequestError, match="forced_responses has 1 entries"):
        eng.start(request([2, 3]), forced_responses=[torch.arange(3)])
    with pytest.raises(RequestError, match="non-empty"):
        eng.start(GenerationRequest([1], [torch.tensor([], dtype=torch.long)]))


def test_from_config_uses_the_engine_and_sampler_fields() -> None:
    from rlfw.config import EngineConfig, SamplerConfig

    cfg = EngineConfig(
        max_slots=3,
        max_model_len=40,
        seed=4,
        kv_policy="recompute",
        in_flight=True,
        sampler=SamplerConfig(temperature=0.5, top_k=7, precision="bf16", topk_logprobs=3),
    )
    eng = NativeEngine.from_config(model("tiny_dense"), cfg, contract_hash="h")
    assert eng.slots.num_slots == 3 and eng.cache.capacity == 40 and eng.seed == 4
    assert eng.transforms.temperature == 0.5 and eng.transforms.top_k == 7 and eng.precision == "bf16"
    assert eng.kv_policy == "recompute" and eng.in_flight and eng.contract_hash == "h"
    assert eng.stop_ids == {2}, "stop ids default to the model's eos"
    (s,) = eng.generate(request([3], max_new_tokens=4))
    assert s.topk_ids.shape[1] == 3


def test_the_cache_grows_with_the_sequences_not_the_maximum_length() -> None:
    """By default the engine's cache and stream records hold the longest sequence it has run (both
    grow past their first 64 positions here); preallocating max_slots x max_model_len
    (engine.kv_cache_preallocate) changes the memory, never a bit. Six sequences share four slots."""
    req = request([5, 30, 9], n=2, max_new_tokens=70)
    runs = {}
    for pre in (False, True):
        eng = NativeEngine(model(), max_slots=4, max_model_len=1024, kv_cache_preallocate=pre)
        runs[pre] = (eng, eng.generate(req))
    grown, full = runs[False][0].cache, runs[True][0].cache
    assert 100 <= grown.capacity < 1024 == full.capacity  # longest sequence: 30 + 70 positions
    assert grown.nbytes * 4 < full.nbytes  # 128 of 1024 positions per row
    assert 70 <= runs[False][0].records.capacity < 1024 == runs[True][0].records.capacity
    assert all(s.response_T.numel() == 70 for s in runs[False][1])  # no stop id: every response full
    for a, b in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(a.response_T, b.response_T) and torch.equal(a.topk_ids, b.topk_ids)
        for name in ("sampler_logp", "decode_logp", "prefill_logp", "topk_logp", "decode_topk_logp"):
            assert same_bits(getattr(a, name), getattr(b, name)), name
