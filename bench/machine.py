"""What a benchmark ran on, for its results file: the CPU model and the widest vector set the kernels use.

The compiled kernels run 16-lane blocks with AVX-512 and 8-lane ones with AVX2 (the same bits either way),
so two machines with the same core count can differ a lot in speed; every results file names which it was.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, else what ``platform`` knows; with its family and
    model numbers, since a VM may name only the brand (``AMD EPYC`` is family 25 on Zen 3 and 4, family
    26 on Zen 5, whose 512-bit units run AVX-512 at twice Zen 4's width)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']}, model {info['model']})"
    return name


def vector_set() -> str:
    """``AVX-512``, ``AVX2`` (with FMA) or ``no AVX2``: the kernels' path ``-march=native`` picks."""
    flags = set(_cpuinfo().get("flags", "").split())
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if {"avx2", "fma"} <= flags else "no AVX2"


def describe() -> str:
    """``"x86_64, 2 cores, AMD EPYC (family 26, model 2), AVX-512"``: architecture, cores, CPU model,
    vector set."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {cpu_model()}, {vector_set()}"
