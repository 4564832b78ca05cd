"""Stops what a local run's Ray started when the driver dies without shutting it down.

A driver killed with SIGKILL (or by the OOM killer) cannot call ``ray.shutdown()``. Ray's head processes
then exit on their own, but the agents the raylet started (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) were measured lingering for minutes. :func:`start` runs this module in a small
process beside the driver: it follows the processes of the local Ray node (its head processes and every
descendant, rescanned every second) and, once the driver is gone, kills those still alive, each by its pid
and only if it is the same process (same start time) it saw. It never touches anything else; a driver
that shuts Ray down normally leaves it nothing to kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

SCAN_S = 1.0


def start(driver_pid: int, ray_pids: list[int]) -> subprocess.Popen[bytes]:
    """Run the reaper for ``driver_pid`` and the local Ray node's head processes ``ray_pids``."""
    cmd = [sys.executable, "-m", "rlfw.distributed.reaper", str(driver_pid), *map(str, ray_pids)]
    quiet = subprocess.DEVNULL
    return subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet)


def _scan(roots: list[int], known: dict[int, float]) -> None:
    """Add the live ``roots`` and their descendants to ``known`` (pid -> start time)."""
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            known.setdefault(proc.pid, proc.create_time())
            for child in proc.children(recursive=True):
                known.setdefault(child.pid, child.create_time())
        except psutil.Error:
            continue


def _kill(known: dict[int, float]) -> int:
    killed = 0
    for pid, created in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed


def watch(driver_pid: int, ray_pids: list[int]) -> int:
    """Follow Ray's processes until the driver exits; then kill the ones still alive. Returns how many."""
    # Ctrl-C reaches the whole foreground process group; the driver handles it, the reaper keeps watching.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    known: dict[int, float] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return 0
    while True:
        _scan([*ray_pids, *known], known)
        try:
            driver.wait(timeout=SCAN_S)
            break
        except psutil.TimeoutExpired:
            continue
        except psutil.Error:
            break
    _scan([*ray_pids, *known], known)
    known.pop(os.getpid(), None)
    return _kill(known)


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])
