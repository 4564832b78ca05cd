"""``sync.mode=async``: the staleness bound, sample accounting, the resync rule and the PPO reference.

The fast tests pin the pure bookkeeping (which samples are dropped, how far a pipelined batch can lag);
the slow ones run ``rlfw train`` end to end and check the same claims on what the run logged. If one of
these breaks, async training trains on data older than the user allowed, loses or double-counts samples,
or pushes weights against its own rule.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfw.train.schedule import SyncClock, pipeline_depth, split_stale
from rlfw.types import Sample
from tests.train._run import SMALL, comparable, run_train, run_until, state_step_at_least


def _sample(index: int, versions: list[int], final: int | None = None) -> Sample:
    n = len(versions)
    return Sample(
        prompt_id=0,
        sample_index=index,
        prompt_P=torch.tensor([1, 2]),
        response_T=torch.arange(n),
        sampler_logp=torch.zeros(n),
        decode_logp=torch.zeros(n),
        prefill_logp=torch.zeros(n),
        version_T=torch.tensor(versions, dtype=torch.int64),
        kv_version_T=torch.tensor(versions, dtype=torch.int64),
        topk_ids=torch.zeros(n, 1, dtype=torch.int64),
        topk_logp=torch.zeros(n, 1),
        finish_reason="length",
        final_version=final if final is not None else (max(versions) if versions else 0),
    )


@pytest.mark.parametrize(
    ("trainer_version", "max_staleness", "kept_indices"),
    [
        (5, 2, [1, 2, 3]),  # oldest allowed version 3: sample 0 (version 2) is one too old
        (5, 0, [3]),  # only the trainer's own version survives
        (5, 5, [0, 1, 2, 3]),
        (8, 2, []),  # everything predates version 6
    ],
)
def test_split_stale_drops_whole_samples_older_than_the_bound(
    trainer_version: int, max_staleness: int, kept_indices: list[int]
) -> None:
    # sample 2 mixes versions 3 and 4: its oldest token (3) decides. Sample 3 is empty, finished at 5.
    samples = [_sample(0, [2, 2]), _sample(1, [3]), _sample(2, [3, 4]), _sample(3, [], final=5)]
    kept, dropped = split_stale(samples, trainer_version, max_staleness)
    assert [s.sample_index for s in kept] == kept_indices
    assert sorted(s.sample_index for s in kept + dropped) == [0, 1, 2, 3]  # each sample exactly once
    assert not {id(s) for s in kept} & {id(s) for s in dropped}


def test_pipeline_depth_never_exceeds_the_staleness_bound() -> None:
    assert [pipeline_depth(k) for k in (0, 1, 2, 10)] == [0, 1, 1, 1]


def _simulate_gaps(policy: str, interval: int, max_staleness: int, steps: int) -> tuple[list[int], int]:
    """The async loop's version arithmetic without a cluster: generation for step s + depth is submitted
    at the engines' version before step s trains; returns each step's version gap and the pushes."""
    clock, depth = SyncClock(0, 0), pipeline_depth(max_staleness)
    in_flight = [clock.engine_version] * depth
    gaps = []
    for _ in range(steps):
        drawn_at = in_flight.pop(0) if in_flight else clock.engine_version
        if depth:
            in_flight.append(clock.engine_version)
        gaps.append(clock.trainer_version - drawn_at)
        clock.trained()
        if clock.due(policy, interval, 0.5, max_staleness, lag_ess=1.0):
            clock.pushed()
    return gaps, clock.resyncs


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3, 5])
@pytest.mark.parametrize(("policy", "interval"), [("every_step", 1), ("interval", 2), ("interval", 100)])
def test_pipelined_batches_reach_but_never_pass_the_staleness_bound(
    policy: str, interval: int, max_staleness: int
) -> None:
    gaps, _ = _simulate_gaps(policy, interval, max_staleness, steps=20)
    assert max(gaps) <= max_staleness
    if policy == "interval" and interval == 100:  # only the hard bound pushes: the gap climbs to it
        assert max(gaps) == max_staleness
    if max_staleness >= 1 and policy == "every_step":  # one step in flight: one version behind
        assert gaps[1:] == [1] * 19


def test_interval_policy_pushes_every_interval_steps() -> None:
    # interval 3 under a loose bound: pushes after steps 3, 6, 9, 12 -> 4 pushes in 12 steps
    _, resyncs = _simulate_gaps("interval", 3, 10, steps=12)
    assert resyncs == 4


# -- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run root per module, so the cached warm start is built once."""
    return tmp_path_factory.mktemp("async_runs")


def _accounted(row: dict[str, Any]) -> bool:
    """Every generated sample was trained on once or dropped as stale (the arithmetic task never fails a
    reward, so GRPO keeps every group)."""
    return row["sync/trained_samples"] + row["sync/dropped_stale"] == row["reward/samples"]


@pytest.mark.slow
def test_async_never_trains_on_tokens_older_than_max_staleness(root: Path) -> None:
    """policy=interval with a huge interval: only the hard bound pushes weights, so the gap climbs to
    max_staleness=2, a push happens there, and no step ever trains on an older token."""
    run = run_train(
        root,
        "bounded",
        *SMALL,
        "trainer.steps=6",
        "sync=async",
        "sync.policy=interval",
        "sync.interval=100",
        "sync.max_staleness=2",
    )
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert len(rows) == 6
    for row in rows:
        assert row["sync/version_gap_max"] <= 2, row["step"]
        assert _accounted(row), row["step"]
    assert max(r["sync/version_gap_max"] for r in rows) == 2
    assert [r["sync/resynced"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert rows[-1]["sync/resyncs"] == 3.0


@functools.cache
def _ess_run(root: Path, lr: str) -> list[dict[str, Any]]:
    """One async run under policy=ess per learning rate (shared by the tests below)."""
    run = run_train(
        root,
        f"ess_lr{lr}",
        *SMALL,
        "trainer.steps=6",
        f"trainer.lr={lr}",
        "sync=async",
        "sync.policy=ess",
        "sync.ess_threshold=0.9",
        "sync.max_staleness=100",  # never the hard bound: every push is the ESS rule's
    )
    assert run.returncode == 0, run.log[-3000:]
    return run.metrics()


@pytest.mark.slow
def test_ess_policy_resyncs_exactly_when_the_lag_ess_drops_below_the_threshold(root: Path) -> None:
    rows = _ess_run(root, "1e-2")
    for row in rows:
        lag_ess = row["ess/lag_seq"]  # sync.ess_level=sequence, the default
        below = lag_ess is None or math.isnan(lag_ess) or lag_ess < 0.9
        assert row["sync/resynced"] == float(below), (row["step"], lag_ess)
        assert _accounted(row)
    assert rows[0]["sync/resynced"] == 0.0  # step 0 trains on its own version: no lag
    assert any(r["sync/resynced"] for r in rows), [r["ess/lag_seq"] for r in rows]
    assert rows[-1]["sync/resyncs"] == sum(r["sync/resynced"] for r in rows)


@pytest.mark.slow
def test_a_larger_learning_rate_triggers_the_first_resync_earlier(root: Path) -> None:
    """The policy moves further per step with a larger learning rate, so the lag ratio's ESS falls below
    the threshold after fewer steps."""

    def first_resync(rows: list[dict[str, Any]]) -> int:
        return next((r["step"] for r in rows if r["sync/resynced"]), len(rows))

    fast, slow = first_resync(_ess_run(root, "1e-2")), first_resync(_ess_run(root, "1e-4"))
    assert fast < slow, (fast, slow)


@pytest.mark.slow
def test_dlc_runs_end_to_end_in_async_mode(root: Path) -> None:
    run = run_train(root, "dlc", *SMALL, "trainer.steps=3", "sync=async", "correction=dlc")
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    assert len(rows) == 3
    assert all("ratio/lag/clip_frac" in r and _accounted(r) for r in rows)
    assert rows[1]["sync/version_gap_max"] == 1.0  # pipelined: trained one version after it was drawn
    assert rows[0]["ratio/trainer_numerics/max_abs_log"] == 0.0  # same weights, invariant kernels
    assert "PPO reference is the prefill stream" in run.log


@pytest.mark.slow
def test_lending_idle_cores_changes_no_value_the_run_logs(root: Path) -> None:
    """``lend_idle_cores=true``: the trainer borrows the engine's core once the generation in flight is
    done (the engine the trainer's between steps), at moments that depend on timing. Only the compiled
    kernels widen, and they give the same bits at any thread count, so two such runs log the same
    values."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("lending needs a second core")
    args = (*SMALL, "trainer.steps=3", "sync=async", "correction=dlc", "lend_idle_cores=true")
    runs = [run_train(root, f"cores-lent-{i}", *args) for i in range(2)]
    logged = []
    for run in runs:
        assert run.returncode == 0, run.log[-3000:]
        rows = run.metrics()
        widened = [r.pop("cores/trainer_widened_frac") for r in rows]
        assert widened[-1] > 0  # the last step trains while the engine has nothing left to generate
        assert not (run.run_dir / "cores.ledger").exists()
        logged.append([comparable(r) for r in rows])
    assert logged[0] == logged[1]


# pushes land inside the generation in flight, after its second engine step (which waits for them)
IN_FLIGHT_AT_STEP_2 = ["engine.in_flight=true", "engine.in_flight_at_step=2"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "vllm"])
@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_in_flight_updates_end_to_end(root: Path, engine: str, kv_policy: str) -> None:
    """engine.in_flight=true: pushes land inside the generation in flight, samples carry two versions,
    and on tokens drawn at their sequence's final version the decode factor is the KV cache alone:
    exactly 0 recomputed, non-zero kept stale. In the built-in engine and in vLLM (driven step by step,
    its running requests preempted and prefilled again to recompute). ``engine.in_flight_at_step=2``
    makes each generation wait after its second step for the push the trainer sends during it, so that
    every step after the first has samples spanning two versions (the tiny model's answers are a few
    tokens long), whichever side is faster."""
    run = run_train(
        root,
        f"in_flight_{engine}_{kv_policy}",
        *SMALL,
        f"engine={engine}",
        "algo.prompts_per_step=8",
        "algo.group_size=8",
        "engine.max_new_tokens=48",
        "engine.max_model_len=96",
        "trainer.steps=6",
        "sync=async",
        "sync.policy=every_step",
        *IN_FLIGHT_AT_STEP_2,
        f"engine.kv_policy={kv_policy}",
    )
    assert run.returncode == 0, run.log[-3000:]
    rows = run.metrics()
    spanning = [r for r in rows if r["sync/in_flight_samples"] > 0]
    assert [r["step"] for r in spanning] == [r["step"] for r in rows[1:]], "a push missed its generation"
    for row in rows:
        assert _accounted(row) and row["sync/version_gap_max"] <= 4
        if kv_policy == "recompute":
            assert row["ratio/decode_kv/max_abs_log"] == 0.0, row["step"]
    if kv_policy == "keep":
        stale = [r["ratio/decode_kv/max_abs_log"] > 0.0 for r in spanning]
        # vLLM rescores every sequence after the whole generation: when a second push lands after a sample
        # finished, none of its tokens is at its final version and the step may show only fresh samples.
        assert all(stale) if engine == "native" else any(stale), stale
    assert "PPO reference is the decode stream" in run.log


@pytest.mark.slow
def test_async_with_the_discrepancy_lag_correction_learns(root: Path) -> None:
    """The embedded default in async mode with correction=dlc (ESS-triggered resync by default) and
    trainer.lr=1e-3: reward rises over 60 steps. Under the contract there is no numerical discrepancy,
    so dlc is PPO-clip against the sampler's weights; at the recipe's lr 2e-3 that async run degrades on
    this task, as the uncorrected one does (bench/RESULTS.md, "Does async learn?")."""
    run = run_train(
        root,
        "async_dlc_learns",
        "sync=async",
        "correction=dlc",
        "trainer.lr=1e-3",
        "logger.wandb=false",
        timeout=900,
    )
    assert run.returncode == 0, run.log[-3000:]
    rewards = [row["reward/mean"] for row in run.metrics()]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert len(rewards) == 60
    assert last > first + 0.04, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("transport", "landing"),
    [("object_store", "after"), ("collective", "after"), ("object_store", "in_flight_at_step")],
)
def test_resume_of_an_async_run_after_kill_gives_the_same_metrics(
    root: Path, transport: str, landing: str
) -> None:
    """policy=interval 2: at a checkpoint the engines are behind the trainer and the next step was
    submitted at an older version still; the resumed run puts both back and continues identically. With
    in-flight pushes pinned to a step (``engine.in_flight_at_step``), the checkpoints fall on the steps
    that push (1, 3, 5), so the next step's generation had a push land inside it, and the resumed run's
    reload of the engines' version must land in the resubmitted generation where that push did."""
    in_flight = landing == "in_flight_at_step"
    args = [*SMALL, "trainer.steps=7", f"trainer.checkpoint_every={2 if in_flight else 3}", "sync=async"]
    args += ["sync.policy=interval", "sync.interval=2", "sync.max_staleness=4", f"sync.transport={transport}"]
    args += IN_FLIGHT_AT_STEP_2 if in_flight else []
    name = f"{transport}_{landing}"
    whole = run_train(root, f"async_whole_{name}", *args)
    assert whole.returncode == 0, whole.log[-3000:]
    if in_flight:  # the pushes did land inside generations
        assert any(r["sync/in_flight_samples"] > 0 for r in whole.metrics())
    checkpointed = state_step_at_least(1 if in_flight else 2)
    killed = run_until(root, f"async_killed_{name}", args, checkpointed, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    state = json.loads((killed.run_dir / "run_state.json").read_text())
    assert state["pending_version"] < state["version"]  # the case that needs the saved engine weights
    if in_flight:  # a push was sent into the pending generation: the resumed run must land it again
        assert state["pending_version"] < state["engine_version"]
    resumed = run_train(root, f"async_killed_{name}", *args, "resume=true")
    assert resumed.returncode == 0, resumed.log[-3000:]
    after = resumed.metrics()
    assert [r["step"] for r in after] == list(range(7))
    resumed_at = state["step"] + 1  # the first step the resumed run computed
    for a, b in zip(whole.metrics()[resumed_at:], after[resumed_at:], strict=True):
        assert comparable(a) == comparable(b), a["step"]
