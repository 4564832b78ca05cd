"""Attention over vLLM's paged cache layout: a query gets the same bits as from the engine's slotted cache.

This is what lets ``engine=vllm`` claim the contract's pairs bitwise: vLLM keeps its paged cache, block
tables, prefix cache and chunked prefill, and a query reads whatever blocks its sequence was given.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.kernels import attention
from tests.kernels.bits import DTYPES, assert_same_bits

HQ, HKV, D = 4, 2, 32
SCALE = D**-0.5


def _paged(k: torch.Tensor, v: torch.Tensor, lengths: list[int], block: int, blocks: int, seed: int):  # type: ignore[no-untyped-def]
    """Each sequence's K/V ``[S, Hkv, D]`` written through :func:`paged_store` into scattered blocks of a
    cache whose other blocks hold NaN; returns the cache and the block table."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-n // block) for n in lengths)
    order = torch.randperm(blocks, generator=g)[:need].tolist()
    cache = torch.full((blocks, HKV, block, 2 * D), float("nan"), dtype=k.dtype)
    width = max(-(-n // block) for n in lengths) + 1
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for r, n in enumerate(lengths):
        mine = [order.pop() for _ in range(-(-n // block))]
        table[r, : len(mine)] = torch.tensor(mine)
        slots = torch.tensor([mine[i // block] * block + i % block for i in range(n)])
        attention.paged_store(cache, k[r, :n], v[r, :n], slots)
    return cache, table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 32])
def test_paged_equals_slotted(dtype: torch.dtype, block: int) -> None:
    lengths = [1, 17, 40, 33]
    s = max(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(lengths), s, HQ, D, generator=g).to(dtype)
    k = torch.randn(len(lengths), s, HKV, D, generator=g).to(dtype)
    v = torch.randn(len(lengths), s, HKV, D, generator=g).to(dtype)
    pos = torch.stack([torch.where(torch.arange(s) < n, torch.arange(s), -1) for n in lengths])
    slotted = attention.attention(q, k, v, pos, SCALE)
    cache, table = _paged(k, v, lengths, block, blocks=12, seed=1)
    # Every query of every sequence as one flat batch (a prefill), then each one alone (a decode step).
    seq = torch.arange(len(lengths))[:, None].expand(-1, s)
    flat = attention.paged_attention(
        q.reshape(-1, HQ, D), cache, seq.reshape(-1), pos.reshape(-1), table, SCALE
    )
    assert_same_bits(flat.view(len(lengths), s, HQ, D), slotted, "flat batch")
    for r, n in enumerate(lengths):
        for t in (0, n // 2, n - 1):
            one = attention.paged_attention(
                q[r, t : t + 1], cache, torch.tensor([r]), torch.tensor([t]), table, SCALE
            )
            assert_same_bits(one[0], slotted[r, t], f"sequence {r}, position {t}")


def test_padding_tokens_get_zeros_and_bad_blocks_are_refused() -> None:
    k = torch.randn(1, 8, HKV, D)
    cache, table = _paged(k, k, [8], 16, blocks=2, seed=0)
    q = torch.randn(2, HQ, D)
    out = attention.paged_attention(q, cache, torch.tensor([0, 0]), torch.tensor([3, -1]), table, SCALE)
    assert torch.all(out[1] == 0) and torch.isfinite(out[0]).all()
    with pytest.raises(RuntimeError, match="block -1 outside"):
        attention.paged_attention(q[:1], cache, torch.tensor([0]), torch.tensor([20]), table, SCALE)


def test_tokens_of_several_sequences_in_one_walk_block() -> None:
    """The kernel walks runs of up to eight consecutive tokens of one sequence together; tokens packed
    without padding (runs crossing sequence ends) or interleaved get the slotted kernel's bits."""
    lengths = [3, 17, 1, 11]
    s = max(lengths)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(lengths), s, HQ, D, generator=g)
    k = torch.randn(len(lengths), s, HKV, D, generator=g)
    v = torch.randn(len(lengths), s, HKV, D, generator=g)
    pos = torch.stack([torch.where(torch.arange(s) < n, torch.arange(s), -1) for n in lengths])
    slotted = attention.attention(q, k, v, pos, SCALE)
    cache, table = _paged(k, v, lengths, 16, blocks=8, seed=3)
    packed = [(r, t) for r, n in enumerate(lengths) for t in range(n)]
    interleaved = [(r, t) for t in range(s) for r, n in enumerate(lengths) if t < n]
    for order in (packed, interleaved):
        rs, ts = torch.tensor([r for r, _ in order]), torch.tensor([t for _, t in order])
        out = attention.paged_attention(q[rs, ts], cache, rs, ts, table, SCALE)
        assert_same_bits(out, slotted[rs, ts], "packed" if order is packed else "interleaved")
