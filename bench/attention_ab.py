"""The compiled attention's backward at this checkout against another revision: bits, then time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_ab.py --rev HEAD~1
    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_ab.py --rev HEAD~1 --paged
    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_ab.py --rev HEAD~1 --slotted

``--paged`` compares the forward over vLLM's paged cache instead (``paged_attention``, what
``engine=vllm`` runs on CPU): the same bits from both builds on decode and prefill shapes, fp32 and bf16
caches, one and two threads; then a decode step of the 76M benchmark model (64 sequences, one query token
each, 12 query and 4 K/V heads of 64, 12 layers, each layer's cache its own 48 MB or more, blocks of 128
positions in shuffled order as vLLM hands them out), timed at 50 and at 271 positions (the mean of a
512-token rollout), alternated call by call. ``--slotted`` does the same for the forward over the built-in
engine's slotted cache (``attention``): the same bits on those shapes and the backward's below, then the
same decode step with each layer's cache one row per sequence, rows in shuffled order.

The other revision's ``kernels/csrc`` is built beside this checkout's extension (``bench/linear_ab.py``'s
``build_at``). First every shape below must give the same dq, dk and dv bits from both builds, on one
thread and on two (causal rows with padding queries; head sizes with and without a tail of eight; one
sequence long enough that the backward takes its query rows in several blocks). Then both are timed,
alternated call by call, on the trainer's shape in ``bench/grpo_vs_trl.py``: a micro-batch of 16
sequences of 65 positions, 8 query and 4 K/V heads of 64, one thread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
from linear_ab import build_at  # noqa: E402
from paired import alternated_medians  # noqa: E402

from kernels import cpu_native  # noqa: E402

# (batch, query tokens, key positions, query heads, K/V heads, head size)
SHAPES = [
    (2, 5, 5, 2, 1, 8),
    (3, 17, 20, 8, 4, 64),
    (2, 9, 9, 4, 2, 12),
    (2, 33, 40, 6, 2, 72),
    (1, 70, 70, 8, 4, 100),
    (2, 130, 600, 4, 2, 64),
    (1, 300, 300, 2, 2, 128),
    (16, 65, 65, 8, 4, 64),
]
TRAINER = (16, 65, 65, 8, 4, 64)


def operands(b: int, t: int, s: int, hq: int, hkv: int, d: int, padding: float = 0.1) -> tuple[Any, ...]:
    """q, k, v, query positions (the last t of s, a share of them padding), scale, output gradient."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, t, hq, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
    v, grad = torch.randn(b, s, hkv, d, generator=g), torch.randn(b, t, hq, d, generator=g)
    pos = torch.arange(t).repeat(b, 1) + (s - t)
    pos[torch.rand(b, t, generator=g) < padding] = -1
    return q, k, v, pos.contiguous(), 0.125, grad


# (sequences, query tokens each, positions, query heads, K/V heads, head size, positions per block)
PAGED_SHAPES = [
    (64, 1, 271, 12, 4, 64, 128),
    (5, 1, 300, 8, 4, 64, 128),
    (3, 20, 150, 8, 4, 64, 16),
    (2, 9, 9, 4, 2, 12, 32),
    (4, 33, 260, 6, 2, 72, 128),
]


def paged_operands(
    seqs: int,
    t: int,
    positions: int,
    hq: int,
    hkv: int,
    d: int,
    block: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[Any, ...]:
    """q, a paged cache holding every sequence's ``positions`` K/V rows in shuffled blocks, each query
    token's sequence and position (the last ``t`` of its sequence), the block table and the scale."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-positions // block)
    order = torch.randperm(seqs * per_seq, generator=g)
    kv = torch.randn(seqs * per_seq, hkv, 2 * block, d, generator=g).to(dtype)
    q = torch.randn(seqs * t, hq, d, generator=g)
    seq = torch.arange(seqs).repeat_interleave(t)
    pos = (torch.arange(t) + positions - t).repeat(seqs)
    return q, kv, seq, pos, order.view(seqs, per_seq).contiguous(), 0.125


def paged(a: argparse.Namespace, here: Any, there: Any) -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for shape in PAGED_SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                args = paged_operands(*shape, dtype=dtype)
                if not same_bits([here.paged_attention(*args)], [there.paged_attention(*args)]):
                    raise SystemExit(
                        f"{shape} {dtype} on {threads} thread(s): the builds give different bits"
                    )
    shapes = len(PAGED_SHAPES)
    print(f"{machine.describe()}; same bits on {shapes} paged shapes, fp32 and bf16, 1 and 2 threads")
    decode_steps(
        a,
        here,
        there,
        "paged_attention",
        "",
        lambda positions, seed: paged_operands(64, 1, positions, 12, 4, 64, 128, torch.float32, seed),
    )


def decode_steps(a: argparse.Namespace, here: Any, there: Any, op: str, cache: str, layer: Any) -> None:
    """Time a decode step of the 76M benchmark model (``layer(positions, seed)``: one layer's operands for
    ``op``) at 50 and at 271 positions on both builds, alternated call by call, one thread."""
    torch.set_num_threads(1)
    for positions in (50, 271):
        layers = [layer(positions, seed) for seed in range(12)]

        def step(mod: Any, layers: list[tuple[Any, ...]] = layers) -> None:
            for args in layers:
                getattr(mod, op)(*args)

        t_there, t_here = alternated_medians([partial(step, there), partial(step, here)], a.reps)
        print(
            f"decode step{cache}, 64 sequences at {positions} positions, 12 layers, one thread, "
            f"medians of {a.reps}: "
            f"{a.rev} {t_there * 1e3:.2f} ms, here {t_here * 1e3:.2f} ms ({t_here / t_there:.3f}x the time)"
        )


def slotted_operands(
    seqs: int, t: int, positions: int, hq: int, hkv: int, d: int, seed: int = 0
) -> tuple[Any, ...]:
    """q, the engine's slotted K and V caches (one row per sequence, room for more positions than are
    visible, rows in shuffled order as slots are handed out), each query's position (the last ``t`` of
    its sequence), each sequence's cache row and the scale."""
    g = torch.Generator().manual_seed(seed)
    cap = positions + 273  # room the walk must not read
    k, v = torch.randn(seqs, cap, hkv, d, generator=g), torch.randn(seqs, cap, hkv, d, generator=g)
    q = torch.randn(seqs, t, hq, d, generator=g)
    pos = (torch.arange(t) + positions - t).repeat(seqs, 1).contiguous()
    return q, k, v, pos, torch.randperm(seqs, generator=g), 0.125


def slotted(a: argparse.Namespace, here: Any, there: Any) -> None:
    cases = [(shape[:-1], slotted_operands(*shape[:-1])) for shape in PAGED_SHAPES]
    for shape in SHAPES:  # the backward's shapes, each sequence reading its own cache row
        q, k, v, pos, scale, _ = operands(*shape)
        cases.append((shape, (q, k, v, pos, torch.arange(q.size(0)), scale)))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for shape, args in cases:
            if not same_bits([here.attention(*args)], [there.attention(*args)]):
                raise SystemExit(f"{shape} on {threads} thread(s): the builds give different bits")
    shapes = len(cases)
    print(f"{machine.describe()}; same bits on {shapes} slotted shapes, 1 and 2 threads")
    decode_steps(
        a,
        here,
        there,
        "attention",
        " over the slotted cache",
        lambda positions, seed: slotted_operands(64, 1, positions, 12, 4, 64, seed),
    )


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the git revision to compare with (e.g. HEAD~1)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--paged", action="store_true", help="the forward over vLLM's paged cache instead")
    ap.add_argument(
        "--slotted", action="store_true", help="the forward over the engine's slotted cache instead"
    )
    a = ap.parse_args()
    here = cpu_native.module()
    with tempfile.TemporaryDirectory() as tmp:
        there = build_at(a.rev, Path(tmp))
        if a.paged:
            paged(a, here, there)
            return
        if a.slotted:
            slotted(a, here, there)
            return
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for shape in SHAPES:
                args = operands(*shape)
                if not same_bits(here.attention_backward(*args), there.attention_backward(*args)):
                    raise SystemExit(f"{shape} on {threads} thread(s): the two builds give different bits")
        print(f"{machine.describe()}; same dq, dk and dv bits on {len(SHAPES)} shapes, 1 and 2 threads")
        torch.set_num_threads(1)
        args = operands(*TRAINER, padding=0.07)
        t_there, t_here = alternated_medians(
            [partial(there.attention_backward, *args), partial(here.attention_backward, *args)], a.reps
        )
        print(
            f"trainer shape {TRAINER}, one thread, medians of {a.reps}: {a.rev} {t_there * 1e3:.2f} ms, "
            f"here {t_here * 1e3:.2f} ms ({t_here / t_there:.3f}x the time)"
        )


if __name__ == "__main__":
    main()
