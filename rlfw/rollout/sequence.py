"""One sequence inside the engine: its tokens, its slot and what was measured for each token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlfw.rollout.prefix import PromptGroup
from rlfw.rollout.streams import TokenStreams
from rlfw.types import Sample

MAX_GROUP = 2**16  # samples per prompt; the seed key packs (prompt_id, sample_index)


def sequence_key(prompt_id: int, sample_index: int) -> int:
    """The id that seeds this sequence's draws: a function of what it is, never of where it runs."""
    return prompt_id * MAX_GROUP + sample_index


@dataclass
class Sequence:
    """A prompt's ``sample_index``-th response being generated.

    Cache invariant while it holds a slot: the slot holds every token but the last (``pending``), so a
    decode step feeds ``pending`` and scores the next token. A new sequence has an empty response and
    ``pending`` is the prompt's last token.
    """

    prompt_id: int
    sample_index: int
    group: PromptGroup
    max_len: int  # response cap: min(max_new_tokens, max_model_len - P)
    seed: int
    forced_T: Tensor | None = None  # teacher-forced response (audit), decoded exactly
    greedy: bool = False  # the most likely token instead of a draw (evaluation)
    slot: int = -1
    kv_oldest: int | None = None  # oldest weight version among the entries in its slot
    prompt_kv_version: int | None = None  # version of the prefill that wrote the prompt's rows
    response: list[int] = field(default_factory=list)  # their streams: NativeEngine.records, this slot
    version: list[int] = field(default_factory=list)
    kv_version: list[int] = field(default_factory=list)
    routing: list[Tensor] = field(default_factory=list)  # [n, L, k] chunks, positions 0 .. fed so far
    finish_reason: str | None = None

    @property
    def prompt_P(self) -> Tensor:
        return self.group.prompt_P

    @property
    def key(self) -> int:
        return sequence_key(self.prompt_id, self.sample_index)

    @property
    def tokens(self) -> Tensor:
        """Prompt then response so far, int64."""
        resp = torch.tensor(self.response, dtype=torch.long, device=self.prompt_P.device)
        return torch.cat([self.prompt_P, resp])

    @property
    def pending(self) -> int:
        return self.response[-1] if self.response else int(self.prompt_P[-1])

    @property
    def cached_tokens(self) -> Tensor:
        """The tokens the slot holds: all but ``pending``."""
        return self.tokens[:-1]

    def forced_token(self) -> int | None:
        return None if self.forced_T is None else int(self.forced_T[len(self.response)])

    def wrote_kv(self, version: int) -> None:
        """Entries were appended at ``version``."""
        self.kv_oldest = version if self.kv_oldest is None else min(self.kv_oldest, version)

    def replaced_kv(self, version: int, routing: Tensor | None) -> None:
        """The slot was re-prefilled at ``version`` (kv_policy=recompute)."""
        self.kv_oldest = version
        self.prompt_kv_version = version
        self.routing = [] if routing is None else [routing]

    def record(self, token: int, version: int, stop_ids: set[int]) -> None:
        """Append a token (its streams went to the engine's records), then decide whether the sequence is
        finished."""
        assert self.kv_oldest is not None
        self.response.append(token)
        self.version.append(version)
        self.kv_version.append(self.kv_oldest)
        self.finish_reason = self._finish_reason(token, stop_ids)

    def _finish_reason(self, token: int, stop_ids: set[int]) -> str | None:
        if self.forced_T is not None:
            if len(self.response) < self.forced_T.shape[0]:
                return None
            return "stop" if token in stop_ids else "length"
        if token in stop_ids:
            return "stop"
        return "length" if len(self.response) >= self.max_len else None

    def to_sample(
        self,
        streams: TokenStreams,
        prefill_logp: Tensor,
        prefill_head: Tensor,
        last_routing: Tensor | None,
        final_version: int,
        prefilled: bool = True,
    ) -> Sample:
        """The record that leaves the engine; ``streams`` are the decode steps' records of its ``T``
        tokens (``[T]`` / ``[T, K]``); ``prefill_head [T, K]`` is the prefill stream at the
        sampler's top-k ids; ``last_routing [1, L, k]`` covers the last response token, which no decode
        step fed."""
        device = self.prompt_P.device
        routed = None
        if last_routing is not None:
            routed = torch.cat([*self.routing, last_routing])
        return Sample(
            prompt_id=self.prompt_id,
            sample_index=self.sample_index,
            prompt_P=self.prompt_P,
            response_T=torch.tensor(self.response, dtype=torch.long, device=device),
            sampler_logp=streams.sampler_logp,
            decode_logp=streams.decode_logp,
            prefill_logp=prefill_logp,
            version_T=torch.tensor(self.version, dtype=torch.long, device=device),
            kv_version_T=torch.tensor(self.kv_version, dtype=torch.long, device=device),
            topk_ids=streams.topk_ids,
            topk_logp=streams.topk_logp,
            decode_topk_logp=streams.decode_topk_logp,
            prefill_topk_logp=prefill_head,
            finish_reason=self.finish_reason or "length",
            final_version=final_version,
            routed_experts=routed,
            prefilled=prefilled,
        )
