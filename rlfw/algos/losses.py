"""`policy_loss`: a correction's per-token loss, aggregated with counts passed in; `ratio_report`: the
per-factor ratio metrics of a whole step.

The two are separate because they run at different grains: the loss per micro-batch on a trainer rank,
the ratio metrics once per step over every token of the batch (on the driver). `policy_loss` returns only
what the loss alone knows (the correction's clip and mask fractions, the loss, dropped tokens)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlfw.algos.batch import CorrectionBatch, prepare
from rlfw.algos.config import CorrectionConfig
from rlfw.algos.corrections import CORRECTIONS
from rlfw.algos.inputs import LossInputs
from rlfw.algos.ratios import ess_from_log, factor_name, ratio_metrics, select_log_ratio, sequence_ess


def _token_mean(per_token: Tensor, batch: CorrectionBatch, inputs: LossInputs) -> Tensor:
    return per_token.sum() / inputs.num_tokens


def _seq_mean(per_token: Tensor, batch: CorrectionBatch, inputs: LossInputs) -> Tensor:
    if inputs.num_sequences is None:
        raise ValueError("correction.aggregation=seq_mean needs LossInputs.num_sequences (the global count)")
    lengths = batch.mask.sum(-1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(-1) / lengths).sum() / inputs.num_sequences


# Both divide by counts the caller passes (global over micro-batches and ranks), never by counts taken
# from this micro-batch, so gradient accumulation reproduces one big batch. A sequence's length is its
# masked-token count including tokens dropped as non-finite, as with token_mean's global count.
_AGGREGATIONS: dict[str, Callable[[Tensor, CorrectionBatch, LossInputs], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
}


def ratio_report(inputs: LossInputs, cfg: CorrectionConfig) -> dict[str, Tensor]:
    """Design §6 ratio metrics over valid tokens: each factor, the total, the lag ratio q / old, the
    numerical ratio old / mu (total minus lag), the product the correction acts on when it is none of
    those, and the ESS/N of lag and total, over tokens (`ess/lag`, `ess/total`) and over sequences
    (`ess/lag_seq`, `ess/total_seq`: each sequence weighted by the product of its token ratios)."""
    batch = prepare(inputs)
    log_ratios = dict(batch.log_factors)
    log_ratios["lag"] = batch.log_lag.detach()
    log_ratios["numerical"] = batch.log_numerical
    log_ratios.setdefault(
        factor_name(cfg.selected_factors), select_log_ratio(batch.log_factors, cfg.selected_factors)
    )
    metrics: dict[str, Tensor] = {}
    for name, log_ratio in log_ratios.items():
        metrics |= ratio_metrics(name, log_ratio, batch.valid)
    for name in ("lag", "total"):
        metrics[f"ess/{name}"] = ess_from_log(log_ratios[name], batch.valid)
        metrics[f"ess/{name}_seq"] = sequence_ess(log_ratios[name], batch.valid)
    return metrics


def policy_loss(inputs: LossInputs, cfg: CorrectionConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one micro-batch under the configured correction, and its metrics.

    The loss is sum over valid tokens of the correction's per-token loss, divided by `inputs.num_tokens`
    (token_mean), or the per-sequence token mean summed and divided by `inputs.num_sequences` (seq_mean).
    Gradient flows only into `trainer_logp` (and `trainer_topk_logp` for centering and dlc).
    Metrics (detached): the correction's own clip/mask fractions, `loss/policy`, and
    `loss/nonfinite_tokens` (masked tokens dropped because a log-probability stream was NaN or inf).
    The ratio metrics of the step are `ratio_report`'s, computed once over the whole batch.
    """
    batch = prepare(inputs)
    per_token, metrics = CORRECTIONS[cfg.name].loss(batch, cfg)
    per_token = torch.where(batch.valid, per_token, torch.zeros_like(per_token))
    loss = _AGGREGATIONS[cfg.aggregation](per_token, batch, inputs)
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics["loss/policy"] = loss.detach()
    metrics["loss/nonfinite_tokens"] = (batch.mask & ~batch.valid).sum()
    return loss, metrics
