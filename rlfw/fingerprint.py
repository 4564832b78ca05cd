"""The environment fingerprint: what, besides the op choices, decides the bits of a log-prob.

The execution contract records the op set, tiles, dtypes and transforms. The same choices can still give
different bits on another machine or software stack: ATen picks vectorised elementwise kernels by CPU
capability (``ATEN_CPU_CAPABILITY``; ``exp`` in SiLU, the router softmax and RoPE differ between AVX2 and
the portable path), MKL's reproducibility mode (``MKL_CBWR``) changes BLAS reductions, library versions
change kernels, and a GPU's name and compute capability change what Triton compiles. The fingerprint lists
those settings, and the model's architecture and shapes, so that two processes whose fingerprints differ
do not share a contract hash. Every trainer rank and engine computes its own and compares it with the
trainer's before the first weight sync (`rlfw.train.environment`).

Only bit-relevant settings belong here. Thread counts are left out: the invariant CPU ops fix their
reduction order independently of threads (each output element is one fma chain), and the default op set
claims no bits. Logging, environment variables that do not reach a kernel and the order of entries do
not change the fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from importlib import metadata
from typing import Any

import torch

from rlfw.model.config import ModelArgs

# Environment variables that change which kernels run or how they reduce (read by ATen, MKL, oneDNN), and
# Triton's floating-point settings: whether a kernel that does not ask fuses a * b + c into one fma
# (vLLM's batch-invariant kernels do not ask; the default flips from on to off in Triton 3.10), and the
# default fp32 precision of tl.dot.
BIT_RELEVANT_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "DNNL_MAX_CPU_ISA",
    "TRITON_DEFAULT_FP_FUSION",
    "TRITON_FORCE_DISABLE_FP_FUSION",
    "TRITON_F32_DEFAULT",
)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpp_kernels() -> dict[str, Any]:
    """The compiled CPU kernels: their sources and flags (a different source is a different kernel)."""
    from rlfw.kernels import cpu_native

    digest = hashlib.sha256()
    for source in cpu_native.SOURCES + cpu_native.HEADERS:
        digest.update(source.read_bytes())
    return {"source_sha256": digest.hexdigest()[:16], "cflags": list(cpu_native.CFLAGS)}


def _device() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {
            "type": "cpu",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(),
            "cpp_kernels": _cpp_kernels(),
        }
    major, minor = torch.cuda.get_device_capability()
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def environment_fingerprint(engine: str = "native") -> dict[str, Any]:
    """This process's bit-relevant environment: library versions, device, CPU capability, BLAS mode."""
    libraries = {"torch": torch.__version__, "triton": _version("triton")}
    if engine == "vllm":
        from rlfw.kernels.vllm_ops import vllm_version

        libraries["vllm"] = vllm_version()
    env = {name: os.environ[name] for name in BIT_RELEVANT_ENV if name in os.environ}
    return {"libraries": libraries, "device": _device(), "env": env}


def model_fingerprint(args: ModelArgs) -> dict[str, Any]:
    """The architecture and every shape of the model (dense and MoE checkpoints never share a hash)."""
    record = asdict(args)
    record["mlp_only_layers"] = list(args.mlp_only_layers)
    record.pop("eos_token_id", None)  # decides when a response stops, not the bits of a log-prob
    return record


def fingerprint_diff(expected: dict[str, Any], actual: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, e.g. ``device.cpu_capability: 'AVX2' != 'DEFAULT'``."""
    out: list[str] = []
    for key in sorted(set(expected) | set(actual)):
        a, b = expected.get(key, "<absent>"), actual.get(key, "<absent>")
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, name)
        elif a != b:
            out.append(f"{name}: {a!r} != {b!r}")
    return out
