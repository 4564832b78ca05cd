"""``keep_freed_memory``: the actors' tensors reuse freed heap pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfw.distributed.cluster import KEEP_FREED_MEMORY_ENV, MALLOC_ENV, keep_freed_memory

# A small step's allocation pattern (an MLP block on 1088 rows: tensors of 2-7 MB allocated and freed),
# run twice in a fresh interpreter; the second pass's page faults are counted.
WORKLOAD = """
import json, resource, sys
import torch
from rlfw.distributed.cluster import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
w = torch.randn(1536, 512)
def step():
    for _ in range(3):
        x = torch.randn(1088, 512)
        h = x @ w.T
        y = (torch.nn.functional.silu(h) * h) @ w
        del x, h, y
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

linux_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's mallopt"
)


def _second_pass(mode: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in (*MALLOC_ENV, KEEP_FREED_MEMORY_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@linux_glibc
def test_a_repeated_step_touches_no_fresh_pages() -> None:
    default, kept = _second_pass("default"), _second_pass("keep")
    assert kept["kept"] is True
    assert isinstance(default["faults"], int) and default["faults"] > 100  # glibc gives the pages back
    assert isinstance(kept["faults"], int) and kept["faults"] < 16  # 0 measured; leave the interpreter a few


@pytest.mark.parametrize(
    ("name", "value"), [("MALLOC_TRIM_THRESHOLD_", "131072"), (KEEP_FREED_MEMORY_ENV, "0")]
)
def test_the_users_own_settings_win(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False
