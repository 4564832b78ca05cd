"""Versioned weight updates: between requests, in flight (keep or recompute the KV), and the contract."""

from __future__ import annotations

import pytest
import torch

from rlfw.model.distribution import Transforms
from rlfw.rollout.engine import ContractMismatchError
from rlfw.rollout.native import NativeEngine
from rlfw.types import Sample, WeightUpdate
from tests.rollout._helpers import (
    PRESETS,
    bits,
    engine,
    model,
    request,
    same_bits,
    score_tokens,
    trainer_logp,
)

UPDATE_AFTER = 3  # steps; every response has 3 tokens drawn at version 0, the rest at version 1


def _in_flight_run(preset: str, kv_policy: str) -> tuple[NativeEngine, list[Sample]]:
    m = model(preset)
    new = model(preset, seed=8).state_dict()
    eng = engine(m, max_slots=8, kv_policy=kv_policy, in_flight=True)
    steps = [0]

    def update(e: NativeEngine) -> None:
        steps[0] += 1
        if steps[0] == UPDATE_AFTER:
            e.update_weights(WeightUpdate(1, "", new))

    return eng, eng.generate(request([4, 7, 2], n=2, max_new_tokens=8), between_steps=update)


@pytest.mark.parametrize("preset", PRESETS)
def test_in_flight_keep_continues_on_stale_kv(preset: str) -> None:
    eng, samples = _in_flight_run(preset, "keep")
    assert eng.version == 1
    for s in samples:
        post = s.version_T == 1
        assert s.version_T.tolist() == [0] * UPDATE_AFTER + [1] * (8 - UPDATE_AFTER)
        assert (s.kv_version_T == 0).all(), "the slot still holds KV written at version 0"
        assert s.final_version == 1
        # decode factor on post-update tokens: prefill at v1 over fresh KV vs decode at v1 over stale KV
        assert (s.prefill_logp[post] != s.decode_logp[post]).all()
    q = trainer_logp(eng.model, samples, Transforms())
    assert all(same_bits(s.prefill_logp, qi) for s, qi in zip(samples, q, strict=True))
    # the prompt rows are stale (version 0): the prefill stream prefilled every row again at version 1
    assert eng.counts.score_tokens == score_tokens(eng.model, samples, whole_prompt=True)


@pytest.mark.parametrize("preset", PRESETS)
def test_in_flight_recompute_makes_the_decode_factor_exactly_zero(preset: str) -> None:
    eng, samples = _in_flight_run(preset, "recompute")
    assert eng.counts.recompute_tokens > 0
    for s in samples:
        post = s.version_T == 1
        assert int(post.sum()) == 8 - UPDATE_AFTER
        assert torch.equal(s.kv_version_T, s.version_T), "recomputed KV is at the token's version"
        assert torch.equal(bits(s.prefill_logp[post]), bits(s.decode_logp[post]))
        assert torch.equal(bits(s.sampler_logp), bits(s.decode_logp))
        assert (s.prefill_logp[~post] != s.decode_logp[~post]).all(), "pre-update tokens show the lag"
    # recompute re-prefilled the prompt rows at version 1, so the prefill stream kept them
    assert eng.counts.score_tokens == score_tokens(eng.model, samples)


def test_sequences_admitted_after_an_update_start_on_fresh_weights() -> None:
    """A group whose later samples wait for a slot re-prefills its prompt after an update: the
    snapshot taken at the old version is invalidated, so those samples have kv_version == version."""
    m = model("tiny_dense")
    eng = engine(m, max_slots=2, in_flight=True)
    new = model(seed=8).state_dict()
    eng.start(request([5], n=4, max_new_tokens=3), forced_responses=[torch.tensor([20, 21, 22])] * 4)
    done = eng.step()
    eng.update_weights(new, version=1)
    while not eng.finished():
        done += eng.step()
    late = [s for s in done if s.sample_index >= 2]
    assert all((s.version_T == 1).all() and (s.kv_version_T == 1).all() for s in late)
    assert eng.counts.prefill_tokens == 2 * 4, "the prompt was prefilled again at version 1"


def test_update_between_requests_moves_the_version() -> None:
    m = model("tiny_dense")
    eng = engine(m)
    (a,) = eng.generate(request([4], max_new_tokens=4))
    eng.update_weights(model(seed=8).state_dict(), version=3)
    (b,) = eng.generate(request([4], max_new_tokens=4), forced_responses=[a.response_T])
    assert eng.version == 3 and (b.version_T == 3).all() and b.final_version == 3
    assert not torch.equal(a.sampler_logp, b.sampler_logp)


def test_updates_are_refused_when_they_cannot_be_honoured() -> None:
    m = model("tiny_dense")
    eng = engine(m, contract_hash="abc123")
    with pytest.raises(ContractMismatchError, match=r"'fff000'.*'abc123'"):
        eng.update_weights(WeightUpdate(1, "fff000", m.state_dict()))
    assert eng.version == 0
    eng.update_weights(WeightUpdate(1, "abc123", {}))
    with pytest.raises(ValueError, match="does not move past"):
        eng.update_weights(m.state_dict(), version=1)
    with pytest.raises(KeyError, match="lacks: bogus.weight"):
        eng.update_weights({"bogus.weight": torch.zeros(1)}, version=2)
    eng.start(request([3]))
    eng.step()
    with pytest.raises(RuntimeError, match="in_flight"):
        eng.update_weights(m.state_dict(), version=2)
