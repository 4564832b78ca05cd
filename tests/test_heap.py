"""``keep_freed_memory``: the actors' tensors reuse freed heap pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfw.distributed.cluster import KEEP_FREED_MEMORY_ENV, MALLOC_ENV, keep_freed_memory

# A step's allocation pattern without BLAS in it (whose workspaces differ by CPU): 40 tensors of 1 MiB
# written and freed. Run five times in a fresh interpreter; the faults of the last two are reported.
WORKLOAD = """
import json, resource, sys
import torch
from rlfw.distributed.cluster import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def step():
    xs = [torch.ones(256 * 1024) for _ in range(40)]
    del xs
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[3:]}))
"""

# glibc's defaults move their thresholds with what was freed so far, so how much they give back depends
# on the run (measured against them in bench/RESULTS.md). The control here pins them to give every
# tensor back: the same workload must then fault, or the count could not tell the two apart.
GIVE_BACK = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}

linux_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's mallopt"
)


def _late_faults(mode: str, extra: dict[str, str]) -> dict[str, object]:
    drop = (*MALLOC_ENV, KEEP_FREED_MEMORY_ENV, "GLIBC_TUNABLES", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in drop} | extra
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@linux_glibc
def test_a_repeated_step_touches_no_fresh_pages() -> None:
    given_back, kept = _late_faults("default", GIVE_BACK), _late_faults("keep", {})
    assert kept["kept"] is True
    assert isinstance(given_back["faults"], list) and isinstance(kept["faults"], list)
    assert all(f > 5000 for f in given_back["faults"])  # 40 tensors of 256 pages: 10,280 measured
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
