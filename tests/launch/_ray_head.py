"""A throwaway Ray head on loopback for the launch tests, started and stopped by its own process ids.

The head runs as ``launch/ray_cluster.sh head --block`` in a new session, with its own ``--temp-dir`` and
free ports, so it never meets another Ray on the machine. Stopping it sends SIGTERM to that ``ray start``
(which takes its GCS, raylet, dashboard and workers down), then kills whatever is left that we can prove
is ours: processes in its session, or whose command line names its temp dir.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlfw.distributed.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.prefix) / "bin"
RUN_ENV = {
    "OMP_NUM_THREADS": "1",
    "TORCH_EXTENSIONS_DIR": "/tmp/tx",
    "WANDB_MODE": "offline",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "DS_ACCELERATOR": "cpu",
    "HF_HUB_OFFLINE": "1",
}


def launch_env() -> dict[str, str]:
    """Our environment with the run's defaults filled in, this venv first on PATH and no inherited Ray."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    for key, value in RUN_ENV.items():
        env.setdefault(key, value)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@dataclass
class Head:
    temp_dir: Path
    gcs_address: str
    job_server: str


def _live_processes() -> dict[int, tuple[int, str]]:
    """pid -> (session id, command line) for every live (not zombie) process we can read."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]  # after "pid (comm)"
        if state != "Z":
            found[int(entry.name)] = (int(session), cmdline)
    return found


def _ours(session: int, temp_dir: Path) -> list[int]:
    return [
        pid
        for pid, (sid, cmd) in _live_processes().items()
        if pid != os.getpid() and (sid == session or str(temp_dir) in cmd)
    ]


def _stop(proc: subprocess.Popen[bytes], temp_dir: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while _ours(proc.pid, temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _ours(proc.pid, temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def ray_head(dashboard: bool) -> Iterator[Head]:
    """A one-node cluster with one ``rollout_gpu`` and one ``trainer_gpu`` slot and 4 CPUs."""
    # Short, so Ray's unix sockets under it stay within the 107-byte path limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="rlfw-ray-", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    env = launch_env() | {"RAY_PORT": str(gcs_port), "RLFW_POOL_SLOTS": "1"}
    args = [
        str(ROOT / "launch" / "ray_cluster.sh"),
        "head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--num-cpus=4",
        f"--include-dashboard={str(dashboard).lower()}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--disable-usage-stats",
    ]
    if importlib.util.find_spec("grpc"):  # ray[client] is there: its server would take the default port
        args.append(f"--ray-client-server-port={free_port()}")
    log = (temp_dir / "head.log").open("wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(temp_dir, f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}")
    try:
        wait = [sys.executable, str(ROOT / "launch" / "wait_for_cluster.py"), "--address", head.gcs_address]
        wait += ["--timeout", "90"] + (["--job-server", head.job_server] if dashboard else [])
        waiter = subprocess.Popen(wait, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while waiter.poll() is None and proc.poll() is None:
            time.sleep(0.5)
        if waiter.poll() is None:
            waiter.kill()
        _, err = waiter.communicate()
        if waiter.returncode != 0 or proc.poll() is not None:
            raise RuntimeError(f"the Ray head did not come up: {err}\n{(temp_dir / 'head.log').read_text()}")
        yield head
    finally:
        _stop(proc, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
