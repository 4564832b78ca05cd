"""One optimizer step on a rollout batch: grad forwards over micro-batches, the corrected loss, one update.

The loss of every micro-batch is normalised by the step's *global* token count (passed in), so gradient
accumulation over micro-batches and ranks equals one big batch. The PPO reference (the old-policy
log-prob) is the stream :func:`rlfw.algos.ppo_reference` chose for the run: the trainer's own scoring
forward (``score``), or the engine's prefill or decode stream, which make that extra forward unnecessary.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor, nn

from rlfw.algos import CORRECTIONS, CorrectionConfig, LossInputs, Reference, gae, policy_loss, value_loss
from rlfw.algos.kl import kl_estimate
from rlfw.model import Transformer
from rlfw.model.distribution import Transforms
from rlfw.trainer.logprobs import critic_values, scoring_logp, trainer_logp
from rlfw.types import TrainBatch, TrainResult


class Backend(Protocol):
    """What the step needs from the optimizer side (DeepSpeed, or plain torch in tests)."""

    @property
    def module(self) -> nn.Module:
        """The callable forward (a DeepSpeed engine wraps the model)."""
        ...

    def backward(self, loss: Tensor) -> None: ...

    def step(self) -> float:
        """Apply the accumulated gradients (clipping, LR schedule); return the global grad norm. Gradients
        that are not finite are dropped instead, and ``last_step_skipped`` is then true."""
        ...

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` dropped non-finite gradients instead of updating."""
        ...


@dataclass
class PPOSpec:
    """PPO's critic settings: GAE over the token rewards, a clipped value loss added to the policy loss."""

    gamma: float
    lam: float
    value_coef: float
    value_clip: float | None = 0.2


@dataclass
class StepSpec:
    """The few settings one step needs."""

    transforms: Transforms
    correction: CorrectionConfig
    micro_batch_size: int
    reference: Reference  # the PPO reference stream (rlfw.algos.ppo_reference): score | prefill | decode
    router_replay: bool
    ppo: PPOSpec | None = None  # None: GRPO (advantages come with the batch)
    kl_coef: float = 0.0  # weight of KL(policy || reference model); the caller keeps the reference
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # entropy bonus
    logits_chunk_mib: int = 0  # the LM head in chunks of positions (trainer.logits_chunk_mib); 0: all at once


def old_policy_logp(
    backend: Backend, model: Transformer, batch: TrainBatch, spec: StepSpec, head: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The PPO reference ``[B, L-1]`` and, with ``head``, the reference at the sampler's top-k ids
    ``[B, L-1, K]`` (what ``dlc`` reads): the recorded engine stream's head, or the scoring pass's."""
    if spec.reference == "score":
        return scoring_logp(
            backend.module, model, batch, spec.transforms, spec.micro_batch_size, head, spec.logits_chunk_mib
        )
    old, old_head = {
        "decode": (batch.decode_logp, batch.decode_topk_logp),
        "prefill": (batch.prefill_logp, batch.prefill_topk_logp),
    }[spec.reference]
    if head and old_head is None:
        raise ValueError(
            f"correction={spec.correction.name} needs the {spec.reference} stream at the sampler's top-k "
            "ids, which this engine did not record; use engine=native or a synchronous run"
        )
    return old, old_head if head else None


def train_step(
    backend: Backend,
    model: Transformer,
    batch: TrainBatch,
    spec: StepSpec,
    num_tokens: int,
    num_sequences: int,
    reference: Transformer | None = None,
) -> TrainResult:
    """Accumulate gradients over micro-batches and step once.

    ``num_tokens`` / ``num_sequences``: the step's global counts over every rank (the loss normaliser).
    Returns the trainer's log-probs at its pre-update weights and the PPO reference it used (so the
    caller can compute ratio metrics over the whole batch, across ranks), and scalar metrics: the loss,
    the correction's clip and mask fractions (token-weighted over micro-batches), the grad norm and the
    R3 mismatch. With ``spec.kl_coef > 0`` the loss adds the KL to ``reference`` (the frozen initial
    weights, scored here without gradient); the token-mean entropy is always reported (``loss/entropy``)
    and, with ``spec.entropy_coef > 0``, subtracted from the loss as a bonus.
    """
    rule = CORRECTIONS[spec.correction.name]
    with model.weights_held():  # the weights change at backend.step(), not before
        old, old_head = old_policy_logp(backend, model, batch, spec, head=rule.needs_reference_head)
        critic = _critic_targets(backend, model, batch, spec) if spec.ppo is not None else None
        if critic is not None:
            batch = replace(batch, advantages=critic[0])
        topk = rule.needs_topk
        ref_logp = None
        if spec.kl_coef > 0:
            if reference is None:
                raise ValueError("algo.kl_coef > 0 needs the reference model (the trainer rank keeps it)")
            micro, chunk_mib = spec.micro_batch_size, spec.logits_chunk_mib
            ref_logp, _ = scoring_logp(reference, reference, batch, spec.transforms, micro, False, chunk_mib)
        q_parts: list[Tensor] = []
        mismatch: list[float] = []
        sums: dict[str, float] = defaultdict(float)
        for i, mb in enumerate(batch.micro_batches(spec.micro_batch_size)):
            rows = slice(i * spec.micro_batch_size, i * spec.micro_batch_size + len(mb))
            out = trainer_logp(
                backend.module,
                model,
                mb,
                spec.transforms,
                replay=spec.router_replay,
                topk=topk,
                values=critic is not None,
                entropy=True,
                entropy_grad=spec.entropy_coef > 0,
                chunk_mib=spec.logits_chunk_mib,
            )
            head = None if old_head is None else old_head[rows]
            inputs = loss_inputs(mb, out.logp, out.topk_logp, old[rows], num_tokens, num_sequences, head)
            loss, metrics = policy_loss(inputs, spec.correction)
            reg, extra = regularisers(out.logp, out.entropy, mb.mask, ref_logp, rows, spec, num_tokens)
            loss = loss + reg
            metrics = {**metrics, **extra}
            if critic is not None and spec.ppo is not None and out.values is not None:
                _, old_values, returns = critic
                v_loss, v_metrics = value_loss(
                    out.values, old_values[rows], returns[rows], mb.mask, num_tokens, spec.ppo.value_clip
                )
                loss = loss + spec.ppo.value_coef * v_loss
                metrics = {**metrics, **v_metrics}
            backend.backward(loss)
            q_parts.append(out.logp.detach())
            for k, v in metrics.items():
                if v.dim() == 0 and (
                    k.startswith(("loss/", "kl/")) or k.endswith(("clip_frac", "mask_frac"))
                ):
                    sums[k] += float(v) * (1.0 if k.startswith("loss/") else mb.num_tokens)
            if out.replay_mismatch is not None:
                mismatch.append(out.replay_mismatch)
    scalars = {k: v if k.startswith("loss/") else v / max(batch.num_tokens, 1) for k, v in sums.items()}
    scalars["grad_norm"] = backend.step()
    scalars["train/skipped_nonfinite"] = float(backend.last_step_skipped)
    if mismatch:
        scalars["router/replay_mismatch_frac"] = sum(mismatch) / len(mismatch)
    return TrainResult(trainer_logp=torch.cat(q_parts), old_logp=old, scalars=scalars)


def _critic_targets(
    backend: Backend, model: Transformer, batch: TrainBatch, spec: StepSpec
) -> tuple[Tensor, Tensor, Tensor]:
    """(advantages, old values, returns), all [B, L-1]: GAE over the token rewards with the pre-update
    critic. Advantages are not whitened across the batch, so sharding rows over ranks changes nothing."""
    assert spec.ppo is not None and batch.rewards is not None, "algo=ppo needs token rewards in the batch"
    old_values = critic_values(backend.module, model, batch, spec.transforms, spec.micro_batch_size)
    advantages, returns = gae(batch.rewards, old_values, batch.mask, spec.ppo.gamma, spec.ppo.lam)
    return advantages, old_values, returns


def loss_inputs(
    mb: TrainBatch,
    q: Tensor,
    q_topk: Tensor | None,
    old: Tensor,
    num_tokens: int,
    num_sequences: int,
    old_head: Tensor | None = None,
) -> LossInputs:
    """The loss's view of a (micro-)batch: its streams, the trainer's log-probs ``q`` and the reference
    ``old`` (all ``[B, L-1]``), the trainer's top-k head when the correction reads it and the reference's
    (``old_head``, for dlc), global counts.

    A token without a prefill value (``engine.prefill_fraction < 1``, allowed only where the contract
    claims prefill and decode bitwise equal) takes its decode value there: the same bits, so its trainer
    factor is measured against the decode stream and its decode factor is exactly 1."""
    prefill = mb.prefill_logp
    if mb.prefilled is not None:
        prefill = torch.where(mb.prefilled | ~mb.mask, prefill, mb.decode_logp)
    return LossInputs(
        trainer_logp=q,
        sampler_logp=mb.sampler_logp,
        decode_logp=mb.decode_logp,
        prefill_logp=prefill,
        advantages=mb.advantages,
        mask=mb.mask,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        old_logp=old,
        sampler_topk_ids=mb.topk_ids if q_topk is not None else None,
        sampler_topk_logp=mb.topk_logp if q_topk is not None else None,
        trainer_topk_logp=q_topk,
        reference_topk_logp=old_head,
    )


def regularisers(
    logp: Tensor,
    entropy: Tensor | None,
    mask: Tensor,
    ref_logp: Tensor | None,
    rows: slice,
    spec: StepSpec,
    num_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The KL and entropy terms of one micro-batch, normalised like the policy loss (token sums over the
    step's global token count), and their metrics: ``loss/kl`` (the KL term as added), ``kl/ref_mean``
    (the micro-batch's token-mean estimate), ``loss/entropy`` (the token-mean entropy's share)."""
    m = mask.to(logp.dtype)
    n = max(num_tokens, 1)
    total = logp.new_zeros(())
    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        ent = (entropy * m).sum() / n
        metrics["loss/entropy"] = ent.detach()
        if spec.entropy_coef > 0:
            total = total - spec.entropy_coef * ent
    if ref_logp is not None:
        kl_tok = kl_estimate(logp, ref_logp[rows].to(logp.dtype), spec.kl_estimator)
        kl = (kl_tok * m).sum() / n
        total = total + spec.kl_coef * kl
        metrics["loss/kl"] = (spec.kl_coef * kl).detach()
        metrics["kl/ref_mean"] = ((kl_tok * m).sum() / m.sum().clamp_min(1)).detach()
    return total, metrics
