"""Built-in tiny architectures for the embedded default and tests (built from config, no download)."""

from __future__ import annotations

from dataclasses import replace

import torch

from rlfw.model.config import ModelArgs
from rlfw.model.transformer import Transformer

# head_dim 32 keeps vLLM's CPU attention backend willing to run the same checkpoints.
TINY_DENSE = ModelArgs(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    eos_token_id=2,  # the tiny tokenizer's <eos>
)

PRESETS: dict[str, ModelArgs] = {
    "tiny_dense": TINY_DENSE,
    "tiny_moe": replace(
        TINY_DENSE,
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # Many small experts (64, top-8): the routing a bounded kernel mismatch can flip in bf16 (about 0.6%
    # of (token, layer) pairs against 0.04% for tiny_moe; bench/moe_routing_flips.py), for R3 studies.
    "tiny_moe64": replace(
        TINY_DENSE,
        model_type="qwen3_moe",
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
}


def build_preset(
    name: str, dtype: torch.dtype = torch.float32, seed: int = 0, kernels: str = "default"
) -> Transformer:
    """A randomly initialised tiny model (std 0.02 weights, unit norms)."""
    if name not in PRESETS:
        raise ValueError(
            f"model.preset={name!r} is not a built-in model; choose one of: {', '.join(PRESETS)}"
        )
    model = Transformer(PRESETS[name], kernels=kernels)
    model.init_weights(seed)
    return model.to(dtype).eval()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path: str | None, preset: str | None, dtype: str, kernels: str, seed: int = 0) -> Transformer:
    """The model a run asks for: an HF checkpoint folder, or a built-in preset built from config."""
    if path is not None:
        from rlfw.model.checkpoint import from_pretrained

        return from_pretrained(path, DTYPES[dtype], kernels=kernels)
    if preset is None:
        raise ValueError("set model.path (an HF checkpoint folder) or model.preset (a built-in tiny model)")
    return build_preset(preset, dtype=DTYPES[dtype], seed=seed, kernels=kernels)
