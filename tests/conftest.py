"""Shared fixtures: tiny HF checkpoints built from config with `transformers` (no downloads); the
hypothesis profile named by ``RLFW_HYPOTHESIS_PROFILE`` (see :mod:`tests.properties`)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.properties import load_profile  # noqa: E402

torch.set_num_threads(1)
load_profile()  # RLFW_HYPOTHESIS_PROFILE=long: many more examples per property (see tests/properties.py)


def make_hf_checkpoint(folder: Path, kind: str, seed: int = 0, **overrides: object) -> Path:
    """Save a random tiny Qwen3 (``dense``), Llama (``llama``) or Qwen3-MoE (``moe``) HF checkpoint."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    base: dict[str, object] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**(base | overrides)))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**(base | overrides)))
    else:
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(base | moe | overrides)))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("dense"), "dense")


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("moe"), "moe")
