"""A trainer rank of the trainer pool: DeepSpeed over gloo (CPU) or NCCL (GPU)."""

from __future__ import annotations

import os

import ray
import torch

from rlfw.distributed.specs import ModelSpec
from rlfw.trainer.deepspeed_backend import DeepSpeedBackend, OptimConfig
from rlfw.trainer.step import StepSpec, train_step
from rlfw.types import TrainBatch, TrainResult


@ray.remote
class TrainerWorker:
    """One data-parallel rank: trains on its shard of each step, publishes weights from rank 0."""

    def __init__(
        self, rank: int, world: int, port: int, spec: ModelSpec, optim: OptimConfig, step: StepSpec
    ) -> None:
        import deepspeed

        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        self.model = spec.build().train()
        self.backend = DeepSpeedBackend(self.model, optim)
        self.step_spec = step
        self.rank = rank

    def train(self, batch: TrainBatch, num_tokens: int, num_sequences: int) -> TrainResult:
        return train_step(self.backend, self.model, batch, self.step_spec, num_tokens, num_sequences)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights (gathered under ZeRO-3); every rank must call it, rank 0's copy is used."""
        return self.backend.full_state_dict()

    def save(self, folder: str, tag: str) -> None:
        self.backend.save(folder, tag)

    def load(self, folder: str, tag: str) -> None:
        self.backend.load(folder, tag)

    def shutdown(self) -> None:
        """Leave the process group cleanly (without this, runs abort at exit)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
