"""The metric keys of a training step (design §6): one source of truth for the logger, the W&B
workspace, the report and the tests of the main job.

A step logs, for each factor of the importance ratio and for the policy-lag ratio, the mean of the
ratio, the worst token's |log r|, the k3 KL estimate and a histogram of log ratios; a correction that
acts on a ratio adds its clip or mask fraction. ESS, weight-sync state, reward, loss, gradient norm,
throughput and timings complete the step. `required_keys` is what every step must carry;
`known_keys` adds what a step may carry, so dashboards and reports can only name keys defined here.
"""

from __future__ import annotations

FACTORS: tuple[str, ...] = ("trainer", "decode", "sampler", "total")
"""The factors of log rho = log q - log mu (design §2), in the order the report shows them."""

LAG = "lag"
"""The policy-lag ratio: the trainer's weights against the weights that sampled each token."""

NUMERICAL = "numerical"
"""The numerical ratio: the PPO reference against the sampler (the total minus the lag), the ratio IcePop
masks; which factors it spans depends on the reference (`rlfw.algos.batch.CorrectionBatch.log_numerical`)."""

RATIOS: tuple[str, ...] = (*FACTORS, LAG, NUMERICAL)
"""Every ratio that gets its own panel group."""

RATIO_STATS: tuple[str, ...] = ("mean", "max_abs_log", "k3_kl", "hist")
"""Statistics logged for every ratio on every step (`rlfw.algos.ratios.ratio_metrics`)."""

CORRECTION_STATS: tuple[str, ...] = ("clip_frac", "mask_frac")
"""Statistics logged for a ratio only when a correction clips or masks it."""

HIST_SUFFIX = "/hist"
"""Keys ending in this carry a histogram of log ratios rather than a scalar."""

ESS_LAG = "ess/lag"
ESS_TOTAL = "ess/total"
ESS_LAG_SEQ = "ess/lag_seq"
ESS_TOTAL_SEQ = "ess/total_seq"
ESS_KEYS: tuple[str, ...] = (ESS_LAG, ESS_TOTAL, ESS_LAG_SEQ, ESS_TOTAL_SEQ)
"""ESS/N of the lag and total ratios, over tokens and over sequences (a sequence's weight is the product
of its token ratios); `sync.ess_level` picks which lag ESS the resync rule reads."""
SYNC_RESYNCS = "sync/resyncs"
SYNC_STALENESS_MEAN = "sync/staleness_mean"
SYNC_VERSION_GAP_MAX = "sync/version_gap_max"
ROUTER_REPLAY_MISMATCH_FRAC = "router/replay_mismatch_frac"

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_NONFINITE_TOKENS = "loss/nonfinite_tokens"
GRAD_NORM = "grad_norm"
THROUGHPUT_TOKENS_PER_S = "throughput/tokens_per_s"
THROUGHPUT_SAMPLES_PER_S = "throughput/samples_per_s"
TIME_STEP = "time/step"
TIME_GENERATE = "time/generate"
TIME_TRAIN = "time/train"
TIME_SYNC = "time/sync"

SYNC_RESYNCED = "sync/resynced"
SYNC_DROPPED_STALE = "sync/dropped_stale"
SYNC_TRAINED_SAMPLES = "sync/trained_samples"
SYNC_ENGINE_VERSION = "sync/engine_version"
SYNC_ENGINE_RESTARTS = "sync/engine_restarts"
SYNC_IN_FLIGHT_SAMPLES = "sync/in_flight_samples"
"""Async mode: samples a weight update landed in the middle of (engine.in_flight=true)."""
DECODE_KV_MAX_ABS_LOG = "ratio/decode_kv/max_abs_log"
"""Async mode: the decode factor on tokens drawn at their sequence's final version (KV staleness only)."""
TRAINER_NUMERICS_MAX_ABS_LOG = "ratio/trainer_numerics/max_abs_log"
"""Async mode: the worst |log q - log s^P| on tokens drawn at the trainer's own version (numerics only)."""

SYNC_KEYS: tuple[str, ...] = (SYNC_RESYNCS, SYNC_STALENESS_MEAN, SYNC_VERSION_GAP_MAX)
ASYNC_KEYS: tuple[str, ...] = (
    SYNC_RESYNCED,
    SYNC_DROPPED_STALE,
    SYNC_TRAINED_SAMPLES,
    SYNC_ENGINE_VERSION,
    SYNC_IN_FLIGHT_SAMPLES,
    DECODE_KV_MAX_ABS_LOG,
    TRAINER_NUMERICS_MAX_ABS_LOG,
)
"""What an async step adds: whether it pushed weights, the samples dropped as too stale and those trained
on (generated = trained + dropped, less failed rewards), the engines' version, the samples an in-flight
update landed in, the numerics-only factor."""
REQUIRED_RUN_KEYS: tuple[str, ...] = (REWARD_MEAN, LOSS_POLICY, GRAD_NORM, THROUGHPUT_TOKENS_PER_S, TIME_STEP)
"""The one key of each usual family (`reward/*`, `loss/*`, ...) that every step must carry."""

MEMORY_ROLLOUT_PEAK_RSS_MB = "memory/rollout_peak_rss_mb"
MEMORY_TRAINER_PEAK_RSS_MB = "memory/trainer_peak_rss_mb"
MEMORY_KEYS: tuple[str, ...] = (MEMORY_ROLLOUT_PEAK_RSS_MB, MEMORY_TRAINER_PEAK_RSS_MB)
"""Peak resident memory of the largest engine actor and trainer rank so far (MiB), logged every step."""

CORES_TRAINER_WIDENED_FRAC = "cores/trainer_widened_frac"
"""``lend_idle_cores=true``: the share of the trainer's compiled-kernel calls in the step that ran on
cores an idle pool lent it (rlfw.distributed.cores)."""

# Evaluation on held-out prompts (rlfw.train.evaluate), on the steps `eval.every` names.
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_PASS_AT_1 = "eval/pass@1"
EVAL_PASS_AT_K = "eval/pass@k"
EVAL_K = "eval/k"
EVAL_FAILED = "eval/failed"
EVAL_GREEDY_REWARD_MEAN = "eval/greedy_reward_mean"
EVAL_GREEDY_PASS = "eval/greedy_pass"
EVAL_KEYS = (
    EVAL_REWARD_MEAN,
    EVAL_PASS_AT_1,
    EVAL_PASS_AT_K,
    EVAL_K,
    EVAL_FAILED,
    EVAL_GREEDY_REWARD_MEAN,
    EVAL_GREEDY_PASS,
)

OPTIONAL_RUN_KEYS: tuple[str, ...] = (
    REWARD_STD,
    LOSS_VALUE,
    LOSS_NONFINITE_TOKENS,
    THROUGHPUT_SAMPLES_PER_S,
    TIME_GENERATE,
    TIME_TRAIN,
    TIME_SYNC,
    *MEMORY_KEYS,
    *EVAL_KEYS,
    CORES_TRAINER_WIDENED_FRAC,
)


def ratio_key(ratio: str, stat: str) -> str:
    """`ratio/{ratio}/{stat}`, refusing names outside `RATIOS` and the ratio statistics."""
    if ratio not in RATIOS:
        raise ValueError(f"unknown ratio {ratio!r}; allowed: {', '.join(RATIOS)}")
    if stat not in RATIO_STATS + CORRECTION_STATS:
        raise ValueError(
            f"unknown ratio statistic {stat!r}; allowed: {', '.join(RATIO_STATS + CORRECTION_STATS)}"
        )
    return f"ratio/{ratio}/{stat}"


def is_hist_key(key: str) -> bool:
    """Whether `key` carries a histogram (the `ratio/*/hist` keys)."""
    return key.endswith(HIST_SUFFIX)


def lag_ess_key(level: str) -> str:
    """The lag ESS key the resync rule reads at `sync.ess_level` (token | sequence)."""
    return {"token": ESS_LAG, "sequence": ESS_LAG_SEQ}[level]


def required_keys(moe: bool) -> list[str]:
    """Every key a training step must carry; MoE runs add the router-replay mismatch fraction."""
    keys = [ratio_key(r, s) for r in RATIOS for s in RATIO_STATS]
    keys += [*ESS_KEYS, *SYNC_KEYS, *REQUIRED_RUN_KEYS]
    if moe:
        keys.append(ROUTER_REPLAY_MISMATCH_FRAC)
    return keys


def known_keys() -> list[str]:
    """Every key this module defines: the required keys of an MoE run plus the optional ones."""
    optional = [ratio_key(r, s) for r in RATIOS for s in CORRECTION_STATS]
    return required_keys(moe=True) + optional + list(OPTIONAL_RUN_KEYS) + [SYNC_ENGINE_RESTARTS, *ASYNC_KEYS]
