"""One DeepSpeed rank in a fresh process (its process group is process-wide), for the trainer tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from rlfw.distributed.cluster import SUBPROCESS_ENV

PREAMBLE = """
import json, os, socket, sys, tempfile
from pathlib import Path
import torch, deepspeed
from rlfw.model import build_preset
from rlfw.trainer.deepspeed_backend import DeepSpeedBackend, OptimConfig, saved_zero_stage
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
"""
"""Imports, a free port and a gloo process group of one rank: what every script below starts with."""


def run_one_rank(script: str, *args: str) -> Any:
    """Run :data:`PREAMBLE` then ``script`` (which prints one JSON line last) on the CPU, with ``args`` as
    ``sys.argv[1:]``; return what that line holds. A failing script fails the test with its stderr."""
    env = os.environ | SUBPROCESS_ENV | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PREAMBLE + script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
