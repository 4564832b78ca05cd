"""Which rank the driver names when one trainer rank's process dies inside a collective.

The survivor's gloo collective fails on the closed connection, and that error can reach the driver
before Ray reports the dead process. If the driver raised the survivor's error, the user would get a
traceback about a lost connection instead of the line naming the dead rank and the resume command. The
tests make both results ready, then hand them to the driver one at a time, the survivor's first (a
``ray.wait`` that returns the first of its list alone), so the order that once lost the dead rank's name
is the one tested every time.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayTaskError

from rlfw.distributed.cluster import free_port, init_ray
from rlfw.distributed.groups import LOST_PEER, TrainerRankDied, gather_ranks


@ray.remote(num_cpus=0)
class Rank:
    """One member of a two-rank gloo group, as a trainer rank is."""

    def __init__(self, rank: int, port: int) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)

    def pid(self) -> int:
        return os.getpid()

    def all_reduce(self) -> float:
        t = torch.ones(4)
        dist.all_reduce(t)
        return float(t.sum())

    def park(self) -> None:
        """Never returns: the process is killed while it waits."""
        threading.Event().wait()

    def fail(self) -> None:
        raise ValueError("a rank's own error: Connection reset by peer")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_ray(num_rollout=0, num_trainer=0)
    yield
    ray.shutdown()


REAL_WAIT = ray.wait


@pytest.fixture
def one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results reach the driver one at a time, in the order it lists them."""

    def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        if timeout == 0:  # "what else is ready already": nothing yet
            return [], list(refs)
        REAL_WAIT(refs[:1])
        return refs[:1], list(refs[1:])

    monkeypatch.setattr(ray, "wait", wait)


@pytest.fixture
def pair(local_ray: None) -> Iterator[list[Any]]:
    port = free_port()
    ranks = [Rank.remote(r, port) for r in range(2)]
    ray.get([r.pid.remote() for r in ranks])  # both have joined the group
    yield ranks
    for r in ranks:
        ray.kill(r, no_restart=True)


def survivor_and_dead(pair: list[Any]) -> tuple[Any, Any]:
    """Rank 0 in an all-reduce, rank 1 killed (SIGKILL, as the OOM killer does); returns once both
    results are ready: the survivor's error and the dead rank's."""
    survivor, victim = pair
    victim_pid = ray.get(victim.pid.remote())
    held = victim.park.remote()
    reducing = survivor.all_reduce.remote()
    os.kill(victim_pid, signal.SIGKILL)
    REAL_WAIT([reducing, held], num_returns=2)
    with pytest.raises(RayTaskError, match=LOST_PEER.pattern):
        ray.get(reducing)
    return reducing, held


def test_the_dead_rank_is_named_when_the_survivors_error_comes_first(
    pair: list[Any], one_at_a_time: None
) -> None:
    reducing, held = survivor_and_dead(pair)
    with pytest.raises(TrainerRankDied, match=r"^trainer rank 1 died during a training step$") as err:
        gather_ranks([reducing, held], "a training step")  # the survivor's result comes first
    assert err.value.rank == 1


def test_a_dead_rank_is_named_before_an_error_ready_with_it(pair: list[Any]) -> None:
    reducing, held = survivor_and_dead(pair)
    with pytest.raises(TrainerRankDied, match=r"^trainer rank 1 died during a training step$"):
        gather_ranks([reducing, held], "a training step")  # both ready when it looks


def test_a_lost_peer_with_no_dead_rank_among_the_results_is_raised_as_it_is(pair: list[Any]) -> None:
    reducing, _ = survivor_and_dead(pair)
    with pytest.raises(RayTaskError, match=LOST_PEER.pattern):
        gather_ranks([reducing], "a training step")


def test_a_ranks_own_error_is_raised_as_it_is(pair: list[Any]) -> None:
    """Even one that mentions a reset connection (a download, a network file system): only gloo's
    transport names a lost collective partner."""
    with pytest.raises(ValueError, match="a rank's own error"):
        gather_ranks([pair[0].fail.remote(), pair[1].pid.remote()], "a training step")


def test_every_result_in_rank_order_when_all_answer(pair: list[Any]) -> None:
    pids = gather_ranks([r.pid.remote() for r in pair], "a memory query")
    assert pids == ray.get([r.pid.remote() for r in pair]) and len(set(pids)) == 2
