"""The compiled attention's backward at this checkout against another revision: bits, then time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/attention_ab.py --rev HEAD~1

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


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the git revision to compare with (e.g. HEAD~1)")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    here = cpu_native.module()
    with tempfile.TemporaryDirectory() as tmp:
        there = build_at(a.rev, Path(tmp))
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
