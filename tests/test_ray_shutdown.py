"""A local run's Ray is shut down without waiting on its autoscaler monitor: ``shutdown_ray`` stops the
monitor with SIGKILL before ``ray.shutdown()`` stops the GCS (on SIGTERM the monitor reported to the gone
GCS and held every run's exit for Ray's whole second of grace), and no head process outlives it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.train._run import env

SCRIPT = """
import json
import ray
from ray._private import ray_constants
from rlfw.distributed.cluster import init_ray, shutdown_ray

init_ray(1, 1)
node = ray._private.worker._global_node
heads = [info.process for infos in node.all_processes.values() for info in infos]
(monitor,) = [info.process for info in node.all_processes[ray_constants.PROCESS_TYPE_MONITOR]]
seen = {}
plain_shutdown = ray.shutdown
def shutdown(*args, **kwargs):
    seen["monitor at ray.shutdown"] = monitor.poll()
    plain_shutdown(*args, **kwargs)
ray.shutdown = shutdown
shutdown_ray()
seen["left running"] = [p.pid for p in heads if p.poll() is None]
print(json.dumps(seen))
"""


def test_the_monitor_is_killed_before_ray_shutdown_and_no_head_process_is_left() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"monitor at ray.shutdown": -9, "left running": []}
