"""The decode stream inside vLLM: a logits processor that reads the raw logits at sampling time.

vLLM returns one log-prob mode per engine; rlfw runs it in ``processed_logprobs`` mode, so what comes
back with each token is the sampler's log-prob (mu) after vLLM's own temperature, top-k, top-p and
min-p. The decode stream (s^D) needs the *raw* decode logits of the same step with rlfw's transforms
replayed on them. :class:`DecodeTap` is a vLLM logits processor that sees every step's logits before
vLLM's sampling transforms, replays :func:`~rlfw.model.distribution.process_logits` on each tracked row
and keeps it until the sampled token is known (one step later, or when the request leaves the batch),
then stores that token's log-prob. Memory: one processed row per running request.

MoE: the registered model publishes each step's routed expert ids per request
(:data:`STEP_ROUTING`, in batch order); the tap appends each tracked request's share, so a request
collects the ids of every position it fed to the model (its prompt, then each decode step's token).

Versions: after every engine step the engine stamps each tracked request's new tokens with the weight
version of that step and with the oldest version among the K/V entries they attended to
(:meth:`Tracked.stamp`). A request's K/V is written from the step vLLM first schedules it (its first
prefill chunk). vLLM takes a running request out of its batch and adds it back both when it merely went
unscheduled for a step (its K/V kept) and when the scheduler preempted it (after an in-flight update under
``kv_policy=recompute``, or for lack of KV blocks; its K/V is then recomputed). The engine tells the two
apart for the tap: before every step it publishes each tracked request's preemption count from vLLM's
scheduler (:data:`PREEMPTIONS`). A preempted request keeps its record, is marked ``refilled`` (its later
tokens carry the version of the recomputing step) and drops the routing collected so far (the
recomputing forward feeds every position again, at the new version, as the built-in engine's
recompute does).

The prefill stream, when vLLM runs the trainer's arithmetic (:func:`~rlfw.contract.vllm_shares_numerics`):
the engine rescores each finished sequence as a one-token request that skips the prefix cache, so vLLM's
prefill forward computes every position. While it does (:class:`PrefillScores`), the registered model
publishes each request's final hidden states (:data:`STEP_HIDDEN`) and its LM head, and the tap scores
the positions a rescoring request names (:class:`Scoring`): the head on those rows only, then rlfw's
transforms and ``ops.token_logp`` at the next token, the same arithmetic as vLLM's prompt log-probs
under the shared log-softmax (the head's rows and ``token_logp`` do not depend on which other rows run),
without the head over the prompt, the full log-softmax written out and the rank count.

Reduced-precision samplers (``engine.sampler.precision=bf16|fp8``): while the engine generates, the
registered model's LM head hands vLLM the sampler head's logits (what vLLM then samples from and reports
as the sampler stream) and publishes the full-precision logits of the same rows
(:data:`STEP_DECODE_LOGITS`), which the tap reads for the decode stream instead of vLLM's.

It runs in the process that runs the model, which the engine guarantees by running vLLM in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker). Requests opt in through
``SamplingParams.extra_args[TAP_KEY] = (engine_id, request_key, kernels, transforms)``; results land in
:data:`RECORDS` under the engine id, per request key and sample seed (children of ``n > 1`` differ only
in their seed). All requests of one engine share its transforms and op set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from vllm.v1.sample.logits_processor import LogitsProcessor

from rlfw.kernels import get_ops
from rlfw.model.distribution import Transforms, process_logits, row_blocks

TAP_KEY = "rlfw_tap"
SCORE_KEY = "rlfw_score_from"  # extra_args of a rescoring request: the first position it scores


@dataclass
class Scoring:
    """A rescoring request's prefill stream: the log-prob of each token after position ``first`` of
    ``tokens`` (its prompt), from the hidden states of the positions as vLLM's prefill feeds them."""

    first: int
    tokens: list[int]
    fed: int = 0  # positions the model has computed so far (prefill chunks)
    logp: list[Tensor] = field(default_factory=list)

    def take(
        self, hidden: Tensor, head: Callable[[Tensor], Tensor], ops: Any, transforms: Transforms
    ) -> None:
        """Score this step's rows (``hidden [n, H]``, positions ``fed..fed+n``) that have a next token."""
        start, stop = max(self.first, self.fed), min(self.fed + hidden.shape[0], len(self.tokens) - 1)
        if start < stop:
            # The call's other tensors are allocated before the logits: a tensor made while they are live
            # and kept afterwards would sit above them in the heap, so that at a real vocabulary every
            # request's logits took fresh pages (39 MB, 9,500 page faults a request) instead of the last
            # request's.
            targets = torch.tensor(self.tokens[start + 1 : stop + 1], device=hidden.device)
            scored = torch.empty(stop - start, dtype=torch.float32)
            logits = head(hidden[start - self.fed : stop - self.fed])
            for r in row_blocks(*logits.shape):  # a few rows of a real vocabulary at a time, in cache
                scored[r] = ops.token_logp(process_logits(logits[r], transforms), targets[r])
            del logits
            self.logp.append(scored)
        self.fed += hidden.shape[0]

    def result(self) -> Tensor:
        """The stream, once the whole prompt was fed."""
        if self.fed != len(self.tokens):
            raise RuntimeError(
                f"vLLM fed {self.fed} of the {len(self.tokens)} positions of a rescored sequence"
            )
        return torch.cat(self.logp) if self.logp else torch.zeros(0)


@dataclass
class Tracked:
    """One sample's decode stream as the tap builds it."""

    transforms: Transforms
    kernels: str
    output: list[int]  # vLLM's live list of this request's output tokens
    logp: list[float] = field(default_factory=list)
    pending: Tensor | None = None  # processed log-probs of the last step whose token is not known yet
    routing: list[Tensor] = field(default_factory=list)  # MoE: [positions fed, n_moe_layers, k] per step
    version: list[int] = field(default_factory=list)  # per output token: the weight version drawing it
    kv_version: list[int] = field(default_factory=list)  # per output token: oldest version in its K/V
    kv_oldest: int | None = None  # oldest weight version among this request's K/V entries
    refilled: bool = True  # vLLM (re)wrote its K/V from this step on: first scheduled, or preempted
    preemptions: int = 0  # vLLM's preemption count for the request when last resumed
    scoring: Scoring | None = None  # a rescoring request's prefill stream (the tap scores its prompt)

    def stamp(self, version: int) -> None:
        """After an engine step at ``version``: stamp the tokens that step drew. The step that first
        schedules a request starts its K/V, and the step that resumes a preempted one recomputes all of
        it, both at ``version``."""
        if self.refilled:
            self.kv_oldest, self.refilled = version, False
        new = len(self.output) - len(self.version)
        if new > 0:
            assert self.kv_oldest is not None
            self.version += [version] * new
            self.kv_version += [self.kv_oldest] * new

    def resolve(self) -> None:
        """Store the log-prob of the token sampled from the pending row, once vLLM appended it."""
        if self.pending is not None and len(self.output) > len(self.logp):
            self.logp.append(float(self.pending[self.output[len(self.logp)]]))
            self.pending = None


# engine id -> (request key, seed) -> the sample's stream. Filled by the tap; the engine pops its
# entries after a generate call and resolves the last token (no later step may come to do it).
RECORDS: dict[str, dict[tuple[str, int], Tracked]] = {}

# engine id -> (request key, seed) -> vLLM's preemption count of that request, published by the engine
# before every step (VllmEngine._publish_preemptions) so the tap can tell a recompute from a request that
# only went unscheduled for a step.
PREEMPTIONS: dict[str, dict[tuple[str, int], int]] = {}

# The sampler head's precision while the engine generates (SamplerHead sets it; "fp32" otherwise, as in
# the rescoring pass, whose prompt log-probs are the full-precision prefill stream).
SAMPLER_PRECISION = ["fp32"]

# With a reduced-precision sampler head: the full-precision LM head's logits of the rows vLLM samples
# from in the current step (the decode stream's source), published by the registered model.
STEP_DECODE_LOGITS: list[Tensor] = []


def tag_of(params: Any) -> tuple[tuple[str, str, str, dict[str, Any]], int] | None:
    """A tracked request's tag ``(engine id, request key, kernels, transforms)`` and its sample seed, from
    its sampling parameters; None for a request the tap does not track."""
    tag = None if params is None else (params.extra_args or {}).get(TAP_KEY)
    if tag is None:
        return None
    return tag, 0 if params.seed is None else int(params.seed)


class SamplerHead:
    """``with SamplerHead(precision):`` the registered model's LM head is the sampler's at ``precision``
    (fp32: the full-precision head itself) for the generation inside the block."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def __enter__(self) -> None:
        SAMPLER_PRECISION[0] = self.precision

    def __exit__(self, *exc: object) -> None:
        SAMPLER_PRECISION[0] = "fp32"
        STEP_DECODE_LOGITS.clear()


class PrefillScores:
    """``with PrefillScores():`` the registered model publishes each step's final hidden states per
    request (:data:`STEP_HIDDEN`) and its LM head (:data:`SCORING_HEAD`), for the tap's rescoring."""

    def __enter__(self) -> None:
        SCORING[0] = True

    def __exit__(self, *exc: object) -> None:
        SCORING[0] = False
        STEP_HIDDEN.clear()
        SCORING_HEAD.clear()


SCORING = [False]
# While scoring: the current step's final hidden states per request in batch order, and the LM head.
STEP_HIDDEN: list[Tensor] = []
SCORING_HEAD: list[Callable[[Tensor], Tensor]] = []

# The current step's expert ids per request in batch order, published by the registered MoE model's
# forward (rlfw.rollout.vllm.model.publish_routing) just before vLLM samples from its logits.
STEP_ROUTING: list[Tensor] = []


class DecodeTap(LogitsProcessor):
    """vLLM V1 logits processor recording the decode stream; never changes the logits."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, Tracked] = {}  # persistent-batch index -> tracked request

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        # False puts it in the group vLLM applies before temperature: it sees raw logits, also for
        # greedy requests. It returns them unchanged.
        return False

    def update_state(self, batch_update: Any) -> None:
        for t in self.rows.values():
            t.resolve()
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            self.rows.pop(index, None)
            tagged = tag_of(params)
            if tagged is not None:
                (engine, request_key, kernels, transforms), seed = tagged
                records = RECORDS.setdefault(engine, {})
                resumed = records.get((request_key, seed))
                # back in the batch (unscheduled for a while, or preempted): after its first token, or
                # a rescoring request between prefill chunks
                if resumed is not None and (output or resumed.scoring is not None):
                    resumed.output = output
                    count = PREEMPTIONS.get(engine, {}).get((request_key, seed), resumed.preemptions)
                    if count > resumed.preemptions:  # preempted: vLLM recomputes its K/V in this step
                        resumed.preemptions, resumed.refilled = count, True
                        resumed.routing.clear()
                        if resumed.scoring is not None:
                            resumed.scoring = Scoring(resumed.scoring.first, resumed.scoring.tokens)
                    self.rows[index] = resumed
                else:
                    t = Tracked(Transforms(**transforms), kernels, output)
                    first = params.extra_args.get(SCORE_KEY)
                    if first is not None:
                        t.scoring = Scoring(int(first), list(prompt))
                    records[(request_key, seed)] = self.rows[index] = t
        for a, b, direction in batch_update.moved:
            ta, tb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ta is not None:
                self.rows[b] = ta
            if tb is not None and direction.name == "SWAP":
                self.rows[a] = tb

    def apply(self, logits: Tensor) -> Tensor:
        live = [(i, t) for i, t in self.rows.items() if i < logits.shape[0]]
        if any(t.scoring is not None for _, t in live):
            for i, t in live:
                if t.scoring is not None:
                    t.scoring.take(STEP_HIDDEN[i], SCORING_HEAD[0], get_ops(t.kernels), t.transforms)
                    if i < len(STEP_ROUTING):
                        t.routing.append(STEP_ROUTING[i])
            live = [(i, t) for i, t in live if t.scoring is None]
        if live:
            first = live[0][1]
            ops = get_ops(first.kernels)
            full = logits
            if STEP_DECODE_LOGITS and STEP_DECODE_LOGITS[0].shape == logits.shape:
                full = STEP_DECODE_LOGITS[0]  # vLLM samples from a reduced-precision head's logits
            ids = [i for i, _ in live]
            index = (
                None
                if ids == list(range(ids[0], ids[0] + len(ids)))
                else torch.tensor(ids, device=full.device)
            )
            # a few rows of a real vocabulary at a time, in cache (a row's bits do not depend on its block);
            # each row's pending log-probs are a row of its block's
            for r in row_blocks(len(live), full.shape[-1]):
                rows = (
                    full[ids[0] + r.start : ids[0] + r.stop]
                    if index is None
                    else full.index_select(0, index[r])
                )
                block = ops.log_softmax(process_logits(rows, first.transforms)).cpu()
                for row, (i, t) in zip(block, live[r], strict=True):
                    t.resolve()
                    t.pending = row
                    if i < len(STEP_ROUTING):
                        t.routing.append(STEP_ROUTING[i])
        return logits
