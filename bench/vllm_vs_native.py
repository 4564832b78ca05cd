"""``engine=vllm`` against the built-in engine: tokens per second and per-factor mismatch, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/vllm_vs_native.py [--prompts 16] [--n 16] [--tokens 16]

Same tiny model (``tiny_dense``, fp32, ``kernels=invariant``), same prompts, same batch (``prompts x n``
samples of exactly ``tokens`` new tokens, no stop token), one process. Engines:

* ``native``: the built-in engine (all four streams);
* ``vllm``: vLLM with the shared model registered (``engine.vllm.model=rlfw``), all four streams;
* ``vllm-stock``: vLLM's own Qwen3 implementation, all four streams;
* ``vllm-bare``: the same vLLM engine generating without any stream (no log-probs, no decode tap, no
  prefill rescoring): what recording the streams costs inside vLLM.

Generation calls alternate between engines (paired medians) so machine noise hits all alike. Mismatch:
each engine's samples are rescored by the trainer's scoring forward and split into the factors of
design §2 (trainer = q/s^P, decode = s^P/s^D, sampler = s^D/mu): the worst |log ratio| and the k3 KL per
factor over every generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import machine
import torch

from rlfw.algos import decompose
from rlfw.algos.ratios import ratio_metrics
from rlfw.config import EngineConfig, VllmSettings
from rlfw.model import Transformer, build_preset, save_pretrained
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest, Sample

FACTORS = ("trainer", "decode", "sampler", "total")


def mismatch(model: Transformer, samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per-factor worst |log ratio| and k3 KL of an engine's samples against the trainer's scoring."""
    parts: dict[str, list[torch.Tensor]] = {f: [] for f in FACTORS}
    with torch.no_grad():
        for s in samples:
            p = s.prompt_P.shape[0]
            q = model.ops.token_logp(model(s.tokens[None])[0][p - 1 : -1], s.response_T)
            logs = decompose(q[None], s.prefill_logp[None], s.decode_logp[None], s.sampler_logp[None])
            for f in FACTORS:
                parts[f].append(logs[f][0])
    out = {}
    for f in FACTORS:
        lr = torch.cat(parts[f])[None]
        m = ratio_metrics(f, lr, torch.ones_like(lr))
        out[f] = {"max_abs_log": float(m[f"ratio/{f}/max_abs_log"]), "k3_kl": float(m[f"ratio/{f}/k3_kl"])}
    return out


def timed(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds per call, engines interleaved rep by rep, after one warm-up call each."""
    for f in calls.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()

    from rlfw.rollout.vllm.engine import VllmEngine  # after argparse: --help works without vLLM

    torch.manual_seed(0)
    model = build_preset("tiny_dense", seed=0, kernels="invariant")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen) for n in torch.randint(4, 12, (a.prompts,))]
    request = GenerationRequest(list(range(a.prompts)), prompts, n=a.n, max_new_tokens=a.tokens, seed=0)
    slots = a.prompts * a.n
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        native = NativeEngine(model, max_slots=slots, max_model_len=64, topk_logprobs=0)

        def vllm_engine(impl: str) -> VllmEngine:
            cfg = EngineConfig(name="vllm", max_slots=slots, max_model_len=64, vllm=VllmSettings(model=impl))
            cfg.sampler.topk_logprobs = 0
            return VllmEngine(tmp, cfg, kernels="invariant")

        engines = {"native": native, "vllm": vllm_engine("rlfw"), "vllm-stock": vllm_engine("stock")}
        bare = engines["vllm"]

        def bare_generate() -> None:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = [
                SamplingParams(n=a.n, max_tokens=a.tokens, seed=i, detokenize=False) for i in range(a.prompts)
            ]
            bare.llm.generate(
                [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params, use_tqdm=False
            )

        calls: dict[str, Callable[[], Any]] = {
            name: (lambda e=e: e.generate(request)) for name, e in engines.items()
        }
        calls["vllm-bare"] = bare_generate
        seconds = timed(calls, a.reps)
        samples = {name: e.generate(request) for name, e in engines.items()}

    tokens = {name: sum(s.response_T.numel() for s in ss) for name, ss in samples.items()}
    tokens["vllm-bare"] = tokens["vllm"]
    result = {
        "machine": machine.describe(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "batch": {"prompts": a.prompts, "n": a.n, "new_tokens": a.tokens, "reps": a.reps},
        "tokens_per_s": {name: tokens[name] / s for name, s in seconds.items()},
        "seconds_per_batch": seconds,
        "mismatch_vs_trainer": {name: mismatch(model, ss) for name, ss in samples.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
