"""rlfw's Triton kernels compile for sm_90 on this CPU-only machine (see ``tests/triton_sm90.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_triton_kernel_compiles_for_an_h100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton's notice
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_sm90"],
        cwd=Path(__file__).parent.parent,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.splitlines()[-1:] == ["ok"], done.stderr[-3000:]
