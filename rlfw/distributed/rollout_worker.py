"""The engine actor of the rollout pool: one engine per actor, the built-in one or vLLM (in-process)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray

from rlfw.config import EngineConfig
from rlfw.distributed.specs import ModelSpec
from rlfw.distributed.weight_group import TensorMeta, WeightGroup
from rlfw.rollout.engine import NativeEngine
from rlfw.types import GenerationRequest, SampleBatch, WeightUpdate


class RolloutWorker:
    """Generates samples at the weight version it holds; loads published versions on request."""

    def __init__(
        self, spec: ModelSpec, engine_cfg: EngineConfig, stop_ids: list[int], contract_hash: str
    ) -> None:
        self.engine: Any
        if engine_cfg.name == "vllm":
            from rlfw.rollout.vllm_engine import VllmEngine

            self.engine = VllmEngine.from_config(
                self._checkpoint(spec), engine_cfg, spec.dtype, spec.kernels, stop_ids, contract_hash
            )
        else:
            self.engine = NativeEngine.from_config(spec.build(), engine_cfg, stop_ids, contract_hash)

    def _checkpoint(self, spec: ModelSpec) -> str:
        """vLLM loads from a folder: a preset model is written to a temporary one for this actor."""
        if spec.path is not None:
            return spec.path
        from rlfw.model import save_pretrained

        self._tmp = tempfile.TemporaryDirectory(prefix="rlfw-vllm-")
        save_pretrained(spec.build(), self._tmp.name)
        return self._tmp.name

    def generate(self, request: GenerationRequest) -> SampleBatch:
        return SampleBatch.pack(self.engine.generate(request))

    def update_weights(self, update: WeightUpdate) -> int:
        """Load a published version (the engine checks its contract hash); returns the new version."""
        self.engine.update_weights(update)
        return self.engine.version

    def join_weight_group(self, host: str, port: int, rank: int, world: int) -> None:
        self.weights = WeightGroup(host, port, rank, world)

    def receive_weights(self, metas: list[TensorMeta], version: int, contract_hash: str) -> int:
        """Receive a broadcast version and load it like any update (the contract hash is checked)."""
        state = self.weights.receive(metas)
        return self.update_weights(
            WeightUpdate(version=version, contract_hash=contract_hash, state_dict=state)
        )

    def version(self) -> int:
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()


RolloutActor = ray.remote(RolloutWorker)
