"""The GPU checks in one script (about 2 minutes on an H200): invariance tests natively, the cost of
invariance for a decode step and a train step, and the built-in engine's throughput.

    .venv/bin/python bench/gpu_check.py [--out bench/results_gpu_check.json]

1. ``pytest tests/gpu`` on the device: every invariant op batch-invariant bit for bit, and the tiny dense
   and MoE models bit-identical across trainer grad forward, trainer scoring, engine prefill and decode
   (fp32 and bf16), on the op set CUDA resolves to (vLLM's batch-invariant kernels when vLLM is installed).
2. ``kernels=invariant`` against ``kernels=default`` on the 13M and 76M Qwen3 shapes of
   ``bench/rollout_vs_peers.py`` (hidden 512 / 768, 4 / 12 layers), in fp32 and in bf16: one decode step of 64
   sequences and one training step (forward, backward, AdamW) on 8 x 256 tokens, alternated, medians
   (target: at most 1.15x).
3. The built-in engine on the device (fp32, 13M): 64 prompts x 4 samples x 128 new tokens, tokens per second
   and peak GPU memory, with invariant kernels (all four streams, and the prefill stream off) and with
   default kernels (four streams).

Each part's result or error (with its traceback) goes into the JSON as soon as the part ends, with the
device name, the op set and the versions. On a machine without CUDA the script says so and exits 2
(nothing is measured).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def run_tests(limit_s: float = 240.0) -> dict[str, Any]:
    t0 = time.perf_counter()
    tests = str(ROOT / "tests" / "gpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", tests]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=limit_s)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return {"passed": False, "summary": f"timed out after {limit_s:.0f} s", "output_tail": out[-6000:]}
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    return {
        "passed": done.returncode == 0,
        "summary": tail,
        "seconds": round(time.perf_counter() - t0, 1),
        "output_tail": (done.stdout + done.stderr)[-6000:],
    }


def model_of(size: str, kernels: str, dtype: torch.dtype = torch.float32) -> Any:
    """The ``size`` model of ``bench/rollout_vs_peers.py`` (13m or 76m, same configs), on the device."""
    from rollout_vs_peers import hf_config

    from rlfw.model import Transformer
    from rlfw.model.config import args_from_hf_config

    torch.manual_seed(0)
    return Transformer(args_from_hf_config(hf_config(size)), kernels=kernels).to("cuda", dtype)


def invariant_cost(reps: int) -> dict[str, Any]:
    from invariant_cost import decode_step, train_step
    from paired import paired_medians

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    cases = {
        "decode_step_64x1": (decode_step, torch.randint(3, 362, (64, 128), generator=gen)),
        "train_step_8x256": (train_step, torch.randint(3, 362, (8, 256), generator=gen)),
    }
    for size in ("13m", "76m"):
        for dtype in (torch.float32, torch.bfloat16):
            for name, (make, ids) in cases.items():
                runs = []
                for kernels in ("default", "invariant"):
                    model = model_of(size, kernels, dtype).train(name.startswith("train"))
                    runs.append(make(model, ids.cuda()))
                t_def, t_inv = paired_medians(runs[0], runs[1], reps)
                key = f"{size}_{name}_{str(dtype).removeprefix('torch.')}"
                out[key] = {"default_ms": t_def * 1e3, "invariant_ms": t_inv * 1e3, "ratio": t_inv / t_def}
                del runs, model
    return out


def engine_throughput() -> dict[str, Any]:
    from rlfw.rollout.native import NativeEngine
    from rlfw.types import GenerationRequest

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 362, (int(n),), generator=gen) for n in torch.randint(8, 24, (64,))]
    request = GenerationRequest(list(range(64)), prompts, n=4, max_new_tokens=128, seed=0)
    out: dict[str, Any] = {}
    runs = (
        ("invariant_four_streams", "invariant", 1.0),
        ("invariant_no_prefill_stream", "invariant", 0.0),
        ("default_four_streams", "default", 1.0),
    )
    for name, kernels, fraction in runs:
        model = model_of("13m", kernels)
        engine = NativeEngine(model, max_slots=256, max_model_len=160, prefill_fraction=fraction)
        engine.generate(request)  # warm-up (Triton compiles)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        tokens = sum(s.response_T.numel() for s in engine.generate(request))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20
        out[name] = {"tokens_per_s": tokens / seconds, "seconds": seconds, "peak_mib": peak}
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results_gpu_check.json"))
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was measured", file=sys.stderr)
        return 2
    from rlfw.fingerprint import environment_fingerprint
    from rlfw.kernels.invariant import InvariantOps

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "op_set": InvariantOps().describe(),
        "environment": environment_fingerprint(),
    }
    parts = (
        ("tests", run_tests),
        ("invariant_cost", lambda: invariant_cost(args.reps)),
        ("engine", engine_throughput),
    )
    for name, part in parts:
        t0 = time.perf_counter()
        report[name] = _guarded(part)
        print(f"gpu_check: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))  # kept if a later part hangs
    print(json.dumps({k: v for k, v in report.items() if k != "op_set"}, indent=2, default=str))
    return 0 if report["tests"].get("passed") else 1


def _guarded(part: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = part()
    except Exception as err:  # one part failing must not lose the others' numbers
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    return result


if __name__ == "__main__":
    sys.exit(main())
