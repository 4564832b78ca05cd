"""The wheel carries configs/ and recipes/: installed (not editable) into a fresh virtual environment,
``rlfw train`` runs from a directory that is not the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlfw.compose import project_root
from rlfw.distributed.cluster import SUBPROCESS_ENV


@pytest.mark.slow
def test_the_installed_wheel_trains_from_any_directory(tmp_path: Path) -> None:
    checkout = project_root()
    assert (checkout / "pyproject.toml").is_file(), "run from a source checkout"
    wheels = tmp_path / "wheels"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(wheels),
    ]
    subprocess.run([*build, str(checkout)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("rlfw-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        .decode()
        .strip()
    )
    # The dependencies (torch, ray, deepspeed, ...) come from this environment; rlfw from the wheel alone.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in (os.environ | SUBPROCESS_ENV).items() if k not in ("PYTHONPATH", "RLFW_HOME")}
    where = subprocess.check_output(
        [str(python), "-c", "import rlfw.compose as c; print(c.__file__); print(c.project_root())"],
        cwd=elsewhere,
        env=env,
        text=True,
    ).split()
    assert where[0].startswith(str(site)) and where[1] == str(site / "rlfw"), where
    run = subprocess.run(
        [str(venv / "bin" / "rlfw"), "train", "trainer.steps=2", "task.warm_start_steps=0",
         "logger.wandb=false", "logger.run_name=w", "algo.prompts_per_step=4", "algo.group_size=4"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rows = (elsewhere / "runs" / "w" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1]
