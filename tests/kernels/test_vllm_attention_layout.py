"""Which calls the CUDA FlashAttention path takes (:mod:`rlfw.kernels.vllm_attention`), checked on CPU:
the paged call needs each row's valid queries to be that row's last key positions, in order."""

from __future__ import annotations

import torch

from rlfw.kernels import vllm_attention


def test_prefill_scoring_and_decode_layouts_are_served_with_their_key_counts() -> None:
    right = torch.tensor([[0, 1, 2, -1], [0, 1, 2, 3]])  # right padding
    left = torch.tensor([[-1, -1, 0, 1], [0, 1, 2, 3]])  # left padding (the trainer's scoring batches)
    decode = torch.tensor([[7], [-1], [30]])  # one new token over the cache; an idle row
    prefix = torch.tensor([[5, 6, 7, 8]])  # a prefill continuing a cached prompt
    for q_pos, n, keys in (
        (right, [3, 4], [3, 4]),
        (left, [2, 4], [2, 4]),
        (decode, [1, 0, 1], [8, 0, 31]),
        (prefix, [4], [9]),
    ):
        layout = vllm_attention._layout(q_pos)
        assert layout is not None, q_pos
        assert layout[0].tolist() == n and layout[1].tolist() == keys


def test_queries_that_are_not_the_last_positions_go_elsewhere() -> None:
    assert vllm_attention._layout(torch.tensor([[0, 2, 3]])) is None  # a gap
    assert vllm_attention._layout(torch.tensor([[1, 0]])) is None  # out of order
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert vllm_attention.layout_for(q, torch.tensor([[0, 1]])) is None, "no CUDA here: another kernel serves"
    assert not vllm_attention.available(torch.float32)
