"""An engine with each dense block in one compiled call against the per-op path, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cached_block_ab.py --size 13m --prefill-fraction 0 --reps 6
    OMP_NUM_THREADS=1 .venv/bin/python bench/cached_block_ab.py --engine vllm --reps 3

One engine (the built-in one, or ``engine=vllm`` with the shared model: the block over vLLM's paged
cache) on the Qwen3 checkpoint of ``bench/rollout_vs_peers.py`` and its requests (16 prompts x 4
samples x ``--tokens`` new tokens, the sampler and decode streams on every token, the prefill stream on
``--prefill-fraction`` of the sequences), ``kernels=invariant``. The two sides alternate call by call on
the same engine: ``one-call`` (``Ops.cached_block``: the block's kernel calls made from C++,
``kernels/csrc/block.cpp``) and ``per-op`` (the same kernels, one Python call per op). Both give the
same bits (``tests/model/test_cached_block.py``); only the time differs. Prints JSON, and writes it to
``--out`` when given.

``--against unshared`` (``engine=vllm``): the one-call blocks against themselves with every token on its
own row, i.e. without computing a prefix that several requests of a step share once (a GRPO group's
prompt in the prefill step and in the rescoring pass; :func:`rlfw.rollout.vllm.model.shared_prefixes`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/cached_block_ab.py --engine vllm --against unshared --reps 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import machine
import torch
from paired import alternated_medians

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from rollout_vs_peers import SIZES, bench_prompts, write_checkpoint

    from rlfw.kernels.block import per_op
    from rlfw.types import GenerationRequest

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["native", "vllm"], default="native")
    ap.add_argument("--size", choices=sorted(SIZES), default="13m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill-fraction", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--against", choices=["per-op", "unshared"], default="per-op")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.against == "unshared" and a.engine != "vllm":
        ap.error("--against unshared compares engine=vllm's steps; add --engine vllm")
    torch.set_num_threads(1)
    request = GenerationRequest(list(range(16)), bench_prompts(16), n=4, max_new_tokens=a.tokens, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(a.size, folder)
        engine = build_engine(a.engine, folder, 32 + a.tokens, a.prefill_fraction)
        tokens = [0]

        def one_call() -> None:
            tokens[0] = sum(s.response_T.numel() for s in engine.generate(request))

        def op_by_op() -> None:
            with per_op():
                one_call()

        def unshared() -> None:
            from rlfw.rollout.vllm import model

            find = model.shared_prefixes
            model.shared_prefixes = lambda *_: None  # type: ignore[assignment]
            try:
                one_call()
            finally:
                model.shared_prefixes = find

        other = op_by_op if a.against == "per-op" else unshared
        sides: dict[str, Callable[[], None]] = {"one-call": one_call, a.against: other}
        seconds = dict(zip(sides, alternated_medians(list(sides.values()), a.reps), strict=True))
    result = {
        "machine": machine.describe(),
        "engine": a.engine,
        "size": a.size,
        "batch": {"prompts": 16, "n": 4, "new_tokens": a.tokens, "prefill_fraction": a.prefill_fraction},
        "reps": a.reps,
        "seconds": seconds,
        "tokens_per_s": {side: tokens[0] / s for side, s in seconds.items()},
        f"{a.against} / one-call time": seconds[a.against] / seconds["one-call"],
    }
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


def build_engine(name: str, folder: str, max_model_len: int, prefill_fraction: float) -> Any:
    """The built-in engine or ``engine=vllm`` (the shared model in vLLM) on the checkpoint in ``folder``."""
    if name == "vllm":
        from rlfw.config import EngineConfig, SamplerConfig, VllmSettings
        from rlfw.rollout.vllm.engine import VllmEngine

        cfg = EngineConfig(
            name="vllm",
            max_slots=64,
            max_model_len=max_model_len,
            sampler=SamplerConfig(),
            vllm=VllmSettings(),
            prefill_fraction=prefill_fraction,
        )
        return VllmEngine(folder, cfg, kernels="invariant")
    from rlfw.model import from_pretrained
    from rlfw.rollout.native import NativeEngine

    return NativeEngine(
        from_pretrained(folder, kernels="invariant"),
        max_slots=64,
        max_model_len=max_model_len,
        prefill_fraction=prefill_fraction,
    )


if __name__ == "__main__":
    main()
