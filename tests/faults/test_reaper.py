"""The reaper beside a local run's driver: once the driver is gone it kills the Ray processes it followed
(the roots and every descendant, including those started after it began), and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rlfw.distributed import reaper


def _sleeper(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *args])


def _wait_until_watching(pid: int) -> None:
    """Until the reaper holds its pidfd on the driver (it then finds the tree in its final scan at the
    latest); a driver killed before the reaper started would leave it nothing to watch."""
    _until(lambda: "anon_inode:[pidfd]" in _open_files(pid), "the reaper watches the driver")


def _until(ready: Callable[[], bool], what: str) -> None:
    """Wait for a state (60 s: a bound for a failing test, never reached by a passing one)."""
    deadline = time.monotonic() + 60
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.05)


def _open_files(pid: int) -> set[str]:
    """What the process's descriptors point at now (a starting interpreter opens and closes files while
    we read, so a descriptor may vanish between the listing and the read)."""
    targets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.add(os.readlink(fd))
        except OSError:
            continue
    return targets


def test_scan_follows_every_descendant_of_the_roots_and_nothing_else() -> None:
    root = subprocess.Popen(["bash", "-c", "sleep 600 & (sleep 600 & wait) & wait"])
    other = _sleeper()
    try:
        tree = psutil.Process(root.pid)
        _until(lambda: len(tree.children(recursive=True)) >= 3, "the grandchildren are up")
        known: dict[int, float] = {}
        reaper._scan([root.pid], known)
        want = {root.pid, *(c.pid for c in tree.children(recursive=True))}
        assert set(known) == want and other.pid not in known
        assert all(known[p] == psutil.Process(p).create_time() for p in want)
    finally:
        for p in (root, other):
            p.kill()
        for c in psutil.Process().children(recursive=True):
            c.kill()


def test_the_driver_exiting_stops_the_watch_and_kills_the_followed_tree() -> None:
    driver, root, unrelated = _sleeper(), subprocess.Popen(["bash", "-c", "sleep 600 & wait"]), _sleeper()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "rlfw.distributed.reaper", str(driver.pid), str(root.pid)]
    )
    try:
        tree = psutil.Process(root.pid)
        _until(lambda: bool(tree.children()), "the root's child is up")
        followed = [root.pid, *(c.pid for c in tree.children(recursive=True))]
        _wait_until_watching(watcher.pid)
        driver.kill()
        driver.wait()
        assert watcher.wait(timeout=60) == 0  # a bound for a failing test; it returns as the driver exits
        gone, alive = psutil.wait_procs(
            [psutil.Process(p) for p in followed if psutil.pid_exists(p)], timeout=30
        )
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert unrelated.poll() is None, "the reaper killed a process it did not follow"
    finally:
        for p in (driver, root, unrelated, watcher):
            p.kill()
        root.wait()
