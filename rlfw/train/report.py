"""One step's metrics (design section 6) from what the step produced."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.algos import CorrectionConfig, ratio_report
from rlfw.train.phases import Trained
from rlfw.trainer.step import loss_inputs
from rlfw.types import Sample, TrainBatch


@dataclass
class StepTimes:
    generate: float
    reward: float
    train: float
    sync: float
    total: float


def reward_metrics(samples: list[Sample], failed: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples if s.reward is not None], dtype=torch.float64)
    return {
        "reward/mean": float(rewards.mean()) if rewards.numel() else float("nan"),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/failed": float(failed),
        "reward/samples": float(len(samples)),
    }


def sync_metrics(batch: TrainBatch, trainer_version: int, resyncs: int) -> dict[str, float]:
    """Staleness of the trained tokens: the trainer's version minus each token's sampling version."""
    gap = (trainer_version - batch.version)[batch.mask].float()
    return {
        "sync/resyncs": float(resyncs),
        "sync/staleness_mean": float(gap.mean()) if gap.numel() else 0.0,
        "sync/version_gap_max": float(gap.max()) if gap.numel() else 0.0,
    }


def step_report(
    trained: Trained, correction: CorrectionConfig, trainer_version: int, resyncs: int, times: StepTimes
) -> dict[str, float | Tensor]:
    """The metrics every step reports, in either loop: ratio factors and ESS over the whole batch (computed
    once, here), the trainer's scalars, rewards, staleness and timings."""
    samples, batch, result = trained.scored.samples, trained.scored.batch, trained.result
    tokens = sum(s.response_T.shape[0] for s in samples)
    report: dict[str, float | Tensor] = {}
    report |= ratio_factors(batch, result.trainer_logp, result.old_logp, correction)
    report["ratio/prefill_coverage"] = prefill_coverage(batch)
    report |= result.scalars
    report |= reward_metrics(samples, trained.scored.failed_rewards)
    report |= trained.scored.reward_parts
    report |= sync_metrics(batch, trainer_version, resyncs)
    report |= time_metrics(tokens, len(samples), times.generate, times)
    return report


def prefill_coverage(batch: TrainBatch) -> float:
    """Share of trained tokens whose sequence has a prefill value (``engine.prefill_fraction``); on the
    others the trainer factor is measured against the decode stream and the decode factor is 1."""
    if batch.prefilled is None:
        return 1.0
    return float(batch.prefilled.sum()) / max(batch.num_tokens, 1)


def ratio_factors(
    batch: TrainBatch, q: Tensor, old: Tensor, correction: CorrectionConfig
) -> dict[str, float | Tensor]:
    """Ratio metrics over a whole batch: every factor, the lag ratio, ESS (design section 6).

    q, old: [B, L-1], the trainer's pre-update log-probs and the PPO reference it used."""
    inputs = loss_inputs(batch, q, None, old, max(batch.num_tokens, 1), max(len(batch), 1))
    metrics = ratio_report(inputs, correction)
    return {k: (v if v.dim() else float(v)) for k, v in metrics.items()}


def time_metrics(tokens: int, samples: int, seconds: float, times: StepTimes) -> dict[str, float]:
    """Phase timings, and throughput as ``tokens`` and ``samples`` per ``seconds``: the generate phase in
    sync mode, the whole step in async mode (where generation overlaps training and the driver's wait
    for it is no measure of the engines' speed)."""
    return {
        "throughput/tokens_per_s": tokens / max(seconds, 1e-9),
        "throughput/samples_per_s": samples / max(seconds, 1e-9),
        "time/step": times.total,
        "time/generate": times.generate,
        "time/reward": times.reward,
        "time/train": times.train,
        "time/sync": times.sync,
    }


def worst_finite(gaps: Tensor) -> float:
    """The largest finite entry of ``gaps`` (NaN when there is none)."""
    finite = gaps[torch.isfinite(gaps)]
    return float(finite.max()) if finite.numel() else float("nan")


def decode_kv_staleness(samples: list[Sample]) -> dict[str, float]:
    """``ratio/decode_kv/max_abs_log``: the worst |log s^P - log s^D| over tokens drawn at their sequence's
    final version, where prefill and decode held the same weights and only the KV cache the decode step
    read can separate them: after an in-flight update, stale K/V under ``kv_policy=keep`` (non-zero), a
    recomputed cache under ``recompute`` (exactly 0 under the execution contract). On the other tokens the
    decode factor also carries the weight change inside the sequence. NaN when no token qualifies."""
    gaps = [
        (s.prefill_logp - s.decode_logp)[s.version_T == s.final_version].abs()
        for s in samples
        if len(s.response_T)
    ]
    return {"ratio/decode_kv/max_abs_log": worst_finite(torch.cat(gaps) if gaps else torch.zeros(0))}


def trainer_numerics(batch: TrainBatch, trainer_logp: Tensor, trainer_version: int) -> dict[str, float]:
    """``ratio/trainer_numerics/max_abs_log``: the worst |log q - log s^P| over tokens drawn at the
    trainer's own version, where trainer and engine held the same weights and only kernel numerics can
    separate them (exactly 0 under the execution contract). NaN on a step with no such token; on the
    other tokens the trainer factor is lag plus numerics and the two cannot be told apart.

    trainer_logp: [B, L-1], the trainer's pre-update log-probs (``TrainResult.trainer_logp``)."""
    same = batch.mask & (batch.version == trainer_version)
    return {
        "ratio/trainer_numerics/max_abs_log": worst_finite((trainer_logp - batch.prefill_logp)[same].abs())
    }
