"""Evaluation every ``eval.every`` steps: the task's held-out prompts, ``eval.samples`` samples each at the
engines' current weights and sampler settings, scored by the task's reward.

Logged with the step: ``eval/reward_mean`` (over the samples whose reward call succeeded), ``eval/pass@1``
and ``eval/pass@k`` (k = ``eval.samples``; a sample passes when its reward is at least
``eval.pass_threshold``; the unbiased estimator averaged over prompts), ``eval/failed`` (reward calls
that failed, counted as not passing); with ``eval.greedy`` also one greedy response per prompt
(``eval/greedy_reward_mean``, ``eval/greedy_pass``: the share of prompts it passes). The draws are seeded
the same at every evaluation, so two evaluations differ only through the weights.
"""

from __future__ import annotations

import math

import torch

from rlfw.logging import metrics as m
from rlfw.logging.progress import progress
from rlfw.train.phases import Driver, reward
from rlfw.types import GenerationRequest, Sample

EVAL_REQUEST_SEED = 7_777_777


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` of ``n`` samples passing: ``1 - C(n-c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_due(every: int, steps: int, step: int) -> bool:
    """After every ``every`` steps and after the last one; never when ``every`` is 0."""
    return every > 0 and ((step + 1) % every == 0 or step == steps - 1)


def evaluate(d: Driver) -> dict[str, float]:
    cfg, setup = d.run.eval, d.setup
    problems = setup.task.eval_problems(cfg.prompts)
    prompts = [torch.tensor(setup.tokenizer(p.prompt, add_special_tokens=False).input_ids) for p in problems]
    ids, length = list(range(len(problems))), d.run.engine.max_new_tokens
    bar = progress(total=2 if cfg.greedy else 1, desc="evaluation")
    samples = d.rollout.generate(GenerationRequest(ids, prompts, cfg.samples, length, EVAL_REQUEST_SEED))
    bar.update()
    failed, _ = reward(setup, problems, samples)
    passed = [0] * len(problems)
    for s in samples:
        if s.reward is not None and s.reward >= cfg.pass_threshold:
            passed[s.prompt_id] += 1
    n = k = cfg.samples
    out = {
        m.EVAL_REWARD_MEAN: mean_reward(samples),
        m.EVAL_PASS_AT_1: sum(pass_at_k(n, c, 1) for c in passed) / len(problems),
        m.EVAL_PASS_AT_K: sum(pass_at_k(n, c, k) for c in passed) / len(problems),
        m.EVAL_K: float(k),
        m.EVAL_FAILED: float(failed),
    }
    if cfg.greedy:
        greedy = d.rollout.generate(
            GenerationRequest(ids, prompts, 1, length, EVAL_REQUEST_SEED, greedy=True)
        )
        failed_greedy, _ = reward(setup, problems, greedy)
        out[m.EVAL_FAILED] += failed_greedy
        out[m.EVAL_GREEDY_REWARD_MEAN] = mean_reward(greedy)
        out[m.EVAL_GREEDY_PASS] = sum(
            s.reward is not None and s.reward >= cfg.pass_threshold for s in greedy
        ) / len(problems)
    bar.close()
    return out


def mean_reward(samples: list[Sample]) -> float:
    rewards = [s.reward for s in samples if s.reward is not None and math.isfinite(s.reward)]
    return sum(rewards) / len(rewards) if rewards else math.nan
