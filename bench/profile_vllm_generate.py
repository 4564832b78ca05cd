"""Where one `engine=vllm` generate spends its time, against stock vLLM on the same requests.

Run one side under a sampling profiler, then attribute its stacks:

    OMP_NUM_THREADS=1 .venv/bin/py-spy record -r 50 -f raw -o four.raw -- \\
        .venv/bin/python bench/profile_vllm_generate.py run four --reps 3
    .venv/bin/python bench/profile_vllm_generate.py attribute four.raw --seconds 11.99

``--seconds``: the median of the generate times ``run`` printed; each row's share is of the samples py-spy
took inside the timed generates (py-spy leaves out idle samples by default, so shares are of busy time).

Sides: ``four`` (rlfw's vLLM engine, all four streams), ``noprefill`` (``engine.prefill_fraction=0``),
``bare`` (stock vLLM, the rollout bench's vllm-bare call). The requests are the rollout bench's (13M model,
16 prompts x 4 samples x 64 new tokens) at ``--vocab`` (default 151,936). Each side is warmed up once;
the timed generates run inside :func:`timed`, which is how ``attribute`` picks their stacks.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (row, the frames a stack must all contain); a stack counts in the first row it matches.
ROWS: list[tuple[str, list[str]]] = [
    ("rescoring: token_logp", ["Scoring.take", "_token_logp"]),
    ("rescoring: the LM head (Scoring.take)", ["Scoring.take"]),
    ("decode tap: the step's log-softmax", ["DecodeTap.apply"]),
    ("decode LM head (compute_logits)", ["compute_logits"]),
    ("vLLM's sampler: fused_gumbel_argmax", ["TopKTopPSampler.forward_cpu"]),
    ("vLLM's sampler: the rest", ["Sampler.forward"]),
    ("model body", ["forward ("]),
]


def timed(call: Callable[[], object], reps: int, side: str) -> None:
    for _ in range(reps):
        start = time.perf_counter()
        call()
        print(f"{side}: a generate took {time.perf_counter() - start:.2f} s", flush=True)


def run(side: str, reps: int, vocab: int) -> None:
    from rollout_vs_peers import bench_prompts, vllm_bare_call, write_checkpoint

    from rlfw.distributed.cluster import keep_freed_memory

    keep_freed_memory()
    from rlfw.config import EngineConfig, SamplerConfig, VllmSettings
    from rlfw.rollout.vllm.engine import VllmEngine
    from rlfw.types import GenerationRequest

    prompts = bench_prompts(16)
    request = GenerationRequest(list(range(16)), prompts, n=4, max_new_tokens=64, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint("13m", folder, vocab)
        cfg = EngineConfig(
            name="vllm", max_slots=64, max_model_len=96, sampler=SamplerConfig(), vllm=VllmSettings()
        )
        call: Callable[[], object]
        if side == "bare":
            stock = VllmEngine(folder, EngineConfig(**{**cfg.__dict__, "vllm": VllmSettings(model="stock")}))
            call = vllm_bare_call(stock.llm, prompts, 4, 64)
        else:
            if side == "noprefill":
                cfg = EngineConfig(**{**cfg.__dict__, "prefill_fraction": 0.0})
            engine = VllmEngine(folder, cfg, kernels="invariant")

            def call() -> object:
                return engine.generate(request)

        call()  # warm-up
        timed(call, reps, side)


def attribute(raw: str, seconds: float) -> None:
    """py-spy's raw output (``stack count`` lines): the timed generates' samples by row."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(raw).read_text(errors="replace").splitlines():
        stack, n = line.rsplit(" ", 1)
        if "timed (" not in stack:
            continue
        total += int(n)
        row = next((name for name, frames in ROWS if all(f in stack for f in frames)), "other")
        counts[row] += int(n)
    if not total:
        raise SystemExit(f"{raw}: no sample inside timed(); was it recorded with `run`?")
    for name in [r for r, _ in ROWS] + ["other"]:
        if counts[name]:
            share = counts[name] / total
            print(f"{share * 100:5.1f}%  {share * seconds:5.2f} s  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("side", choices=["four", "noprefill", "bare"])
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--vocab", type=int, default=151936)
    a = sub.add_parser("attribute")
    a.add_argument("raw")
    a.add_argument("--seconds", type=float, default=1.0, help="a generate's time (the rows' scale)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.what == "run":
        run(args.side, args.reps, args.vocab)
    else:
        attribute(args.raw, args.seconds)


if __name__ == "__main__":
    main()
