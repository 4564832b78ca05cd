"""The trainer's log-probs of the sampled tokens and of the sampler's top-k, transforms replayed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlfw.model import RouterTrace, Transformer
from rlfw.model.distribution import Transforms, process_logits
from rlfw.types import TrainBatch


@dataclass
class TrainerLogp:
    """``logp [B, L-1]`` of each predicted response token (0 at the other positions, which are not
    scored); ``topk_logp [B, L-1, K]`` at the sampler's top-k ids (``None`` when not asked for);
    ``replay_mismatch`` for MoE: the share of (token, layer) whose experts differ from the engine's (under
    R3: the router's own choice against the replayed one; ``None`` for dense models)."""

    logp: Tensor
    topk_logp: Tensor | None
    replay_mismatch: float | None
    values: Tensor | None = None  # [B, L-1] critic estimate at each prediction position (PPO)
    entropy: Tensor | None = None  # [B, L-1] entropy of the (transformed) distribution (0 where not scored)


def trainer_logp(
    model: nn.Module,
    ops_model: Transformer,
    batch: TrainBatch,
    t: Transforms,
    *,
    replay: bool,
    topk: bool,
    values: bool = False,
    entropy: bool = False,
    entropy_grad: bool = False,
    log_probs: bool = True,
) -> TrainerLogp:
    """Run ``model`` (the trainer's module, possibly wrapped by DeepSpeed) over ``batch``.

    Gradient flows when grad mode is on (the grad forward) and not otherwise (the scoring forward); both
    run the same ops, so they agree bit for bit. ``ops_model`` is the unwrapped shared model, for its op
    set. Under R3 (``replay``) the MoE layers use the rollout's expert ids. ``entropy``: also the
    entropy of each position's distribution (with gradient only if ``entropy_grad``). ``log_probs=False``:
    the value head alone (the LM head scores no position and every log-prob reads 0).
    """
    # The last position would predict a token past the sequence, so it is not fed: the forward covers
    # positions 0 .. L-2, which predict tokens 1 .. L-1. Under batch-invariant kernels each of them gets
    # the bits it would get in the longer forward (causal attention, row-independent linears).
    tokens, mask = batch.tokens[:, :-1], batch.attention_mask[:, :-1]
    engine_ids = None if batch.routed_experts is None else batch.routed_experts[:, :-1]
    routing = None
    if engine_ids is not None:
        routing = RouterTrace(replay=engine_ids if replay else None)
    # Only the positions that predict a response token are scored: nothing reads the others, and with a
    # real vocabulary their logits and log-softmax would be most of the step's memory. Those positions
    # read 0 in the [B, L-1] outputs.
    scored = batch.mask if log_probs else torch.zeros_like(batch.mask)
    out = model(tokens, mask, routing=routing, with_values=values, scored=scored)
    logits, v = out if values else (out, None)
    logp_all = ops_model.ops.log_softmax(process_logits(logits, t))  # [n, V], one row per scored position
    where = scored.nonzero(as_tuple=True)
    logp = _placed(logp_all.gather(-1, batch.tokens[:, 1:][where][:, None]).squeeze(-1), where, scored)
    topk_logp = _placed(logp_all.gather(-1, batch.topk_ids[where]), where, batch.topk_ids) if topk else None
    mismatch = None  # the share of tokens routed differently from the engine (logged for every MoE run)
    if routing is not None and engine_ids is not None:
        if replay:
            mismatch = routing.replay_mismatch_frac(mask)
        else:
            mismatch = routing.mismatch_against(engine_ids, mask)
    ent = None
    if entropy:
        grad = entropy_grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            ent = _placed(_entropy(logp_all, grad), where, scored)
    return TrainerLogp(logp, topk_logp, mismatch, v, ent)


def _entropy(logp: Tensor, grad: bool) -> Tensor:
    """``-sum p log p`` of each row of ``logp [n, V]`` (a token masked to -inf counts 0). Without a
    gradient (the usual case: the entropy is a metric) one ``[n, V]`` temporary rather than three."""
    if grad:
        return -(logp.exp() * logp).nan_to_num().sum(-1)
    terms = logp.exp()
    return -terms.mul_(logp).nan_to_num_().sum(-1)


def _placed(values: Tensor, where: tuple[Tensor, ...], like: Tensor) -> Tensor:
    """``values [n, ...]`` of the scored positions ``where`` laid out as ``like``'s ``[B, L-1, ...]``
    (fp32), zero elsewhere."""
    out = values.new_zeros(like.shape)
    return out.index_put(where, values)


def scoring_logp(
    model: nn.Module, ops_model: Transformer, batch: TrainBatch, t: Transforms, micro: int, topk: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The no-grad scoring forward over the whole batch, in micro-batches: ``[B, L-1]``, and with
    ``topk`` its log-probs at the sampler's top-k ids ``[B, L-1, K]`` (else None)."""
    with torch.no_grad():
        outs = [
            trainer_logp(model, ops_model, mb, t, replay=True, topk=topk) for mb in batch.micro_batches(micro)
        ]
    heads = [o.topk_logp for o in outs if o.topk_logp is not None]
    return torch.cat([o.logp for o in outs]), torch.cat(heads) if topk else None


def critic_values(
    model: nn.Module, ops_model: Transformer, batch: TrainBatch, t: Transforms, micro: int
) -> Tensor:
    """The critic's no-grad estimates over the whole batch, ``[B, L-1]`` (the pre-update values GAE reads)."""
    with torch.no_grad():
        parts = []
        for mb in batch.micro_batches(micro):
            v = trainer_logp(
                model, ops_model, mb, t, replay=True, topk=False, values=True, log_probs=False
            ).values
            assert v is not None
            parts.append(v)
    return torch.cat(parts)
