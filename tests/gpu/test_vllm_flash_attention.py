"""vLLM's batch-invariant FlashAttention as the invariant attention on CUDA (skipped without a device and
vLLM's FlashAttention; ``bench/gpu_check.py`` runs them).

The claims the contract needs from it: a query's result does not depend on the other rows of the batch,
a query gets the same bits in a prefill call (all positions at once) and in a decode call (one position
over the cache), and the result is the attention the torch reference computes, to bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.kernels import vllm_attention
from rlfw.kernels.attention import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not vllm_attention.available(torch.bfloat16), reason="needs CUDA and vLLM's FlashAttention"
    ),
]

HEADS, KV_HEADS = 8, 2
DIMS = (64, 128)  # FlashAttention picks its tiles by head size: each is checked


def _inputs(lengths: list[int], dim: int = 128, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Right-padded rows: q [B, T, H, D], k/v [B, T, Hkv, D] at slot = position, q_pos (-1 padding)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, t = len(lengths), max(lengths)
    q = torch.randn(b, t, HEADS, dim, generator=g, device="cuda").bfloat16()
    k = torch.randn(b, t, KV_HEADS, dim, generator=g, device="cuda").bfloat16()
    v = torch.randn(b, t, KV_HEADS, dim, generator=g, device="cuda").bfloat16()
    pos = torch.arange(t, device="cuda").expand(b, t).clone()
    for i, n in enumerate(lengths):
        pos[i, n:] = -1
    return q, k, v, pos


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("dim", DIMS)
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(dim: int) -> None:
    lengths = [37, 5, 130, 64]
    q, k, v, pos = _inputs(lengths, dim)
    batch = vllm_attention.paged_flash_attention(q, k, v, pos, dim**-0.5)
    for i, n in enumerate(lengths):
        alone = vllm_attention.paged_flash_attention(q[i : i + 1, :n], k[i : i + 1, :n], v[i : i + 1, :n],
                                                     pos[i : i + 1, :n], dim**-0.5)  # fmt: skip
        assert torch.equal(_bits(alone[0]), _bits(batch[i, :n])), i
        assert (batch[i, n:] == 0).all()


@pytest.mark.parametrize("dim", DIMS)
def test_prefill_continued_prefill_and_decode_give_a_query_the_same_bits(dim: int) -> None:
    q, k, v, pos = _inputs([90], dim)
    prefill = vllm_attention.paged_flash_attention(q, k, v, pos, dim**-0.5)
    for p in (0, 15, 16, 17, 63, 89):
        decode = vllm_attention.paged_flash_attention(
            q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos[:, p : p + 1], dim**-0.5
        )
        assert torch.equal(_bits(decode[0, 0]), _bits(prefill[0, p])), p
    # a prefill continuing a cached prefix: queries 40..59 over keys 0..59
    rest = vllm_attention.paged_flash_attention(q[:, 40:60], k[:, :60], v[:, :60], pos[:, 40:60], dim**-0.5)
    assert torch.equal(_bits(rest[0]), _bits(prefill[0, 40:60]))


@pytest.mark.parametrize("dim", DIMS)
def test_matches_the_reference_to_bf16_rounding(dim: int) -> None:
    q, k, v, pos = _inputs([40, 7], dim)
    got = vllm_attention.paged_flash_attention(q, k, v, pos, dim**-0.5).float()
    want = attention_reference(q, k, v, pos, dim**-0.5).float()
    assert (got - want).abs().max() < 2e-2
    # left padding (the trainer's scoring batches): row 1's three queries at positions 0..2, slots 0..2
    left = torch.tensor([[0, 1, 2, 3], [-1, 0, 1, 2]], device="cuda")
    q4, k4, v4 = q[:, :4], k[:, :4], v[:, :4]
    got = vllm_attention.paged_flash_attention(q4, k4, v4, left, dim**-0.5).float()
    want = attention_reference(q4, k4, v4, left, dim**-0.5).float()
    assert (got - want).abs().max() < 2e-2 and (got[1, 0] == 0).all()


def test_the_invariant_op_set_routes_bf16_attention_to_it() -> None:
    from rlfw.kernels import vllm_ops

    q, k, v, pos = _inputs([12, 3])
    assert vllm_attention.layout_for(q, pos) is not None
    assert vllm_attention.layout_for(q.float(), pos) is None, "no fp32 FlashAttention: Triton serves fp32"
    assert torch.equal(_bits(vllm_ops.attention(q, k, v, pos, 128**-0.5)),
                       _bits(vllm_attention.paged_flash_attention(q, k, v, pos, 128**-0.5)))  # fmt: skip
