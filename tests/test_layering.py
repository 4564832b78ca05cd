"""The package's layers, checked on its imports: the math and the model stay free of the cluster.

A reader finds the architecture in the folders only if the arrows between them point one way: ``kernels/``,
``rlfw/model/`` and ``rlfw/algos/`` are pure torch (no Ray, DeepSpeed, ``torch.distributed`` or
``rlfw.distributed``, reached directly or through another rlfw module, at import time or lazily inside a
function); the model and the algorithms know nothing of vLLM, while ``kernels/`` may use vLLM's kernel
modules as a kernel library and nothing else of it; and ``rlfw/trainer/`` never reaches ``rlfw/rollout/``.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# rlfw.kernels is installed from the top-level kernels/ folder (pyproject's package-dir).
PACKAGE_DIRS = {"rlfw.kernels": ROOT / "kernels", "rlfw": ROOT / "rlfw"}
CLUSTER = ("ray", "deepspeed", "torch.distributed", "rlfw.distributed")
VLLM_KERNEL_MODULES = (
    "vllm.model_executor.determinism.batch_invariant",
    "vllm.triton_utils",
    "vllm.vllm_flash_attn",  # vLLM's FlashAttention build (kernels/vllm_attention.py)
)


def module_file(name: str) -> Path | None:
    """The source file of an rlfw module (``None`` for anything outside rlfw)."""
    for prefix, folder in PACKAGE_DIRS.items():
        if name == prefix or name.startswith(prefix + "."):
            base = (
                folder.joinpath(*name.removeprefix(prefix).lstrip(".").split("."))
                if name != prefix
                else folder
            )
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def imports_of(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (lazy imports inside functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}")}
    return found


@cache
def reachable(start: str) -> frozenset[str]:
    """Every module reachable from rlfw module ``start`` through rlfw modules, itself included."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for imported in imports_of(path, package):
            # importing a.b.c runs a/__init__ and a/b/__init__ too
            parts = imported.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return frozenset(seen)


def modules_under(prefix: str) -> list[str]:
    folder = module_file(prefix)
    assert folder is not None
    root = folder.parent
    return sorted(
        prefix + ("." + ".".join(p.relative_to(root).with_suffix("").parts) if p != folder else "")
        for p in root.rglob("*.py")
    )


def _hits(modules: frozenset[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_the_walker_sees_a_known_arrow() -> None:
    """The walker itself: the driver reaches Ray and the rollout actor reaches vLLM's engine module."""
    assert "ray" in reachable("rlfw.train.run")
    assert "rlfw.rollout.vllm.engine" in reachable("rlfw.distributed.rollout_worker")
    assert "rlfw.kernels.invariant" in reachable("rlfw.model")


@pytest.mark.parametrize("package", ["rlfw.kernels", "rlfw.model", "rlfw.algos"])
def test_math_and_model_never_reach_the_cluster(package: str) -> None:
    for module in modules_under(package):
        assert not _hits(reachable(module), CLUSTER), f"{module} reaches {_hits(reachable(module), CLUSTER)}"


def _beyond_vllm_kernels(modules: frozenset[str]) -> list[str]:
    """vLLM modules reached other than its kernel library (and the packages that hold it)."""
    holders = {".".join(m.split(".")[:i]) for m in VLLM_KERNEL_MODULES for i in range(1, len(m.split(".")))}
    hits = _hits(modules, ("vllm",))
    return [m for m in hits if m not in holders and not m.startswith(VLLM_KERNEL_MODULES)]


@pytest.mark.parametrize("package", ["rlfw.model", "rlfw.algos"])
def test_model_and_algorithms_import_nothing_of_vllm(package: str) -> None:
    """They import no vLLM module themselves; what they reach of vLLM is the kernel library, through
    ``rlfw.kernels`` (the CUDA op set runs vLLM's batch-invariant kernels)."""
    for module in modules_under(package):
        path = module_file(module)
        assert path is not None
        assert not [m for m in imports_of(path, package) if m == "vllm" or m.startswith("vllm.")], module
        assert not _beyond_vllm_kernels(reachable(module)), module


def test_kernels_use_only_vllms_kernel_modules() -> None:
    for module in modules_under("rlfw.kernels"):
        other = _beyond_vllm_kernels(reachable(module))
        assert not other, f"{module} imports {other}"


def test_trainer_does_not_reach_the_rollout_package() -> None:
    for module in modules_under("rlfw.trainer"):
        assert not _hits(reachable(module), ("rlfw.rollout",)), module
