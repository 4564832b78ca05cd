"""``engine.prefill_fraction``: the prefill stream on a chosen share of sequences, nothing else changed.

If one of these breaks, a run that skips prefills to save time either changes the samples it draws (the
choice must not touch the other streams), trains on a different reference than a full run (the decode
stream must stand in bit for bit), or says nothing about which tokens had no prefill value.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.algos import CorrectionConfig
from rlfw.contract import build_contract
from rlfw.kernels import get_ops
from rlfw.model.distribution import Transforms
from rlfw.rollout.native import NativeEngine
from rlfw.rollout.sampling import gets_prefill
from rlfw.train.collate import collate
from rlfw.train.report import prefill_coverage
from rlfw.train.setup import check_prefill_fraction
from rlfw.trainer.step import StepSpec, train_step
from rlfw.types import SampleBatch
from rlfw.validation import ConfigError
from tests.rollout._helpers import model, request, same_bits, score_tokens
from tests.trainer.test_step import PlainBackend


def _generate(fraction: float) -> tuple[NativeEngine, list]:  # type: ignore[type-arg]
    engine = NativeEngine(model(), max_slots=6, max_model_len=48, prefill_fraction=fraction, topk_logprobs=4)
    return engine, engine.generate(request([5, 9, 3, 7], n=3, max_new_tokens=10))


def test_the_choice_depends_only_on_the_sequence() -> None:
    draws = [gets_prefill(3, p, i, 0.3) for p in range(50) for i in range(20)]
    assert 0.25 < sum(draws) / len(draws) < 0.35  # 1000 fixed draws: 0.3 within a few points
    assert all(gets_prefill(3, p, i, 1.0) for p in range(5) for i in range(5))
    assert not any(gets_prefill(3, p, i, 0.0) for p in range(5) for i in range(5))


def test_skipped_sequences_are_marked_and_every_other_stream_is_unchanged() -> None:
    _, full = _generate(1.0)
    engine, half = _generate(0.5)
    chosen = [gets_prefill(0, s.prompt_id, s.sample_index, 0.5) for s in half]  # seed: the engine's 0
    assert 0 < sum(chosen) < len(half)  # both kinds occur in this batch
    for a, b, keep in zip(full, half, chosen, strict=True):
        for name in ("response_T", "sampler_logp", "decode_logp", "topk_ids", "topk_logp", "version_T"):
            x, y = getattr(a, name), getattr(b, name)
            assert same_bits(x, y) if x.is_floating_point() else torch.equal(x, y), name
        assert b.prefilled is keep
        if keep:
            assert same_bits(a.prefill_logp, b.prefill_logp)
        else:
            assert torch.isnan(b.prefill_logp).all()
    scored = score_tokens(engine.model, [s for s, k in zip(half, chosen, strict=True) if k])
    assert engine.counts.score_tokens == scored  # the skipped sequences cost no forward
    back = SampleBatch.pack(half).unpack()
    assert [s.prefilled for s in back] == [s.prefilled for s in half]


def test_the_decode_stream_stands_in_bit_for_bit_in_the_trainer_step() -> None:
    """Under the contract a batch with prefills on half its sequences gives the same reference, the same
    loss and the same gradient as the full batch."""
    _, full = _generate(1.0)
    _, half = _generate(0.5)
    advantages = [float(i % 3) - 1.0 for i in range(len(full))]
    trained = model().train()
    results = []
    for samples, reference in ((full, "prefill"), (half, "decode")):
        batch = collate(samples, advantages)
        backend = PlainBackend(trained)
        spec = StepSpec(Transforms(), CorrectionConfig(name="tis"), 5, reference, False)  # type: ignore[arg-type]
        results.append(
            (train_step(backend, trained, batch, spec, batch.num_tokens, len(batch)), backend, batch)
        )
    (a, ga, full_batch), (b, gb, half_batch) = results
    assert prefill_coverage(full_batch) == 1.0 and 0.0 < prefill_coverage(half_batch) < 1.0
    m = full_batch.mask
    assert same_bits(a.old_logp[m], b.old_logp[m]) and a.scalars["loss/policy"] == b.scalars["loss/policy"]
    for k, g in ga.grads.items():
        assert same_bits(g, gb.grads[k]), k


@pytest.mark.parametrize("kernels", ["default"])
def test_a_run_without_the_contract_cannot_skip_prefills(kernels: str) -> None:
    contract = build_contract(get_ops(kernels), "float32", "fp32", {}, False, "native", "rlfw")
    with pytest.raises(ConfigError, match="engine.prefill_fraction=0.5"):
        check_prefill_fraction(0.5, contract, is_moe=False)
    check_prefill_fraction(1.0, contract, is_moe=False)  # the default is always allowed


def test_moe_needs_every_prefill() -> None:
    contract = build_contract(get_ops("invariant"), "float32", "fp32", {}, False, "native", "rlfw")
    check_prefill_fraction(0.5, contract, is_moe=False)
    with pytest.raises(ConfigError, match="MoE"):
        check_prefill_fraction(0.5, contract, is_moe=True)
