"""Tile sizes of the Triton kernels (importable without triton, so they can be described anywhere)."""

MM_BLOCK_M = 64
"""Rows per matmul program: a row's result never depends on how many rows share its launch. 64 x 128
output tiles ran a [2048, 512] x [512, 1536] fp32 product at 10.5 TFLOP/s on an H200, 16 x 32 at 3.5
(``bench/RESULTS.md``, 2026-12-04); every row kept its bits alone and in batches of up to 257."""
MM_BLOCK_N = 128
MM_BLOCK_K = 32
"""K slice per step of the matmul loop; steps are accumulated in ascending order, no split-K."""
ATTN_BLOCK_R = 16
"""Query rows ((t, g) pairs of one KV head) per attention program."""
LSM_BLOCK_V = 1024
"""Vocabulary chunk per step of the log-softmax loops."""
