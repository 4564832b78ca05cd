"""Tile sizes of the Triton kernels (importable without triton, so they can be described anywhere)."""

from __future__ import annotations

from typing import NamedTuple

MM_BLOCK_K = 32
"""K slice per step of the matmul loop for fp32 operands; steps are accumulated in ascending order, no
split-K. Of the matmul's tile sizes only the K slice enters an element's reduction."""
MM_BLOCK_K_16 = 64
"""K slice for bf16/fp16 operands, which go into the tensor cores as they are (each step is a fixed chain
of MMA instructions over 16-wide K chunks, accumulated in fp32)."""


class MatmulTiles(NamedTuple):
    """How one matmul launch is cut: output tile, warps per program, software-pipeline depth. None of
    these enters an element's reduction (that is one accumulator walked over K in ``MM_BLOCK_K`` steps,
    ascending), so they may change with the row count: vLLM's batch-invariant matmul picks them per
    row-count bucket in the same way, keeping only the K slice fixed."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


MM_SMALL_ROWS = 256
"""Launches with at most this many rows (decode steps) take :data:`MM_TILES_SMALL`, larger ones
(prefill, training) :data:`MM_TILES_LARGE`."""
MM_TILES_SMALL = MatmulTiles(64, 128, 4, 3)
"""64 x 128 output tiles ran a [2048, 512] x [512, 1536] fp32 product at 10.5 TFLOP/s on an H200, 16 x 32
at 3.5 (``bench/RESULTS.md``, 2026-12-04); every row kept its bits alone and in batches of up to 257."""
MM_TILES_LARGE = MatmulTiles(128, 128, 8, 3)
"""128 x 128 tiles, 8 warps: a [2048, 768] x [768, 2048] product at 17.2 TFLOP/s in fp32 and 64-95 TFLOP/s
in bf16 on the tensor cores (17.0 when bf16 was widened to fp32), H200 (``bench/RESULTS.md``)."""


def matmul_tiles(rows: int) -> MatmulTiles:
    """The launch shape for a product with ``rows`` output rows."""
    return MM_TILES_SMALL if rows <= MM_SMALL_ROWS else MM_TILES_LARGE


ATTN_BLOCK_R = 16
"""Query rows ((t, g) pairs of one KV head) per attention program."""
LSM_BLOCK_V = 1024
"""Vocabulary chunk per step of the log-softmax loops."""
