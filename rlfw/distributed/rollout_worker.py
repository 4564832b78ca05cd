"""The engine actor of the rollout pool: one engine per actor, the built-in one or vLLM (in-process).

It starts in two calls: created, it reports its environment fingerprint; :meth:`RolloutWorker.start` then
builds the engine under the contract the driver settled on every slot's fingerprint. One process does
both, so the fingerprint costs no process of its own.

The actor is threaded (two calls at a time) so that a weight update can arrive while a generation runs.
What happens to it then is the engine's ``in_flight`` setting:

* ``engine.in_flight=false``: the update waits until the running generation has finished (every sequence
  is generated at one version);
* ``engine.in_flight=true`` (either engine): the update is handed to the generation loop, which loads it
  between two decode steps; unfinished sequences continue at the new version on their old KV cache
  (``kv_policy=keep``) or on a recomputed one (``recompute``), and every token records its version. The
  call returns once the weights are loaded.

  Where the update lands is where timing puts it, unless ``engine.in_flight_at_step=k``: a generation
  submitted with a hold ticket then loads an update only after its k-th engine step, and waits there
  until one arrives, the driver releases its ticket (:meth:`RolloutWorker.release`, called before the
  driver collects it: by then every push meant for it has been sent) or another generation queues behind
  it. Each update then lands at the same place in its generation, whatever the two sides' speeds.

A lock around the engine makes the two calls take turns: the generation thread owns the engine while it
runs; the update thread touches it only when no generation runs, or through the hand-over slot.
"""

from __future__ import annotations

import os
import tempfile
import threading
from datetime import timedelta
from typing import Any

import ray

from rlfw.config import EngineConfig
from rlfw.distributed.cluster import keep_freed_memory, peak_rss_mb, use_cpu_threads
from rlfw.distributed.cores import Seat, join, working
from rlfw.distributed.specs import ModelSpec
from rlfw.distributed.weight_group import BroadcastFailed, TensorMeta, WeightGroup
from rlfw.fingerprint import environment_fingerprint
from rlfw.rollout.engine import Engine
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest, SampleBatch, WeightUpdate


class RolloutWorker:
    """Generates samples at the weight version it holds; loads published versions on request."""

    engine_cfg: EngineConfig  # kept from creation until start() builds the engine from it

    def __init__(
        self, spec: ModelSpec, engine_cfg: EngineConfig, stop_ids: list[int], seat: Seat | None = None
    ) -> None:
        """Nothing is built yet: the driver first reads this process's :meth:`fingerprint`, settles the
        execution contract on every slot's, then calls :meth:`start` with its hash."""
        self.spec, self.engine_cfg, self.stop_ids, self.seat = spec, engine_cfg, stop_ids, seat

    def fingerprint(self) -> dict[str, Any]:
        """This process's environment fingerprint, read before anything here changes it."""
        return environment_fingerprint(self.engine_cfg.name)

    def start(self, contract_hash: str) -> None:
        """Build the engine under the settled contract (its hash stamps samples and checks updates)."""
        spec, stop_ids = self.spec, self.stop_ids
        engine_cfg = self.engine_cfg
        self.engine: Engine
        keep_freed_memory()  # no page faults on the tensors each step frees and allocates again
        self.cores = join(self.seat, use_cpu_threads(engine_cfg.cpu_threads))  # lend_idle_cores=true
        if engine_cfg.name == "vllm":
            from rlfw.rollout.vllm.engine import VllmEngine

            self.engine = VllmEngine.from_config(
                self._checkpoint(spec), engine_cfg, spec.dtype, spec.kernels, stop_ids, contract_hash
            )
        else:
            self.engine = NativeEngine.from_config(spec.build(), engine_cfg, stop_ids, contract_hash)
        self.in_flight = engine_cfg.in_flight
        self._turn = threading.Condition()  # guards the two fields below and every engine call
        self._generating = False
        self._handed: WeightUpdate | None = None  # an update for the generation loop to load
        self._handed_error: BaseException | None = None  # what loading it raised, for the caller
        self.in_flight_updates = 0
        self.land_at = engine_cfg.in_flight_at_step
        self._steps = 0  # engine steps of the running generation
        self._ticket: int | None = None  # the running generation's hold ticket (it waits at land_at)
        self._released = -1  # tickets up to this one are released (the driver collects them)
        self._queued = 0  # generate calls waiting for the running one

    def _checkpoint(self, spec: ModelSpec) -> str:
        """vLLM loads from a folder: a preset model is written to a temporary one for this actor."""
        if spec.path is not None:
            return spec.path
        from rlfw.model import save_pretrained

        self._tmp = tempfile.TemporaryDirectory(prefix="rlfw-vllm-")
        save_pretrained(spec.build(), self._tmp.name)
        return self._tmp.name

    def generate(self, request: GenerationRequest, hold: int | None = None) -> SampleBatch:
        """Generate ``request`` at the held version (updates may land inside it, see the module
        docstring). ``hold``: a ticket; with ``engine.in_flight_at_step`` the generation waits at that
        step for an update until the ticket is released."""
        with self._turn:
            self._queued += 1
            self._turn.notify_all()  # a held generation stops waiting for one queued behind it
            self._turn.wait_for(lambda: not self._generating)
            self._queued -= 1
            self._generating, self._steps = True, 0
            self._ticket = hold  # consulted only at step land_at
        try:
            with working(self.cores):
                if self.in_flight:
                    samples = self.engine.generate(request, between_steps=self._load_handed)
                else:
                    samples = self.engine.generate(request)
        finally:
            with self._turn:
                self._generating = False
                self._turn.notify_all()
        return SampleBatch.pack(samples)

    def _load_handed(self, engine: Engine) -> None:
        """Between two engine steps: load an update the update thread handed over (with
        ``engine.in_flight_at_step``, not before that step; at it, a held generation waits for one)."""
        with self._turn:
            self._steps += 1
            self._turn.notify_all()  # for whoever waits on the generation's progress
            if self.land_at is not None and self._steps < self.land_at:
                return
            if self._steps == self.land_at:
                self._turn.wait_for(lambda: self._handed is not None or not self._held())
            if self._handed is None:
                return
            try:
                engine.update_weights(self._handed)
                self.in_flight_updates += 1
            except Exception as e:  # refused (contract, version): the caller raises it, generation goes on
                self._handed_error = e
            self._handed = None
            self._turn.notify_all()

    def _held(self) -> bool:
        ticket = self._ticket
        return ticket is not None and ticket > self._released and self._queued == 0

    def release(self, ticket: int) -> None:
        """No further update is coming for the generation holding ``ticket`` (or an earlier one): it
        does not wait for one. It may not have started yet; it then does not wait when it does."""
        with self._turn:
            self._released = max(self._released, ticket)
            self._turn.notify_all()

    def update_weights(self, update: WeightUpdate) -> int:
        """Load a published version (the engine checks its contract hash); returns the new version.

        A version the engine already holds is not loaded again (a replacement actor is loaded with the
        latest version before a retried call delivers the same one)."""
        with self._turn:
            if update.version == self.engine.version:
                return int(self.engine.version)
            self._turn.wait_for(lambda: self._handed is None)
            if self._generating and self.in_flight:
                self._handed = update
                self._turn.notify_all()  # a generation held at engine.in_flight_at_step waits for it
                self._turn.wait_for(lambda: self._handed is None or not self._generating)
                if self._handed is None:
                    error, self._handed_error = self._handed_error, None
                    if error is not None:
                        raise error
                    return self.engine.version
                self._handed = None  # the generation ended before its next step: load it here
            else:
                self._turn.wait_for(lambda: not self._generating)
            self.engine.update_weights(update)
            return self.engine.version

    def join_weight_group(
        self, host: str, port: int, rank: int, world: int, timeout: timedelta
    ) -> str | None:
        """Join the weight-broadcast group. Returns None, or why joining failed (a member that never came
        or left while the group formed; if an engine died, the driver replaces it and forms the group
        again)."""
        try:
            self.weights = WeightGroup(host, port, rank, world, timeout)
        except RuntimeError as err:
            return str(err)
        return None

    def receive_weights(self, metas: list[TensorMeta], version: int, contract_hash: str) -> str | None:
        """Receive a broadcast version and load it like any update (the contract hash is checked). Returns
        None, or why the broadcast failed here (the driver then delivers the version another way)."""
        try:
            state = self.weights.receive(metas)
        except BroadcastFailed as err:
            return str(err)
        self.update_weights(WeightUpdate(version=version, contract_hash=contract_hash, state_dict=state))
        return None

    def version(self) -> int:
        return int(self.engine.version)

    def pid(self) -> int:
        return os.getpid()

    def peak_rss_mb(self) -> float:
        """This actor's peak resident memory (weights, KV cache, activations), in MiB."""
        return peak_rss_mb()


RolloutActor = ray.remote(RolloutWorker)
ACTOR_CONCURRENCY = 2  # threaded: a weight update may arrive while a generation runs (module docstring)
