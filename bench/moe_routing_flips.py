"""How often a token's routed experts differ between the engine's decode and the trainer's forward.

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_routing_flips.py

R3 (router replay) can only matter where routing flips: where the engine's decode forward (the KV cache,
one new token per step, batched with other sequences) and the trainer's forward over the whole sequence
choose different top-k experts for the same token. Under ``kernels=invariant`` the two forwards are the
same bits, so nothing flips; this script measures the rate under ``kernels=default`` (a bounded kernel
mismatch) for MoE variants of the tiny model, in fp32 and bf16: the built-in engine generates 16 prompts
x 4 samples x 32 tokens, the trainer's forward re-routes every sample, and the printed rate is the share
of (token, MoE layer) whose expert sets differ.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlfw.model import RouterTrace
from rlfw.model.presets import TINY_DENSE
from rlfw.model.routing import set_mismatch_frac
from rlfw.model.transformer import Transformer
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest

VARIANTS = [(4, 2, 64), (16, 2, 64), (16, 4, 128), (64, 8, 64)]  # experts, top-k, hidden


def flip_rate(experts: int, k: int, hidden: int, dtype: torch.dtype, kernels: str) -> float:
    args = replace(
        TINY_DENSE,
        model_type="qwen3_moe",
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    )
    model = Transformer(args, kernels=kernels)
    model.init_weights(0)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 12, (16,), generator=g).tolist()
    prompts = [torch.randint(8, args.vocab_size, (n,), generator=g) for n in lengths]
    engine = NativeEngine(model, max_slots=16, max_model_len=128)
    samples = engine.generate(GenerationRequest(list(range(16)), prompts, n=4, max_new_tokens=32, seed=1))
    rates = []
    for s in samples:
        assert s.routed_experts is not None
        with torch.no_grad():
            trace = RouterTrace()
            model(s.tokens[None], routing=trace)
        rates.append(set_mismatch_frac(trace.stacked(), s.routed_experts[None]))
    return sum(rates) / len(rates)


def main() -> None:
    torch.set_num_threads(1)
    print("| experts | top-k | hidden | kernels | fp32 flip rate | bf16 flip rate |")
    print("|---|---|---|---|---|---|")
    for experts, k, hidden in VARIANTS:
        for kernels in ("default", "invariant"):
            fp32, bf16 = (flip_rate(experts, k, hidden, d, kernels) for d in (torch.float32, torch.bfloat16))
            print(f"| {experts} | {k} | {hidden} | {kernels} | {fp32:.4%} | {bf16:.4%} |", flush=True)


if __name__ == "__main__":
    main()
