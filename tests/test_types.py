"""Records that cross actor boundaries: a SampleBatch unpacks to exactly the samples that were packed."""

from __future__ import annotations

import pytest
import torch

from rlfw.model import build_preset
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest, SampleBatch


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
def test_sample_batch_roundtrip_is_exact(preset: str) -> None:
    engine = NativeEngine(
        build_preset(preset, kernels="invariant"), max_slots=4, max_model_len=32, topk_logprobs=3
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=gen) for n in (2, 5, 3)]
    samples = engine.generate(GenerationRequest([0, 1, 2], prompts, n=2, max_new_tokens=5, seed=1))
    again = SampleBatch.pack(samples).unpack()
    assert len(again) == len(samples) == 6
    for a, b in zip(samples, again, strict=True):
        assert (a.prompt_id, a.sample_index, a.finish_reason, a.final_version) == (
            b.prompt_id,
            b.sample_index,
            b.finish_reason,
            b.final_version,
        )
        for field in (
            "prompt_P",
            "response_T",
            "sampler_logp",
            "decode_logp",
            "prefill_logp",
            "version_T",
            "kv_version_T",
            "topk_ids",
            "topk_logp",
        ):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), field
        if preset == "tiny_moe":
            assert a.routed_experts is not None and torch.equal(a.routed_experts, b.routed_experts)
        else:
            assert b.routed_experts is None
