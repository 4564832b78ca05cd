"""The rollout actor's hand-over of a weight update that arrives while a generation runs (no Ray: the
worker class is driven from two threads, as Ray's threaded actor does)."""

from __future__ import annotations

import threading

import pytest
import torch

from rlfw.config import EngineConfig
from rlfw.distributed.rollout_worker import RolloutWorker
from rlfw.distributed.specs import ModelSpec
from rlfw.types import GenerationRequest, SampleBatch, WeightUpdate
from rlfw.validation import ConfigError

SPEC = ModelSpec(path=None, preset="tiny_dense", dtype="float32", kernels="invariant", seed=0)


def _update(version: int, contract_hash: str = "h") -> WeightUpdate:
    model = SPEC.build()
    gen = torch.Generator().manual_seed(version)
    state = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.named_parameters()}
    return WeightUpdate(version=version, contract_hash=contract_hash, state_dict=state)


def _run_with_update(worker: RolloutWorker, update: WeightUpdate) -> tuple[list, int]:
    request = GenerationRequest(list(range(4)), [torch.arange(4, 9)] * 4, n=2, max_new_tokens=40, seed=1)
    out: dict[str, SampleBatch] = {}
    thread = threading.Thread(target=lambda: out.setdefault("batch", worker.generate(request)))
    thread.start()
    while not worker._generating:  # wait until the generation owns the engine
        pass
    try:
        version = worker.update_weights(update)
    finally:
        thread.join()
    return out["batch"].unpack(), version


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_in_flight_update_lands_between_decode_steps(kv_policy: str) -> None:
    """The push lands inside the generation (held at step 5 until it arrives, so whichever thread is
    faster, every sequence spans it), and what the sequences continue on depends on ``kv_policy``."""
    worker = _held_worker(5, kv_policy)
    thread, out = _start_held(worker, ticket=0)
    _wait_at_step(worker, 5)
    assert worker.update_weights(_update(1)) == 1
    thread.join()
    assert worker.in_flight_updates == 1
    for s in out["batch"].unpack():  # every sequence started at 0 and finished at 1
        assert s.version_T[0] == 0 and s.version_T[-1] == 1 and s.final_version == 1
        kv_old = s.kv_version_T[s.version_T == 1]
        assert bool((kv_old == 0).all()) if kv_policy == "keep" else bool((kv_old == 1).all())
        # tokens drawn at the final version: prefill and decode hold the same weights, so only the
        # KV cache can separate them; recompute makes them bit-identical, keep does not
        at_final = s.version_T == 1
        gap = (s.prefill_logp - s.decode_logp)[at_final].abs().max()
        assert (gap == 0) if kv_policy == "recompute" else (gap > 0)


def _started(cfg: EngineConfig) -> RolloutWorker:
    """The actor's class used in this process: created, then started under contract "h"."""
    worker = RolloutWorker(SPEC, cfg, stop_ids=[])
    worker.start("h")
    return worker


def test_without_in_flight_the_update_waits_for_the_generation() -> None:
    worker = _started(EngineConfig(max_slots=8, max_model_len=64))
    samples, version = _run_with_update(worker, _update(1))
    assert version == 1 and worker.in_flight_updates == 0
    assert all(int(s.version_T.max()) == 0 and s.final_version == 0 for s in samples)


def test_a_refused_in_flight_update_raises_to_its_caller_and_generation_goes_on() -> None:
    cfg = EngineConfig(max_slots=8, max_model_len=64, in_flight=True)
    worker = _started(cfg)
    with pytest.raises(Exception, match="contract"):
        _run_with_update(worker, _update(1, contract_hash="other"))
    assert worker.engine.version == 0 and worker.engine.finished()


def _held_worker(at_step: int, kv_policy: str = "keep") -> RolloutWorker:
    cfg = EngineConfig(
        max_slots=8, max_model_len=64, in_flight=True, in_flight_at_step=at_step, kv_policy=kv_policy
    )
    return _started(cfg)


def _start_held(worker: RolloutWorker, ticket: int | None) -> tuple[threading.Thread, dict[str, SampleBatch]]:
    request = GenerationRequest(list(range(4)), [torch.arange(4, 9)] * 4, n=2, max_new_tokens=20, seed=1)
    out: dict[str, SampleBatch] = {}
    thread = threading.Thread(target=lambda: out.setdefault("batch", worker.generate(request, ticket)))
    thread.start()
    return thread, out


def _wait_at_step(worker: RolloutWorker, step: int) -> None:
    """Until the generation has run ``step`` engine steps (and, when held, waits there)."""
    with worker._turn:
        worker._turn.wait_for(lambda: worker._steps >= step)


@pytest.mark.parametrize("sent_after", [5, 1])
def test_in_flight_at_step_lands_the_update_after_exactly_that_step(sent_after: int) -> None:
    """engine.in_flight_at_step=5: the push lands after the fifth step whether it is sent once the
    generation waits there (5) or early, from a second thread as soon as it has run one step (1): the
    generation does not move past step 5 without it, and does not load it before. Every sequence has 5
    tokens at version 0, the rest at version 1, whatever the two threads' speeds."""
    worker = _held_worker(5)
    thread, out = _start_held(worker, ticket=0)
    _wait_at_step(worker, sent_after)
    assert worker.update_weights(_update(1)) == 1
    thread.join()
    for s in out["batch"].unpack():
        assert s.version_T.tolist() == [0] * 5 + [1] * (len(s.version_T) - 5)


@pytest.mark.parametrize("when", ["before it starts", "while it waits"])
def test_a_released_ticket_generates_without_waiting(when: str) -> None:
    """The driver releases a generation's ticket before collecting it (no push is coming): the release
    frees a generation waiting at the step, and one released before it started never waits."""
    worker = _held_worker(5)
    if when == "before it starts":
        worker.release(0)
    thread, out = _start_held(worker, ticket=0)
    if when == "while it waits":
        _wait_at_step(worker, 5)
        worker.release(0)
    thread.join()
    assert all(int(s.version_T.max()) == 0 for s in out["batch"].unpack())
    assert worker.in_flight_updates == 0


def test_a_generation_queued_behind_a_held_one_releases_it() -> None:
    """Evaluation asks for a generation while the step's one waits for a push that is not coming: the
    held one goes on, then the queued one runs."""
    worker = _held_worker(5)
    thread, out = _start_held(worker, ticket=0)
    _wait_at_step(worker, 5)
    request = GenerationRequest([9], [torch.arange(4, 9)], n=1, max_new_tokens=4, seed=2)
    later = worker.generate(request).unpack()
    thread.join()
    assert len(out["batch"].unpack()) == 8 and len(later) == 1


def test_in_flight_at_step_needs_in_flight() -> None:
    with pytest.raises(ConfigError, match="engine.in_flight=true"):
        EngineConfig(in_flight_at_step=3)
    with pytest.raises(ConfigError, match="in_flight_at_step"):
        EngineConfig(in_flight=True, in_flight_at_step=0)
