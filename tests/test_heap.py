"""``keep_freed_memory``: the actors' tensors reuse freed heap pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfw.distributed.cluster import KEEP_FREED_MEMORY_ENV, MALLOC_ENV, keep_freed_memory

# A step's allocation pattern without BLAS in it (whose workspaces differ by CPU): 40 tensors of 1 MiB,
# or 2 of 48 MiB (a real vocabulary's logits), written and freed. Run ten times in a fresh interpreter
# (the heap takes a few passes to hold blocks of the large size: cluster.keep_freed_memory); the faults of
# the last two are reported.
WORKLOAD = """
import json, resource, sys
import torch
from rlfw.distributed.cluster import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
count, numel = (40, 256 * 1024) if sys.argv[2] == "small" else (2, 12 * 1024 * 1024)
def step():
    xs = [torch.ones(numel) for _ in range(count)]
    del xs
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[8:]}))
"""

# glibc's defaults move their thresholds with what was freed so far, so how much they give back depends
# on the run (measured against them in bench/RESULTS.md). The control here pins them to give every
# tensor back: the same workload must then fault, or the count could not tell the two apart.
GIVE_BACK = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}

linux_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's mallopt"
)


def _late_faults(mode: str, extra: dict[str, str], sizes: str = "small") -> dict[str, object]:
    drop = (*MALLOC_ENV, KEEP_FREED_MEMORY_ENV, "GLIBC_TUNABLES", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in drop} | extra
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode, sizes], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@linux_glibc
@pytest.mark.parametrize("sizes", ["small", "large"])
def test_a_repeated_step_touches_no_fresh_pages(sizes: str) -> None:
    given_back, kept = _late_faults("default", GIVE_BACK, sizes), _late_faults("keep", {}, sizes)
    assert kept["kept"] is True
    assert isinstance(given_back["faults"], list) and isinstance(kept["faults"], list)
    # 40 tensors of 256 pages (10,280 measured), or 2 of 12,288 pages
    assert all(f > 5000 for f in given_back["faults"])
    assert all(f < 16 for f in kept["faults"])  # 0 measured


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"),
        (KEEP_FREED_MEMORY_ENV, "0"),
    ],
)
def test_the_users_own_settings_win(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False
