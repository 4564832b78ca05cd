"""What an actor needs to build its model and engine or trainer: small typed records, not the config."""

from __future__ import annotations

from dataclasses import dataclass

from rlfw.model import Transformer, load_model


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from; trainer and engines build identical models from it."""

    path: str | None
    preset: str | None
    dtype: str
    kernels: str
    seed: int

    def build(self) -> Transformer:
        return load_model(self.path, self.preset, self.dtype, self.kernels, self.seed)
