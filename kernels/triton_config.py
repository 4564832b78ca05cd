"""Tile sizes of the Triton kernels (importable without triton, so they can be described anywhere)."""

MM_BLOCK_M = 16
"""Rows per matmul program: a row's result never depends on how many rows share its launch."""
MM_BLOCK_N = 32
MM_BLOCK_K = 32
"""K slice per step of the matmul loop; steps are accumulated in ascending order, no split-K."""
ATTN_BLOCK_R = 16
"""Query rows ((t, g) pairs of one KV head) per attention program."""
LSM_BLOCK_V = 1024
"""Vocabulary chunk per step of the log-softmax loops."""
