"""End-to-end GRPO steps against TRL's ``GRPOTrainer``, on the same model, task and token count.

    .venv/bin/pip install trl==1.16.0      # the peer; not a dependency of rlfw
    .venv/bin/python bench/grpo_vs_trl.py --steps 7 --rounds 2

Both sides train the 13M Qwen3 checkpoint of ``bench/rollout_vs_peers.py`` (fp32, the tiny character
tokenizer saved beside it) with GRPO on the arithmetic task (rlfw's own reward, called by both), 16
prompts x 4 completions of exactly 64 tokens per step (rlfw ``engine.ignore_eos=true``, TRL
``min_new_tokens=64``), one optimizer step per generation, lr 1e-3, no KL term. Each side runs in its own
process; the sides alternate round by round, and a side's step time is the median over its steps but the
first (which compiles and warms up) and the last (in an async run it has no generation in flight to
overlap, so it is faster than the steady state; until 2026-12-03 it was kept, which flattered the async
sides by 1-10%: see bench/RESULTS.md). Sides:

* ``trl``: ``GRPOTrainer`` on CPU, ``torch.set_num_threads(--trl-threads)`` (default: every core, the
  whole machine, as a user would run it);
* ``trl-keepheap``: the same with glibc keeping freed memory (``rlfw.distributed.cluster.
  keep_freed_memory``, what rlfw's actors do), to show how much of a gap that setting alone makes;
* ``rlfw-sync``: ``rlfw train`` (Ray, a rollout actor and a DeepSpeed rank of one thread each, all four
  streams on every token);
* ``rlfw-sync-allcores``: ``rlfw-sync`` with ``engine.cpu_threads=0 trainer.cpu_threads=0``: the phases
  take turns, so each uses every core (as TRL's single process does);
* ``rlfw-async``: the same with ``sync=async`` (generation of step t+1 overlaps training on step t, so
  the two pools work at once), with ``correction=dlc``, the correction an async run would use.
* ``rlfw-async-allcores``: ``rlfw-async`` with every pool's kernels on every core
  (``engine.cpu_threads=0 trainer.cpu_threads=0``): whichever phase finishes first leaves its core to
  the other.
* ``rlfw-async-2ranks``: ``rlfw-async`` with two data-parallel trainer ranks of one thread each (three
  single-threaded processes share the two cores, so the engine's idle time goes to the trainer);
* ``rlfw-async-trainer2`` and ``rlfw-async-noprefill-trainer2``: the trainer rank's kernels on every
  core (``trainer.cpu_threads=0``), the engine on one: the trainer, the longer phase, takes the core the
  engine leaves idle once its generation is done;
* ``rlfw-async-lend``, ``rlfw-async-noprefill-lend``, ``rlfw-sync-lend``: one thread per pool and
  ``lend_idle_cores=true``: while one pool idles (the engine once its generation is done, the trainer
  between its steps), the other runs its compiled kernels on both cores;
* ``rlfw-async-lend-glibcheap``: ``rlfw-async-lend`` with ``RLFW_KEEP_FREED_MEMORY=0`` (glibc's
  defaults in the actors: freed memory goes back to the kernel and is faulted in again);
* ``rlfw-async-noprefill`` and ``rlfw-async-2ranks-noprefill``: the same with
  ``engine.prefill_fraction=0`` (sampler, decode and trainer streams on every token, no prefill stream;
  allowed because the contract claims prefill and decode bitwise equal here).
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
from typing import Any

import machine

PROMPTS, GROUP, TOKENS, LR = 16, 4, 64, 1e-3


def write_model(folder: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from rollout_vs_peers import write_checkpoint

    from rlfw.tokenizer import build_tiny_tokenizer

    write_checkpoint("13m", str(folder))
    build_tiny_tokenizer().save_pretrained(folder)


ASYNC = ["sync=async", "correction=dlc"]
ALL_CORES = ["engine.cpu_threads=0", "trainer.cpu_threads=0"]
NO_PREFILL = ["engine.prefill_fraction=0"]
SIDES = {  # rlfw side -> its overrides on top of the shared ones
    "sync": [],
    "sync-allcores": ALL_CORES,
    "async": ASYNC,
    "async-allcores": ASYNC + ALL_CORES,
    "async-2ranks": [*ASYNC, "trainer.num_ranks=2"],
    "async-noprefill": ASYNC + NO_PREFILL,
    "async-2ranks-noprefill": [*ASYNC, "trainer.num_ranks=2", *NO_PREFILL],
    "async-trainer2": [*ASYNC, "trainer.cpu_threads=0"],
    "async-noprefill-trainer2": [*ASYNC, *NO_PREFILL, "trainer.cpu_threads=0"],
    "async-lend": [*ASYNC, "lend_idle_cores=true"],
    "async-noprefill-lend": [*ASYNC, *NO_PREFILL, "lend_idle_cores=true"],
    "sync-lend": ["lend_idle_cores=true"],
    "async-lend-glibcheap": [*ASYNC, "lend_idle_cores=true"],  # with SIDE_ENV below
}
SIDE_ENV = {"async-lend-glibcheap": {"RLFW_KEEP_FREED_MEMORY": "0"}}  # glibc's defaults in the actors


def rlfw_side(folder: Path, root: Path, steps: int, mode: str) -> list[float]:
    from rlfw.distributed.cluster import SUBPROCESS_ENV

    name = f"{mode}-{time.monotonic_ns()}"
    overrides = [
        "model=hf",
        f"model.path={folder}",
        "model.dtype=float32",
        "trainer.precision=fp32",
        f"trainer.lr={LR}",
        f"trainer.steps={steps}",
        "trainer.micro_batch_size=16",
        f"algo.prompts_per_step={PROMPTS}",
        f"algo.group_size={GROUP}",
        f"engine.max_new_tokens={TOKENS}",
        "engine.ignore_eos=true",
        "task.warm_start_steps=0",  # TRL trains the checkpoint as it is; so does rlfw here
        f"engine.max_model_len={TOKENS + 64}",
        f"engine.max_slots={PROMPTS * GROUP}",
        "logger.wandb=false",
        f"logger.run_root={root}",
        f"logger.run_name={name}",
    ]
    if mode not in SIDES:
        raise SystemExit(f"unknown side rlfw-{mode}; known: {', '.join('rlfw-' + m for m in SIDES)}")
    overrides += SIDES[mode]
    cmd = [str(Path(sys.executable).with_name("rlfw")), "train", *overrides]
    env = os.environ | SUBPROCESS_ENV | SIDE_ENV.get(mode, {})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rlfw {mode} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return [float(r["time/step"]) for r in rows if "time/step" in r]


def trl_worker(folder: str, steps: int, threads: int, keep_heap: bool) -> None:
    """Runs in its own process: print the wall time of every TRL step as JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlfw.distributed.cluster import keep_freed_memory
    from rlfw.tasks.arithmetic import Arithmetic
    from rlfw.tasks.rewards import score

    if keep_heap and not keep_freed_memory():
        raise SystemExit("trl-keepheap: glibc's mallopt is not available here")
    torch.set_num_threads(threads)
    task = Arithmetic(20)
    problems = task.sample(PROMPTS * (steps + 1), random.Random(0))
    by_prompt = {p.prompt: p for p in problems}
    data = Dataset.from_list([{"prompt": p.prompt} for p in problems])

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return list(score(task, [by_prompt[p] for p in prompts], completions).rewards)

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    times: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=TOKENS,
            generation_kwargs={"min_new_tokens": TOKENS},
            max_steps=steps,
            learning_rate=LR,
            beta=0.0,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reward], args=cfg, train_dataset=data, processing_class=tok
        )
        trainer.add_callback(Clock())
        trainer.train()
    print(json.dumps(times))


def trl_side(folder: Path, steps: int, threads: int, keep_heap: bool) -> list[float]:
    cmd = [sys.executable, __file__, "--trl-worker", str(folder), "--steps", str(steps)]
    cmd += ["--trl-threads", str(threads)] + (["--trl-keep-heap"] if keep_heap else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trl failed:\n{proc.stderr[-3000:]}")
    return [float(t) for t in json.loads(proc.stdout.strip().splitlines()[-1])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sides", nargs="*", default=["trl", "rlfw-sync", "rlfw-sync-allcores", "rlfw-async"])
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    ap.add_argument("--trl-keep-heap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results_grpo_vs_trl.json")))
    a = ap.parse_args()
    if a.trl_worker:
        trl_worker(a.trl_worker, a.steps, a.trl_threads, a.trl_keep_heap)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder, root = Path(tmp) / "model", Path(tmp) / "runs"
        write_model(folder)
        steps: dict[str, list[float]] = {side: [] for side in a.sides}
        by_round: list[dict[str, float]] = []  # each side's median step, round by round
        for _ in range(a.rounds):
            by_round.append({})
            for side in a.sides:
                if side in ("trl", "trl-keepheap"):
                    times = trl_side(folder, a.steps, a.trl_threads, side == "trl-keepheap")
                else:
                    times = rlfw_side(folder, root, a.steps, side.removeprefix("rlfw-"))
                # the first step compiles and warms up; an async run's last step has no generation in
                # flight (nothing to overlap, so faster than the steady state), so both ends are dropped
                steps[side] += times[1:-1]
                by_round[-1][side] = statistics.median(times[1:-1])
                print(side, [round(t, 2) for t in times], flush=True)
    s_per_step = {side: statistics.median(ts) for side, ts in steps.items()}
    ratios = peer_ratios(s_per_step)
    # The machine's speed can move between rounds (its memory bandwidth, a neighbour): a round's sides run
    # within a few minutes of each other, so each round's ratios show how far the pooled ones can be trusted.
    round_ratios = [peer_ratios(medians) for medians in by_round]
    result = {
        "machine": machine.describe(),
        "trl_threads": a.trl_threads,
        "steps_per_run": a.steps,
        "rounds": a.rounds,
        "s_per_step": s_per_step,
        "ratios": ratios,
        "ratios_by_round": round_ratios,
        "s_per_step_by_round": by_round,
        "step_times": steps,
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("s_per_step", "ratios", "ratios_by_round")}, indent=2))


def peer_ratios(s_per_step: dict[str, float]) -> dict[str, float]:
    """Each rlfw side's steps per second over each peer's, from seconds per step."""
    peers = [p for p in ("trl", "trl-keepheap") if p in s_per_step]
    return {
        f"{s}/{p} (steps per second)": s_per_step[p] / s_per_step[s]
        for p in peers
        for s in s_per_step
        if s not in ("trl", "trl-keepheap")
    }


if __name__ == "__main__":
    main()
