"""The compiled log-softmax's bits on the three instruction sets it is written for, on this one machine.

    .venv/bin/python bench/softmax_builds.py

``kernels/csrc/softmax.cpp`` has an AVX-512 path, an AVX2/FMA path and a portable one, chosen at build time
by ``-march=native``; its header claims they compute the same additions lane by lane, so the same bits. A
machine builds only one of them. This script builds ``softmax.cpp`` twice more beside the checkout's
extension, with ``-march=x86-64-v3`` (AVX2/FMA, no AVX-512) and ``-march=x86-64`` (no AVX2, no FMA: the
portable path, its ``fma`` in software), and compares ``softmax_stats``, ``log_softmax_into`` and
``token_logp`` of all three bit for bit (and the sum's ``exp_neg`` on each row's differences from its
finite max) on rows of every kind (lengths around the 16-lane blocks, top-k style
rows of mostly -inf, a spread wider than the exp's edge cases, signed-zero maxima, NaN and inf entries, a
151,936-entry vocabulary). About two minutes, most of it the two builds. Exit 1 on any difference.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlfw.kernels import cpu_native  # noqa: E402

BINDINGS = r"""
#include <torch/extension.h>
std::vector<torch::Tensor> softmax_stats(const torch::Tensor& x);
void log_softmax_into(const torch::Tensor& x, torch::Tensor out);
torch::Tensor token_logp(const torch::Tensor& x, const torch::Tensor& ids);
torch::Tensor exp_neg_tensor(const torch::Tensor& x);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_stats", &softmax_stats);
  m.def("log_softmax_into", &log_softmax_into);
  m.def("token_logp", &token_logp);
  m.def("exp_neg", &exp_neg_tensor);
}
"""


def build(arch: str, folder: Path) -> object:
    from torch.utils.cpp_extension import load

    csrc = Path(cpu_native.__file__).with_name("csrc")
    (folder / "bindings.cpp").write_text(BINDINGS)
    for source in (csrc / "softmax.cpp", *cpu_native.HEADERS):
        (folder / source.name).write_bytes(source.read_bytes())
    flags = [f if not f.startswith("-march=") else f"-march={arch}" for f in cpu_native.CFLAGS]
    return load(
        name=f"rlfw_softmax_{arch.replace('-', '_')}",
        sources=[str(folder / "bindings.cpp"), str(folder / "softmax.cpp")],
        extra_cflags=flags,
        extra_ldflags=list(cpu_native.LDFLAGS),
        build_directory=str(folder),
        verbose=False,
    )


def rows(v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(v, generator=g) * 4
    masked = torch.full((v,), -math.inf)
    keep = torch.randperm(v, generator=g)[: max(1, v // 20)]
    masked[keep] = torch.randn(keep.numel(), generator=g)
    spread = torch.randn(v, generator=g) * 120
    zero_max = -torch.rand(v, generator=g) - 0.5
    zero_max[v // 2] = -0.0
    nan_tail, inf = plain.clone(), plain.clone()
    nan_tail[-1] = math.nan
    inf[v // 3] = math.inf
    return torch.stack([plain, masked, spread, zero_max, torch.full((v,), -math.inf), nan_tail, inf])


def outputs(module: object, x: torch.Tensor) -> list[torch.Tensor]:
    m, lse = module.softmax_stats(x)  # type: ignore[attr-defined]
    out = torch.empty_like(x)
    module.log_softmax_into(x, out)  # type: ignore[attr-defined]
    ids = torch.arange(x.shape[0]) * 7 % x.shape[1]
    diffs = (x - x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax(-1, keepdim=True)).clamp(max=0.0)
    return [m, lse, out, module.token_logp(x, ids), module.exp_neg(diffs)]  # type: ignore[attr-defined]


NAMES = ("max", "lse", "log_softmax", "token_logp", "exp_neg")


def main() -> int:
    native = cpu_native.module()
    lengths = [1, 7, 15, 16, 17, 31, 33, 1000, 3001, 151_936]
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        builds = {}
        for arch in ("x86-64-v3", "x86-64"):
            folder = Path(tmp) / arch
            folder.mkdir()
            builds[arch] = build(arch, folder)
        for v in lengths:
            x = rows(v, seed=v)
            want = outputs(native, x)
            for arch, module in builds.items():
                got = outputs(module, x)
                for name, a, b in zip(NAMES, got, want, strict=True):
                    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                        differ += 1
                        print(f"V={v} {arch}: {name} differs from the native build")
    native_path = "AVX-512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "AVX2 or portable"
    print(
        f"native build ({native_path}) against -march=x86-64-v3 and -march=x86-64, {len(lengths)} lengths x "
        f"7 kinds of row: {'same bits everywhere' if differ == 0 else f'{differ} differences'}"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
