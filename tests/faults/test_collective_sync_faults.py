"""``sync.transport=collective`` when a process dies: real Ray actors, a real DeepSpeed trainer rank and a
real gloo weight group.

An engine that died since the last publish fails the next broadcast. Gloo sends down a tree, so an engine
whose partner failed waited out the group's timeout (10 minutes) before its members left the group on a
failure; then the run stopped on a traceback about a closed connection. Now the version goes through the
object store, the dead engine is replaced, and the group is formed again at the next publish. A trainer
rank that dies is named, as it is in every other trainer call.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import remove_placement_group

from rlfw.algos import CorrectionConfig
from rlfw.config import EngineConfig
from rlfw.distributed.cluster import ROLLOUT, TRAINER, init_ray, make_pool
from rlfw.distributed.groups import RolloutGroup, TrainerGroup, TrainerRankDied
from rlfw.distributed.specs import ModelSpec
from rlfw.distributed.weight_sync import CollectiveSync
from rlfw.model.distribution import Transforms
from rlfw.trainer.deepspeed_backend import OptimConfig
from rlfw.trainer.step import StepSpec
from rlfw.types import GenerationRequest, Sample

ENGINES = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=0)
TRAINER_SPEC = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=1)
OPTIM = OptimConfig(1e-3, 0.0, 1.0, 0, "constant", 10, 0, "fp32")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_ray(num_rollout=2, num_trainer=1)
    yield
    ray.shutdown()


@pytest.fixture
def groups(local_ray: None) -> Iterator[tuple[TrainerGroup, RolloutGroup]]:
    """One trainer rank whose weights (seed 1) differ from the two engines' (seed 0)."""
    pools = [make_pool(ROLLOUT, 2), make_pool(TRAINER, 1)]
    rollout = RolloutGroup(pools[0], ENGINES, EngineConfig(max_slots=8, max_model_len=64), stop_ids=[])
    trainer = TrainerGroup(pools[1], TRAINER_SPEC, OPTIM)
    engines = rollout.start(contract_hash="")
    trainer.start(StepSpec(Transforms(), CorrectionConfig(name="tis"), 4, "score", False))
    ray.get(engines)
    yield trainer, rollout
    for pool in pools:
        remove_placement_group(pool.group)


def _request() -> GenerationRequest:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (5,), generator=gen) for _ in range(6)]
    return GenerationRequest(list(range(6)), prompts, n=2, max_new_tokens=16, seed=7)


def _same(a: list[Sample], b: list[Sample]) -> bool:
    return all(
        torch.equal(x.response_T, y.response_T)
        and torch.equal(x.sampler_logp.view(torch.int32), y.sampler_logp.view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


def _kill_engine(rollout: RolloutGroup, index: int) -> None:
    """SIGKILL an engine's process (as the OOM killer does) and wait until it has exited."""
    pid = ray.get(rollout.actors[index].pid.remote())
    os.kill(pid, signal.SIGKILL)
    while _running(pid):
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited: its sockets are closed


@pytest.mark.slow
def test_an_engine_dead_at_a_broadcast_is_replaced_and_gets_the_version(
    groups: tuple[TrainerGroup, RolloutGroup], caplog: pytest.LogCaptureFixture
) -> None:
    trainer, rollout = groups
    sync = CollectiveSync()
    untrained = rollout.generate(_request())
    sync.publish(trainer, rollout, 1, "")
    published = rollout.generate(_request())
    assert not _same(published, untrained)  # the broadcast did change the engines' weights

    _kill_engine(rollout, 0)  # engine 0 is the root's first partner: the root's send fails
    with caplog.at_level(logging.WARNING, logger="rlfw.distributed.weight_sync"):
        sync.publish(trainer, rollout, 2, "")
    assert "broadcast of version 2 failed (engines that lost it: 0" in caplog.text
    assert rollout.restarts == 1
    assert [ray.get(a.version.remote()) for a in rollout.actors] == [2, 2]
    assert _same(rollout.generate(_request()), published)  # the trainer's weights, on both engines

    sync.publish(trainer, rollout, 3, "")  # the group is formed again, the replacement in it
    assert sync.members == rollout.restarts == 1
    assert [ray.get(a.version.remote()) for a in rollout.actors] == [3, 3]
    assert _same(rollout.generate(_request()), published)


@pytest.mark.slow
def test_an_engine_dead_when_the_group_is_formed_is_replaced_first(
    groups: tuple[TrainerGroup, RolloutGroup],
) -> None:
    """Rank 0 would wait for the dead engine to join until the group's timeout (10 minutes)."""
    trainer, rollout = groups
    sync = CollectiveSync()
    _kill_engine(rollout, 1)
    sync.publish(trainer, rollout, 1, "")  # the first publish forms the group
    assert sync.members == rollout.restarts == 1
    assert [ray.get(a.version.remote()) for a in rollout.actors] == [1, 1]


@pytest.mark.slow
def test_a_trainer_rank_dead_at_a_broadcast_is_named(groups: tuple[TrainerGroup, RolloutGroup]) -> None:
    trainer, rollout = groups
    sync = CollectiveSync()
    sync.publish(trainer, rollout, 1, "")
    trainer.kill(0)
    with pytest.raises(TrainerRankDied, match=r"^trainer rank 0 died during a weight sync$"):
        sync.publish(trainer, rollout, 2, "")
    assert trainer.dead == 0
