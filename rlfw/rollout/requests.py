"""Turning a :class:`~rlfw.types.GenerationRequest` into engine sequences, refusing what cannot run."""

from __future__ import annotations

from torch import Tensor

from rlfw.rollout.prefix import PromptGroup
from rlfw.rollout.sequence import MAX_GROUP, Sequence
from rlfw.types import GenerationRequest


class RequestError(ValueError):
    """A request the engine cannot run; the message names the prompt and the limit."""


def _check_prompt(prompt_id: int, prompt: Tensor, max_model_len: int) -> None:
    if prompt.dim() != 1 or prompt.shape[0] == 0:
        raise RequestError(f"prompt {prompt_id} must be a non-empty 1-D tensor of token ids")
    if prompt.shape[0] >= max_model_len:
        raise RequestError(
            f"prompt {prompt_id} has {prompt.shape[0]} tokens but max_model_len={max_model_len} (the KV "
            "cache capacity) leaves no room for a response; shorten the prompt or raise engine.max_model_len"
        )


def _check_forced(forced: list[Tensor] | None, n_sequences: int) -> None:
    if forced is None:
        return
    if len(forced) != n_sequences:
        raise RequestError(
            f"forced_responses has {len(forced)} entries; the request has {n_sequences} sequences "
            "(len(prompts) * n, prompt-major)"
        )
    for i, f in enumerate(forced):
        if f.dim() != 1 or f.shape[0] == 0:
            raise RequestError(f"forced_responses[{i}] must be a non-empty 1-D tensor of token ids")


def _check_request(request: GenerationRequest) -> None:
    if len(request.prompt_ids) != len(request.prompts):
        raise RequestError(f"{len(request.prompt_ids)} prompt_ids for {len(request.prompts)} prompts")
    if len(set(request.prompt_ids)) != len(request.prompt_ids):
        raise RequestError("prompt_ids must be unique within a request (they seed the draws)")
    if not 1 <= request.n <= MAX_GROUP:
        raise RequestError(f"n={request.n} samples per prompt; allowed: 1 .. {MAX_GROUP}")
    if request.max_new_tokens < 1:
        raise RequestError(f"max_new_tokens={request.max_new_tokens} must be at least 1")


def expand_request(
    request: GenerationRequest, forced: list[Tensor] | None, max_model_len: int, seed: int
) -> list[Sequence]:
    """One :class:`Sequence` per (prompt, sample), prompt-major; samples of a prompt share a group.

    A response stops at ``max_new_tokens`` or when prompt plus response fill ``max_model_len``
    (finish reason ``length``). A forced response must fit entirely.
    """
    _check_request(request)
    _check_forced(forced, len(request.prompts) * request.n)
    seed = request.seed if request.seed is not None else seed
    sequences = []
    for p, (prompt_id, prompt) in enumerate(zip(request.prompt_ids, request.prompts, strict=True)):
        _check_prompt(prompt_id, prompt, max_model_len)
        group = PromptGroup(prompt.long().cpu(), waiting=request.n)  # records live on the CPU
        max_len = min(request.max_new_tokens, max_model_len - prompt.shape[0])
        for i in range(request.n):
            f = None if forced is None else forced[p * request.n + i].long().cpu()
            if f is not None and prompt.shape[0] + f.shape[0] > max_model_len:
                raise RequestError(
                    f"prompt {prompt_id} ({prompt.shape[0]} tokens) with its forced response "
                    f"({f.shape[0]} tokens) exceeds max_model_len={max_model_len}"
                )
            sequences.append(Sequence(prompt_id, i, group, max_len, seed, forced_T=f, greedy=request.greedy))
    return sequences
