"""The validation ladder (spec section 8) on one checkpoint, as one JSON-ready dict.

Rungs: every case on the same prompts and continuations (adjacent pairs compared in bits and in
|d log p|), the same sequences alone and inside batches of other sizes, positions and paddings, the
contract's claims checked against what was measured, `transformers` on the same weights, and, where
bits differ, the first op whose output differs (localisation).
"""

from __future__ import annotations

import tempfile
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
from rlfw.model import Transformer, load_model, save_pretrained
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


def run_audit(run: RunConfig) -> tuple[dict[str, Any], int]:
    """The ladder's JSON and the exit code: 1 when bits differ where the contract claims they match."""
    model = load_model(run.model.path, run.model.preset, run.model.dtype, run.kernels, run.model.seed)
    t = run.engine.sampler.transforms()
    contract = build_contract(
        model.ops,
        run.model.dtype,
        run.engine.sampler.precision,
        asdict(t),
        engine=run.engine.name,
        vllm_model=run.engine.vllm.model,
    )
    gen = torch.Generator().manual_seed(run.seed)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    vllm = None
    if run.engine.name == "vllm":
        from rlfw.audit.vllm_cases import VllmAudit

        vllm = VllmAudit(run, model, contract.hash, max(PROMPT_LENS) + max(RESPONSE_LENS))
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
    try:
        cases = trainer_cases(model, seqs, list(PROMPT_LENS), t) | engine
        pairs = compare_pairs(cases, contract)
        invariance = batch_invariance(model, seqs)
        claims_invariance = model.ops.name == "invariant"
        holds = all(p["within_contract"] for p in pairs.values()) and (
            invariance["bits_match"] or not claims_invariance
        )
        report: dict[str, Any] = {
            "model": run.model.path or run.model.preset,
            "architecture": model.args.model_type,
            "dtype": run.model.dtype,
            "kernels": run.kernels,
            "engine": run.engine.name,
            "sampler_precision": run.engine.sampler.precision,
            "tokens_compared": int(sum(c.numel() for c in cases["trainer_score"])),
            "pairs": pairs,
            "batch_invariance": invariance | {"claimed": claims_invariance},
            "contract": {
                "hash": contract.hash,
                "holds": holds,
                "claims_bitwise": [k for k, v in contract.pairs.items() if v["bitwise"]],
            },
            "transformers": transformers_diff(model, run.model.path, seqs),
        }
        if vllm is not None:
            report["vllm"] = {"model": vllm.impl, "version": vllm.version}
        if not all(p["bits_match"] for p in pairs.values()) or not invariance["bits_match"]:
            report["localise"] = localisation(model, seqs[-1])
            if vllm is not None:
                report["localise"] |= vllm.localise(model, seqs[-1])
    finally:
        if vllm is not None:
            vllm.close()
    return report, 0 if holds else 1
