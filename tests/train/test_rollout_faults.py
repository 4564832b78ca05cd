"""A rollout actor that dies mid-generation is replaced at the last published version; every sample of
the request comes back exactly once, identical to an undisturbed generation."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import ray
import torch

from rlfw.config import EngineConfig
from rlfw.distributed.cluster import ROLLOUT, init_ray, make_pool
from rlfw.distributed.groups import RolloutGroup
from rlfw.distributed.specs import ModelSpec
from rlfw.types import GenerationRequest, WeightUpdate

SPEC = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=0)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_ray(num_rollout=2, num_trainer=0)
    yield
    ray.shutdown()


def _request() -> GenerationRequest:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (5,), generator=gen) for _ in range(12)]
    return GenerationRequest(list(range(12)), prompts, n=4, max_new_tokens=24, seed=7)


def _perturbed_update(version: int) -> WeightUpdate:
    model = SPEC.build()
    state = {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.named_parameters()}
    return WeightUpdate(version=version, contract_hash="", state_dict=state)


def _key(s):  # type: ignore[no-untyped-def]
    return (s.prompt_id, s.sample_index)


@pytest.mark.slow
def test_killed_actor_is_replaced_and_no_sample_is_lost_or_doubled(local_ray: None) -> None:
    engine_cfg = EngineConfig(max_slots=8, max_model_len=64)
    group = RolloutGroup(make_pool(ROLLOUT, 2), SPEC, engine_cfg, stop_ids=[], contract_hash="")
    group.load(ray.put(_perturbed_update(version=1)))
    reference = group.generate(_request())

    killer = threading.Timer(0.5, group.kill, args=(0,))
    killer.start()
    samples = group.generate(_request())
    killer.join()

    assert group.restarts == 1
    assert ray.get(group.actors[0].version.remote()) == 1  # the replacement holds the published version
    assert (
        sorted(map(_key, samples))
        == sorted(map(_key, reference))
        == [(p, i) for p in range(12) for i in range(4)]
    )
    for a, b in zip(samples, reference, strict=True):
        assert torch.equal(a.response_T, b.response_T)
        assert torch.equal(a.sampler_logp.view(torch.int32), b.sampler_logp.view(torch.int32))


@pytest.mark.slow
def test_actor_killed_while_an_async_generation_is_in_flight(local_ray: None) -> None:
    """The async pattern: a generation is submitted, the trainer publishes while it runs, and an actor
    dies in between. Every sample still comes back exactly once, each generated at one version."""
    engine_cfg = EngineConfig(max_slots=8, max_model_len=64)
    group = RolloutGroup(make_pool(ROLLOUT, 2), SPEC, engine_cfg, stop_ids=[], contract_hash="")
    group.load(ray.put(_perturbed_update(version=1)))
    pending = group.submit(_request())
    killer = threading.Timer(0.3, group.kill, args=(0,))
    killer.start()
    group.load(ray.put(_perturbed_update(version=2)))  # publish while the generation is in flight
    killer.join()
    samples = group.collect(pending)

    assert group.restarts == 1
    assert sorted(map(_key, samples)) == [(p, i) for p in range(12) for i in range(4)]
    for s in samples:
        assert int(s.version_T.min()) == int(s.version_T.max()) == s.final_version in (1, 2)
    assert [ray.get(a.version.remote()) for a in group.actors] == [2, 2]
