"""Ops on the log-probability path, installed as ``rlfw.kernels``.

The shared model calls every numerically relevant op through an :class:`Ops` object, so one switch
(``kernels=invariant|default``) decides whether trainer and engine run plain torch ops or the
batch-invariant ones. Shapes follow the model's layout: activations ``[B, T, H, D]``, KV cache
``[B, S, H_kv, D]`` where slot ``s`` holds position ``s``.
"""

from rlfw.kernels.default import DefaultOps
from rlfw.kernels.registry import KERNEL_CHOICES, Ops, get_ops

__all__ = ["KERNEL_CHOICES", "DefaultOps", "Ops", "get_ops"]
