"""Forward and training-step time of the shared model against `transformers` on the same checkpoint.

    OMP_NUM_THREADS=1 .venv/bin/python bench/model_vs_transformers.py [--batch 8 --seq 64 --reps 20]

Both models load the same random tiny checkpoint; timings alternate between the two (A, B, A, B, ...) so
machine noise hits both alike, and the table reports medians and the ratio rlfw / transformers.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from paired import paired_medians

from rlfw.model import from_pretrained

torch.set_num_threads(1)


def make_checkpoint(kind: str, folder: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    if kind == "dense":
        Qwen3ForCausalLM(Qwen3Config(**base)).save_pretrained(folder)
    else:
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**base, **moe)).save_pretrained(folder)


def forward_fn(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(ids)

    return run


def train_fn(model: torch.nn.Module, ids: torch.Tensor, hf: bool) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> None:
        out = model(ids)
        logits = out.logits if hf else out
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 96, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"input [{args.batch}, {args.seq}], fp32, 1 thread, median of {args.reps} paired runs")
    print("| model | what | rlfw ms | transformers ms | rlfw / transformers |")
    print("|---|---|---|---|---|")
    for kind in ("dense", "moe"):
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(kind, Path(tmp))
            for what, make in (("forward", forward_fn), ("train step", train_fn)):
                ours = from_pretrained(tmp).train(what == "train step")
                hf = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train(
                    what == "train step"
                )
                t_ours, t_hf = paired_medians(make(ours, ids, False), make(hf, ids, True), args.reps)
                print(f"| {kind} | {what} | {t_ours * 1e3:.2f} | {t_hf * 1e3:.2f} | {t_ours / t_hf:.2f} |")


if __name__ == "__main__":
    main()
