"""Cost of ``kernels=invariant`` against ``kernels=default``: forward, decode step (on a bare model, and
with the weights prepared as the built-in engine prepares them) and training step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/invariant_cost.py [--batch 8 --seq 64 --reps 20] [--path DIR ...]

``--path`` takes HF checkpoint folders (e.g. those ``bench/rollout_vs_peers.py --keep DIR`` writes)
instead of the tiny presets.

Runs on CUDA when available (the invariant set then uses its Triton kernels natively), else on CPU
(the compiled kernels). Both op sets run the same weights; timings alternate between them, and the table
reports medians and the ratio invariant / default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from paired import paired_medians

from rlfw.model import Transformer, build_preset, from_pretrained


def forward(model: Transformer, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(ids)

    return run


def decode_step(model: Transformer, ids: torch.Tensor) -> Callable[[], None]:
    """One token per row after a cached prefix: the engine's hot loop, on a model outside an engine (each
    linear reads its weight as stored)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 1)
    with torch.no_grad():
        model(ids, cache=cache)

    def run() -> None:
        cache.lengths.fill_(ids.shape[1])
        with torch.no_grad():
            model(ids[:, -1:], cache=cache)

    return run


def engine_decode_step(model: Transformer, ids: torch.Tensor) -> Callable[[], None]:
    """:func:`decode_step` with the weights prepared as the built-in engine prepares them
    (``prepare_for_inference``: packed panels on the CPU kernels, nothing for the default op set)."""
    model.prepare_for_inference()
    return decode_step(model, ids)


def train_step(model: Transformer, ids: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> None:
        logits = model(ids)
        loss = -model.ops.token_logp(logits[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--path", nargs="*", default=[], help="HF checkpoint folders instead of the presets")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1) if device == "cpu" else None
    ids = torch.randint(4, 96, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    print(f"device {device}, input [{args.batch}, {args.seq}], fp32, median of {args.reps} paired runs")
    print("| model | what | default ms | invariant ms | invariant / default |")
    print("|---|---|---|---|---|")
    for preset in args.path or ["tiny_dense", "tiny_moe"]:

        def load(kernels: str, name: str = preset) -> Transformer:
            if args.path:
                return from_pretrained(name, kernels=kernels)
            return build_preset(name, seed=0, kernels=kernels)

        for what, make in (
            ("forward", forward),
            ("decode step", decode_step),
            ("decode step, engine weights", engine_decode_step),
            ("train step", train_step),
        ):
            runs = []
            for kernels in ("default", "invariant"):
                model = load(kernels).to(device).train(what == "train step")
                runs.append(make(model, ids))
            t_def, t_inv = paired_medians(runs[0], runs[1], args.reps)
            print(f"| {preset} | {what} | {t_def * 1e3:.2f} | {t_inv * 1e3:.2f} | {t_inv / t_def:.2f} |")


if __name__ == "__main__":
    main()
