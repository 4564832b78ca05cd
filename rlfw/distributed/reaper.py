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
import select
import signal
import subprocess
import sys
from collections.abc import Callable

import psutil

SCAN_S = 1.0


def start(driver_pid: int, ray_pids: list[int]) -> subprocess.Popen[bytes]:
    """Run the reaper for ``driver_pid`` and the local Ray node's head processes ``ray_pids``."""
    cmd = [sys.executable, "-m", "rlfw.distributed.reaper", str(driver_pid), *map(str, ray_pids)]
    quiet = subprocess.DEVNULL
    return subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet)


def _scan(roots: list[int], known: dict[int, float]) -> None:
    """Add the live ``roots`` and their descendants to ``known`` (pid -> start time): one pass over the
    process table per scan, however many roots (a ``children()`` call per root reads the whole table each
    time, which cost this process 3% of a core on a small machine)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    todo, seen = list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if pid not in known:
            try:
                known[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                continue
        todo.extend(children.get(pid, []))


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
    exited = _exit_waiter(driver)
    while True:
        _scan([*ray_pids, *known], known)
        if exited(SCAN_S):
            break
    _scan([*ray_pids, *known], known)
    known.pop(os.getpid(), None)
    return _kill(known)


def _exit_waiter(driver: psutil.Process) -> Callable[[float], bool]:
    """``exited(timeout)``: block up to ``timeout`` seconds for the driver to exit; whether it has. A
    pidfd (Linux 5.3+) sleeps in the kernel until then; elsewhere psutil's wait polls."""
    try:
        fd = os.pidfd_open(driver.pid)
    except (AttributeError, OSError):

        def polled(timeout: float) -> bool:
            try:
                driver.wait(timeout=timeout)
            except psutil.TimeoutExpired:
                return False
            except psutil.Error:
                pass
            return True

        return polled
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    return lambda timeout: bool(waiter.poll(timeout * 1000)) or not driver.is_running()


if __name__ == "__main__":
    watch(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])
