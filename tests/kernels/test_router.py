"""MoE router: fp32 softmax, top-k with lowest-index tie breaking, replay weights with the same bits."""

from __future__ import annotations

import pytest
import torch

from rlfw.kernels.default import DefaultOps
from rlfw.kernels.invariant import InvariantOps
from tests.kernels.bits import DTYPES, assert_same_bits, embed_row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_row_invariant(inv: InvariantOps, dtype: torch.dtype, norm: bool) -> None:
    row = torch.randn(1, 64).to(dtype)
    w_alone, ids_alone = inv.router_topk(row, 8, norm)
    for n, at in [(2, 1), (7, 3), (40, 39)]:
        w, ids = inv.router_topk(embed_row(row, n, at, seed=n), 8, norm)
        assert_same_bits(w[at], w_alone[0])
        assert torch.equal(ids[at], ids_alone[0])


def test_ties_go_to_the_lowest_index(inv: InvariantOps) -> None:
    # Experts 5, 2 and 9 share the top logit, 1 and 7 the next one.
    logits = torch.full((1, 12), -1.0)
    logits[0, [9, 5, 2]] = 3.0
    logits[0, [7, 1]] = 2.0
    probs = torch.softmax(logits, -1)
    assert probs[0, 2] == probs[0, 5] == probs[0, 9] and probs[0, 1] == probs[0, 7], "ties did not occur"
    weights, ids = inv.router_topk(logits, 4, norm_topk_prob=False)
    assert ids.tolist() == [[2, 5, 9, 1]]
    assert bool((weights[0, :-1] >= weights[0, 1:]).all())
    # Larger batches with many tied rows choose the same experts.
    many = logits.repeat(300, 1)
    assert bool((inv.router_topk(many, 4, False)[1] == torch.tensor([2, 5, 9, 1])).all())


def test_all_equal_logits(inv: InvariantOps) -> None:
    _, ids = inv.router_topk(torch.zeros(3, 16), 5, True)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3


@pytest.mark.parametrize("norm", [False, True])
def test_replay_weights_have_the_same_bits(inv: InvariantOps, norm: bool) -> None:
    logits = torch.randn(20, 16)
    weights, ids = inv.router_topk(logits, 4, norm)
    assert_same_bits(inv.router_weights(logits, ids, norm), weights)


@pytest.mark.parametrize("norm", [False, True])
def test_agrees_with_default_and_backward(inv: InvariantOps, norm: bool) -> None:
    logits = torch.randn(20, 16)
    w, ids = inv.router_topk(logits, 4, norm)
    w_ref, ids_ref = DefaultOps().router_topk(logits, 4, norm)
    assert torch.equal(ids, ids_ref)  # no ties in random logits, so both rules agree
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)

    def grad(ops) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = logits.clone().requires_grad_()
        (ops.router_weights(x, ids, norm) * torch.arange(4.0)).sum().backward()
        assert x.grad is not None
        return x.grad

    got = grad(inv)
    torch.testing.assert_close(got, grad(DefaultOps()), atol=1e-6, rtol=1e-5)
    assert_same_bits(got, grad(inv))
