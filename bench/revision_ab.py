"""The built-in engine's ``generate`` or the trainer's step at this checkout against another revision,
alternated process by process.

    OMP_NUM_THREADS=1 .venv/bin/python bench/revision_ab.py --rev HEAD~1 [--prefill-fraction 0]
    OMP_NUM_THREADS=1 .venv/bin/python bench/revision_ab.py --rev HEAD~3 --what train-step
    OMP_NUM_THREADS=1 .venv/bin/python bench/revision_ab.py --rev HEAD~1 --what train-step-vocab

The other revision is checked out into a temporary git worktree and imported first on ``PYTHONPATH``;
the benchmark's own code (checkpoint, requests, batch) is this checkout's, so both sides get the same
work. Each repetition starts one process per side, in turn, that builds the model, runs one untimed call
and then ``--calls`` timed ones, one thread:

* ``generate``: the 13M model of ``bench/rollout_vs_peers.py`` on its requests (16 prompts x 4 samples x
  64 tokens, ``kernels=invariant``, ``--prefill-fraction`` of the sequences scored by the prefill
  stream); the process reports its median tokens/s;
* ``train-step``: the GRPO step of ``bench/train_step_backward.py`` (the same batch and settings as
  ``bench/grpo_vs_trl.py``, one lent thread); the process reports its median seconds per step;
* ``train-step-vocab``: a GRPO step at a real vocabulary: the 13M model's layers with ``--vocab`` tokens
  (tied embeddings, as Qwen3's small models; 151,936 is Qwen's) on a batch of 4 prompts of
  ``--prompt-tokens`` random tokens x 4 samples of ``--response-tokens`` (one micro-batch), AdamW, one
  lent thread; the process reports its median seconds per step.

Each process also reports its peak resident memory over the timed calls (Linux: the high-water mark is
reset after the untimed call through ``/proc/self/clear_refs``, so the model's set-up and, for the train
step, the engine that generated its batch are not counted).

Prints each side's per-process figures and the median of the paired ratios (this checkout's speed over
the other's: above 1 is faster here), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402

from rlfw.config import TrainerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WHAT = ("generate", "train-step", "train-step-vocab")


@contextmanager
def other_revision(rev: str, folder: Path) -> Iterator[Path]:
    """``rev`` checked out in a git worktree under ``folder``, removed on exit."""
    other = folder / "other"
    subprocess.run(["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT, check=True)
    try:
        yield other
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)


def reset_peak_rss() -> None:
    """Start the process's peak resident memory (``VmHWM``, which ``ru_maxrss`` reads, so
    :func:`rlfw.distributed.cluster.peak_rss_mb` too) again from its current resident size (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def child_generate(calls: int, prefill_fraction: float) -> float:
    """Median tokens/s of ``calls`` timed ``generate`` calls after one untimed call."""
    from rollout_vs_peers import bench_prompts, write_checkpoint

    from rlfw.model import from_pretrained
    from rlfw.rollout.native import NativeEngine
    from rlfw.types import GenerationRequest

    request = GenerationRequest(list(range(16)), bench_prompts(16), n=4, max_new_tokens=64, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint("13m", folder)
        model = from_pretrained(folder, kernels="invariant")
        engine = NativeEngine(model, max_slots=64, max_model_len=128, prefill_fraction=prefill_fraction)
        engine.generate(request)
        reset_peak_rss()
        rates = []
        for _ in range(calls):
            t0 = time.perf_counter()
            tokens = sum(s.response_T.numel() for s in engine.generate(request))
            rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def child_train_step(calls: int) -> float:
    """Median seconds of ``calls`` timed train steps after one untimed step."""
    from train_step_backward import setup

    from rlfw.kernels import threads

    with tempfile.TemporaryDirectory() as folder:
        step = setup(Path(folder) / "model")
        threads.set_lender(lambda: 1)
        step()
        reset_peak_rss()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child_train_step_vocab(
    calls: int, vocab: int, prompt_tokens: int, response_tokens: int, chunk_mib: int
) -> float:
    """Median seconds of ``calls`` timed GRPO steps at a real vocabulary, after one untimed step."""
    import dataclasses
    import random

    import torch
    from rollout_vs_peers import hf_config

    from rlfw.algos import CorrectionConfig
    from rlfw.distributed.cluster import keep_freed_memory
    from rlfw.kernels import threads
    from rlfw.model import Transformer
    from rlfw.model.config import ModelArgs
    from rlfw.model.distribution import Transforms
    from rlfw.train.collate import collate
    from rlfw.trainer.step import StepSpec, train_step
    from rlfw.types import Sample

    keep_freed_memory()  # as the trainer actor does
    c = hf_config("13m")
    args = ModelArgs(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        tie_word_embeddings=True,
    )
    model = Transformer(args, kernels="invariant")
    model.init_weights(0)
    model.train()
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    samples = []
    for prompt_id in range(4):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen)
        for index in range(4):
            t = response_tokens
            zeros = torch.zeros(t)
            samples.append(
                Sample(
                    prompt_id,
                    index,
                    prompt,
                    torch.randint(0, vocab, (t,), generator=gen),
                    zeros,
                    zeros,
                    zeros,
                    torch.zeros(t, dtype=torch.long),
                    torch.zeros(t, dtype=torch.long),
                    torch.zeros(t, 0, dtype=torch.long),
                    torch.zeros(t, 0),
                    "length",
                    0,
                )
            )
    batch = collate(samples, [rng.uniform(-1.0, 1.0) for _ in samples])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    class Backend:
        module = model
        last_step_skipped = False

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

        def step(self) -> float:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return 0.0

    spec = StepSpec(Transforms(), CorrectionConfig(name="tis"), 16, "decode", False)
    if "logits_chunk_mib" in {f.name for f in dataclasses.fields(StepSpec)}:  # revisions before it: unchunked
        spec = dataclasses.replace(spec, logits_chunk_mib=chunk_mib)
    threads.set_lender(lambda: 1)
    train_step(Backend(), model, batch, spec, batch.num_tokens, len(batch))
    reset_peak_rss()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        train_step(Backend(), model, batch, spec, batch.num_tokens, len(batch))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_side(code_root: Path, a: argparse.Namespace) -> tuple[float, float]:
    """One process of one side: its figure (tokens/s or seconds per step) and peak resident MiB."""
    env = os.environ | {"PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--child", a.what, "--calls", str(a.calls)]
    args += ["--prefill-fraction", str(a.prefill_fraction)]
    args += ["--vocab", str(a.vocab), "--prompt-tokens", str(a.prompt_tokens)]
    args += ["--response-tokens", str(a.response_tokens)]
    args += ["--logits-chunk-mib", str(a.logits_chunk_mib)]
    out = subprocess.run(args, cwd=code_root, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{code_root}: the {a.what} process exited {out.returncode}:\n{out.stderr[-3000:]}")
    figure, peak = out.stdout.strip().splitlines()[-1].split()
    return float(figure), float(peak)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", help="the other revision (required unless --child)")
    p.add_argument("--what", choices=WHAT, default="generate")
    p.add_argument("--reps", type=int, default=4, help="processes per side, alternated")
    p.add_argument("--calls", type=int, default=3, help="timed calls per process")
    p.add_argument("--prefill-fraction", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=151936, help="train-step-vocab: vocabulary size")
    p.add_argument("--prompt-tokens", type=int, default=128, help="train-step-vocab: tokens per prompt")
    p.add_argument("--response-tokens", type=int, default=64, help="train-step-vocab: tokens per response")
    p.add_argument(
        "--logits-chunk-mib",
        type=int,
        default=getattr(TrainerConfig, "logits_chunk_mib", 0),  # a child of an older revision: unused
        help="train-step-vocab: trainer.logits_chunk_mib (revisions without it run the head unchunked)",
    )
    p.add_argument("--child", choices=WHAT, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        import torch

        from rlfw.distributed.cluster import peak_rss_mb

        torch.set_num_threads(1)
        if a.child == "generate":
            figure = child_generate(a.calls, a.prefill_fraction)
        elif a.child == "train-step":
            figure = child_train_step(a.calls)
        else:
            figure = child_train_step_vocab(
                a.calls, a.vocab, a.prompt_tokens, a.response_tokens, a.logits_chunk_mib
            )
        print(figure, peak_rss_mb())
        return
    if not a.rev:
        p.error("--rev is required")
    tmp = tempfile.TemporaryDirectory(prefix="rlfw-revision-")
    with tmp, other_revision(a.rev, Path(tmp.name)) as other:
        sides = {"this": ROOT, a.rev: other}
        figures: dict[str, list[float]] = {name: [] for name in sides}
        peaks: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(a.reps):
            for name, code in sides.items():
                figure, peak = run_side(code, a)
                figures[name].append(figure)
                peaks[name].append(peak)
    faster = (lambda x, y: x / y) if a.what == "generate" else (lambda x, y: y / x)
    ratios = [faster(x, y) for x, y in zip(figures["this"], figures[a.rev], strict=True)]
    unit = "tok/s" if a.what == "generate" else "s/step"
    for name, f in figures.items():
        print(f"{name:>10}: median {statistics.median(f):8.2f} {unit}  ({', '.join(f'{x:.2f}' for x in f)})")
    print(f"this over {a.rev} (speed): median of paired ratios {statistics.median(ratios):.3f}")
    for name, f in peaks.items():
        print(f"{name:>10}: peak resident memory over the timed calls, median {statistics.median(f):.0f} MiB")
    record = {"machine": machine.describe(), "rev": a.rev, "what": a.what, "calls": a.calls}
    record |= {"prefill_fraction": a.prefill_fraction} if a.what == "generate" else {}
    if a.what == "train-step-vocab":
        record |= {"vocab": a.vocab, "prompt_tokens": a.prompt_tokens, "response_tokens": a.response_tokens}
        record |= {"logits_chunk_mib": a.logits_chunk_mib}
    print(json.dumps(record | {unit: figures, "speed_ratios": ratios, "peak_rss_mb": peaks}))


if __name__ == "__main__":
    main()
