"""Driver-side handles on the two pools: shard work over actors, gather results, replace dead actors."""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rlfw.config import EngineConfig
from rlfw.distributed.cluster import Pool
from rlfw.distributed.cores import Seat
from rlfw.distributed.rollout_worker import ACTOR_CONCURRENCY, RolloutActor
from rlfw.distributed.specs import ModelSpec
from rlfw.distributed.trainer_worker import TrainerActor
from rlfw.trainer.deepspeed_backend import OptimConfig
from rlfw.trainer.step import StepSpec
from rlfw.types import GenerationRequest, Sample, TrainBatch, TrainResult

log = logging.getLogger(__name__)
MAX_RETRIES = 3

LOST_PEER = re.compile(r"gloo/transport/\w+/pair\.cc")
"""Where gloo raises a lost connection to a collective partner (closed or reset by the peer, a broken pipe):
its transport's pair, named in the message. Gloo's own timeouts come from elsewhere."""


def split_request(request: GenerationRequest, parts: int) -> list[GenerationRequest]:
    """Round-robin prompts over ``parts`` actors. Draws are seeded per (prompt, sample), so a prompt's
    samples are the same whichever actor generates them."""
    shards = []
    for i in range(parts):
        ids, prompts = request.prompt_ids[i::parts], request.prompts[i::parts]
        if ids:
            shards.append(GenerationRequest(ids, prompts, request.n, request.max_new_tokens, request.seed))
    return shards


@dataclass
class PendingGeneration:
    """A request in flight: its shards and the actors' result references, in actor order."""

    shards: list[GenerationRequest]
    futures: list[Any]  # ObjectRefs of SampleBatch
    actors: list[Any]  # the actor handle each shard went to
    ticket: int | None = None  # the hold ticket the shards wait on (engine.in_flight_at_step)


class RolloutGroup:
    """The engine actors. A dead actor is replaced, loaded with the last published version, and its
    request re-issued: results count only from calls that completed, so no sample is lost or doubled.

    Created, the actors only report their :meth:`fingerprints`; :meth:`start` builds the engines."""

    def __init__(
        self,
        pool: Pool,
        spec: ModelSpec,
        engine_cfg: EngineConfig,
        stop_ids: list[int],
        ledger: str | None = None,
    ) -> None:
        """``ledger``: the core ledger's path under ``lend_idle_cores=true`` (actor ``i`` sits in seat
        ``i``)."""
        self.pool, self.args = pool, (spec, engine_cfg, stop_ids)
        self.holds = engine_cfg.in_flight_at_step is not None  # generations wait for updates (submit)
        self.tickets = itertools.count()
        self.ledger = ledger
        self.actors: list[Any] = [self._spawn(i) for i in range(pool.size)]  # actor handles
        self.contract_hash: str | None = None  # set by start(); a replacement starts under it too
        self.latest: Any = None  # ObjectRef of the last WeightUpdate, loaded into replacements
        self.restarts = 0

    def _spawn(self, index: int) -> Any:
        options = self.pool.options(index) | {"max_concurrency": ACTOR_CONCURRENCY}
        seat = None if self.ledger is None else Seat(self.ledger, index)
        return RolloutActor.options(**options).remote(*self.args, seat)

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        """Every engine slot's environment fingerprint (``"engine 0"``, ...), read where it runs."""
        prints = ray.get([a.fingerprint.remote() for a in self.actors])
        return {f"engine {i}": fp for i, fp in enumerate(prints)}

    def start(self, contract_hash: str) -> list[Any]:
        """Build every engine under the settled contract; returns the calls' references to wait on (so
        the trainer ranks can start meanwhile)."""
        self.contract_hash = contract_hash
        return [a.start.remote(contract_hash) for a in self.actors]

    def _replace(self, index: int) -> None:
        log.warning("rollout actor %d died; restarting it from the last published version", index)
        self.actors[index] = self._spawn(index)
        self.restarts += 1
        if self.contract_hash is not None:
            ray.get(self.actors[index].start.remote(self.contract_hash))
        if self.latest is not None:
            ray.get(self.actors[index].update_weights.remote(self.latest))

    def _call(self, index: int, method: str, *args: Any) -> Any:
        for attempt in range(MAX_RETRIES + 1):
            try:
                return ray.get(getattr(self.actors[index], method).remote(*args))
            except RayActorError:
                if attempt == MAX_RETRIES:
                    raise
                self._replace(index)
        raise AssertionError("unreachable")

    def generate(self, request: GenerationRequest) -> list[Sample]:
        return self.collect(self.submit(request))

    def submit(self, request: GenerationRequest, hold: bool = False) -> PendingGeneration:
        """Start generating without waiting: each actor runs its shard at the version it holds now. An
        update sent later waits for the shard, or lands inside it with ``engine.in_flight=true``.
        ``hold``: with ``engine.in_flight_at_step``, the shards wait at that step for the next update
        until :meth:`collect` (see :mod:`rlfw.distributed.rollout_worker`)."""
        shards = split_request(request, len(self.actors))
        actors = list(self.actors[: len(shards)])
        ticket = next(self.tickets) if hold and self.holds else None
        futures = [a.generate.remote(s, ticket) for a, s in zip(actors, shards, strict=True)]
        return PendingGeneration(shards, futures, actors, ticket)

    def collect(self, pending: PendingGeneration) -> list[Sample]:
        """Wait for a submitted request; a shard whose actor died is re-issued to its replacement.
        Every push meant for it has been sent by now, so a shard held for one is released first."""
        if pending.ticket is not None:
            for actor in pending.actors:
                actor.release.remote(pending.ticket)
        samples: list[Sample] = []
        for i, (shard, future) in enumerate(zip(pending.shards, pending.futures, strict=True)):
            try:
                packed = ray.get(future)
            except RayActorError:
                if self.actors[i] is pending.actors[i]:  # not already replaced by another call
                    self._replace(i)
                packed = self._call(i, "generate", shard)
            samples += packed.unpack()
        return sorted(samples, key=lambda s: (s.prompt_id, s.sample_index))

    def load(self, update_ref: Any) -> None:
        """Every engine loads the published version; returns once all have acknowledged it."""
        self.latest = update_ref
        for i in range(len(self.actors)):
            self._call(i, "update_weights", update_ref)

    def replace_dead(self) -> None:
        """Replace every engine whose process is gone (a round trip to each)."""
        for i in range(len(self.actors)):
            self._call(i, "version")

    def broadcast_failures(self, receives: list[Any]) -> dict[int, str]:
        """Why each engine that missed a weight broadcast, or failed to join its group, missed it
        (``receives``: one receive or join call per actor, in order): ``"died"``, or the error the call
        returned. Any other error is raised."""
        failures = {}
        for i, ref in enumerate(receives):
            try:
                failed = ray.get(ref)
            except RayActorError:
                failures[i] = "died"
                continue
            if failed is not None:
                failures[i] = failed
        return failures

    def peak_rss_mb(self) -> float:
        """The largest peak resident memory among the engine actors, in MiB."""
        return max(ray.get([a.peak_rss_mb.remote() for a in self.actors]))

    def kill(self, index: int) -> None:
        """Kill an actor (tests and fault drills); the next call replaces it."""
        ray.kill(self.actors[index], no_restart=True)


def shard_rows(n: int, parts: int) -> list[slice]:
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


class TrainerRankDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, a node lost); the message names the rank."""

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(f"trainer rank {rank} died during {what}")
        self.rank = rank


def gather_ranks(futures: list[Any], what: str) -> list[Any]:
    """Every rank's result, or :class:`TrainerRankDied` as soon as one rank's process is gone (the others
    are then blocked in a collective that will never complete, so nothing waits for them).

    Of the results ready at once, a dead rank's is looked at first. A survivor's collective can fail on
    the lost connection before Ray reports the dead process; that error (:data:`LOST_PEER`) says a peer is
    gone, so the dead rank's own result, which Ray always resolves, is waited for and named instead. Any
    other error is raised as it is."""
    pending = list(futures)
    results: dict[int, Any] = {}  # rank -> its result, each fetched once
    lost_peer: RayTaskError | None = None
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        if pending:  # and whatever else is ready already
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        errors = []
        for ref in ready:
            rank = futures.index(ref)
            try:
                results[rank] = ray.get(ref)
            except RayActorError as err:
                raise TrainerRankDied(rank, what) from err
            except RayTaskError as err:
                errors.append(err)
        for error in errors:
            if not LOST_PEER.search(str(error)):
                raise error
            lost_peer = lost_peer or error
    if lost_peer is not None:  # a peer was lost, yet every rank answered: nothing to name
        raise lost_peer
    return [results[rank] for rank in range(len(futures))]


class TrainerGroup:
    """The data-parallel trainer ranks; each step's batch is split into contiguous row shards.

    Created, the ranks only report their :meth:`fingerprints`; :meth:`start` builds them."""

    def __init__(
        self,
        pool: Pool,
        spec: ModelSpec,
        optim: OptimConfig,
        cpu_threads: int = 1,
        ledger: str | None = None,
        first_seat: int = 0,
    ) -> None:
        """``ledger``: the core ledger's path under ``lend_idle_cores=true``; rank ``r`` sits in seat
        ``first_seat + r`` (after the engine actors')."""
        self.actors: list[Any] = [  # actor handles
            TrainerActor.options(**pool.options(r)).remote(
                r,
                pool.size,
                spec,
                optim,
                cpu_threads,
                None if ledger is None else Seat(ledger, first_seat + r),
            )
            for r in range(pool.size)
        ]
        self.dead: int | None = None  # the rank that died, once one has

    def fingerprints(self, engine: str) -> dict[str, dict[str, Any]]:
        """Every rank's environment fingerprint (``"trainer rank 0"``, ...), read where it runs, with the
        libraries of the run's ``engine``."""
        prints = self.gather([a.fingerprint.remote(engine) for a in self.actors], "start-up")
        return {f"trainer rank {r}": fp for r, fp in enumerate(prints)}

    def start(self, step: StepSpec) -> None:
        """Build every rank (they join one process group, so all at once) and wait for them.

        Rank 0 picks the group's port just before: a port picked when the ranks were created was free
        for the seconds their processes took to start, while Ray opened connections from the same range
        of ephemeral ports, and one of them once took it (EADDRINUSE in the rank's start)."""
        (address,) = self.gather([self.actors[0].node_address.remote()], "start-up")
        self.gather([a.start.remote(step, address[1]) for a in self.actors], "start-up")

    def gather(self, futures: list[Any], what: str) -> list[Any]:
        """:func:`gather_ranks`, remembering which rank died (:meth:`shutdown` then stops the rest)."""
        try:
            return gather_ranks(futures, what)
        except TrainerRankDied as err:
            self.dead = err.rank
            raise

    def train(self, batch: TrainBatch) -> TrainResult:
        if len(batch) < len(self.actors):
            raise ValueError(f"{len(batch)} samples cannot feed {len(self.actors)} trainer ranks")
        shards = shard_rows(len(batch), len(self.actors))
        futures = [
            a.train.remote(batch.rows(s), batch.num_tokens, len(batch))
            for a, s in zip(self.actors, shards, strict=True)
        ]
        results: list[TrainResult] = self.gather(futures, "a training step")
        return merge_results(results, [batch.rows(s).num_tokens for s in shards])

    def publish(self, version: int, contract_hash: str) -> Any:
        """Gather full weights (every rank takes part); rank 0 puts them in the object store itself, so
        they never pass through the driver. Returns the reference."""
        refs = self.gather([a.publish.remote(version, contract_hash) for a in self.actors], "a publish")
        return refs[0][0]

    def save(self, folder: str, tag: str) -> None:
        self.gather([a.save.remote(folder, tag) for a in self.actors], "a checkpoint save")

    def load(self, folder: str, tag: str) -> None:
        self.gather([a.load.remote(folder, tag) for a in self.actors], "a checkpoint load")

    def peak_rss_mb(self) -> float:
        """The largest peak resident memory among the trainer ranks, in MiB."""
        return max(self.gather([a.peak_rss_mb.remote() for a in self.actors], "a memory query"))

    def shutdown(self) -> None:
        """Leave the process group cleanly; after a rank died, the survivors are stuck in a collective
        (a clean exit would wait on the dead rank), so they are stopped instead."""
        if self.dead is not None:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            return
        self.gather([a.shutdown.remote() for a in self.actors], "shutdown")

    def kill(self, rank: int) -> None:
        """Kill one rank's process (fault drills and tests)."""
        ray.kill(self.actors[rank], no_restart=True)


def merge_results(results: list[TrainResult], tokens: list[int]) -> TrainResult:
    """Concatenate shards; losses add (each rank's is normalised by the global count), fractions are
    token-weighted, the grad norm is global already (rank 0's)."""
    total = max(sum(tokens), 1)
    keys = {k for r in results for k in r.scalars}
    scalars: dict[str, float] = {}
    for k in keys:
        values = [(r.scalars[k], n) for r, n in zip(results, tokens, strict=True) if k in r.scalars]
        if k.startswith("loss/"):
            scalars[k] = sum(v for v, _ in values)
        elif k == "grad_norm":
            scalars[k] = values[0][0]
        else:
            scalars[k] = sum(v * n for v, n in values) / total
    return TrainResult(
        trainer_logp=torch.cat([r.trainer_logp for r in results]),  # shards share the batch's width
        old_logp=torch.cat([r.old_logp for r in results]),
        scalars=scalars,
    )
