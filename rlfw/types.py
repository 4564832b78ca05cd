"""The typed records that cross actor boundaries. Ray actors exchange only these.

Shapes use suffixes where it helps: ``_T`` per response token, ``_P`` per prompt token, ``_K`` top-k,
``_L`` per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

STREAMS = ("sampler_logp", "decode_logp", "prefill_logp", "trainer_logp")


@dataclass
class Sample:
    """One generated response and everything measured about each of its tokens.

    Invariants: every per-token array (``*_logp``, ``version_T``, ``kv_version_T``, ``topk_*``) has the
    length of ``response_T``; ``routed_experts`` (MoE only) covers prompt then response tokens,
    ``[P + T, n_moe_layers, k]``; ``trainer_logp`` is ``None`` until the trainer fills it in.
    Log-probs are fp32 and of the *processed* distribution (after the declared sampling transforms).
    A token a reduced-precision sampler drew outside the decode path's kept set (a top-k/top-p
    boundary moved) has ``decode_logp``/``prefill_logp`` ``-inf``: reported, never clamped.
    ``prefilled`` is False when the engine skipped the prefill stream for this sequence
    (``engine.prefill_fraction < 1``); ``prefill_logp`` is then NaN everywhere, a marker, not a value.
    ``routed_experts[p]`` are the ids used when position ``p`` was fed to the model (prompt prefill or
    decode step; after an in-flight ``kv_policy=recompute`` update, the re-prefill's); the last
    response token, which no decode step feeds, takes the ids of the final prefill.
    """

    prompt_id: int  # which prompt; samples of one GRPO group share it
    sample_index: int  # index within the group, 0 .. n-1
    prompt_P: Tensor  # int64 prompt token ids
    response_T: Tensor  # int64 generated token ids (stop token included when one was drawn)
    sampler_logp: Tensor  # mu: as recorded when drawn, at the sampler's precision
    decode_logp: Tensor  # s^D: decode path, full precision, at the token's version
    prefill_logp: Tensor  # s^P: one prefill of the finished sequence at its final version
    version_T: Tensor  # int64 weight version each token was sampled with
    kv_version_T: Tensor  # int64 oldest weight version in the KV entries each token attended to
    topk_ids: Tensor  # int64 [T, K] the sampler's top-k ids
    topk_logp: Tensor  # fp32 [T, K] their sampler log-probs
    finish_reason: str  # "stop" (a stop token was drawn) or "length" (max_new_tokens reached)
    final_version: int  # weight version when the sequence finished (prefill_logp's version)
    routed_experts: Tensor | None = None  # int64 [P + T, n_moe_layers, k] expert ids (MoE), for R3
    trainer_logp: Tensor | None = None  # q: filled in by the trainer
    reward: float | None = None  # filled in by the task's reward function
    prefilled: bool = True  # the prefill stream was computed (see engine.prefill_fraction)
    decode_topk_logp: Tensor | None = None  # fp32 [T, K] decode stream at topk_ids (None: not recorded)
    prefill_topk_logp: Tensor | None = None  # fp32 [T, K] prefill stream at topk_ids (NaN if not prefilled)

    def __post_init__(self) -> None:
        n = self.response_T.shape[0]
        per_token = {
            "sampler_logp": self.sampler_logp,
            "decode_logp": self.decode_logp,
            "prefill_logp": self.prefill_logp,
            "version_T": self.version_T,
            "kv_version_T": self.kv_version_T,
            "topk_ids": self.topk_ids,
            "topk_logp": self.topk_logp,
        }
        for name in _HEADS:
            if getattr(self, name) is not None:
                per_token[name] = getattr(self, name)
        for name, t in per_token.items():
            if t.shape[0] != n:
                raise ValueError(f"Sample.{name} has {t.shape[0]} entries for {n} response tokens")
        if self.routed_experts is not None and self.routed_experts.shape[0] != self.prompt_P.shape[0] + n:
            raise ValueError("Sample.routed_experts must cover prompt and response tokens")

    @property
    def tokens(self) -> Tensor:
        """Prompt then response, int64 ``[P + T]``."""
        return torch.cat([self.prompt_P, self.response_T])


# The engine streams at the sampler's top-k ids: optional (an engine that cannot record them leaves None).
# Whichever is the PPO reference gives `dlc` the generating weights' distribution over the head.
_HEADS = ("decode_topk_logp", "prefill_topk_logp")

# Per-token fields of a Sample, packed end to end in a SampleBatch.
_PER_TOKEN = (
    "response_T",
    "sampler_logp",
    "decode_logp",
    "prefill_logp",
    "version_T",
    "kv_version_T",
    "topk_ids",
    "topk_logp",
)


def _packed(samples: list[Sample]) -> tuple[str, ...]:
    """The per-token fields every sample has (optional heads only when all samples carry them)."""
    if not samples:
        return ()
    heads = tuple(f for f in _HEADS if all(getattr(s, f) is not None for s in samples))
    return (*_PER_TOKEN, *heads)


@dataclass
class SampleBatch:
    """Many samples as a few concatenated tensors, for crossing an actor boundary.

    Pickling thousands of tiny tensors costs far more than the generation that made them (measured:
    about 0.5 s for 256 samples of 4 tokens); a handful of large tensors moves at memory speed.
    Invariants: ``per_token[f]`` holds every sample's field ``f`` end to end in sample order, sample
    ``i`` owning ``response_lens[i]`` rows; ``prompts`` and ``routed`` likewise with ``prompt_lens``
    (and ``prompt_lens + response_lens`` for ``routed``).
    """

    prompt_ids: list[int]
    sample_indices: list[int]
    prefilled: list[bool]
    finish_reasons: list[str]
    final_versions: list[int]
    prompt_lens: list[int]
    response_lens: list[int]
    prompts: Tensor
    per_token: dict[str, Tensor]
    routed: Tensor | None

    @classmethod
    def pack(cls, samples: list[Sample]) -> SampleBatch:
        routed = [s.routed_experts for s in samples if s.routed_experts is not None]
        return cls(
            prompt_ids=[s.prompt_id for s in samples],
            sample_indices=[s.sample_index for s in samples],
            prefilled=[s.prefilled for s in samples],
            finish_reasons=[s.finish_reason for s in samples],
            final_versions=[s.final_version for s in samples],
            prompt_lens=[s.prompt_P.shape[0] for s in samples],
            response_lens=[s.response_T.shape[0] for s in samples],
            prompts=torch.cat([s.prompt_P for s in samples]) if samples else torch.zeros(0, dtype=torch.long),
            per_token={f: torch.cat([getattr(s, f) for s in samples]) for f in _packed(samples)},
            routed=torch.cat(routed) if samples and len(routed) == len(samples) else None,
        )

    def unpack(self) -> list[Sample]:
        prompts = self.prompts.split(self.prompt_lens)
        fields = {f: t.split(self.response_lens) for f, t in self.per_token.items()}
        totals = [p + r for p, r in zip(self.prompt_lens, self.response_lens, strict=True)]
        routed = self.routed.split(totals) if self.routed is not None else [None] * len(prompts)
        return [
            Sample(
                prompt_id=self.prompt_ids[i],
                sample_index=self.sample_indices[i],
                prefilled=self.prefilled[i],
                prompt_P=prompts[i],
                finish_reason=self.finish_reasons[i],
                final_version=self.final_versions[i],
                routed_experts=routed[i],
                **{f: parts[i] for f, parts in fields.items()},
            )
            for i in range(len(prompts))
        ]


@dataclass
class GenerationRequest:
    """Prompts for one rollout round: ``n`` samples each (a GRPO group shares the prompt's prefill).

    A draw is seeded by (seed, prompt_id, sample_index, step), so ``prompt_ids`` must be unique within a
    request; pass a different ``seed`` per round to get fresh samples of a prompt seen before.
    """

    prompt_ids: list[int]  # ids of the prompts, for grouping, bookkeeping and seeding
    prompts: list[Tensor]  # int64 [P] token ids per prompt
    n: int = 1  # samples per prompt
    max_new_tokens: int = 32  # response length cap
    seed: int | None = None  # sampling seed of this round; None: the engine's seed
    greedy: bool = False  # draw the most likely token (after the sampler's transforms) instead of sampling


@dataclass
class WeightUpdate:
    """A published set of trainer weights.

    ``contract_hash`` is the trainer's execution-contract hash; an engine whose own hash differs refuses
    the update (the error names the differing entries when both contracts are at hand).
    """

    version: int
    contract_hash: str
    state_dict: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class TrainBatch:
    """Per-token training tensors for a set of samples; what the driver sends each trainer rank.

    Layout: ``tokens [B, L]`` holds prompt then response, right-padded. The model's logits at position
    ``t`` predict token ``t + 1``, so every per-token tensor is ``[B, L - 1]`` in *prediction* positions:
    response token ``j`` of a sample with prompt length ``P`` sits at index ``P + j - 1``, and ``mask``
    marks exactly those positions.
    """

    tokens: Tensor  # int64 [B, L]
    attention_mask: Tensor  # int64 [B, L], 1 on prompt and response tokens
    mask: Tensor  # bool [B, L-1], True where a response token is predicted
    sampler_logp: Tensor  # fp32 [B, L-1]
    decode_logp: Tensor  # fp32 [B, L-1]
    prefill_logp: Tensor  # fp32 [B, L-1]
    advantages: Tensor  # fp32 [B, L-1]
    version: Tensor  # int64 [B, L-1] weight version each token was sampled with
    topk_ids: Tensor  # int64 [B, L-1, K]
    topk_logp: Tensor  # fp32 [B, L-1, K]
    routed_experts: Tensor | None  # int64 [B, L, n_moe_layers, k] for R3, None for dense models
    rewards: Tensor | None = None  # fp32 [B, L-1] PPO: the sample's reward at its last response token
    prefilled: Tensor | None = None  # bool [B, L-1]: the token has a prefill value; None: every token has
    decode_topk_logp: Tensor | None = None  # fp32 [B, L-1, K] decode stream at topk_ids; None: not recorded
    prefill_topk_logp: Tensor | None = None  # fp32 [B, L-1, K] prefill stream at topk_ids; None: not recorded

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice | Tensor) -> TrainBatch:
        """A micro-batch: the same tensors restricted to some rows."""
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        sliced: dict[str, Any] = {k: None if v is None else v[index] for k, v in values.items()}
        return TrainBatch(**sliced)

    def micro_batches(self, size: int) -> list[TrainBatch]:
        """Consecutive row blocks of at most ``size`` sequences (gradient accumulation's unit)."""
        return [self.rows(slice(i, i + size)) for i in range(0, len(self), size)]


@dataclass
class TrainResult:
    """What a trainer rank returns for its shard of a step.

    ``trainer_logp`` and ``old_logp`` are ``[B_shard, L-1]`` in the shard's :class:`TrainBatch` layout:
    the trainer's log-probs at its pre-update weights (q) and the PPO reference it used. The driver
    concatenates shards to compute ratio metrics over the whole batch.
    """

    trainer_logp: Tensor
    old_logp: Tensor
    scalars: dict[str, float]
