"""Where a step of the embedded default goes, and what reusing the prefill stream saves.

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_breakdown.py [--steps 15]

Two measurements on the same machine:

1. The real ``rlfw train`` (local Ray, DeepSpeed, object-store weight sync) of the embedded default for
   ``--steps`` steps: median wall time per phase as the driver sees it (``time/*`` in metrics.jsonl).
2. The same phases computed in one process without Ray, from the run's warm-started checkpoint, with
   the same engine settings and the same DeepSpeed backend: pure compute. The difference between the
   two is orchestration (Ray calls, serialisation, scheduling).

The Ray run also reports the peak resident memory of the engine actor and the trainer rank
(``memory/*`` in metrics.jsonl). Inside generation, the prefill stream (one prefill of every finished
sequence) is timed separately, and the trainer's scoring forward, which the contract lets the trainer
skip by taking the prefill stream as the old-policy log-prob, is timed against the train step it would
be added to.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlfw.compose import load_config
from rlfw.distributed.cluster import SUBPROCESS_ENV, keep_freed_memory
from rlfw.model.distribution import Transforms
from rlfw.rollout.native import NativeEngine
from rlfw.tasks.arithmetic import Arithmetic
from rlfw.tasks.rewards import score
from rlfw.tokenizer import build_tiny_tokenizer
from rlfw.train.collate import collate, grpo_advantages
from rlfw.trainer.logprobs import scoring_logp
from rlfw.trainer.step import StepSpec, train_step
from rlfw.types import GenerationRequest

PHASES = ("time/generate", "time/reward", "time/train", "time/sync", "time/step")
MEMORY = ("memory/rollout_peak_rss_mb", "memory/trainer_peak_rss_mb")


def ray_run(root: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    env = os.environ | SUBPROCESS_ENV
    cmd = [
        str(Path(sys.executable).with_name("rlfw")),
        "train",
        f"logger.run_root={root}",
        "logger.run_name=b",
        f"trainer.steps={steps}",
        "logger.wandb=false",
        *overrides,
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (root / "b" / "metrics.jsonl").read_text().splitlines()][1:]
    phases = {k: statistics.median(r[k] for r in rows) for k in PHASES}
    return phases | {k: max(r[k] for r in rows) for k in MEMORY}


def _without_stop(response: torch.Tensor, eos: int) -> list[int]:
    ids = response.tolist()
    return ids[:-1] if ids and ids[-1] == eos else ids


def in_process(root: Path, reps: int, overrides: list[str]) -> dict[str, float]:
    """The same phases in this process: the warm-started checkpoint of the Ray run, the same engine
    settings, the same DeepSpeed backend (one rank over gloo), no Ray."""
    import deepspeed

    from rlfw.model import from_pretrained
    from rlfw.train.setup import optim_config
    from rlfw.trainer.deepspeed_backend import DeepSpeedBackend

    run = load_config(overrides)
    tok, task = build_tiny_tokenizer(), Arithmetic(run.task.max_operand)
    checkpoint = next((root / ".cache").glob("warm_start-*"))
    trainer_model = from_pretrained(checkpoint, kernels=run.kernels).train()
    engine = NativeEngine.from_config(
        from_pretrained(checkpoint, kernels=run.kernels), run.engine, [tok.eos_token_id]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    backend = DeepSpeedBackend(trainer_model, optim_config(run))
    retire = engine._retire  # time the prefill stream inside generation
    prefill_time = [0.0]

    def timed_retire():  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = retire()
        prefill_time[0] += time.perf_counter() - t
        return out

    engine._retire = timed_retire  # type: ignore[method-assign]
    spec = StepSpec(Transforms(), run.correction, run.trainer.micro_batch_size, "prefill", False)
    times: dict[str, list[float]] = {k: [] for k in ("generate", "prefill_stream", "score", "train", "sync")}
    for step in range(reps):
        problems = task.sample(run.algo.prompts_per_step, random.Random(step))
        prompts = [torch.tensor(tok(p.prompt, add_special_tokens=False).input_ids) for p in problems]
        request = GenerationRequest(
            list(range(len(problems))), prompts, run.algo.group_size, run.engine.max_new_tokens, step
        )
        prefill_time[0] = 0.0
        t0 = time.perf_counter()
        samples = engine.generate(request)
        t1 = time.perf_counter()
        # the Ray run's reward (the task's own), so the policy learns the same thing in both halves
        texts = [
            str(tok.decode(_without_stop(s.response_T, tok.eos_token_id), skip_special_tokens=True))
            for s in samples
        ]
        result = score(task, [problems[s.prompt_id] for s in samples], texts)
        for s, r in zip(samples, result.rewards, strict=True):
            s.reward = r
        batch = collate(*grpo_advantages(samples, True, False))
        t2 = time.perf_counter()
        scoring_logp(backend.module, trainer_model, batch, Transforms(), run.trainer.micro_batch_size)
        t3 = time.perf_counter()
        train_step(backend, trainer_model, batch, spec, batch.num_tokens, len(batch))
        t4 = time.perf_counter()
        engine.update_weights(backend.full_state_dict(), step + 1)
        t5 = time.perf_counter()
        for k, value in zip(times, (t1 - t0, prefill_time[0], t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[k].append(value)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("overrides", nargs="*", help="config overrides for both measurements")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the actors do, so the two measurements differ by orchestration alone
    root = Path(tempfile.mkdtemp())
    ray_phases = ray_run(root, args.steps, args.overrides)
    local = in_process(root, args.steps, args.overrides)
    step = ray_phases["time/step"]
    compute = local["generate"] + local["train"] + local["sync"]
    label = " ".join(["embedded default", *args.overrides])
    print(f"{label}, median over steps 1..{args.steps - 1}, seconds")
    print("| phase | rlfw train (Ray) | in-process compute | share of Ray step |")
    print("|---|---|---|---|")
    for name, key in (("generate", "time/generate"), ("train", "time/train"), ("weight sync", "time/sync")):
        local_key = {"time/generate": "generate", "time/train": "train", "time/sync": "sync"}[key]
        print(f"| {name} | {ray_phases[key]:.3f} | {local[local_key]:.3f} | {ray_phases[key] / step:.1%} |")
    reward = ray_phases["time/reward"]
    print(f"| reward + batching | {reward:.3f} | - | {reward / step:.1%} |")
    print(f"| whole step | {step:.3f} | {compute:.3f} | 100% |")
    overhead = step - compute - ray_phases["time/reward"]
    print(
        f"\norchestration (Ray step - in-process compute - reward): {overhead:.3f} s = {overhead / step:.1%}"
    )
    print(f"weight sync + orchestration: {(overhead + ray_phases['time/sync']) / step:.1%} of the step")
    print(
        f"prefill stream inside generation: {local['prefill_stream']:.3f} s "
        f"({local['prefill_stream'] / local['generate']:.1%} of generation)"
    )
    print(
        f"trainer scoring forward skipped by reusing the prefill stream: {local['score']:.3f} s "
        f"= {local['score'] / local['train']:.1%} of the train step it would be added to"
    )
    print(
        f"peak resident memory (Ray run): rollout actor {ray_phases[MEMORY[0]]:.0f} MiB, "
        f"trainer rank {ray_phases[MEMORY[1]]:.0f} MiB"
    )


if __name__ == "__main__":
    main()
