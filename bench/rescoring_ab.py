"""``engine=vllm``'s prefill stream two ways in one process: bits, then time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rescoring_ab.py --vocab 151936 --reps 5
    OMP_NUM_THREADS=1 .venv/bin/python bench/rescoring_ab.py --size 76m --reps 3

One ``VllmEngine`` with the shared model on the invariant kernels (shared numerics), all four streams,
on ``bench/rollout_vs_peers.py``'s request (16 prompts x 4 samples x ``--tokens`` new tokens, its
checkpoint at ``--size`` and ``--vocab``). The rescoring pass that gives the prefill stream runs either as
vLLM's prompt log-probs (``scores_hidden_states=False``: the LM head, the log-softmax and a rank count at
every position of each sequence) or as the decode tap's scoring of the same prefill forward's hidden
states (``True``, the default: the head and ``token_logp`` at the response's positions only). First
both must give every stream the same bits on every sample; then whole ``generate`` calls of each are
timed, alternated call by call.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
from paired import alternated_medians  # noqa: E402
from rollout_vs_peers import SIZES, VOCAB, bench_prompts, write_checkpoint  # noqa: E402

STREAMS = ("sampler_logp", "decode_logp", "prefill_logp", "topk_ids", "topk_logp")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="13m")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from rlfw.config import EngineConfig, SamplerConfig, VllmSettings
    from rlfw.distributed.cluster import keep_freed_memory
    from rlfw.rollout.vllm.engine import VllmEngine
    from rlfw.types import GenerationRequest

    keep_freed_memory()  # as the rollout actors do
    prompts = bench_prompts(16)
    request = GenerationRequest(list(range(16)), prompts, n=4, max_new_tokens=a.tokens, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(a.size, folder, a.vocab)
        cfg = EngineConfig(
            name="vllm",
            max_slots=64,
            max_model_len=32 + a.tokens,
            sampler=SamplerConfig(),
            vllm=VllmSettings(),
        )
        engine = VllmEngine(folder, cfg, kernels="invariant")
        assert engine.scores_hidden_states, "needs shared numerics: the shared model on the invariant kernels"

        def run(scored: bool) -> list:
            engine.scores_hidden_states = scored
            return engine.generate(request)

        logprobs, scored = run(False), run(True)
        for x, y in zip(logprobs, scored, strict=True):
            for name in STREAMS:
                assert torch.equal(getattr(x, name), getattr(y, name)), (x.prompt_id, x.sample_index, name)
        print(f"same bits: {len(scored)} samples, streams {', '.join(STREAMS)}", flush=True)
        old, new = alternated_medians([lambda: run(False), lambda: run(True)], a.reps)
        engine.shutdown()
    tokens = sum(s.response_T.numel() for s in scored)
    result = {
        "machine": machine.describe(),
        "size": a.size,
        "vocab": a.vocab,
        "batch": {"prompts": 16, "n": 4, "new_tokens": a.tokens, "reps": a.reps},
        "seconds": {"prompt_logprobs": old, "hidden_states": new},
        "tokens_per_s": {"prompt_logprobs": tokens / old, "hidden_states": tokens / new},
        "time_ratio_hidden_states/prompt_logprobs": new / old,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
