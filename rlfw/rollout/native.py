"""The built-in rollout engine (``engine=native``) on the shared model and kernels.

A fixed number of KV cache slots is decoded together (continuous batching): waiting sequences are
admitted as soon as a slot is free and a finished sequence frees its slot in the same step. One
:meth:`NativeEngine.step` is

1. **admit**: prefill each new prompt once (all but its last token) and copy its K/V rows into the
   slots of the other samples of its group;
2. **decode**: feed every running sequence its pending token, draw the next one with a seed that depends
   only on (seed, prompt, sample, step), and record ``sampler_logp``, ``decode_logp``, the sampler's
   top-k, ``version`` and ``kv_version``;
3. **retire**: run a prefill forward over each finished sequence, in its own slot, at the current
   weights, for ``prefill_logp``, and hand out :class:`~rlfw.types.Sample` records. The slot's prompt
   rows are kept when a prefill wrote them at the current version (as a prefix cache would serve them),
   so the forward covers the response; otherwise the whole row is prefilled again.

The prefill stream runs through the cache rather than the model's no-cache path because that is the
path the engine prefills prompts with, the one ``prefill_logp`` is meant to measure (vLLM's prompt
logprobs also go through its cache, prefix cache included). Under ``kernels=invariant`` the attention
reduces a query over the same positions in the same order from either layout, so it is also
bit-identical to the trainer's no-cache scoring forward; the tests check both claims.

Weight updates land between steps (:meth:`NativeEngine.update_weights`). With ``in_flight=True`` they
may land while sequences are unfinished; those continue on their stale KV (``kv_policy=keep``:
``kv_version`` keeps the old version) or on KV re-prefilled at the new version (``recompute``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlfw.model import Transformer
from rlfw.model.distribution import Transforms
from rlfw.rollout.engine import Engine, accept_update
from rlfw.rollout.forward import ForwardCounts, forward_rows, refill_rows
from rlfw.rollout.prefix import PrefixKV, empty_prefix
from rlfw.rollout.requests import expand_request
from rlfw.rollout.sampling import PRECISIONS, draw, gets_prefill, step_seed
from rlfw.rollout.sequence import Sequence
from rlfw.rollout.slots import SlotPool
from rlfw.rollout.streams import StreamRecords, next_token_logits, response_logp, token_streams
from rlfw.types import GenerationRequest, Sample, WeightUpdate

if TYPE_CHECKING:
    from rlfw.config import EngineConfig

KV_POLICIES = ("keep", "recompute")
PLAIN = Transforms()  # no transforms: sample from the model's distribution
KV_INITIAL_POSITIONS = 64  # per slot row; the cache doubles from here up to max_model_len as needed


SCORE_ROWS = 4096  # padded rows per scoring forward (see score_groups)


def score_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of the sequences of ``lengths`` whose padded rows (count x longest) stay within
    ``budget`` (a longer sequence goes alone). The prefill stream scores each group in one forward: one
    forward over every finished sequence at 512 tokens holds activations of hundreds of MB, which the
    allocator maps fresh and the kernel zero-fills on every call, and which no cache keeps. Under
    ``kernels=invariant`` a row's result does not depend on which rows share its forward, so the grouping
    changes no bit."""
    groups: list[list[int]] = []
    widest = 0
    for i, n in enumerate(lengths):
        if groups and max(widest, n) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
            widest = max(widest, n)
        else:
            groups.append([i])
            widest = n
    return groups


class NativeEngine:
    """An :class:`~rlfw.rollout.engine.Engine`: batched generation with per-token streams, versioned
    weights and teacher forcing for audits.

    Step-wise API (what an async scheduler drives): :meth:`start` queues a request, :meth:`step` runs
    one admit/decode/retire round and returns the samples that finished, :meth:`update_weights` loads
    new weights between steps, :meth:`finished` says whether anything is left. :meth:`generate` is the
    synchronous loop built from them.
    """

    def __init__(
        self,
        model: Transformer,
        transforms: Transforms = PLAIN,
        precision: str = "fp32",
        max_slots: int = 8,
        max_model_len: int = 256,
        stop_ids: Iterable[int] = (),
        seed: int = 0,
        topk_logprobs: int = 32,
        kv_policy: str = "keep",
        *,
        in_flight: bool = False,
        contract_hash: str = "",
        version: int = 0,
        prefill_fraction: float = 1.0,
        kv_cache_preallocate: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"engine.sampler.precision={precision!r}; allowed: {', '.join(PRECISIONS)}")
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"engine.kv_policy={kv_policy!r}; allowed: {', '.join(KV_POLICIES)}")
        if max_model_len < 2:
            raise ValueError(f"engine.max_model_len={max_model_len} must hold a prompt and a response")
        if prefill_fraction < 1.0 and model.args.is_moe:
            raise ValueError(
                "engine.prefill_fraction < 1: MoE models need every prefill (last token's experts)"
            )
        self.model = model
        model.prepare_for_inference()
        self.transforms, self.precision, self.kv_policy = transforms, precision, kv_policy
        self.stop_ids, self.seed, self.topk_logprobs = set(stop_ids), seed, topk_logprobs
        self.max_model_len, self.in_flight, self.contract_hash = max_model_len, in_flight, contract_hash
        initial = max_model_len if kv_cache_preallocate else min(max_model_len, KV_INITIAL_POSITIONS)
        self.cache = model.new_cache(max_slots, initial, max_capacity=max_model_len)
        self.records = StreamRecords(max_slots, initial, max_model_len)
        self.slots = SlotPool(max_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.counts = ForwardCounts()
        self._version = version
        self.prefill_fraction = prefill_fraction

    @classmethod
    def from_config(
        cls,
        model: Transformer,
        engine_cfg: EngineConfig,
        stop_ids: Iterable[int] | None = None,
        contract_hash: str = "",
    ) -> NativeEngine:
        """An engine for ``engine.*`` of the run config; ``stop_ids`` default to the model's eos id."""
        s = engine_cfg.sampler
        if stop_ids is None:
            eos = model.args.eos_token_id
            stop_ids = () if eos is None else (eos,)
        return cls(
            model,
            s.transforms(),
            s.precision,
            engine_cfg.max_slots,
            engine_cfg.max_model_len,
            stop_ids,
            engine_cfg.seed,
            s.topk_logprobs,
            engine_cfg.kv_policy,
            in_flight=engine_cfg.in_flight,
            contract_hash=contract_hash,
            prefill_fraction=engine_cfg.prefill_fraction,
            kv_cache_preallocate=engine_cfg.kv_cache_preallocate,
        )

    @property
    def version(self) -> int:
        """The weight version the engine samples with now."""
        return self._version

    def finished(self) -> bool:
        """True when no sequence is waiting or running."""
        return not self.waiting and not self.running

    # -- requests --------------------------------------------------------------------------------------

    def start(self, request: GenerationRequest, forced_responses: list[Tensor] | None = None) -> None:
        """Queue a request's sequences (prompt-major). ``forced_responses`` (one per sequence, audits):
        decode exactly these tokens instead of drawing, recording every stream for them."""
        self.waiting.extend(expand_request(request, forced_responses, self.max_model_len, self.seed))

    def generate(
        self,
        request: GenerationRequest,
        forced_responses: list[Tensor] | None = None,
        *,
        between_steps: Callable[[Engine], None] | None = None,
    ) -> list[Sample]:
        """Run a request to completion; samples come back prompt-major, in sample order.

        ``between_steps(engine)`` runs after every step that leaves sequences unfinished; it may call
        :meth:`update_weights` (an in-flight update when ``in_flight=True``).
        """
        if not self.finished():
            raise RuntimeError("generate() needs an idle engine; drive start()/step() to mix requests")
        self.start(request, forced_responses)
        samples: list[Sample] = []
        while not self.finished():
            samples.extend(self.step())
            if between_steps is not None and not self.finished():
                between_steps(self)
        rank = {pid: i for i, pid in enumerate(request.prompt_ids)}
        return sorted(samples, key=lambda s: (rank[s.prompt_id], s.sample_index))

    @torch.no_grad()
    def step(self) -> list[Sample]:
        """Admit waiting sequences, decode one token for every running one, retire the finished."""
        self._admit()
        self._decode()
        return self._retire()

    # -- admission -------------------------------------------------------------------------------------

    def _admit(self) -> None:
        batch = [self.waiting.popleft() for _ in range(min(self.slots.num_free, len(self.waiting)))]
        for seq in batch:
            seq.slot = self.slots.take()
        leaders: dict[int, Sequence] = {}  # first admitted sample of each group without a prefix
        for seq in batch:
            if seq.group.prefix is None:
                leaders.setdefault(id(seq.group), seq)
        self._prefill_prefixes(list(leaders.values()))
        for seq in batch:
            self._install(seq)

    def _prefill_prefixes(self, leaders: list[Sequence]) -> None:
        """Prefill each new group's prompt once, in its first sample's slot, and snapshot the rows."""
        for seq in leaders:
            seq.group.prefix = empty_prefix(self.cache, self._version)
        todo = [s for s in leaders if s.group.prefix_tokens.numel() > 0]
        if not todo:
            return
        rows = [s.group.prefix_tokens for s in todo]
        _, routing = refill_rows(self.model, rows, self.cache, [s.slot for s in todo])
        self._count(rows, "prefill_tokens")
        for i, (seq, row) in enumerate(zip(todo, rows, strict=True)):
            n = row.shape[0]
            ids = None if routing is None else routing[i, :n]
            seq.group.prefix = PrefixKV.from_slot(self.cache, seq.slot, n, ids, self._version)

    def _install(self, seq: Sequence) -> None:
        """Give a sequence its group's prefix rows (a copy, not a recomputation) and start it."""
        prefix = seq.group.prefix
        assert prefix is not None
        prefix.write_to(self.cache, seq.slot)
        seq.kv_oldest = prefix.version if prefix.length else None
        seq.prompt_kv_version = prefix.version
        seq.routing = [] if prefix.routing is None else [prefix.routing]
        seq.group.admitted_one()
        self.running[seq.slot] = seq

    # -- decoding --------------------------------------------------------------------------------------

    def _decode(self) -> None:
        seqs = [self.running[slot] for slot in sorted(self.running)]
        if not seqs:
            return
        rows = list(torch.tensor([[s.pending] for s in seqs], dtype=torch.long))
        hidden, routing = forward_rows(self.model, rows, self.cache, [s.slot for s in seqs])
        self._count(rows, "decode_tokens")
        logits = next_token_logits(self.model, hidden[:, 0], self.transforms, self.precision)
        tokens = self._choose(seqs, logits.sampler)
        streams = token_streams(self.model.ops, logits, tokens, self.topk_logprobs).cpu()
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        self.records.write(slots, torch.tensor([len(s.response) for s in seqs], dtype=torch.long), streams)
        for i, (seq, token) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
            seq.wrote_kv(self._version)
            if routing is not None:
                seq.routing.append(routing[i])
            seq.record(token, self._version, self.stop_ids)

    def _choose(self, seqs: list[Sequence], sampler_BV: Tensor) -> Tensor:
        """Forced tokens where given, the most likely token for greedy requests, else a Gumbel-max draw
        seeded by (seed, sequence, step)."""
        forced = [s.forced_token() for s in seqs]
        tokens = torch.tensor([0 if f is None else f for f in forced], dtype=torch.long)
        free = [i for i, s in enumerate(seqs) if s.forced_T is None and not s.greedy]
        if free:
            seeds = torch.tensor([step_seed(seqs[i].seed, seqs[i].key, len(seqs[i].response)) for i in free])
            rows = sampler_BV if len(free) == len(seqs) else sampler_BV[free]  # no copy when all draw
            tokens[free] = draw(rows, seeds).cpu()
        greedy = [i for i, s in enumerate(seqs) if s.forced_T is None and s.greedy]
        if greedy:  # ties go to the lowest id, as torch.argmax breaks them
            tokens[greedy] = torch.argmax(sampler_BV[greedy], dim=-1).cpu()
        return tokens.to(sampler_BV.device)

    # -- retiring --------------------------------------------------------------------------------------

    def _retire(self) -> list[Sample]:
        """Score each finished sequence with one prefill forward at the current version (only those
        :func:`~rlfw.rollout.sampling.gets_prefill` picks when ``prefill_fraction < 1``; the others are
        marked ``prefilled=False``); free its slot."""
        done = [self.running[slot] for slot in sorted(self.running) if self.running[slot].finish_reason]
        if not done:
            return []
        scored = [s for s in done if gets_prefill(s.seed, s.prompt_id, s.sample_index, self.prefill_fraction)]
        samples = self._score(scored) if scored else []
        scored_ids = {id(s) for s in scored}
        for seq in done:
            if id(seq) not in scored_ids:
                streams = self.records.take(seq.slot, len(seq.response))
                nan = torch.full((len(seq.response),), float("nan"))
                nan_head = torch.full_like(streams.topk_logp, float("nan"))
                samples.append(seq.to_sample(streams, nan, nan_head, None, self._version, prefilled=False))
            del self.running[seq.slot]
            self.slots.release(seq.slot)
        return samples

    def _score(self, done: list[Sequence]) -> list[Sample]:
        """Prefill forwards over the finished sequences, a group at a time (:func:`score_groups`). Where
        the slot's prompt rows were themselves prefilled at the current version (the usual case), they
        are kept, as a prefix cache keeps them, and the forward covers the last prompt token and the
        response; otherwise the whole row is prefilled again. Under ``kernels=invariant`` both give the
        same bits (a query reduces over the same positions in the same order whichever forward wrote
        them). The response's last token is fed only by MoE models, for its routing record: its logits
        would predict a token past the sequence."""
        starts = [self._reusable_prompt(seq) for seq in done]
        for seq, start in zip(done, starts, strict=True):
            self.cache.lengths[seq.slot] = start
        end = 0 if self.model.args.is_moe else -1
        tokens = [s.tokens for s in done]
        rows = [t[start : len(t) + end] for t, start in zip(tokens, starts, strict=True)]
        self._count(rows, "score_tokens")
        samples = []
        for group in score_groups([row.shape[0] for row in rows], SCORE_ROWS):
            hidden, routing = forward_rows(
                self.model, [rows[i] for i in group], self.cache, [done[i].slot for i in group]
            )
            for j, i in enumerate(group):
                seq, n = done[i], rows[i].shape[0]
                p = seq.prompt_P.shape[0]
                streams = self.records.take(seq.slot, len(seq.response))
                prefill, head = response_logp(
                    self.model, hidden[j, :n], p - starts[i], tokens[i][p:], self.transforms, streams.topk_ids
                )
                last = None if routing is None else routing[j, n - 1 : n]
                samples.append(seq.to_sample(streams, prefill, head, last, self._version))
        return samples

    def _reusable_prompt(self, seq: Sequence) -> int:
        """How many leading cache rows of ``seq``'s slot the prefill stream may keep: the prompt's
        (all but its last token) when a prefill forward wrote them at the current version, else 0."""
        if seq.prompt_kv_version == self._version:
            return seq.prompt_P.shape[0] - 1
        return 0

    # -- weights ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(
        self, weights: WeightUpdate | Mapping[str, Tensor], version: int | None = None
    ) -> None:
        """Load new weights between steps and move to ``version``.

        A :class:`~rlfw.types.WeightUpdate` carries its version and the trainer's contract hash, which
        must equal this engine's. A partial state dict updates only the tensors it names; a name the
        model lacks is refused. The update invalidates prompt snapshots (sequences not yet started
        prefill at the new version) and, under ``kv_policy=recompute``, re-prefills running sequences.
        """
        state, version = accept_update(
            weights,
            version,
            contract_hash=self.contract_hash,
            current_version=self._version,
            known_names=self.model.state_dict().keys(),
        )
        if not self.finished() and not self.in_flight:
            raise RuntimeError(
                "weight update while sequences are unfinished; set engine.in_flight=true to allow "
                "in-flight updates, or update between requests"
            )
        self.model.load_state_dict(dict(state), strict=False)
        self.model.prepare_for_inference()
        self._version = version
        for seq in self.waiting:
            seq.group.prefix = None
        if self.kv_policy == "recompute":
            self._recompute()

    def shutdown(self) -> None:
        """Nothing outside this object to release: the cache and model go with it."""

    def _recompute(self) -> None:
        """kv_policy=recompute: re-prefill every running sequence's cached tokens at the new version."""
        seqs = [self.running[slot] for slot in sorted(self.running)]
        if not seqs:
            return
        rows = [s.cached_tokens for s in seqs]
        _, routing = refill_rows(self.model, rows, self.cache, [s.slot for s in seqs])
        self._count(rows, "recompute_tokens")
        for i, (seq, row) in enumerate(zip(seqs, rows, strict=True)):
            seq.replaced_kv(self._version, None if routing is None else routing[i, : row.shape[0]])

    def _count(self, rows: list[Tensor], field: str) -> None:
        self.counts.forward_calls += 1
        setattr(self.counts, field, getattr(self.counts, field) + sum(int(r.shape[0]) for r in rows))
