"""The bit-relevant choices of each op set, as plain JSON-serialisable dicts.

These records feed the execution contract: two processes whose records differ may not assume equal
bits. Only choices that can change a result bit belong here (never logging or ordering of entries).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlfw.kernels import attention, matmul, reduce, router


def _linear_record(backend: str) -> dict[str, Any]:
    from rlfw.kernels import triton_config as tc

    common = {"split_k": False, "accumulate": "fp32", "bf16_operands": "widened_to_fp32_round_once"}
    if backend == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter widens every operand
        return {
            "impl": "triton_tiled_matmul",
            "k_tile": tc.MM_BLOCK_K,
            # kept in the record although they do not enter an element's reduction
            "launch_tiles": {
                "up_to_rows": tc.MM_SMALL_ROWS,
                "small": list(tc.MM_TILES_SMALL),
                "large": list(tc.MM_TILES_LARGE),
            },
            **common,
            "bf16_operands": common["bf16_operands"] if interpreted else "tensor_core_mma_fp32_accumulate",
            "k_tile_16bit": tc.MM_BLOCK_K if interpreted else tc.MM_BLOCK_K_16,
        }
    if not torch.cuda.is_available():  # CPU tensors: the compiled kernel (kernels/csrc/linear.cpp)
        return {"impl": "cpp_fma_chain", "order": "one fma per k, ascending, from +0", **common}
    blocks = {"row_block": matmul.ROW_BLOCK, "col_block": None, "k_tile": matmul.K_TILE}
    return {"impl": "torch_row_block_matmul", **blocks, **common}


def _log_softmax_record(triton_like: bool, off_cpu: bool) -> dict[str, Any]:
    from rlfw.kernels import triton_config as tc

    if not off_cpu:  # the compiled row statistics (kernels/csrc/softmax.cpp)
        return {
            "impl": "cpp_row_max_then_exp_sum",
            "math": "fp32",
            "shift": "row_max_canonical_zero",
            "exp": "own_fp32_exp_neg_cody_waite_poly5_fp32",
            "sum": "fp64_16_lanes_halving_fold",
            "log": "own_fp64_atanh_series",
        }
    return {
        "impl": "triton_row" if triton_like else "torch_row",
        "math": "fp32",
        "shift": "row_max_canonical_zero",
        "v_chunk": tc.LSM_BLOCK_V if triton_like else reduce.SUM_CHUNK,
    }


def _attention_record(backend: str) -> dict[str, Any]:
    from rlfw.kernels import triton_config as tc

    common: dict[str, Any] = {"accumulate": "fp32", "backward": "recompute_reference_fp32"}
    if backend != "triton" and not torch.cuda.is_available():  # the compiled kernel
        # fp32 operands: the compiled backward; bf16 (trainer.precision=bf16) keeps the recompute
        common["backward"] = {
            "fp32": "cpp_per_kv_head_recompute_softmax",
            "other": "recompute_reference_fp32",
        }
        return {
            "impl": "cpp_row_two_pass_softmax",
            "visible": "slots_0_to_position_only",
            "dot": "8_lane_fma_fold_then_tail",
            "exp": "own_fp32_exp_table32_cubic_double",  # not the C library's: its bits travel with rlfw
            "sums": "ascending_position",
            **common,
        }
    triton_like = backend == "triton"
    if triton_like:
        common["backward"] = "triton_two_pass_closed_form_fp32"  # kernels/triton_attention.py
    return {
        "impl": "triton_tiled_online_softmax" if triton_like else "torch_tiled_online_softmax",
        "kv_tile": attention.KV_TILE,
        "q_row_block": tc.ATTN_BLOCK_R if triton_like else matmul.ROW_BLOCK,
        "score_gemm_tiles": 1 if triton_like else attention.TILE_GROUP,
        "tile_alignment": "position_0",
        "tile_order": "ascending",
        "masked_slots": "zeroed_past_row_last_position",
        **common,
    }


def _rms_norm_record(triton_like: bool, off_cpu: bool) -> dict[str, Any]:
    common = {"accumulate": "fp32", "round": "normed_to_input_dtype_then_weight_mul"}
    if triton_like:
        # training: the closed form in one Triton program per row (kernels/triton_norm.py), on the vLLM
        # backend too (whose forward is vLLM's)
        return {"impl": "triton_row", "sum_chunk": None, "backward": "triton_row_closed_form_fp32", **common}
    torch_row = {"impl": "torch_row", "sum_chunk": reduce.SUM_CHUNK, **common}
    if off_cpu:
        return torch_row
    # CPU: fp32 rows take the compiled kernel; other dtypes (bf16) the torch spelling
    return {"fp32": {"impl": "cpp_row", "sum": "16_lane_fma_then_halving_fold", **common}, **torch_row}


def describe_invariant(backend: str) -> dict[str, Any]:
    """The record of :class:`~rlfw.kernels.invariant.InvariantOps` on ``backend``."""

    if backend == "vllm":
        return _describe_vllm()
    triton_like = backend == "triton"
    off_cpu = triton_like or torch.cuda.is_available()  # CPU tensors take the compiled kernels
    return {
        "name": "invariant",
        "backend": backend,
        "linear": _linear_record(backend),
        "rms_norm": _rms_norm_record(triton_like, off_cpu),
        "rope": {
            # the compiled kernel on CPU: the torch spelling's IEEE operations, in its order
            "impl": "torch_elementwise" if off_cpu else "cpp_elementwise",
            "math": "fp32",
            "layout": "rotate_half",
            "products": "unfused_mul_mul_add",
        },
        "silu_mul": {
            "impl": "torch_elementwise" if off_cpu else "cpp_elementwise",
            "silu": "x/(1+exp(-x))",
            "exp": "torch" if off_cpu else "own_fp32_exp_table32_cubic_double",
            "math": "fp32",
            "round": "once",
        },
        "attention": _attention_record(backend),
        "log_softmax": _log_softmax_record(triton_like, off_cpu),
        "token_logp": {"impl": "gather_of_log_softmax_arithmetic"},
        "entropy": {"impl": "log_softmax_then_row_sum", "sum_chunk": reduce.SUM_CHUNK},
        "router_topk": {
            "impl": "torch_stable_sort",
            "softmax": "fp32",
            "rank_by": "fp32_probability",
            "tie_rule": router.TIE_RULE,
        },
        "router_weights": {"impl": "fp32_softmax_gather", "norm_sum": "row_sum"},
    }


def _describe_vllm() -> dict[str, Any]:
    """The CUDA op set on vLLM's kernels: ops vLLM serves are named by its implementation and version (its
    tile choices are its own, tuned per device; the device is in the environment fingerprint), the rest as
    on the Triton backend."""
    from rlfw.kernels import vllm_attention, vllm_ops

    record = describe_invariant("triton")
    served = {
        "library": vllm_ops.VLLM_KERNELS,
        "vllm": vllm_ops.vllm_version(),
        "backward": "rlfw_closed_form",
    }
    record["backend"] = "vllm"
    record["linear"] = {"impl": vllm_ops.IMPLEMENTATIONS["linear"], "split_k": False, **served}
    record["rms_norm"] = {
        "impl": vllm_ops.IMPLEMENTATIONS["rms_norm"],
        **served,
        "backward": record["rms_norm"]["backward"],  # rlfw's Triton kernel, as on the Triton backend
    }
    record["log_softmax"] = {"impl": vllm_ops.IMPLEMENTATIONS["log_softmax"], **served}
    record["token_logp"] = {"impl": vllm_ops.IMPLEMENTATIONS["token_logp"]}
    record["attention"] = {
        **record["attention"],
        "impl": vllm_ops.IMPLEMENTATIONS["attention"],
        "page_size": vllm_attention.BLOCK_SIZE,
        "fp32_impl": vllm_ops.IMPLEMENTATIONS["attention_fp32"],
        **served,
        "backward": record["attention"]["backward"],  # rlfw's Triton kernels, as on the Triton backend
    }
    record["entropy"] = {"impl": "vllm_log_softmax_then_row_sum", "sum_chunk": reduce.SUM_CHUNK}
    return record


def describe_default() -> dict[str, Any]:
    """The record of :class:`~rlfw.kernels.default.DefaultOps`: library choices, not batch-invariant."""
    return {
        "name": "default",
        "backend": "torch",
        "linear": {"impl": "F.linear"},
        "rms_norm": {"impl": "torch", "accumulate": "fp32"},
        "rope": {"impl": "torch_elementwise", "math": "fp32"},
        "silu_mul": {"impl": "F.silu_mul_in_input_dtype"},
        "attention": {"impl": "F.scaled_dot_product_attention"},
        "log_softmax": {"impl": "torch.log_softmax", "math": "fp32"},
        "token_logp": {"impl": "gather_of_log_softmax"},
        "entropy": {"impl": "torch_sum"},
        "router_topk": {"impl": "torch.topk", "softmax": "fp32", "tie_rule": "unspecified"},
        "router_weights": {"impl": "fp32_softmax_gather"},
    }
