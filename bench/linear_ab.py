"""The compiled CPU linear of this checkout against the one of another revision, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_ab.py --rev HEAD~1 [--reps 15] [--rows 1040]
    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_ab.py --rev HEAD~1 --engine --rows 64
    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_ab.py --rev HEAD~1 --stored --rows 8
    OMP_NUM_THREADS=1 .venv/bin/python bench/linear_ab.py --rev HEAD~1 --step --rows 64

Builds ``kernels/csrc`` as it is at ``--rev`` into a second extension (in a temporary folder, with this
checkout's compiler flags), then times the trainer's three products per linear of the 13M model, forward
``x @ W.T``, input gradient ``g @ W`` and weight gradient ``g.T @ x`` (a micro-batch of ``--rows`` rows,
about 16 sequences of 65 tokens), each as the trainer calls it (the weight packed per call), alternating
the two builds call by call (medians). ``--engine``: instead, an engine's forward against its weights
packed once (``linear_packed``), for every weight of the 13M and 76M models (64 rows: a decode step of
the benchmark's batch; 4,096: its prefill stream). ``--stored``: the same weights read as stored
(``linear``; up to 64 rows it never packs: the per-op path's decode step when nothing packed the
weights). ``--step``: a decode step's linears of each model, every layer's weights its own tensors (the
76M model's 300 MB, the 13M model's 48 MB: more than the last-level cache, as in an engine's step), packed
once per build. Every product must give the same bits from both builds: a kernel change that moves speed may
not move a bit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import machine  # noqa: E402
from paired import alternated_medians  # noqa: E402

from rlfw.kernels import cpu_native  # noqa: E402

SHAPES = [(512, 512), (512, 1536), (1536, 512), (512, 362)]  # (K, N) of the 13M model's weights [N, K]
ENGINE_SHAPES = [  # (K, N) of every weight of the 13M model (then the 76M one): q/k/v, o, gate/up, down, head
    *((512, 1024), (512, 512), (512, 1536), (1536, 512), (512, 362)),
    *((768, 1280), (768, 768), (768, 2048), (2048, 768), (768, 362)),
]


def build_at(rev: str, folder: Path):  # type: ignore[no-untyped-def]
    """The extension built from ``kernels/csrc`` at git revision ``rev``."""
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parent.parent
    sources = []
    for path in cpu_native.SOURCES + cpu_native.HEADERS:
        shown = subprocess.run(
            ["git", "show", f"{rev}:kernels/csrc/{path.name}"], cwd=root, capture_output=True
        )
        if shown.returncode != 0 and path in cpu_native.HEADERS:
            continue  # a header added since rev: rev's sources do not include it
        shown.check_returncode()
        (folder / path.name).write_bytes(shown.stdout)
        if path in cpu_native.SOURCES:
            sources.append(str(folder / path.name))
    return load(
        name="rlfw_cpu_kernels_ab",
        sources=sources,
        extra_cflags=list(cpu_native.CFLAGS),
        extra_ldflags=list(cpu_native.LDFLAGS),
        build_directory=str(folder),
        verbose=False,
    )


def products(rows: int, k: int, n: int) -> list[tuple[str, Callable[[Any], torch.Tensor]]]:
    """The trainer's three products for a weight [n, k] and ``rows`` rows, each a call on a build."""
    g = torch.Generator().manual_seed(k * n)
    x, w, grad = (torch.randn(*shape, generator=g) for shape in ((rows, k), (n, k), (rows, n)))
    gt = grad.t().contiguous()
    return [
        ("forward", lambda mod: mod.linear(x, w)),
        ("input grad", lambda mod: mod.linear_t(grad, w)),
        ("weight grad", lambda mod: mod.linear_t(gt, x)),
    ]


def engine_products(rows: int, k: int, n: int) -> list[tuple[str, Callable[[Any], torch.Tensor]]]:
    """An engine's forward for a weight [n, k] packed once per build, on ``rows`` rows."""
    g = torch.Generator().manual_seed(k * n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    packed: dict[int, torch.Tensor] = {}

    def forward(mod: Any) -> torch.Tensor:
        if id(mod) not in packed:  # packed on the first (untimed, bit-checking) call only
            packed[id(mod)] = mod.pack(w)
        return mod.linear_packed(x, packed[id(mod)], n)

    return [("packed fwd", forward)]


def stored_products(rows: int, k: int, n: int) -> list[tuple[str, Callable[[Any], torch.Tensor]]]:
    """The forward for a weight [n, k] read as stored (``linear``), on ``rows`` rows."""
    g = torch.Generator().manual_seed(k * n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    return [("stored fwd", lambda mod: mod.linear(x, w))]


# Layers of each model whose weights a decode step passes over (every one its own tensor, so that a step
# reads more than the last-level cache holds, as an engine's step does); gate and up are two weights.
STEP_MODELS = {"13m": (4, ENGINE_SHAPES[:5]), "76m": (12, ENGINE_SHAPES[5:])}


def step_products(rows: int) -> list[tuple[str, Callable[[Any], list[torch.Tensor]]]]:
    """One decode step's linears per model: every layer's q/k/v, o, gate, up and down weights, then the head,
    each packed once per build, on ``rows`` rows."""
    out = []
    for model, (layers, shapes) in STEP_MODELS.items():
        g = torch.Generator().manual_seed(layers)
        block = [shapes[0], shapes[1], shapes[2], shapes[2], shapes[3]]
        weights = [torch.randn(n, k, generator=g) for _ in range(layers) for k, n in block]
        weights.append(torch.randn(shapes[4][1], shapes[4][0], generator=g))
        xs = {k: torch.randn(rows, k, generator=g) for k, _ in shapes}
        packed: dict[int, list[torch.Tensor]] = {}

        def step(
            mod: Any,
            weights: list[torch.Tensor] = weights,
            xs: dict[int, torch.Tensor] = xs,
            packed: dict[int, list[torch.Tensor]] = packed,
        ) -> Any:
            if id(mod) not in packed:
                packed[id(mod)] = [mod.pack(w) for w in weights]
            return [
                mod.linear_packed(xs[w.size(1)], p, w.size(0))
                for w, p in zip(weights, packed[id(mod)], strict=True)
            ]

        params = sum(w.numel() for w in weights)
        out.append((f"{model} decode step ({layers} layers, {params / 1e6:.0f}M weights)", step))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the git revision to compare with (e.g. HEAD~1)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=1040)
    ap.add_argument("--engine", action="store_true", help="an engine's packed forward, both models' weights")
    ap.add_argument("--stored", action="store_true", help="the forward over weights as stored, both models'")
    ap.add_argument(
        "--step", action="store_true", help="a decode step's linears: every layer's own weights, packed once"
    )
    a = ap.parse_args()
    shapes, make = (SHAPES, products)
    if a.engine or a.stored:
        shapes, make = ENGINE_SHAPES, stored_products if a.stored else engine_products
    torch.set_num_threads(1)
    here = cpu_native.module()
    with tempfile.TemporaryDirectory() as tmp:
        there = build_at(a.rev, Path(tmp))
        print(f"{machine.describe()}; this checkout against {a.rev}, {a.rows} rows, medians of {a.reps}")
        totals = [0.0, 0.0]
        if a.step:
            for name, step in step_products(a.rows):
                pairs = zip(step(here), step(there), strict=True)
                if not all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in pairs):
                    raise SystemExit(f"{name}: the two builds give different bits")
                t_there, t_here = alternated_medians([partial(step, there), partial(step, here)], a.reps)
                print(
                    f"{name}: {a.rev} {t_there * 1e3:.2f} ms, here {t_here * 1e3:.2f} ms "
                    f"({t_here / t_there:.3f}x the time)",
                    flush=True,
                )
            return
        for k, n in shapes:
            for name, call in make(a.rows, k, n):
                if not torch.equal(call(here).view(torch.int32), call(there).view(torch.int32)):
                    raise SystemExit(f"{name} {k}->{n}: the two builds give different bits")
                t_there, t_here = alternated_medians([partial(call, there), partial(call, here)], a.reps)
                totals[0] += t_there
                totals[1] += t_here
                gflops = 2 * a.rows * k * n / 1e9
                print(
                    f"{k:5d} -> {n:5d} {name:11s}: {a.rev} {gflops / t_there:6.1f} GFLOP/s, "
                    f"here {gflops / t_here:6.1f} ({t_here / t_there:.3f}x the time)",
                    flush=True,
                )
        print(f"all products: here {totals[1] / totals[0]:.3f}x the time of {a.rev}")


if __name__ == "__main__":
    main()
