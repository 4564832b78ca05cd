"""``sync.transport=collective`` when a process dies: real Ray actors, a real DeepSpeed trainer rank and a
real gloo weight group.

Gloo broadcasts down a tree (rank 0 the trainer, ranks 1.. the engines), and a member waits on its
partners for the group's timeout (10 minutes by default). An engine that died since the last publish used
to stop the run with a traceback about a closed connection, and members around it waited out the timeout.
Now every member whose broadcast fails leaves the group, which fails its partners' waits at once; the
version goes through the object store, the dead engine is replaced, and the group is formed again at the
next publish. An engine that dies while the group forms is replaced, and the group formed again. A
trainer rank that dies is named, as it is in every other trainer call.

Most tests form the group with a 30-second timeout: a member that waited it out would say "Timed out" in
the warning that names why each member missed the broadcast. A member that does time out (a stuck
engine) stops the publish instead: the object store would wait on the same engine with no timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
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
from rlfw.distributed.weight_sync import BroadcastStuck, CollectiveSync, _first_sentence
from rlfw.model.distribution import Transforms
from rlfw.trainer.deepspeed_backend import OptimConfig
from rlfw.trainer.step import StepSpec
from rlfw.types import GenerationRequest, Sample
from tests.rollout._helpers import same_bits

ENGINES = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=0)
TRAINER_SPEC = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=1)
OPTIM = OptimConfig(1e-3, 0.0, 1.0, 0, "constant", 10, 0, "fp32")
TIMEOUT = timedelta(seconds=30)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_ray(num_rollout=3, num_trainer=1)
    yield
    ray.shutdown()


@pytest.fixture
def make_groups(local_ray: None) -> Iterator[Callable[[int], tuple[TrainerGroup, RolloutGroup]]]:
    """One trainer rank whose weights (seed 1) differ from the engines' (seed 0); the pools (and their
    actors) are removed after the test."""
    pools = []

    def make(engines: int) -> tuple[TrainerGroup, RolloutGroup]:
        pools.extend([make_pool(ROLLOUT, engines), make_pool(TRAINER, 1)])
        cfg = EngineConfig(max_slots=8, max_model_len=64)
        rollout = RolloutGroup(pools[-2], ENGINES, cfg, stop_ids=[])
        trainer = TrainerGroup(pools[-1], TRAINER_SPEC, OPTIM)
        started = rollout.start(contract_hash="")
        trainer.start(StepSpec(Transforms(), CorrectionConfig(name="tis"), 4, "score", False))
        ray.get(started)
        return trainer, rollout

    yield make
    for pool in pools:
        remove_placement_group(pool.group)


def _request() -> GenerationRequest:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (5,), generator=gen) for _ in range(6)]
    return GenerationRequest(list(range(6)), prompts, n=2, max_new_tokens=16, seed=7)


def _same(a: list[Sample], b: list[Sample]) -> bool:
    return all(
        torch.equal(x.response_T, y.response_T) and same_bits(x.sampler_logp, y.sampler_logp)
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


def _versions(rollout: RolloutGroup) -> list[int]:
    return [ray.get(a.version.remote()) for a in rollout.actors]


def _reasons(log: str) -> str:
    """What the warning says of each member that missed the broadcast."""
    (line,) = [line for line in log.splitlines() if "the weight broadcast of version" in line]
    return line


@pytest.mark.slow
def test_an_engine_dead_at_a_broadcast_is_replaced_and_gets_the_version(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]], caplog: pytest.LogCaptureFixture
) -> None:
    """Engine 0 is rank 0's first partner: rank 0's send fails, and engine 1, waiting on rank 0, fails
    once rank 0 has left the group."""
    trainer, rollout = make_groups(2)
    sync = CollectiveSync(TIMEOUT)
    untrained = rollout.generate(_request())
    sync.publish(trainer, rollout, 1, "")
    published = rollout.generate(_request())
    assert not _same(published, untrained)  # the broadcast did change the engines' weights

    _kill_engine(rollout, 0)
    with caplog.at_level(logging.WARNING, logger="rlfw.distributed.weight_sync"):
        sync.publish(trainer, rollout, 2, "")
    reasons = _reasons(caplog.text)
    assert "engine 0: died" in reasons and "trainer rank 0: " in reasons, reasons
    assert "Timed out" not in reasons, reasons
    assert rollout.restarts == 1
    assert _versions(rollout) == [2, 2]
    assert _same(rollout.generate(_request()), published)  # the trainer's weights, on both engines

    sync.publish(trainer, rollout, 3, "")  # the group is formed again, the replacement in it
    assert sync.members == rollout.restarts == 1
    assert _versions(rollout) == [3, 3]
    assert _same(rollout.generate(_request()), published)


@pytest.mark.slow
def test_an_engine_that_loses_its_partner_leaves_the_group_at_once(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]], caplog: pytest.LogCaptureFixture
) -> None:
    """Three engines: engine 0 (rank 1) forwards rank 0's broadcast to engine 2 (rank 3). With engine 2
    dead, engine 0's forward fails; unless engine 0 then leaves the group, rank 0's next send to it waits
    out the timeout, and so does engine 1."""
    trainer, rollout = make_groups(3)
    sync = CollectiveSync(TIMEOUT)
    sync.publish(trainer, rollout, 1, "")
    published = rollout.generate(_request())
    _kill_engine(rollout, 2)
    with caplog.at_level(logging.WARNING, logger="rlfw.distributed.weight_sync"):
        sync.publish(trainer, rollout, 2, "")
    reasons = _reasons(caplog.text)
    assert "engine 2: died" in reasons and "Timed out" not in reasons, reasons
    assert _versions(rollout) == [2, 2, 2]
    assert _same(rollout.generate(_request()), published)
    sync.publish(trainer, rollout, 3, "")
    assert sync.members == rollout.restarts == 1
    assert _versions(rollout) == [3, 3, 3]


@pytest.mark.slow
def test_a_stuck_engine_stops_the_publish_with_the_members_reasons(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]],
) -> None:
    """A stopped engine (SIGSTOP) makes rank 0 wait out the timeout. The object store would wait on the
    same engine with no timeout at all, so the publish is stopped, naming why."""
    trainer, rollout = make_groups(2)
    sync = CollectiveSync(timedelta(seconds=5))
    sync.publish(trainer, rollout, 1, "")
    pid = ray.get(rollout.actors[1].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(BroadcastStuck, match=r"version 2 did not complete \(trainer rank 0: Timed out"):
            sync.publish(trainer, rollout, 2, "")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert sync.members == -1


def test_a_gloo_error_is_cut_to_what_happened() -> None:
    said = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:23946. This is typically caused by a remote worker crashing.\nException raised from x"
    )
    assert _first_sentence(said) == "Connection closed by peer [127.0.0.1]:23946"
    assert _first_sentence("died") == "died"
    assert _first_sentence("") == ""


@pytest.mark.slow
def test_an_engine_dead_when_the_group_is_formed_is_replaced_first(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]],
) -> None:
    """Rank 0 would wait for the dead engine to join until the timeout, and the publish would fail."""
    trainer, rollout = make_groups(2)
    sync = CollectiveSync(TIMEOUT)
    _kill_engine(rollout, 1)
    sync.publish(trainer, rollout, 1, "")  # the first publish forms the group
    assert sync.members == rollout.restarts == 1
    assert _versions(rollout) == [1, 1]


@pytest.mark.slow
def test_a_trainer_rank_dead_at_a_broadcast_is_named(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]],
) -> None:
    trainer, rollout = make_groups(2)
    sync = CollectiveSync(TIMEOUT)
    sync.publish(trainer, rollout, 1, "")
    trainer.kill(0)
    with pytest.raises(TrainerRankDied, match=r"^trainer rank 0 died during a weight sync$"):
        sync.publish(trainer, rollout, 2, "")
    assert trainer.dead == 0


@pytest.mark.slow
def test_an_engine_that_dies_while_the_group_forms_is_replaced_and_the_group_formed_again(
    make_groups: Callable[[int], tuple[TrainerGroup, RolloutGroup]], caplog: pytest.LogCaptureFixture
) -> None:
    """Engine 1 is killed after the dead engines were replaced and before it joins: the other members
    wait for it until the group's timeout (5 s here), then the driver replaces it and forms the group
    again. Before, rank 0's timeout came out of the publish as a traceback."""
    trainer, rollout = make_groups(2)
    sync = CollectiveSync(timedelta(seconds=5))
    replace_dead = rollout.replace_dead
    calls = []

    def replace_then_lose_engine_1() -> None:
        replace_dead()
        if not calls:
            _kill_engine(rollout, 1)
        calls.append(1)

    rollout.replace_dead = replace_then_lose_engine_1  # type: ignore[method-assign]
    untrained = rollout.generate(_request())
    with caplog.at_level(logging.WARNING, logger="rlfw.distributed.weight_sync"):
        sync.publish(trainer, rollout, 1, "")  # the first publish forms the group
    (line,) = [line for line in caplog.text.splitlines() if "the weight group did not form" in line]
    assert "engine 1: died" in line, line
    assert len(calls) == 2 and rollout.restarts == 1 and sync.members == 1
    assert _versions(rollout) == [1, 1]
    published = rollout.generate(_request())
    assert not _same(published, untrained)  # the trainer's weights reached the engines (both at version 1)
    sync.publish(trainer, rollout, 2, "")  # the group formed the second time broadcasts
    assert _versions(rollout) == [2, 2]
    assert _same(rollout.generate(_request()), published)
