"""The shared model reproduces `transformers` (Qwen3, Llama, Qwen3-MoE) on the same checkpoint.

If one of these breaks, checkpoints from the Hub no longer mean what they meant in `transformers`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfw.model import from_pretrained
from tests.conftest import make_hf_checkpoint

CASES = [
    ("dense", {"tie_word_embeddings": False, "num_key_value_heads": 2}),
    ("dense", {"tie_word_embeddings": True, "num_key_value_heads": 4}),  # MHA, tied
    ("dense", {"tie_word_embeddings": False, "num_key_value_heads": 1}),  # MQA
    ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 2}),
    ("moe", {"norm_topk_prob": True}),
    ("moe", {"norm_topk_prob": False, "num_key_value_heads": 1}),
    ("moe", {"norm_topk_prob": True, "num_experts": 8, "num_experts_per_tok": 3, "mlp_only_layers": [0]}),
]


def _hf_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.mark.parametrize(("kind", "overrides"), CASES)
def test_fp32_logits_match_transformers(tmp_path: Path, kind: str, overrides: dict) -> None:
    path = make_hf_checkpoint(tmp_path, kind, seed=len(str(overrides)), **overrides)
    ids = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(1))
    ours = from_pretrained(path, torch.float32)
    with torch.no_grad():
        logits = ours(ids).float()
    ref = _hf_logits(path, ids, torch.float32)
    assert ref.std() > 1e-3  # the checkpoint is not degenerate
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_logits_close_to_transformers(tmp_path: Path, kind: str) -> None:
    """bf16 is measured, not bitwise: both sides round differently (we accumulate the MoE combine in fp32).

    Measured on these tiny checkpoints (logit std about 0.16, [4, 32] inputs): max |d logit| 4.9e-3 to
    5.9e-3 dense, 4.4e-3 to 1.4e-2 MoE. The bound leaves headroom over that, while a wrong op gives errors
    of the order of the logits themselves.
    """
    path = make_hf_checkpoint(tmp_path, kind)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = from_pretrained(path, torch.bfloat16)(ids).float()
    ref = _hf_logits(path, ids, torch.bfloat16)
    assert (logits - ref).abs().max().item() <= 0.05


def test_transformers_roundtrip_of_our_save(tmp_path: Path, moe_ckpt: Path) -> None:
    """What we save, `transformers` loads to the same logits."""
    from rlfw.model import save_pretrained

    ours = from_pretrained(moe_ckpt)
    save_pretrained(ours, tmp_path / "out")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine = ours(ids)
    assert (mine - _hf_logits(tmp_path / "out", ids, torch.float32)).abs().max().item() <= 1e-4
