"""`CorrectionBatch`: the loss inputs after the non-finite check, in the form every correction reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.algos.inputs import LossInputs
from rlfw.algos.ratios import decompose


@dataclass
class CorrectionBatch:
    """Per-token tensors for one micro-batch, all [B, T] unless noted.

    Tokens dropped for a non-finite stream have `valid` False and every stream set to 0 (top-k to -inf),
    so no NaN reaches the loss or its gradient. Only `logp`, `log_lag` and the trainer's head carry grad;
    the decomposed factors are detached because corrections use them as weights, never as a path for grad.
    """

    logp: Tensor
    """log q under the trainer, with grad."""
    adv: Tensor
    """Advantages."""
    mask: Tensor
    """bool: tokens the caller trains on (its mask, as given)."""
    valid: Tensor
    """bool: `mask` and every log-probability stream of the token finite."""
    log_factors: dict[str, Tensor]
    """`decompose` of the four streams (trainer, decode, sampler, total), detached."""
    log_lag: Tensor
    """log q - log old: the lag ratio against the weights that generated each token, with grad."""
    log_numerical: Tensor
    """log old - log mu: the numerical ratio, reference over sampler (the total minus the lag), detached.
    Which streams it spans depends on the reference: decode x sampler for the prefill stream, the sampler
    factor alone for the decode stream, every factor for the trainer's scoring pass."""
    trainer_head: Tensor | None
    """[B, T, k] trainer log-probs at the sampler's top-k ids, with grad; None when not given."""
    sampler_head: Tensor | None
    """[B, T, k] sampler log-probs of its top-k ids; None when not given."""
    reference_head: Tensor | None = None
    """[B, T, k] the PPO reference's log-probs at the sampler's top-k ids, detached; None when not given."""


def _finite_tokens(inputs: LossInputs) -> Tensor:
    """[B, T] bool: every log-probability stream of the token is finite. In the top-k heads -inf is
    legitimate (a replayed transform removed that token); NaN and +inf are not."""
    streams = (inputs.trainer_logp, inputs.sampler_logp, inputs.decode_logp, inputs.prefill_logp)
    ok = torch.stack([torch.isfinite(s.detach()) for s in (*streams, inputs.reference_logp)]).all(0)
    for head in (inputs.trainer_topk_logp, inputs.sampler_topk_logp, inputs.reference_topk_logp):
        if head is not None:
            ok = ok & (head.detach() < torch.inf).all(-1)
    return ok


def prepare(inputs: LossInputs) -> CorrectionBatch:
    """Drop non-finite tokens, cut gradient from every stream but the trainer's, and decompose the ratio."""
    mask = inputs.mask.bool()
    valid = mask & _finite_tokens(inputs)

    def clean(x: Tensor) -> Tensor:
        return torch.where(valid, x, torch.zeros_like(x))

    def clean_head(x: Tensor | None) -> Tensor | None:
        return None if x is None else torch.where(valid.unsqueeze(-1), x, torch.full_like(x, -torch.inf))

    logp = clean(inputs.trainer_logp)
    prefill = clean(inputs.prefill_logp.detach())
    decode = clean(inputs.decode_logp.detach())
    sampler = clean(inputs.sampler_logp.detach())
    sampler_head = None if inputs.sampler_topk_logp is None else inputs.sampler_topk_logp.detach()
    reference_head = None if inputs.reference_topk_logp is None else inputs.reference_topk_logp.detach()
    reference = clean(inputs.reference_logp.detach())
    return CorrectionBatch(
        logp=logp,
        adv=inputs.advantages.detach(),
        mask=mask,
        valid=valid,
        log_factors=decompose(logp.detach(), prefill, decode, sampler),
        log_lag=logp - reference,
        log_numerical=reference - sampler,
        trainer_head=clean_head(inputs.trainer_topk_logp),
        sampler_head=clean_head(sampler_head),
        reference_head=clean_head(reference_head),
    )
