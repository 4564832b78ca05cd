"""Ray start-up and the two resource pools (placement groups): rollout and trainer.

On a GPU cluster every bundle holds one GPU. On one CPU machine, custom resources stand in for GPUs:
the local Ray node advertises ``rollout_gpu`` and ``trainer_gpu`` slots, so the same placement logic
runs everywhere. (``launch/ray_cluster.sh`` makes cluster nodes advertise the same names.)
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

ROLLOUT, TRAINER = "rollout_gpu", "trainer_gpu"
LOCAL_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a local Ray binds 127.0.0.1, not the host's address
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    # Ray runs workers at nice 15 by default; on a small machine the actors doing the work would then
    # lose the CPU to Ray's own daemons and to the waiting driver (measured: step 0.70 s -> see bench).
    "RAY_worker_niceness": "0",
    # Ray starts one idle worker per CPU for the first driver; the actors run under this run's runtime env,
    # which those workers lack, so none is ever used (each took about a core-second at every start-up).
    "RAY_prestart_worker_first_driver": "0",
}


# What a local run started as a subprocess (tests, benchmarks) sets on top: W&B offline, no progress bars.
SUBPROCESS_ENV = LOCAL_ENV | {"WANDB_MODE": "offline", "RLFW_PROGRESS": "0"}

PASSED_ON = (
    "TORCH_EXTENSIONS_DIR",
    "WANDB_MODE",
    "HF_HUB_OFFLINE",
    "RLFW_HOME",
    "PYTHONPATH",
    "RLFW_KEEP_FREED_MEMORY",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)


def worker_env(local: bool) -> dict[str, str]:
    """Environment every actor gets: what the driver set (and, on a local run, the CPU defaults)."""
    keys = (*LOCAL_ENV, *PASSED_ON) if local else PASSED_ON
    return {k: os.environ[k] for k in keys if k in os.environ}


def use_cpu_threads(n: int) -> int:
    """Give this actor's torch ``n`` CPU threads (0: every core of the node); returns the number set.

    Local runs start actors with ``OMP_NUM_THREADS=1`` (one core per pool bundle); the invariant kernels
    give the same forward bits at any thread count (tested), so this changes speed, not the contract.
    """
    import torch

    threads = n if n > 0 else (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's own variables for the two settings below; a process started with either keeps its settings."""
MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
"""The same two settings as ``GLIBC_TUNABLES`` entries; a process started with either keeps its settings."""
KEEP_FREED_MEMORY_ENV = "RLFW_KEEP_FREED_MEMORY"
"""Set to ``0`` to leave glibc's defaults in every actor (the driver passes it on)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD = 64 * 1024 * 1024  # a step's logits at a real vocabulary (64 x 151,936 fp32: 39 MB) fit
_MMAP_THRESHOLD_DOCUMENTED = 32 * 1024 * 1024  # mallopt(3)'s documented ceiling, for a glibc refusing more
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: keep up to 2 GiB of free heap top


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of returning it to the kernel; returns whether set.

    A step allocates and frees the same tensors over and over (activations, gradients, packed weights:
    a few MB each on a small model). glibc's defaults give such memory back: blocks above a threshold
    that adapts to the sizes freed so far are mapped for each allocation and unmapped when freed, and a
    heap whose free top grows past another threshold is trimmed. The next allocation then touches fresh
    pages, one page fault each, which the kernel zero-fills. On a 2-core VM that was 40,000 faults and up
    to 1.1 s of system time in one 4.5 s train step of the 13M model, and 70,000 faults in a 3.4 s
    ``generate`` (bench/RESULTS.md). With blocks up to 64 MiB served from the heap and the heap trimmed
    only past 2 GiB of free top, a steady step reuses the pages it touched before (no faults after the
    first few steps). The memory is kept rather than given back between steps.

    64 MiB, not mallopt(3)'s documented ceiling of 32 MiB: a step's logits at a real vocabulary pass
    32 MiB (64 rows of 151,936 fp32 logits: 39 MB, faulted in afresh at 17 ms a block on that VM, 1.2
    ms from the heap); glibc 2.36 takes it for the main arena, and a glibc that refuses gets 32 MiB. Not
    more: torch allocates with ``posix_memalign``, whose over-sized requests do not fit the exact
    blocks freed before, so a heap serving blocks this size settles only after holding a few times the
    live set (two 48 MiB tensors a step: 433 MiB held after five steps, then no growth); blocks above
    the threshold stay mapped and unmapped per use.

    glibc only (elsewhere a no-op returning False). Nothing is changed (False) in a process started with
    ``RLFW_KEEP_FREED_MEMORY=0``, or with ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` set, or
    either threshold in ``GLIBC_TUNABLES`` (the user's own settings); the driver passes these on to actors.
    """
    import ctypes
    import sys

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        os.environ.get(KEEP_FREED_MEMORY_ENV) == "0"
        or any(k in os.environ for k in MALLOC_ENV)
        or any(t in tunables for t in MALLOC_TUNABLES)
    ):
        return False
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: their mallopt differs or is a stub
        return False
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    mapped = mapped or libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_DOCUMENTED) == 1
    return bool(mapped and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)


def init_ray(num_rollout: int, num_trainer: int, address: str | None = None) -> None:
    """Connect to ``address`` (a cluster), or start a local Ray with emulated GPU pools on loopback.

    The CPU defaults (``DS_ACCELERATOR=cpu``, one thread, loopback) apply to local runs only; on a
    cluster the nodes' own environment decides.
    """
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, runtime_env={"env_vars": worker_env(local=False)}, log_to_driver=True)
        return
    for k, v in LOCAL_ENV.items():
        os.environ.setdefault(k, v)
    runtime_env = {"env_vars": worker_env(local=True)}
    ray.init(
        num_cpus=num_rollout + num_trainer + 1,
        resources={ROLLOUT: num_rollout, TRAINER: num_trainer},
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=True,
        _node_ip_address="127.0.0.1",
    )
    from rlfw.distributed import reaper

    node: Any = ray._private.worker._global_node  # the local node this driver started
    reaper.start(os.getpid(), [info.process.pid for infos in node.all_processes.values() for info in infos])


def shutdown_ray() -> None:
    """``ray.shutdown()``, with the autoscaler monitor of a local Ray this driver started stopped first.

    Ray stops its head processes one by one, each with SIGTERM and a second's grace, and the GCS before
    the monitor. On SIGTERM the monitor publishes an "autoscaler failed" error to that GCS, which is gone
    by then, so it always used the whole second: a second of every run's exit. A local run's monitor
    scales nothing and keeps no state; SIGKILL loses nothing.
    """
    import signal
    import subprocess

    import ray

    node: Any = ray._private.worker._global_node  # not the head when this driver joined a cluster
    if node is not None and node.is_head():
        for info in node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_MONITOR, []):
            if info.process.poll() is None:
                os.kill(info.process.pid, signal.SIGKILL)
                try:  # bounded, as Ray bounds its own: a process in uninterruptible sleep outlives SIGKILL
                    info.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
    ray.shutdown()


@dataclass
class Pool:
    """A placement group of ``size`` one-accelerator bundles, and how to place an actor in bundle i."""

    group: Any
    size: int
    uses_gpu: bool

    def options(self, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": 1, "num_gpus": 1 if self.uses_gpu else 0}


def make_pool(resource: str, size: int) -> Pool:
    """Reserve ``size`` bundles of the pool ``resource`` (blocks until the cluster can place them)."""
    import ray
    from ray.util.placement_group import placement_group

    uses_gpu = ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"CPU": 1, resource: 1} | ({"GPU": 1} if uses_gpu else {})
    group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
    ray.get(group.ready(), timeout=120)
    return Pool(group, size, uses_gpu)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak) / (1024 * 1024 if sys.platform == "darwin" else 1024)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
