"""The ladder's cases when the engine is vLLM (``rlfw audit engine=vllm``).

vLLM cannot be teacher-forced, so the sequences are vLLM's own: it samples a continuation of each audit
prompt (no stop token, a fixed length), recording the sampler and decode streams, and rescores the
finished sequences for the prefill stream. The trainer's cases then run on exactly those tokens.

Localisation: with the shared model registered in vLLM (``engine.vllm.model=rlfw``) the same op
recorder the native ladder uses wraps the model *inside* vLLM (it runs in this process), records one
prefill of a sequence there, and compares it op by op with the trainer's scoring forward; vLLM's
attention layer is recorded under the shared attention op's name, so a difference there is named as
``model.layers.N.self_attn:attention#0``.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
from torch import Tensor

from rlfw.audit import localise as loc
from rlfw.config import RunConfig
from rlfw.model import Transformer, save_pretrained
from rlfw.types import GenerationRequest, Sample

_ACTIVE: dict[str, Any] = {}  # the recorder installed inside vLLM's model between start and stop


def _start_recording(worker: Any) -> None:
    context = loc.recording(worker.model_runner.get_model())
    _ACTIVE["context"], _ACTIVE["recorder"] = context, context.__enter__()


def _stop_recording(worker: Any) -> tuple[list[str], dict[str, Tensor]]:
    context, rec = _ACTIVE.pop("context"), _ACTIVE.pop("recorder")
    context.__exit__(None, None, None)
    return rec.order, {k: torch.cat([t[0] for t in ts], dim=0) for k, ts in rec.records.items()}


class VllmAudit:
    """A vLLM engine on the audited weights, started once for the whole ladder."""

    def __init__(self, run: RunConfig, model: Transformer, contract_hash: str, max_len: int) -> None:
        from rlfw.rollout.vllm.engine import VllmEngine

        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        path = run.model.path
        if path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlfw-audit-")
            save_pretrained(model, self._tmp.name)
            path = self._tmp.name
        cfg = dataclasses.replace(
            run.engine, max_model_len=max(max_len, run.engine.max_model_len), max_slots=8
        )
        self.impl = cfg.vllm.model
        import vllm

        self.version = vllm.__version__
        self.engine = VllmEngine(
            path, cfg, dtype=run.model.dtype, kernels=run.kernels, stop_ids=(), contract_hash=contract_hash
        )

    def sample(self, prompts: list[Tensor], length: int, seed: int) -> list[Sample]:
        request = GenerationRequest(list(range(len(prompts))), prompts, n=1, max_new_tokens=length, seed=seed)
        return self.engine.generate(request)

    def localise(self, model: Transformer, seq: Tensor) -> dict[str, Any]:
        """First op whose bits differ between vLLM's prefill of ``seq`` and the trainer's scoring pass."""
        if self.impl != "rlfw":
            return {"vllm_prefill~score": "needs engine.vllm.model=rlfw (the stock model has other ops)"}
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self.engine.llm
        llm.collective_rpc(_start_recording)
        try:
            llm.generate(
                [TokensPrompt(prompt_token_ids=seq.tolist())],
                SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                use_tqdm=False,
            )
        finally:
            (inside,) = llm.collective_rpc(_stop_recording)
        trainer = loc.capture(model, loc.full_pass(seq))
        return {"vllm_prefill~score": loc.first_difference(inside, trainer)}

    def close(self) -> None:
        self.engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
