"""``rlfw train`` end to end on the embedded default (local Ray, built-in engine, DeepSpeed on CPU).

If one of these breaks, the main job no longer does what the README promises a user on a laptop.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from rlfw.compose import project_root
from rlfw.logging.metrics import required_keys
from rlfw.logging.wandb_reader import read_offline_run
from tests.train._run import (
    SMALL,
    Run,
    run_train,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run root per module, so the cached warm start is built once."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def default_run(root: Path) -> Run:
    run = run_train(root, "default", "logger.wandb=true", timeout=900)
    assert run.returncode == 0, run.log[-3000:]
    return run


def _factor(row: dict[str, Any], factor: str) -> float:
    return float(row[f"ratio/{factor}/max_abs_log"])


@pytest.mark.slow
def test_embedded_default_learns(default_run: Run) -> None:
    rewards = [row["reward/mean"] for row in default_run.metrics()]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert len(rewards) == 60
    assert last > first + 0.04, (first, last)


@pytest.mark.slow
def test_the_bring_your_own_task_example_learns(root: Path) -> None:
    """recipes/example_dataset.yaml: examples/double's JSONL rows and reward file through task=dataset."""
    example = project_root() / "examples" / "double"
    run = run_train(
        root,
        "own_task",
        "recipe=example_dataset",
        f"task.data_path={example / 'data.jsonl'}",
        f"task.reward={example / 'reward.py'}:reward",
        "logger.wandb=false",
        "task.eval_fraction=0.2",
        "eval.every=10",
        timeout=900,
    )
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert len(rows) == 30 and all("reward/reward" in r for r in rows)
    evaluated = [r for r in rows if "eval/pass@k" in r]
    assert [r["step"] for r in evaluated] == [9, 19, 29]
    assert all(0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1 and r["eval/k"] == 4 for r in evaluated)
    assert all(0 <= r["eval/greedy_pass"] <= 1 for r in evaluated)
    rewards = [r["reward/mean"] for r in rows]
    first, last = statistics.mean(rewards[:8]), statistics.mean(rewards[-8:])
    assert last > first + 0.05, (first, last)


@pytest.mark.slow
def test_trainer_decode_and_sampler_factors_are_exactly_zero_under_the_contract(default_run: Run) -> None:
    """kernels=invariant, sync mode, fp32 sampler: the numerical factors are exactly 1 at every step."""
    for row in default_run.metrics():
        for factor in ("trainer", "decode", "sampler", "total", "lag"):
            assert _factor(row, factor) == 0.0, (row["step"], factor)
        assert row["ess/total"] == 1.0 and row["sync/staleness_mean"] == 0.0
    assert "PPO reference is the prefill stream" in default_run.log


@pytest.mark.slow
def test_metrics_and_the_offline_wandb_run_carry_every_key(default_run: Run) -> None:
    rows = default_run.metrics()
    for row in rows:
        missing = set(required_keys(moe=False)) - set(row)
        assert not missing, missing
    history = read_offline_run(default_run.run_dir)
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows, strict=True):
        assert not set(required_keys(moe=False)) - set(h)
        assert h["reward/mean"] == r["reward/mean"]
        assert h["ratio/sampler/hist"]["_type"] == "histogram"
    # peak resident memory of the engine actor and the trainer rank, reported every step, never shrinking
    for key in ("memory/rollout_peak_rss_mb", "memory/trainer_peak_rss_mb"):
        peaks = [r[key] for r in rows]
        assert peaks[0] > 100 and peaks == sorted(peaks), key  # each holds torch and a model: > 100 MiB


@pytest.mark.slow
def test_fp8_sampler_moves_only_the_sampler_factor(root: Path) -> None:
    run = run_train(root, "fp8", *SMALL, "trainer.steps=3", "engine.sampler.precision=fp8")
    assert run.returncode == 0, run.log[-3000:]
    for row in run.metrics():
        assert _factor(row, "sampler") > 0 and _factor(row, "total") > 0
        assert _factor(row, "trainer") == 0.0 and _factor(row, "decode") == 0.0


@pytest.mark.slow
def test_two_zero3_ranks_train_like_one_rank(root: Path) -> None:
    """Sharding the batch over ranks must not change the step: the loss is normalised by the global token
    count and gradients are summed over ranks (not averaged), so one rank and two give the same update.
    Eight groups a step and a longer warm start (reward about 0.15 rather than 0.05), so that some group's
    rewards differ and every step has a gradient to compare: with SMALL's four groups of a model that
    rarely scores, a step whose groups all tie (zero advantage, zero gradient) is a matter of the seed."""
    size = [*SMALL, "algo.prompts_per_step=8", "task.warm_start_steps=40", "trainer.steps=2"]
    one = run_train(root, "one_rank", *size, "trainer.num_ranks=1", "trainer.zero_stage=1")
    two = run_train(root, "zero3", *size, "trainer.num_ranks=2", "trainer.zero_stage=3")
    assert one.returncode == 0 and two.returncode == 0, two.log[-3000:]
    for a, b in zip(one.metrics(), two.metrics(), strict=True):
        assert _factor(b, "trainer") == 0.0 and a["reward/mean"] == b["reward/mean"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5, abs=1e-9)
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-5, abs=1e-9)
    assert all(r["grad_norm"] > 0 for r in one.metrics())


@pytest.mark.slow
def test_collective_weight_sync_delivers_the_exact_weights(root: Path) -> None:
    """Over the gloo broadcast group the engines get the trainer's weights bit for bit: the trainer factor
    of the next step (trainer at v+1 against an engine that loaded v+1) is exactly zero."""
    run = run_train(root, "collective", *SMALL, "trainer.steps=3", "sync.transport=collective")
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert len(rows) == 3 and all(_factor(r, "trainer") == 0.0 for r in rows)


@pytest.mark.slow
def test_moe_recipe_with_router_replay_logs_every_moe_key(root: Path) -> None:
    run = run_train(root, "moe_r3", "recipe=tiny_moe_r3", *SMALL, "trainer.steps=2")
    assert run.returncode == 0, run.log[-3000:]
    for row in run.metrics():
        assert not set(required_keys(moe=True)) - set(row)
        # same weights, invariant kernels: the trainer's own router would have chosen the replayed experts
        assert row["router/replay_mismatch_frac"] == 0.0 and _factor(row, "trainer") == 0.0


@pytest.mark.slow
def test_ppo_runs_with_a_critic(root: Path) -> None:
    run = run_train(root, "ppo", *SMALL, "algo=ppo", "algo.prompts_per_step=16", "trainer.steps=3")
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert len(rows) == 3 and all(r["loss/value"] is not None and r["loss/value"] >= 0 for r in rows)
    assert all(_factor(r, "trainer") == 0.0 for r in rows)


@pytest.mark.slow
def test_router_replay_with_vllm_trains_on_the_experts_vllm_chose(root: Path) -> None:
    """R3 with engine=vllm: the shared MoE model inside vLLM records its routing, the trainer replays it;
    under the contract every factor is exactly 1 and no replayed expert differs from the trainer's own."""
    run = run_train(
        root,
        "vllm_r3",
        *SMALL,
        "engine=vllm",
        "model=tiny_moe",
        "model.router_replay=true",
        "trainer.steps=3",
    )
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["router/replay_mismatch_frac"] == 0.0
        assert row["ratio/total/max_abs_log"] == 0.0


@pytest.mark.slow
def test_vllm_engine_trains_a_few_steps(root: Path) -> None:
    """engine=vllm: real vLLM in the rollout actor, weights pushed every step, a clean exit."""
    run = run_train(root, "vllm", *SMALL, "engine=vllm", "trainer.steps=4", timeout=600)
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["sync/engine_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]  # one version per step
    for row in rows:
        # the shared model, attention and log-softmax inside vLLM: the numerical factors are exactly 1
        for factor in ("trainer", "decode", "sampler", "total"):
            assert row[f"ratio/{factor}/max_abs_log"] == 0.0, (row["step"], factor)
    contract = json.loads((run.run_dir / "contract.json").read_text())
    assert contract["cases"]["engine_decode"]["ops"]["attention_cache"] == "vllm_paged_blocks"
    assert all(pair["bitwise"] for pair in contract["pairs"].values())
    assert "Aborted" not in run.log and "core dumped" not in run.log


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.foo=1"], "unknown config key 'model.foo'; keys allowed here: path, preset"),
        (["trainer.zero_stage=7"], "trainer.zero_stage=7 is not allowed; choose one of: 0, 1, 2, 3"),
        (["model=hf", "model.path=/no/such/checkpoint"], "/no/such/checkpoint/config.json not found"),
        (
            ["engine=vllm", "engine.vllm.model=stock"],
            "engine.vllm.model=stock cannot take weight updates on CPU",
        ),
    ],
)
def test_config_errors_fail_fast_and_name_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    run = run_train(tmp_path, "bad", *overrides, timeout=120)
    assert run.returncode == 2
    assert message in run.log
    assert "Traceback" not in run.log


@pytest.mark.slow
def test_the_shipped_workspace_panels_name_keys_the_run_logs(default_run: Run) -> None:
    """The W&B workspace (built with the installed wandb-workspaces) against a real run's keys: every
    key a step must carry is on some panel and logged, and a panel key the run did not log is one the
    metrics module declares optional (a correction's fractions, async, MoE, the critic)."""
    from rlfw.logging import metrics as m
    from rlfw.logging.dashboard import build_workspace

    logged = {key for row in default_run.metrics() for key in row}
    workspace = build_workspace("entity", "project", "rlfw")
    on_panels = {key for section in workspace.sections for panel in section.panels for key in panel.y}
    required = set(m.required_keys(moe=False))
    assert required <= logged and required <= on_panels, (required - logged, required - on_panels)
    optional = set(m.known_keys()) - required
    for section in workspace.sections:
        for panel in section.panels:
            missing = set(panel.y) - logged
            assert missing <= optional, (section.name, panel.title, missing)
    comparison = workspace.sections[-1]  # evaluation keys need eval.every > 0, which the default leaves off
    assert {key for panel in comparison.panels for key in panel.y} - set(m.EVAL_KEYS) <= logged
