"""`LossInputs`: the tensors the policy loss reads for one micro-batch (design §8)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

_STREAMS = ("trainer_logp", "sampler_logp", "decode_logp", "prefill_logp", "advantages", "mask")
_TOPK = ("sampler_topk_ids", "sampler_topk_logp", "trainer_topk_logp", "reference_topk_logp")


@dataclass
class LossInputs:
    """One micro-batch of per-token tensors for `policy_loss`.

    Invariants: every per-token tensor is [B, T] with the same shape; the top-k tensors, when given, are
    [B, T, k] with the same k. Only `trainer_logp` and `trainer_topk_logp` carry gradient; the others are
    read as constants. Tokens where any log-probability stream is NaN or +-inf are dropped from the loss
    and counted in the metrics.
    """

    trainer_logp: Tensor
    """[B, T] log q of each token under the trainer's current weights, with grad."""
    sampler_logp: Tensor
    """[B, T] log mu recorded by the sampler when the token was drawn."""
    decode_logp: Tensor
    """[B, T] log s^D from the engine's decode path at the token's weight version."""
    prefill_logp: Tensor
    """[B, T] log s^P from the engine's prefill over the finished sequence, at its final weight version."""
    advantages: Tensor
    """[B, T] advantage of each token (a sequence's advantage broadcast to its tokens for GRPO)."""
    mask: Tensor
    """[B, T] bool or 0/1: which tokens are trained on (response tokens, not prompt or padding)."""
    num_tokens: float | int | Tensor
    """Global count of masked tokens across all micro-batches and ranks of the step (token_mean)."""
    num_sequences: float | int | Tensor | None = None
    """Global count of sequences across micro-batches and ranks; required for seq_mean aggregation."""
    old_logp: Tensor | None = None
    """[B, T] PPO reference: the log-prob under the weights that generated each token, i.e. the prefill
    stream scored at the token's own version, which the caller computes; None = `prefill_logp` (exact
    when the whole sequence was sampled with one weight version)."""
    sampler_topk_ids: Tensor | None = None
    """[B, T, k] the sampler's top-k token ids; the caller gathers `trainer_topk_logp` at these ids."""
    sampler_topk_logp: Tensor | None = None
    """[B, T, k] the sampler's log-probs of its top-k ids (-inf allowed where transforms removed a token)."""
    trainer_topk_logp: Tensor | None = None
    """[B, T, k] the trainer's log-probs at `sampler_topk_ids`, with grad (score centering only)."""
    reference_topk_logp: Tensor | None = None
    """[B, T, k] the PPO reference's log-probs at `sampler_topk_ids` (the generating weights' distribution
    over the sampler's head; dlc only, which needs the lag ratio of every head token)."""

    def __post_init__(self) -> None:
        shape = tuple(self.trainer_logp.shape)
        if len(shape) != 2:
            raise ValueError(f"LossInputs.trainer_logp must be [B, T], got shape {shape}")
        for name in (*_STREAMS, "old_logp"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}, expected {shape}")
        topk = {name: getattr(self, name) for name in _TOPK if getattr(self, name) is not None}
        topk_shapes = {tuple(value.shape) for value in topk.values()}
        for name, value in topk.items():
            if value.dim() != 3 or tuple(value.shape[:2]) != shape or len(topk_shapes) > 1:
                found = sorted(topk_shapes)
                raise ValueError(
                    f"LossInputs.{name}: top-k tensors must all be [{shape[0]}, {shape[1]}, k], got {found}"
                )
        if not _positive(self.num_tokens):
            raise ValueError(f"LossInputs.num_tokens must be > 0, got {self.num_tokens!r}")
        if self.num_sequences is not None and not _positive(self.num_sequences):
            raise ValueError(f"LossInputs.num_sequences must be > 0, got {self.num_sequences!r}")

    @property
    def reference_logp(self) -> Tensor:
        """[B, T] the PPO reference log-prob: `old_logp`, or `prefill_logp` when it is not given."""
        return self.prefill_logp if self.old_logp is None else self.old_logp


def _positive(n: float | int | Tensor) -> bool:
    return bool(n > 0)
