"""One module, four modes: training forward, scoring, prefill and decode agree on token log-probs.

Under ``kernels=default`` they agree to a tolerance; the bitwise version of these checks belongs to the
invariant kernels' tests.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.model import build_preset

TOL = 1e-5  # fp32, plain torch ops: different matmul shapes round differently


def _token_logp(model, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return model.ops.token_logp(logits[:, :-1], ids[:, 1:])


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
def test_prefill_then_decode_matches_scoring(preset: str) -> None:
    model = build_preset(preset, seed=1)
    ids = torch.randint(4, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        score = model(ids)
        cache = model.new_cache(num_slots=3, capacity=16)
        steps = [model(ids[:, :5], cache=cache)]
        steps += [model(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
    stepped = torch.cat(steps, dim=1)
    assert cache.lengths.tolist() == [12, 12, 12]
    diff = (_token_logp(model, ids, stepped) - _token_logp(model, ids, score)).abs().max().item()
    assert diff <= TOL


def test_training_forward_equals_scoring_forward() -> None:
    model = build_preset("tiny_moe", seed=2).train()
    ids = torch.randint(4, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    logits_grad = model(ids)
    assert logits_grad.requires_grad
    with torch.no_grad():
        logits_score = model(ids)
    assert torch.equal(logits_grad.detach().view(torch.int32), logits_score.view(torch.int32))


def test_left_and_right_padding_give_the_same_logits() -> None:
    """Positions come from the mask, so where the padding sits does not change a sequence."""
    model = build_preset("tiny_dense", seed=3)
    seq = torch.randint(4, 96, (7,), generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(3, dtype=torch.long)
    right = torch.cat([seq, pad])[None]
    left = torch.cat([pad, seq])[None]
    m_right = (torch.arange(10) < 7).long()[None]
    m_left = (torch.arange(10) >= 3).long()[None]
    with torch.no_grad():
        alone = model(seq[None])[0]
        r = model(right, m_right)[0, :7]
        l_ = model(left, m_left)[0, 3:]
    assert (r - alone).abs().max() <= TOL and (l_ - alone).abs().max() <= TOL


def test_chunked_prefill_continues_each_row_after_its_length() -> None:
    """Rows of different lengths share a prefill; the next chunk continues each row where it stopped."""
    model = build_preset("tiny_dense", seed=4)
    a = torch.randint(4, 96, (10,), generator=torch.Generator().manual_seed(3))
    b = torch.randint(4, 96, (6,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref_a, ref_b = model(a[None])[0], model(b[None])[0]
        cache = model.new_cache(num_slots=2, capacity=12)
        first = torch.stack([a[:4], torch.cat([b[:2], torch.zeros(2, dtype=torch.long)])])
        model(first, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), cache=cache)
        second = torch.stack([a[4:10], torch.cat([b[2:6], torch.zeros(2, dtype=torch.long)])])
        out = model(second, torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]), cache=cache)
    assert cache.lengths.tolist() == [10, 6]
    assert (out[0] - ref_a[4:]).abs().max() <= TOL
    assert (out[1, :4] - ref_b[2:]).abs().max() <= TOL


def test_decode_on_a_subset_of_cache_slots() -> None:
    """Continuous batching decodes only some slot rows; the others are untouched."""
    model = build_preset("tiny_dense", seed=5)
    ids = torch.randint(4, 96, (3, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids)
        cache = model.new_cache(num_slots=3, capacity=8)
        model(ids[:, :5], cache=cache)
        out = model(ids[[2, 0], 5:6], cache=cache, slots=torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [6, 5, 6]
    assert (out[0, 0] - ref[2, 5]).abs().max() <= TOL and (out[1, 0] - ref[0, 5]).abs().max() <= TOL


def test_cache_overflow_is_refused() -> None:
    model = build_preset("tiny_dense")
    cache = model.new_cache(num_slots=1, capacity=4)
    with torch.no_grad(), pytest.raises(ValueError, match="cache holds 4"):
        model(torch.ones(1, 5, dtype=torch.long), cache=cache)


def test_a_growing_cache_keeps_every_position_and_stops_at_its_maximum() -> None:
    model = build_preset("tiny_dense")
    ids = torch.randint(0, 64, (2, 11))
    fixed = model.new_cache(num_slots=2, capacity=16)
    grows = model.new_cache(num_slots=2, capacity=2, max_capacity=16)
    with torch.no_grad():
        outs = []
        for cache in (fixed, grows):
            a = model(ids[:, :3], cache=cache)  # 3 > 2: grows to 4
            b = model(ids[:, 3:11], cache=cache)  # 11 > 4: grows to 11 (more than doubling)
            outs.append((a, b))
        assert grows.capacity == 11 and grows.nbytes < fixed.nbytes
        for x, y in zip(outs[0], outs[1], strict=True):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
        grows.lengths.zero_()
        model(ids[:, :1], cache=grows)
        model(ids[:, :10], cache=grows)  # needs 11: holds; the copy kept nothing it should not have
        with pytest.raises(ValueError, match="cache holds 16.*engine.max_model_len"):
            model(torch.ones(2, 6, dtype=torch.long), cache=grows)  # 11 + 6 > 16
