"""A cache-less forward computes each distinct token once (:mod:`rlfw.model.packing`).

The trainer's forwards (grad and scoring) leave padding out and feed a prefix that several rows share
once: a GRPO group's prompt, and any response tokens its samples have in common. Under
``kernels=invariant`` this must not move a bit of any row, so the trainer factor of the ratio stays
exactly 1; these tests check the bits of drawn batches against each row alone, that the shared tokens
really are computed once, and that the gradient is the per-row gradient.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlfw.kernels import threads
from rlfw.model import build_preset
from rlfw.model.packing import PackedRows, shared_prefixes
from tests.head_rows import head_rows
from tests.kernels.bits import assert_same_bits
from tests.properties import examples


def flat(*requests: list[int]) -> tuple[list[int], list[int]]:
    """A batch's flat tokens and each row's start offset."""
    tokens = [t for r in requests for t in r]
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + len(r))
    return tokens, starts


def test_a_groups_prompt_is_computed_once() -> None:
    tokens, starts = flat([5, 6, 7], [5, 6, 7], [5, 6, 7])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_tokens_after_two_sequences_part_are_their_own() -> None:
    # the second shares [5, 6] with the first; its 9 at position 3 matches the first's token there but
    # follows a different prefix, so it is computed; the third shares the second's whole prefix.
    tokens, starts = flat([5, 6, 7, 9], [5, 6, 8, 9], [5, 6, 8, 9, 4])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) == [0, 1, 2, 3, 0, 1, 6, 7, 0, 1, 6, 7, 12]


def test_a_row_continuing_from_earlier_positions_takes_no_part() -> None:
    # the second row's tokens sit at positions 2 onwards (a cached prefix): same ids, other prefix
    tokens, starts = flat([5, 6, 7], [5, 6, 7], [5, 6])
    assert shared_prefixes(tokens, starts, [0, 2, 0]) == [0, 1, 2, 3, 4, 5, 0, 1]


def test_nothing_shared_is_none() -> None:
    tokens, starts = flat([5, 6], [6, 5], [7])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) is None
    assert shared_prefixes(*flat([5, 6], [5, 6]), [0, 3]) is None


def test_a_batch_without_padding_or_shared_prefixes_is_fed_as_it_is() -> None:
    ids = torch.tensor([[5, 6, 7], [6, 5, 7]])
    assert PackedRows.of(ids, torch.arange(3).expand(2, 3)) is None


def _pad(rows: list[Tensor], left: bool) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = r, 1
    return ids, mask


def _groups(data: st.DataObject, vocab: int, g: torch.Generator) -> list[Tensor]:
    """Drawn GRPO-like rows: groups of samples sharing a prompt, some also the start of a response,
    a row that is a prefix of another, and lone rows."""
    rows: list[Tensor] = []
    for i in range(data.draw(st.integers(1, 3), "groups")):
        prompt = torch.randint(0, vocab, (data.draw(st.integers(1, 9), f"prompt{i}"),), generator=g)
        for j in range(data.draw(st.integers(1, 4), f"samples{i}")):
            common = rows[-1][len(prompt) :] if j and data.draw(st.booleans(), f"copies{i}{j}") else None
            length = data.draw(st.integers(0, 8), f"response{i}{j}")
            response = torch.randint(0, vocab, (length,), generator=g)
            if common is not None:  # this sample starts like the one before it
                response = torch.cat((common, response))[: max(length, 1)]
            rows.append(torch.cat((prompt, response)))
    return rows


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
@settings(max_examples=examples(25), deadline=None)
@given(data=st.data(), bf16=st.booleans(), left=st.booleans(), seed=st.integers(0, 2**16))
def test_each_row_keeps_its_bits_and_a_shared_prefix_is_computed_once(
    preset: str, data: st.DataObject, bf16: bool, left: bool, seed: int
) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = build_preset(preset, dtype=dtype, seed=7, kernels="invariant")
    rows = _groups(data, model.args.vocab_size, torch.Generator().manual_seed(seed))
    ids, mask = _pad(rows, left)
    # The oracle: one computed token per distinct prefix of the batch.
    distinct = {tuple(r[: p + 1].tolist()) for r in rows for p in range(len(r))}
    packed = PackedRows.of(ids, model.positions(mask, None, None))
    computed = ids.numel() if packed is None else packed.ids.shape[1]
    assert computed == len(distinct)
    with torch.no_grad():
        out = model(ids, mask)
        for i, r in enumerate(rows):
            assert_same_bits(out[i][mask[i].bool()], model(r[None])[0])


def test_the_gradient_is_the_sum_of_each_rows_gradient() -> None:
    """Shared tokens gather the gradient of every row that reads them: the same sum in another order."""
    model = build_preset("tiny_dense", seed=1, kernels="invariant").train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 96, (7,), generator=g)
    rows = [torch.cat((prompt, torch.randint(4, 96, (n,), generator=g))) for n in (5, 9, 3)]
    rows.append(torch.randint(4, 96, (11,), generator=g))
    ids, mask = _pad(rows, left=False)
    model(ids, mask).log_softmax(-1)[mask.bool()].sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for r in rows:
        model(r[None]).log_softmax(-1).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None
        scale = float(p.grad.abs().max())  # fp32 sums of many terms: compare against the largest entry
        torch.testing.assert_close(packed[n], p.grad, rtol=0.0, atol=1e-5 * scale)


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
@settings(max_examples=examples(15), deadline=None)
@given(data=st.data(), left=st.booleans(), compiled=st.booleans(), seed=st.integers(0, 2**16))
def test_scored_entries_get_their_bits_and_their_gradient(
    preset: str, data: st.DataObject, left: bool, compiled: bool, seed: int
) -> None:
    """``scored``: the logits of the chosen entries alone, each with the bits it has in the full forward,
    and the full forward's gradient of a loss on them: the same sums less terms that are zero, so the
    same bits on the compiled backward (what a trainer lending cores runs) and close on BLAS's."""
    model = build_preset(preset, seed=7, kernels="invariant").train()
    g = torch.Generator().manual_seed(seed)
    ids, mask = _pad(_groups(data, model.args.vocab_size, g), left)
    scored = mask.bool() & (torch.rand(ids.shape, generator=g) < data.draw(st.floats(0.0, 1.0), "share"))
    threads.set_lender((lambda: 1) if compiled else None)
    try:
        few = model(ids, mask, scored=scored)
        few.log_softmax(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        full = model(ids, mask)[scored]
        full.log_softmax(-1).sum().backward()
    finally:
        threads.set_lender(None)
    assert_same_bits(few, full.detach())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n not in grads)
        if p.grad is None:
            continue
        if compiled:
            assert torch.equal(grads[n], p.grad), n
        else:
            torch.testing.assert_close(grads[n], p.grad, rtol=0.0, atol=1e-5 * float(p.grad.abs().max()))


def test_the_head_computes_each_distinct_scored_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples of a group that drew the same first tokens share those positions' head rows; positions
    not scored (the prompt) reach no head row."""
    model = build_preset("tiny_dense", seed=1, kernels="invariant")
    heads = head_rows(monkeypatch, model)
    prompt, a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11]), torch.tensor([9, 12, 13])
    ids = torch.stack((torch.cat((prompt, a)), torch.cat((prompt, b)), torch.cat((prompt, a))))
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[:, 3:6] = True  # the positions that predict the response tokens
    with torch.no_grad():
        out = model(ids, None, scored=scored)
    # distinct scored tokens: the prompt's last (shared by all three), 9 (all three), then 10 and 12,
    # (row 2 repeats row 0): 4 head rows for 9 scored entries
    assert heads == [4] and out.shape == (9, model.args.vocab_size)
