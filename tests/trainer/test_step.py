"""The trainer step: micro-batching equals one big batch, the prefill shortcut is exact under the
contract, and PPO trains its critic on GAE targets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from rlfw.algos import CorrectionConfig, Reference
from rlfw.model import Transformer, build_preset
from rlfw.model.distribution import Transforms
from rlfw.rollout.native import NativeEngine
from rlfw.train.collate import collate
from rlfw.trainer.step import PPOSpec, StepSpec, train_step
from rlfw.types import GenerationRequest, TrainBatch
from tests.head_rows import head_rows


class PlainBackend:
    """Accumulate gradients; ``step`` records them instead of updating (so tests can compare)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}
        self.last_step_skipped = False

    @property
    def module(self) -> nn.Module:
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        self.grads = {k: p.grad.clone() for k, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in self.grads.values()])))


def _batch(preset: str = "tiny_dense", token_rewards: bool = False) -> tuple[Transformer, TrainBatch]:
    model = build_preset(preset, seed=1, kernels="invariant")
    engine = NativeEngine(
        build_preset(preset, seed=1, kernels="invariant"), max_slots=8, max_model_len=32, topk_logprobs=4
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (n,), generator=gen) for n in (3, 6, 4)]
    samples = engine.generate(GenerationRequest([0, 1, 2], prompts, n=4, max_new_tokens=7, seed=3))
    for s in samples:
        s.reward = float(s.response_T.sum() % 3 == 0)
    advantages = [float(i % 3) - 1.0 for i in range(len(samples))]
    return model.train(), collate(samples, advantages, token_rewards=token_rewards)


def _spec(
    micro: int, reference: Reference = "prefill", name: str = "tis", ppo: PPOSpec | None = None
) -> StepSpec:
    return StepSpec(Transforms(), CorrectionConfig(name=name), micro, reference, False, ppo)


@pytest.mark.parametrize("name", ["tis", "centering", "ppo_sampler"])
def test_micro_batches_give_the_gradient_of_one_big_batch(name: str) -> None:
    """The loss is normalised by the global token count, so accumulation over micro-batches is exact."""
    model, batch = _batch()
    whole, parts = PlainBackend(model), PlainBackend(model)
    r1 = train_step(whole, model, batch, _spec(len(batch), name=name), batch.num_tokens, len(batch))
    r2 = train_step(parts, model, batch, _spec(5, name=name), batch.num_tokens, len(batch))
    for k, g in whole.grads.items():
        torch.testing.assert_close(parts.grads[k], g, rtol=1e-5, atol=1e-7)
    assert r1.scalars["loss/policy"] == pytest.approx(r2.scalars["loss/policy"], rel=1e-5)
    assert torch.equal(r1.trainer_logp, r2.trainer_logp)


def test_prefill_stream_as_old_policy_equals_the_trainers_own_scoring_forward() -> None:
    """Under the contract the shortcut is not an approximation: same reference, same gradient."""
    model, batch = _batch()
    skip, score = PlainBackend(model), PlainBackend(model)
    a = train_step(skip, model, batch, _spec(6, "prefill", name="ppo_sampler"), batch.num_tokens, len(batch))
    b = train_step(score, model, batch, _spec(6, "score", name="ppo_sampler"), batch.num_tokens, len(batch))
    m = batch.mask  # the prefill stream exists on response tokens only
    assert torch.equal(a.old_logp[m].view(torch.int32), b.old_logp[m].view(torch.int32))
    for k, g in skip.grads.items():
        assert torch.equal(g, score.grads[k]), k


def test_ppo_trains_the_value_head_on_gae_targets() -> None:
    model, batch = _batch(token_rewards=True)
    model.attach_value_head()
    assert batch.rewards is not None and batch.rewards.sum() == sum(
        1.0 for i in range(len(batch)) if batch.rewards[i].sum() > 0
    )
    backend = PlainBackend(model)
    spec = _spec(6, name="none", ppo=PPOSpec(1.0, 1.0, 0.5))
    result = train_step(backend, model, batch, spec, batch.num_tokens, len(batch))
    assert backend.grads["value_head.weight"].abs().sum() > 0  # the critic learns
    assert result.scalars["loss/value"] > 0
    # with a zero critic and gamma = lam = 1 every token's advantage is its sequence's reward R, so the
    # plain policy-gradient loss is -sum(R * log q) / N over response tokens
    reward_per_token = batch.rewards.sum(1, keepdim=True) * batch.mask
    expected = -float((reward_per_token * result.trainer_logp).sum()) / batch.num_tokens
    assert result.scalars["loss/policy"] == pytest.approx(expected, rel=1e-5)


def test_an_empty_batch_collates_to_zero_rows() -> None:
    """Every reward failed: the driver sees a zero-row batch and skips the step instead of crashing."""
    batch = collate([], [])
    assert len(batch) == 0 and batch.num_tokens == 0


def test_kl_to_a_reference_and_the_entropy_bonus_enter_the_loss() -> None:
    """KL to an identical reference is 0 with no gradient of its own; to a different one it adds
    kl_coef x its token mean. Entropy is always logged; the bonus changes the gradient."""
    model, batch = _batch()
    twin = build_preset("tiny_dense", seed=1, kernels="invariant")  # the initial weights, frozen
    other = build_preset("tiny_dense", seed=5, kernels="invariant")
    base = replace(_spec(6), kl_coef=0.0)
    plain, same, far = PlainBackend(model), PlainBackend(model), PlainBackend(model)
    r0 = train_step(plain, model, batch, base, batch.num_tokens, len(batch))
    r1 = train_step(same, model, batch, replace(base, kl_coef=0.5), batch.num_tokens, len(batch), twin)
    r2 = train_step(far, model, batch, replace(base, kl_coef=0.5), batch.num_tokens, len(batch), other)
    assert r1.scalars["loss/kl"] == 0.0 and r1.scalars["kl/ref_mean"] == 0.0
    for k, g in plain.grads.items():
        torch.testing.assert_close(same.grads[k], g, rtol=1e-6, atol=1e-8)
    assert r2.scalars["kl/ref_mean"] > 0 and r2.scalars["loss/kl"] == pytest.approx(
        0.5 * r2.scalars["kl/ref_mean"], rel=1e-5
    )
    assert r2.scalars["loss/policy"] == pytest.approx(r0.scalars["loss/policy"], rel=1e-6)  # a term beside it
    assert 0 < r0.scalars["loss/entropy"] <= float(torch.log(torch.tensor(96.0)))
    bonus = PlainBackend(model)
    train_step(bonus, model, batch, replace(base, entropy_coef=0.1), batch.num_tokens, len(batch))
    assert any(not torch.allclose(bonus.grads[k], g) for k, g in plain.grads.items())
    with pytest.raises(ValueError, match="needs the reference model"):
        train_step(
            PlainBackend(model), model, batch, replace(base, kl_coef=0.5), batch.num_tokens, len(batch)
        )


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
def test_the_trainer_does_not_feed_the_last_position_and_loses_no_bit(preset: str) -> None:
    """The last position predicts past the sequence, so the trainer's forward stops one short. Every
    log-prob of a response token (sampled token and top-k) is the bit pattern of the forward over the
    whole sequence; the positions before the response are not scored (0)."""
    from rlfw.model import RouterTrace
    from rlfw.trainer.logprobs import trainer_logp

    model, batch = _batch(preset)
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        out = trainer_logp(model, model, batch, Transforms(), replay=True, topk=True)
    handle.remove()
    assert seen == [batch.tokens.shape[1] - 1]
    routing = None if batch.routed_experts is None else RouterTrace(replay=batch.routed_experts)
    with torch.no_grad():
        full = model(batch.tokens, batch.attention_mask, routing=routing)[:, :-1]
    logp_all = model.ops.log_softmax(full)
    m = batch.mask
    assert torch.equal(out.logp[m], logp_all.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)[m])
    assert out.topk_logp is not None and torch.equal(out.topk_logp[m], logp_all.gather(-1, batch.topk_ids)[m])
    assert not out.logp[~m].any() and not out.topk_logp[~m].any()  # positions no loss reads: not scored
    if preset == "tiny_moe":
        assert out.replay_mismatch == 0.0


def test_the_critics_pass_reads_the_value_head_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """GAE's pre-update values come from a forward whose LM head scores no position; they are the bits
    of the values the grad forward computes beside its log-probs."""
    from rlfw.trainer.logprobs import critic_values, trainer_logp

    model, batch = _batch()
    model.attach_value_head()
    heads = head_rows(monkeypatch, model)
    values = critic_values(model, model, batch, Transforms(), micro=len(batch))
    assert heads == [0]
    with torch.no_grad():
        both = trainer_logp(model, model, batch, Transforms(), replay=True, topk=False, values=True)
    assert 0 < heads[1] <= int(batch.mask.sum())  # the grad forward's head: the scored positions
    assert both.values is not None and torch.equal(values, both.values)
