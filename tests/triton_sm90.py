"""Compile every rlfw Triton kernel for an H100/H200 (sm_90) without a GPU: Triton's own compiler and the
``ptxas`` its wheel bundles, from the source to a cubin. Run as ``python -m tests.triton_sm90`` with
``TRITON_INTERPRET`` unset (the interpreter replaces the kernels); prints one line per kernel, then ``ok``.

GPU sessions are rare; this catches what the interpreter cannot: a construct the real backend rejects
(a loop bound or a tuple it cannot lower, a ``tl.dot`` shape it has no instruction for), and 32-bit
address arithmetic: a product of two run-time values in i32 (``row * V``, ``rows * stride``) wraps once a
tensor passes 2^31 elements (a log-softmax over a 152k vocabulary at about 14,000 rows), which no test
on this machine can allocate, so each kernel's Triton IR is read for such products instead."""

from __future__ import annotations

import inspect
import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlfw.kernels import triton_attention, triton_config, triton_matmul, triton_norm, triton_softmax

TARGET = GPUTarget("cuda", 90, 32)
F32, BF16, I64 = "*fp32", "*bf16", "*i64"


_DEFINITION = re.compile(r"^\s*(%[\w.]+) = ([\w.]+) ?(%[\w.]+)?")
_PRODUCT_32 = re.compile(r"^\s*%[\w.]+ = arith\.muli (%[\w.]+), (%[\w.]+) : (?:i32|tensor<[^>]*xi32>)")


def products_32(ttir: str) -> list[str]:
    """The lines of ``ttir`` that multiply two run-time values in 32 bits (an operand that is a constant,
    or a splat of one, is a tile size: its product stays within the launch grid)."""
    defined = {m.group(1): (m.group(2), m.group(3)) for m in map(_DEFINITION.match, ttir.splitlines()) if m}

    def constant(value: str) -> bool:
        op, source = defined.get(value, ("", None))
        return op == "arith.constant" or (op == "tt.splat" and source is not None and constant(source))

    found = []
    for line in ttir.splitlines():
        m = _PRODUCT_32.match(line)
        if m and not (constant(m.group(1)) or constant(m.group(2))):
            found.append(line.split(" loc(")[0].strip())
    return found


def compile_for_sm90(
    kernel: Any, types: dict[str, str], constexprs: dict[str, Any], options: dict[str, int] | None = None
) -> tuple[int, list[str]]:
    """Compile ``kernel`` (launch ``options`` such as ``num_warps``); parameters not named in ``types`` are
    i32 scalars. Returns the cubin's size and the 32-bit run-time products of its Triton IR."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    compiled = triton.compile(source, target=TARGET, options=options or {})
    return len(compiled.asm["cubin"]), products_32(compiled.asm["ttir"])


def main() -> None:
    large = triton_config.MM_TILES_LARGE
    tiles = {"BLOCK_M": large.block_m, "BLOCK_N": large.block_n, "ROW_EXACT": False}
    launch = {"num_warps": large.num_warps, "num_stages": large.num_stages}
    attn = {"TILE": 32, "BLOCK_R": triton_config.ATTN_BLOCK_R, "BLOCK_D": 128, "ROW_EXACT": False}  # Qwen3's
    rows_bwd = {"q_ptr": F32, "k_ptr": BF16, "v_ptr": BF16, "go_ptr": F32, "pos_ptr": I64, "last_ptr": I64}
    stats = {"m_ptr": F32, "l_ptr": F32, "delta_ptr": F32, "scale": "fp32"}
    cases = [
        (triton_matmul._matmul_kernel, {"a_ptr": F32, "b_ptr": F32, "c_ptr": F32},
         {**tiles, "BLOCK_K": triton_config.MM_BLOCK_K, "WIDEN": True}, launch),
        (triton_matmul._matmul_kernel, {"a_ptr": BF16, "b_ptr": BF16, "c_ptr": BF16},
         {**tiles, "BLOCK_K": triton_config.MM_BLOCK_K_16, "WIDEN": False}, launch),
        (triton_norm._rms_norm_kernel, {"x_ptr": BF16, "w_ptr": BF16, "y_ptr": BF16, "eps": "fp32"},
         {"BLOCK_D": 64}),
        (triton_norm._rms_norm_backward_kernel,
         {"x_ptr": BF16, "w_ptr": BF16, "g_ptr": BF16, "dx_ptr": BF16, "gn_ptr": F32, "eps": "fp32"},
         {"BLOCK_D": 64}),
        (triton_softmax._row_stats_kernel, {"x_ptr": BF16, "m_ptr": F32, "lse_ptr": F32},
         {"BLOCK_V": triton_config.LSM_BLOCK_V}),
        (triton_softmax._log_softmax_kernel, {"x_ptr": BF16, "m_ptr": F32, "lse_ptr": F32, "y_ptr": F32},
         {"BLOCK_V": triton_config.LSM_BLOCK_V}),
        (triton_attention._attention_kernel,
         {"q_ptr": F32, "k_ptr": BF16, "v_ptr": BF16, "pos_ptr": I64, "last_ptr": I64, "o_ptr": F32,
          "scale": "fp32"}, attn),
        (triton_attention._attention_backward_rows_kernel, {**rows_bwd, **stats, "dq_ptr": F32}, attn),
        (triton_attention._attention_backward_slots_kernel,
         {**rows_bwd, **stats, "dk_ptr": F32, "dv_ptr": F32}, attn),
    ]  # fmt: skip
    wrapping = []
    for kernel, types, constexprs, *options in cases:
        size, products = compile_for_sm90(kernel, types, constexprs, *options)
        print(kernel.fn.__name__, size, flush=True)
        wrapping += [f"{kernel.fn.__name__}: {line}" for line in products]
    if wrapping:
        raise SystemExit("32-bit products of run-time values (they wrap past 2^31):\n" + "\n".join(wrapping))
    print("ok")


if __name__ == "__main__":
    main()
