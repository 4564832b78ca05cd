"""A trainer rank of the trainer pool: DeepSpeed over gloo (CPU) or NCCL (GPU).

It starts in two calls, like the engine actor (:mod:`rlfw.distributed.rollout_worker`): created, it reports
its environment fingerprint; :meth:`TrainerWorker.start` builds the model and DeepSpeed."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import ray
import torch

from rlfw.distributed.cluster import keep_freed_memory, peak_rss_mb, use_cpu_threads
from rlfw.distributed.cores import Seat, join, working
from rlfw.distributed.specs import ModelSpec
from rlfw.distributed.weight_group import BroadcastFailed, WeightGroup, describe
from rlfw.fingerprint import environment_fingerprint
from rlfw.kernels import threads
from rlfw.logging.metrics import CORES_TRAINER_WIDENED_FRAC
from rlfw.trainer.deepspeed_backend import DeepSpeedBackend, OptimConfig
from rlfw.trainer.step import StepSpec, train_step
from rlfw.types import TrainBatch, TrainResult, WeightUpdate


class TrainerWorker:
    """One data-parallel rank: trains on its shard of each step, publishes weights from rank 0."""

    def __init__(
        self,
        rank: int,
        world: int,
        spec: ModelSpec,
        optim: OptimConfig,
        cpu_threads: int = 1,
        seat: Seat | None = None,
    ) -> None:
        """Nothing is built yet: the driver first reads this process's :meth:`fingerprint`, settles the
        execution contract on every slot's, then calls :meth:`start` (on every rank at once: it joins the
        process group)."""
        self.rank, self.world, self.spec, self.optim = rank, world, spec, optim
        self.cpu_threads, self.seat = cpu_threads, seat

    def fingerprint(self, engine: str) -> dict[str, Any]:
        """This process's environment fingerprint, read before anything here changes it, with the
        libraries of the run's ``engine`` (vLLM's version under ``engine=vllm``), as the engines report."""
        return environment_fingerprint(engine)

    def start(self, step: StepSpec, port: int) -> None:
        """Join the process group (rank 0 hosts its store on ``port``), build the model and DeepSpeed;
        ``step`` follows the settled contract."""
        import deepspeed

        keep_freed_memory()  # no page faults on the tensors each step frees and allocates again
        self.cores = join(self.seat, use_cpu_threads(self.cpu_threads))  # lend_idle_cores=true

        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        self.model = self.spec.build().train()
        if step.ppo is not None:
            self.model.attach_value_head()
        # KL to the initial weights: a frozen copy kept on this rank (a scoring pass per step; the engines
        # hold none). Built before DeepSpeed wraps the trained copy.
        self.reference = self.spec.build().eval().requires_grad_(False) if step.kl_coef > 0 else None
        self.backend = DeepSpeedBackend(self.model, self.optim)
        self.step_spec = step

    def train(self, batch: TrainBatch, num_tokens: int, num_sequences: int) -> TrainResult:
        calls_before, widened_before = threads.counts()
        with working(self.cores):
            result = train_step(
                self.backend, self.model, batch, self.step_spec, num_tokens, num_sequences, self.reference
            )
        if self.cores is not None:  # the share of this step's kernel calls that ran on borrowed cores
            calls, widened = threads.counts()
            share = (widened - widened_before) / max(calls - calls_before, 1)
            result.scalars[CORES_TRAINER_WIDENED_FRAC] = share
        return result

    def publish(self, version: int, contract_hash: str) -> list[Any]:
        """Gather the full weights (every rank must call it: a collective under ZeRO-3); rank 0 puts one
        :class:`WeightUpdate` in the object store and returns ``[ref]`` (a list, so Ray hands back the
        reference rather than the weights)."""
        state = self.backend.full_state_dict()
        if self.rank != 0:
            return []
        return [ray.put(WeightUpdate(version=version, contract_hash=contract_hash, state_dict=state))]

    def node_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for a group rank 0 hosts: the trainer ranks' own, or
        the weight-broadcast group."""
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def join_weight_group(self, host: str, port: int, world: int, timeout: timedelta) -> list[Any]:
        """Rank 0 joins the broadcast group as its rank 0; returns ``[metas, failed]``: what it will send,
        in order, and None or why joining failed (a member that never joined, most likely)."""
        try:
            self.weights = WeightGroup(host, port, 0, world, timeout)
        except RuntimeError as err:
            return [[], str(err)]
        return [describe(dict(self.model.named_parameters())), None]

    def send_weights(self, version: int, contract_hash: str) -> list[Any]:
        """Every rank gathers (a collective under ZeRO-3); rank 0 broadcasts to the engines, then keeps the
        version in its node's object store, and returns ``[ref, failed]``: ``failed`` is None, or why its
        broadcast failed (the driver may then deliver ``ref`` through the object store). A replacement
        engine, or a resumed async run, needs exactly this version later, when the trainer has moved on. It
        stays on the trainer's node unless one of them fetches it."""
        state = self.backend.full_state_dict()
        if self.rank != 0:
            return []
        failed = None
        try:
            self.weights.send(state)
        except BroadcastFailed as err:
            failed = str(err)
        return [ray.put(WeightUpdate(version=version, contract_hash=contract_hash, state_dict=state)), failed]

    def save(self, folder: str, tag: str) -> None:
        self.backend.save(folder, tag)

    def load(self, folder: str, tag: str) -> None:
        self.backend.load(folder, tag)

    def peak_rss_mb(self) -> float:
        """This rank's peak resident memory (model, optimizer state, activations), in MiB."""
        return peak_rss_mb()

    def shutdown(self) -> None:
        """Leave the process group cleanly (without this, runs abort at exit)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


TrainerActor = ray.remote(TrainerWorker)
