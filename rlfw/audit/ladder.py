"""The validation ladder (spec section 8) on one checkpoint, as one JSON-ready dict.

Rungs: every case on the same prompts and continuations (adjacent pairs compared in bits and in
|d log p|), the same sequences alone and inside batches of other sizes, positions and paddings, the
contract's claims checked against what was measured, `transformers` on the same weights, and, where
bits differ, the first op whose output differs (localisation).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from rlfw.audit import localise as loc
from rlfw.audit.stream_checks import (
    engine_cases,
    pad_right,
    sample_continuations,
    sample_streams,
    trainer_cases,
)
from rlfw.config import RunConfig
from rlfw.contract import PAIRS, ExecutionContract, build_contract, pair_name
from rlfw.fingerprint import model_fingerprint
from rlfw.model import Transformer, load_model, save_pretrained
from rlfw.model.distribution import Transforms
from rlfw.rollout.native import NativeEngine

PROMPT_LENS = (5, 9, 3, 12)
RESPONSE_LENS = (7, 11, 4, 30)  # the longest crosses a 32-slot KV tile


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def compare_pairs(cases: dict[str, list[Tensor]], contract: ExecutionContract) -> dict[str, dict[str, Any]]:
    out = {}
    for a, b in PAIRS:
        x, y = torch.cat(cases[a]), torch.cat(cases[b])
        declared = contract.pairs[pair_name(a, b)]
        bound = declared["max_abs_dlogp"]
        dmax = float((x - y).abs().max().item())
        bits = same_bits(x, y)
        within = bits if declared["bitwise"] else (bound is None or dmax <= bound)
        out[pair_name(a, b)] = {
            "max_abs_dlogp": dmax,
            "bits_match": bits,
            "declared": "bitwise" if declared["bitwise"] else f"|dlogp| <= {bound}",
            "within_contract": within,
        }
    return out


def batch_invariance(model: Transformer, seqs: list[Tensor]) -> dict[str, Any]:
    """Each sequence alone vs inside batches of 2, 4 and 7 at first, middle and last row, both paddings."""
    gen = torch.Generator().manual_seed(1)
    worst, all_bits, checked = 0.0, True, 0
    with torch.no_grad():
        for target in seqs:
            alone = model(target[None])[0]
            for size in (2, 4, 7):
                for row in sorted({0, size // 2, size - 1}):
                    others = [
                        torch.randint(0, model.args.vocab_size, (int(n),), generator=gen)
                        for n in torch.randint(1, 40, (size,), generator=gen)
                    ]
                    others[row] = target
                    for left in (False, True):
                        got = _row_in_batch(model, others, row, left)
                        worst = max(worst, float((got - alone).abs().max().item()))
                        all_bits &= same_bits(got, alone)
                        checked += 1
    return {"bits_match": all_bits, "max_abs_dlogit": worst, "placements_checked": checked}


def _row_in_batch(model: Transformer, seqs: list[Tensor], row: int, left: bool) -> Tensor:
    ids, mask = pad_right(seqs)
    if left:
        ids, mask = _to_left_padding(ids, mask)
    logits = model(ids, mask)[row]
    n = seqs[row].shape[0]
    return logits[-n:] if left else logits[:n]


def _to_left_padding(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    shift = mask.shape[1] - mask.sum(1)
    idx = (torch.arange(mask.shape[1])[None] - shift[:, None]) % mask.shape[1]
    return ids.gather(1, idx), mask.gather(1, idx)


def transformers_diff(model: Transformer, path: str | None, seqs: list[Tensor]) -> dict[str, Any]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "transformers is not importable"}
    ids, mask = pad_right(seqs)
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            save_pretrained(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(path or tmp, dtype=model.output_weight.dtype).eval()
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask).logits.float()
            ours = model(ids, mask).float()
    valid = mask.bool()
    return {"max_abs_dlogit": float((ref - ours).abs()[valid].max().item())}


def localisation(model: Transformer, seq: Tensor) -> dict[str, Any]:
    return {f"score~{mode}": loc.localise(model, seq, "score", mode) for mode in ("decode", "batched")}


def _stage(report: dict[str, Any], name: str, fn: Callable[[], Any], keep: bool = True) -> Any:
    """Run one rung and return its result (stored under ``name`` when ``keep``); a failure is stored as
    ``{"error": ...}`` and returns None, so the other rungs still run and report."""
    try:
        result = fn()
    except Exception as err:  # a rung's own failure is a finding of the audit, not the end of it
        report[name] = {"error": f"{type(err).__name__}: {err}"}
        return None
    if keep:
        report[name] = result
    return result


def run_audit(run: RunConfig) -> tuple[dict[str, Any], int]:
    """The ladder's JSON and the exit code: 1 when bits differ where the contract claims they match, or
    when a rung that checks a claim failed (its ``error`` says why); the other rungs are kept either way.
    The comparison with `transformers` is a tolerance check, not a claim: its failure does not decide
    the exit code."""
    model = load_model(run.model.path, run.model.preset, run.model.dtype, run.kernels, run.model.seed)
    t = run.engine.sampler.transforms()
    contract = build_contract(
        model.ops,
        run.model.dtype,
        run.engine.sampler.precision,
        asdict(t),
        engine=run.engine.name,
        vllm_model=run.engine.vllm.model,
        model=model_fingerprint(model.args),
    )
    report: dict[str, Any] = {
        "model": run.model.path or run.model.preset,
        "architecture": model.args.model_type,
        "dtype": run.model.dtype,
        "kernels": run.kernels,
        "engine": run.engine.name,
        "sampler_precision": run.engine.sampler.precision,
        "contract": {
            "hash": contract.hash,
            "claims_bitwise": [k for k, v in contract.pairs.items() if v["bitwise"]],
            "environment": contract.environment,
            "model": contract.model,
        },
    }
    gen = torch.Generator().manual_seed(run.seed)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    vllm = None
    try:
        if run.engine.name == "vllm":
            from rlfw.audit.vllm_cases import VllmAudit

            vllm = VllmAudit(run, model, contract.hash, max(PROMPT_LENS) + max(RESPONSE_LENS))
            report["vllm"] = {"model": vllm.impl, "version": vllm.version}
        cases = _stage(report, "cases", lambda: _cases(run, model, contract, prompts, t, vllm), keep=False)
        seqs = None if cases is None else cases.pop("sequences")
        if cases is not None:
            report["tokens_compared"] = cases.pop("tokens_compared")
        pairs = None if cases is None else _stage(report, "pairs", lambda: compare_pairs(cases, contract))
        invariance = None
        if seqs is not None:
            invariance = _stage(report, "batch_invariance", lambda: batch_invariance(model, seqs))
            _stage(report, "transformers", lambda: transformers_diff(model, run.model.path, seqs))
        claims_invariance = model.ops.name == "invariant"
        if invariance is not None:
            invariance["claimed"] = claims_invariance
        holds = (
            pairs is not None
            and all(p["within_contract"] for p in pairs.values())
            and (not claims_invariance or (invariance is not None and invariance["bits_match"]))
        )
        report["contract"]["holds"] = holds
        differs = pairs is None or not all(p["bits_match"] for p in pairs.values())
        if seqs is not None and (differs or invariance is None or not invariance["bits_match"]):
            _stage(report, "localise", lambda: _localise(model, seqs[-1], vllm))
    finally:
        if vllm is not None:
            vllm.close()
    return report, 0 if holds else 1


def _cases(
    run: RunConfig,
    model: Transformer,
    contract: ExecutionContract,
    prompts: list[Tensor],
    t: Transforms,
    vllm: Any,
) -> dict[str, Any]:
    """Every case's log-probs on the same sequences (``sequences`` and ``tokens_compared`` ride along)."""
    if vllm is not None:
        samples = vllm.sample(prompts, max(RESPONSE_LENS), run.seed)  # vLLM's own continuations
        seqs = [s.tokens for s in samples]
        engine = sample_streams(samples)
    else:
        seqs = sample_continuations(model, prompts, list(RESPONSE_LENS), t, run.seed)
        native = NativeEngine(
            model,
            t,
            run.engine.sampler.precision,
            max_slots=3,
            max_model_len=max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)),
            topk_logprobs=run.engine.sampler.topk_logprobs,
            contract_hash=contract.hash,
        )
        engine = engine_cases(native, seqs, list(PROMPT_LENS))
    cases: dict[str, Any] = trainer_cases(model, seqs, list(PROMPT_LENS), t) | engine
    tokens = int(sum(c.numel() for c in cases["trainer_score"]))
    return cases | {"sequences": seqs, "tokens_compared": tokens}


def _localise(model: Transformer, seq: Tensor, vllm: Any) -> dict[str, Any]:
    found = localisation(model, seq)
    if vllm is not None:
        found |= vllm.localise(model, seq)
    return found
