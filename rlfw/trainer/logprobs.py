"""The trainer's log-probs of the sampled tokens and of the sampler's top-k, transforms replayed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from rlfw.model import RouterTrace, Transformer
from rlfw.model.distribution import Transforms, process_logits, row_blocks
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
    chunk_mib: float = 0,
) -> TrainerLogp:
    """Run ``model`` (the trainer's module, possibly wrapped by DeepSpeed) over ``batch``.

    Gradient flows when grad mode is on (the grad forward) and not otherwise (the scoring forward); both
    run the same ops, so they agree bit for bit. ``ops_model`` is the unwrapped shared model, for its op
    set. Under R3 (``replay``) the MoE layers use the rollout's expert ids. ``entropy``: also the
    entropy of each position's distribution (with gradient only if ``entropy_grad``). ``log_probs=False``:
    the value head alone (the LM head scores no position and every log-prob reads 0). ``chunk_mib > 0``:
    the LM head and what is read from it run over chunks of positions whose fp32 logits fit that many
    MiB, recomputed in the backward (the same log-probs; the weight gradient sums the chunks').
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
    where = scored.nonzero(as_tuple=True)
    targets = batch.tokens[:, 1:][where][:, None]
    topk_ids = batch.topk_ids[where] if topk else None
    grad_entropy = entropy_grad and torch.is_grad_enabled()

    def read(logits: Tensor, row_of: Tensor | None, entries: slice) -> tuple[Tensor, ...]:
        """What the step reads of the scored positions' distributions (row by row)."""
        ids = row_of, targets[entries], None if topk_ids is None else topk_ids[entries]
        rows = DistributionRows(ops_model.ops.log_softmax, t, entropy, grad_entropy)
        out = rows.apply(logits, *ids) if logits.requires_grad else rows.forward_rows(logits, *ids)[0]
        return tuple(o for o in out if o is not None)

    chunk_rows = max(1, int(chunk_mib * 2**20) // (4 * ops_model.args.vocab_size)) if chunk_mib > 0 else 0
    out = model(
        tokens, mask, routing=routing, with_values=values, scored=scored, read=read, chunk_rows=chunk_rows
    )
    reads, v = out if values else (out, None)
    logp = _placed(reads[0], where, scored)
    topk_logp = _placed(reads[1], where, batch.topk_ids) if topk_ids is not None else None
    mismatch = None  # the share of tokens routed differently from the engine (logged for every MoE run)
    if routing is not None and engine_ids is not None:
        if replay:
            mismatch = routing.replay_mismatch_frac(mask)
        else:
            mismatch = routing.mismatch_against(engine_ids, mask)
    ent = _placed(reads[-1], where, scored) if entropy else None
    return TrainerLogp(logp, topk_logp, mismatch, v, ent)


@dataclass(frozen=True)
class DistributionRows:
    """The reads of the LM head's logits that a step needs at each scored entry: the log-prob of its
    next token, of the sampler's top-k ids, and the entropy, of the distribution after the transforms
    ``t``. The logits are ``[m, V]``, one row per distinct computed token; entry ``i`` reads row
    ``row_of[i]`` (``None``: row ``i``), so entries that share a row share its log-softmax.

    Under autograd (:meth:`apply`) the one ``[m, V]`` tensor kept for the backward is the rows'
    log-softmax, and the backward turns it into the logits' gradient in place, in closed form:
    ``dz = scatter(g) - p * sum(g) - g_H * p * (log p + H)`` per row, divided by the temperature (the
    transforms' masks pass no gradient: ``p`` is 0 there). Autograd through the ops would hold the
    exponentials, the log-softmax and several ``[m, V]`` gradients, and it gives NaN for an entropy
    bonus under a transform that masks tokens. The forward values are those of
    ``log_softmax(process_logits(logits, t))`` gathered, bit for bit: the same ops, a block of rows at
    a time (:func:`~rlfw.model.distribution.row_blocks`: 4 MiB of logits, whose temporaries stay in
    cache), and a row's result does not depend on its block under the invariant kernels.
    """

    log_softmax: Callable[[Tensor], Tensor]
    t: Transforms
    entropy: bool
    entropy_grad: bool

    def forward_rows(
        self, logits: Tensor, row_of: Tensor | None, targets: Tensor, topk_ids: Tensor | None
    ) -> tuple[tuple[Tensor, Tensor | None, Tensor | None], Tensor, Tensor | None]:
        """``((logp [c], topk_logp [c, K] | None, entropy [c] | None), log_softmax [m, V], entropy
        [m] | None)`` for ``targets [c, 1]`` and ``topk_ids [c, K]``; no gradient."""
        with torch.no_grad():
            m, vocab = logits.shape
            logp = torch.empty((m, vocab), dtype=torch.float32, device=logits.device)
            ent = logp.new_empty(m) if self.entropy else None
            for r in row_blocks(m, vocab):
                block = logp[r]
                block.copy_(self.log_softmax(process_logits(logits[r], self.t)))
                if ent is not None:  # -sum p log p, a token masked to -inf counting 0
                    ent[r] = -block.exp().mul_(block).nan_to_num_().sum(-1)
            rows = torch.arange(m, device=logp.device) if row_of is None else row_of
            taken = logp[rows[:, None], targets].squeeze(-1)
            topk = None if topk_ids is None else logp[rows[:, None], topk_ids]
            entries_ent = None if ent is None else ent if row_of is None else ent[row_of]
            return (taken, topk, entries_ent), logp, ent

    def apply(
        self, logits: Tensor, row_of: Tensor | None, targets: Tensor, topk_ids: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        """:meth:`forward_rows`'s reads, differentiable with respect to ``logits`` (the entropy only
        with ``entropy_grad``)."""
        out: tuple[Tensor | None, ...] = _Rows.apply(logits, row_of, targets, topk_ids, self)
        return out


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        row_of: Tensor | None,
        targets: Tensor,
        topk_ids: Tensor | None,
        rows: DistributionRows,
    ) -> tuple[Tensor | None, ...]:
        (logp, topk, ent), logp_all, row_ent = rows.forward_rows(logits, row_of, targets, topk_ids)
        if row_of is None:
            row_of = torch.arange(logits.shape[0], device=logits.device)
        ctx.rows, ctx.dtype = rows, logits.dtype
        ctx.save_for_backward(logp_all, row_of, targets, topk_ids, topk, row_ent)
        if ent is not None and not rows.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, topk, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_logp: Tensor | None, g_topk: Tensor | None, g_ent: Tensor | None
    ) -> tuple[Tensor, None, None, None, None]:
        d, row_of, targets, topk_ids, topk, ent = ctx.saved_tensors  # d: the log-softmax, made the gradient
        rows: DistributionRows = ctx.rows
        m, vocab = d.shape
        g_logp = d.new_zeros(row_of.shape[0]) if g_logp is None else g_logp.float()
        if g_topk is not None:  # a top-k id the transforms removed passes no gradient
            g_topk = g_topk.float().masked_fill(topk == float("-inf"), 0.0)
        # each row's sum of what its entries' reads pass back, and of their entropy gradients (index_put_
        # accumulates in a fixed order on CUDA too, where index_add_ uses atomics)
        g_entries = g_logp if g_topk is None else g_logp + g_topk.sum(-1)
        total = d.new_zeros(m).index_put_((row_of,), g_entries, accumulate=True)
        row_g_ent = None
        if g_ent is not None and rows.entropy_grad:
            row_g_ent = d.new_zeros(m).index_put_((row_of,), g_ent.float(), accumulate=True)
        for r in row_blocks(m, vocab):
            block = d[r]
            p = block.exp()
            if row_g_ent is not None:  # dH/dz = -p (log p + H); p log p reads 0 where p is 0
                block.add_(ent[r, None]).mul_(p).nan_to_num_().mul_(-row_g_ent[r, None])
                block.sub_(p.mul_(total[r, None]))
            else:
                torch.mul(p, total[r, None].neg(), out=block)
        d.index_put_((row_of[:, None], targets), g_logp[:, None], accumulate=True)
        if g_topk is not None:
            d.index_put_((row_of[:, None], topk_ids), g_topk, accumulate=True)
        if rows.t.temperature != 1.0:
            d.div_(rows.t.temperature)
        return d.to(ctx.dtype), None, None, None, None


def _placed(values: Tensor, where: tuple[Tensor, ...], like: Tensor) -> Tensor:
    """``values [n, ...]`` of the scored positions ``where`` laid out as ``like``'s ``[B, L-1, ...]``
    (fp32), zero elsewhere."""
    out = values.new_zeros(like.shape)
    return out.index_put(where, values)


def scoring_logp(
    model: nn.Module,
    ops_model: Transformer,
    batch: TrainBatch,
    t: Transforms,
    micro: int,
    topk: bool = False,
    chunk_mib: float = 0,
) -> tuple[Tensor, Tensor | None]:
    """The no-grad scoring forward over the whole batch, in micro-batches: ``[B, L-1]``, and with
    ``topk`` its log-probs at the sampler's top-k ids ``[B, L-1, K]`` (else None). ``chunk_mib``: as in
    :func:`trainer_logp`."""
    with torch.no_grad():
        outs = [
            trainer_logp(model, ops_model, mb, t, replay=True, topk=topk, chunk_mib=chunk_mib)
            for mb in batch.micro_batches(micro)
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
