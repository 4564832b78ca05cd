"""MoE routed expert ids for R3, and teacher-forced continuations for the audit."""

from __future__ import annotations

import torch

from rlfw.model import RouterTrace
from rlfw.model.distribution import Transforms, process_logits
from tests.rollout._helpers import engine, model, request, same_bits


def test_routed_experts_cover_prompt_and_response_and_replay_reproduces_prefill() -> None:
    m = model("tiny_moe")
    samples = engine(m, max_slots=3, stop_ids=(8, 9)).generate(request([1, 6, 11], n=2, max_new_tokens=9))
    n_moe, k = len(m.args.moe_layers), m.args.num_experts_per_tok
    for s in samples:
        assert s.routed_experts is not None
        assert s.routed_experts.shape == (s.tokens.shape[0], n_moe, k)
        with torch.no_grad():
            recorded = RouterTrace()
            m(s.tokens[None], routing=recorded)
            assert torch.equal(recorded.stacked()[0], s.routed_experts), "decode routing == prefill routing"
            # R3: the trainer replays the recorded ids and must get the engine's prefill stream back.
            replay = RouterTrace(replay=s.routed_experts[None])
            logits = m(s.tokens[None], routing=replay)[0, s.prompt_P.shape[0] - 1 : -1]
        replayed = m.ops.token_logp(process_logits(logits, Transforms()), s.response_T)
        assert same_bits(replayed, s.prefill_logp)


def test_dense_models_record_no_routing() -> None:
    (s,) = engine(model("tiny_dense")).generate(request([3], max_new_tokens=2))
    assert s.routed_experts is None


def test_forced_responses_are_decoded_exactly_and_match_the_sampled_run() -> None:
    m = model("tiny_moe")
    sampled = engine(m, precision="fp8", seed=3).generate(request([5, 2], n=2, max_new_tokens=7))
    forced = [s.response_T for s in sampled]
    again = engine(m, precision="fp8", seed=99, max_slots=1).generate(
        request([5, 2], n=2, max_new_tokens=1), forced_responses=forced
    )
    for a, b in zip(sampled, again, strict=True):
        assert torch.equal(a.response_T, b.response_T), "forcing ignores seeds and max_new_tokens"
        for name in ("sampler_logp", "decode_logp", "prefill_logp", "topk_logp"):
            assert same_bits(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.topk_ids, b.topk_ids)


def test_forced_responses_run_through_stop_tokens() -> None:
    m = model("tiny_dense")
    forced = [torch.tensor([2, 30, 2]), torch.tensor([30, 31])]
    samples = engine(m, stop_ids=(2,)).generate(request([4, 4]), forced_responses=forced)
    assert [s.response_T.tolist() for s in samples] == [[2, 30, 2], [30, 31]]
    assert [s.finish_reason for s in samples] == ["stop", "length"]
