"""R3: MoE layers record the experts they chose and can replay given ones."""

from __future__ import annotations

import pytest
import torch

from rlfw.model import RouterTrace, build_preset


def _ids() -> torch.Tensor:
    return torch.randint(4, 96, (2, 8), generator=torch.Generator().manual_seed(0))


def test_record_shapes_and_replaying_recorded_ids_reproduces_the_forward() -> None:
    model = build_preset("tiny_moe", seed=1)
    trace = RouterTrace()
    with torch.no_grad():
        recorded_logits = model(_ids(), routing=trace)
    ids = trace.stacked()
    assert ids.shape == (2, 8, 2, 2)  # [B, T, moe layers, top-k]
    replay = RouterTrace(replay=ids)
    with torch.no_grad():
        replayed_logits = model(_ids(), routing=replay)
    assert torch.equal(replay.stacked(), ids)
    assert torch.equal(recorded_logits.view(torch.int32), replayed_logits.view(torch.int32))


def test_router_gets_a_gradient_under_replay() -> None:
    model = build_preset("tiny_moe", seed=2).train()
    trace = RouterTrace()
    with torch.no_grad():
        model(_ids(), routing=trace)
    logits = model(_ids(), routing=RouterTrace(replay=trace.stacked()))
    torch.log_softmax(logits, -1)[..., 5].sum().backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_replaying_different_ids_changes_the_output() -> None:
    model = build_preset("tiny_moe", seed=3)
    trace = RouterTrace()
    with torch.no_grad():
        base = model(_ids(), routing=trace)
        other = (trace.stacked() + 1) % 4  # every token sent to different experts
        changed = model(_ids(), routing=RouterTrace(replay=other))
    assert (base - changed).abs().max() > 1e-3


def test_replay_gate_weights_come_from_the_router_softmax() -> None:
    """Under replay the gate weight of expert e is the router's (renormalised) softmax at e."""
    model = build_preset("tiny_moe", seed=4)
    moe = model.model.layers[0].mlp
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[[3, 0], [1, 2], [0, 3]]])
    from rlfw.model.layers import ForwardContext

    pos = torch.arange(3)[None]
    ctx = ForwardContext(
        model.ops, pos, pos.float(), pos.float(), routing=RouterTrace(replay=ids[:, :, None])
    )
    with torch.no_grad():
        weights, got = moe.route(x, ctx)
        probs = torch.softmax(torch.nn.functional.linear(x, moe.gate.weight).float(), -1)
    expected = probs.gather(-1, ids)
    expected = expected / expected.sum(-1, keepdim=True)  # norm_topk_prob=True in the preset
    assert torch.equal(got, ids)
    assert torch.allclose(weights, expected, atol=1e-7)


def test_an_expert_id_out_of_range_is_refused_not_clamped() -> None:
    model = build_preset("tiny_moe", seed=3)
    trace = RouterTrace()
    with torch.no_grad():
        model(_ids(), routing=trace)
    for bad in (4, -1):  # tiny_moe has experts 0..3
        ids = trace.stacked().clone()
        ids[1, 5, 1, 0] = bad
        with pytest.raises(ValueError, match=rf"expert id {bad}, outside 0\.\.3"):
            with torch.no_grad():
                model(_ids(), routing=RouterTrace(replay=ids))


def test_without_replay_the_mismatch_compares_the_trainers_choice_with_the_engines() -> None:
    import torch

    from rlfw.model.routing import RouterTrace

    trace = RouterTrace()
    trace.recorded = [torch.tensor([[[0, 1], [2, 3], [1, 0]]])]  # one MoE layer, 3 tokens, top-2
    engine = torch.tensor([[[[1, 0]], [[2, 1]], [[3, 2]]]])  # [B, T, layers, k]: same set, differs, differs
    assert trace.mismatch_against(engine) == pytest.approx(2 / 3)
    assert trace.mismatch_against(engine, torch.tensor([[1, 0, 0]])) == 0.0  # only the first token counts
