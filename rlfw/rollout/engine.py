"""What every rollout engine is: the :class:`Engine` protocol, and the weight-update checks they share.

Two engines implement it: the built-in one (:class:`~rlfw.rollout.native.NativeEngine`) and vLLM
(:class:`~rlfw.rollout.vllm.engine.VllmEngine`). The rollout actor holds an ``Engine`` and nothing more
specific, so a third engine is a new file, not a new branch in the actor.

Weight updates follow one contract in every engine (:func:`accept_update`): an update built under another
execution contract is refused, a version must move past the engine's, and a tensor name the engine's model
lacks is refused before anything is loaded, so a refused update leaves the engine as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from torch import Tensor

from rlfw.types import GenerationRequest, Sample, WeightUpdate


class ContractMismatchError(RuntimeError):
    """A weight update built under another execution contract than the engine runs."""


class Engine(Protocol):
    """A rollout engine: generates :class:`~rlfw.types.Sample` records at the weight version it holds."""

    contract_hash: str
    """The execution contract this engine runs under; updates from another contract are refused."""

    @property
    def version(self) -> int:
        """The weight version the engine samples with now."""
        ...

    def finished(self) -> bool:
        """True when no sequence is waiting or running."""
        ...

    def generate(
        self, request: GenerationRequest, *, between_steps: Callable[[Engine], None] | None = None
    ) -> list[Sample]:
        """Run a request to completion; samples come back prompt-major, in sample order.
        ``between_steps(engine)`` runs between decode steps (in-flight updates); engines that load weights
        only between requests refuse it."""
        ...

    def update_weights(
        self, weights: WeightUpdate | Mapping[str, Tensor], version: int | None = None
    ) -> None:
        """Load new weights and move to their version (checked by :func:`accept_update`)."""
        ...

    def shutdown(self) -> None:
        """Release what the engine holds (caches, worker state)."""
        ...


def accept_update(
    weights: WeightUpdate | Mapping[str, Tensor],
    version: int | None,
    *,
    contract_hash: str,
    current_version: int,
    known_names: Iterable[str],
) -> tuple[Mapping[str, Tensor], int]:
    """The state dict and version of an ``update_weights`` call, after the checks every engine makes.

    A :class:`~rlfw.types.WeightUpdate` carries its version and must have been built under the engine's
    contract; a plain state dict needs ``version`` given with it. The version must move past
    ``current_version``, and every tensor must be one of ``known_names``.
    """
    state, version = _unpack(weights, version, contract_hash)
    if version <= current_version:
        raise ValueError(f"weight version {version} does not move past the engine's {current_version}")
    unknown = sorted(set(state) - set(known_names))
    if unknown:
        raise KeyError(f"weight update names tensors the model lacks: {', '.join(unknown)}")
    return state, version


def _unpack(
    weights: WeightUpdate | Mapping[str, Tensor], version: int | None, contract_hash: str
) -> tuple[Mapping[str, Tensor], int]:
    if not isinstance(weights, WeightUpdate):
        if version is None:
            raise ValueError("update_weights(state_dict, version): the version is required")
        return weights, version
    if weights.contract_hash != contract_hash:
        raise ContractMismatchError(
            f"weight update {weights.version} was built under contract {weights.contract_hash!r} "
            f"but this engine runs contract {contract_hash!r}; refusing to load it"
        )
    if version is not None and version != weights.version:
        raise ValueError(f"version={version} contradicts the update's version {weights.version}")
    return weights.state_dict, weights.version
