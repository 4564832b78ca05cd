"""Everything a training run fixes before its first step: tokenizer, task, warm start, contract, specs."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfw.algos import CORRECTIONS, Reference, ppo_reference
from rlfw.config import RunConfig
from rlfw.contract import ContractMismatch, ExecutionContract, build_contract
from rlfw.distributed.specs import ModelSpec
from rlfw.fingerprint import fingerprint_diff, model_fingerprint
from rlfw.kernels import get_ops
from rlfw.model.config import ModelArgs
from rlfw.model.distribution import Transforms
from rlfw.tasks import Task, build_task
from rlfw.tasks.dataset import DatasetTask
from rlfw.tokenizer import build_tiny_tokenizer, check_vocab, load_tokenizer
from rlfw.train.warm_start import WarmStart, cached_warm_start
from rlfw.trainer.deepspeed_backend import OptimConfig, default_zero_stage, same_checkpoint_layout
from rlfw.trainer.step import PPOSpec, StepSpec
from rlfw.validation import ConfigError

CONTRACT_FILE = "contract.json"  # the run's execution contract, in its folder

log = logging.getLogger(__name__)


@dataclass
class Setup:
    model: ModelSpec
    tokenizer: PreTrainedTokenizerBase
    task: Task
    transforms: Transforms
    contract: ExecutionContract
    stop_ids: list[int]
    model_args: ModelArgs


def tokenizer_of(run: RunConfig, vocab_size: int) -> PreTrainedTokenizerBase:
    if run.model.tokenizer == "tiny" or run.model.path is None:
        tok = build_tiny_tokenizer()
        check_vocab(tok, vocab_size)
        return tok
    return load_tokenizer(run.model.path, vocab_size)


def build_setup(run: RunConfig, run_dir: Path) -> Setup:
    """Build and check everything the run fixes before its first step; writes ``contract.json``."""
    spec = ModelSpec(run.model.path, run.model.preset, run.model.dtype, run.kernels, run.model.seed)
    model = spec.build()  # also validates the checkpoint before any actor starts
    if run.engine.name == "vllm":
        from rlfw.rollout.vllm.checks import check_vllm_run

        check_vllm_run(run.model.path, model.args.head_dim, run.engine.vllm.model)
    tok = tokenizer_of(run, model.args.vocab_size)
    t = run.task
    task = build_task(
        t.name,
        t.data_path,
        t.max_operand,
        prompt_key=t.prompt_key,
        answer_key=t.answer_key,
        reward=t.reward,
        rewards=list(t.rewards),
        chat_template=t.chat_template,
        system_prompt=t.system_prompt,
        tokenizer=tok,
        reward_workers=t.reward_workers,
        reward_timeout_s=t.reward_timeout_s,
        eval_path=t.eval_path,
        eval_fraction=t.eval_fraction,
    )
    if isinstance(task, DatasetTask):  # a prompt needs room for at least one response token
        total = len(task.problems) + len(task.held_out)
        dropped = task.drop_long_prompts(
            lambda text: len(tok(text, add_special_tokens=False).input_ids), run.engine.max_model_len - 1
        )
        if dropped:
            log.warning(
                "task=dataset: %d of %d prompts are longer than engine.max_model_len - 1 = %d tokens and "
                "were dropped (not truncated); raise engine.max_model_len to keep them",
                dropped,
                total,
                run.engine.max_model_len - 1,
            )
    if run.eval.every > 0:
        task.eval_problems(run.eval.prompts)  # refuses a task=dataset without a held-out split, up front
    if run.task.warm_start_steps > 0:
        t = run.task
        ws = WarmStart(
            str(run.model.path or run.model.preset),
            f"{task.name}(max_operand={t.max_operand}, data_path={t.data_path}, eval_path={t.eval_path}, "
            f"eval_fraction={t.eval_fraction})",
            run.task.warm_start_steps,
            run.task.warm_start_lr,
            32,
            run.seed,
        )
        folder = cached_warm_start(Path(run.logger.run_root) / ".cache", model, tok, task, ws)
        log.info("warm start: %d supervised steps, checkpoint %s", ws.steps, folder)
        spec = ModelSpec(str(folder), None, run.model.dtype, run.kernels, run.model.seed)
    contract = make_contract(run, model.args)  # this machine's fingerprint until the pools report theirs
    (run_dir / CONTRACT_FILE).write_text(json.dumps(contract.to_dict(), indent=2))
    check_prefill_fraction(run.engine.prefill_fraction, contract, model.args.is_moe)
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None and not run.engine.ignore_eos else []
    return Setup(spec, tok, task, run.engine.sampler.transforms(), contract, stop_ids, model.args)


def make_contract(
    run: RunConfig,
    args: ModelArgs,
    environment: dict[str, Any] | None = None,
    accepted_mismatch: list[str] | None = None,
) -> ExecutionContract:
    """The run's execution contract (``environment`` None: this process's fingerprint)."""
    keep_kv = run.engine.in_flight and run.engine.kv_policy == "keep"
    return build_contract(
        get_ops(run.kernels),
        run.model.dtype,
        run.engine.sampler.precision,
        asdict(run.engine.sampler.transforms()),
        keep_kv,
        run.engine.name,
        run.engine.vllm.model,
        environment=environment,
        model=model_fingerprint(args),
        accepted_mismatch=accepted_mismatch,
    )


REFERENCE_SLOT = "trainer rank 0"
"""Whose fingerprint the contract records: every other rank and engine is compared with it."""


def settle_environment(
    run: RunConfig, setup: Setup, run_dir: Path, fingerprints: dict[str, dict[str, Any]]
) -> Setup:
    """Compare every trainer rank's and engine's fingerprint with trainer rank 0's, before any weight
    sync, and fix the contract on rank 0's. A difference is refused, naming each entry and where it
    differs, unless ``environment_mismatch=bound``: the run then claims no pair bitwise (each declares the
    default kernels' bound) and records the accepted entries in the contract."""
    reference = fingerprints[REFERENCE_SLOT]
    diffs = {who: d for who, fp in fingerprints.items() if (d := fingerprint_diff(reference, fp))}
    listed = "; ".join(f"{who}: {', '.join(d)}" for who, d in diffs.items())
    if diffs and run.environment_mismatch == "refuse":
        raise ContractMismatch(
            f"environment fingerprints differ from {REFERENCE_SLOT}'s ({listed}), so the bitwise claims "
            "of the execution contract cannot hold; run every rank and engine on the same software stack "
            "and device type, or set environment_mismatch=bound to accept bounded log-prob pairs"
        )
    accepted = sorted({line.split(":")[0] for d in diffs.values() for line in d})
    if accepted:
        log.warning("environment_mismatch=bound: pairs are bounded, not bitwise (%s)", listed)
    contract = make_contract(run, setup.model_args, reference, accepted)
    (run_dir / CONTRACT_FILE).write_text(json.dumps(contract.to_dict(), indent=2))
    check_prefill_fraction(run.engine.prefill_fraction, contract, setup.model_args.is_moe)
    return replace(setup, contract=contract)


def check_prefill_fraction(fraction: float, contract: ExecutionContract, is_moe: bool) -> None:
    """Skipping the prefill stream for some sequences is safe only where it would have measured nothing:
    the contract claims trainer scoring, engine prefill and engine decode bitwise equal, so the decode
    stream stands in for both to the bit. MoE needs every prefill (it records the last token's experts)."""
    if fraction >= 1.0:
        return
    holds = contract.claims_bitwise("trainer_score", "engine_prefill") and contract.claims_bitwise(
        "engine_prefill", "engine_decode"
    )
    if not holds:
        raise ConfigError(
            f"engine.prefill_fraction={fraction} skips the prefill stream, which this run's execution "
            f"contract ({contract.hash}) does not claim equal to the decode stream and the trainer; use "
            "engine.prefill_fraction=1, or kernels=invariant with the built-in engine and an fp32 model"
        )
    if is_moe:
        raise ConfigError(
            f"engine.prefill_fraction={fraction}: MoE models record the last token's experts in the prefill "
            "stream; use engine.prefill_fraction=1"
        )


def check_correction_streams(run: RunConfig, reference: Reference) -> None:
    """Refuse a correction whose inputs this run would not record (rather than degrade silently)."""
    name, k = run.correction.name, run.engine.sampler.topk_logprobs
    rule = CORRECTIONS[name]
    if rule.needs_topk and k == 0:
        raise ConfigError(
            f"correction={name} centres the score over the sampler's top-k, but "
            "engine.sampler.topk_logprobs=0 records none (it would become plain policy gradient); set "
            "engine.sampler.topk_logprobs > 0"
        )
    if rule.needs_reference_head and reference != "score" and run.engine.name == "vllm":
        raise ConfigError(
            f"correction={name} needs the {reference} stream at the sampler's top-k ids, which engine=vllm "
            "does not record; use engine=native, or sync=sync (the trainer's scoring pass is the reference)"
        )


def optim_config(run: RunConfig, saved_stage: int | None = None) -> OptimConfig:
    """The optimizer settings of ``run``; ``saved_stage``: the ZeRO stage of the checkpoint a resumed run
    loads (:func:`zero_stage`)."""
    tr = run.trainer
    return OptimConfig(
        tr.lr,
        tr.weight_decay,
        tr.grad_clip,
        tr.warmup_steps,
        tr.lr_schedule,
        tr.steps,
        zero_stage(run, saved_stage),
        tr.precision,
    )


def zero_stage(run: RunConfig, saved: int | None) -> int:
    """``trainer.zero_stage``, or when unset the checkpoint's stage (``saved``) or else the default for the
    rank count. A set stage that cannot load the checkpoint's optimizer state is refused with the fix."""
    configured = run.trainer.zero_stage
    if configured is None:
        return saved if saved is not None else default_zero_stage(run.trainer.num_ranks)
    if saved is not None and not same_checkpoint_layout(configured, saved):
        raise ConfigError(
            f"trainer.zero_stage={configured}: the checkpoint this run resumes from was written at ZeRO "
            f"stage {saved}, whose optimizer state DeepSpeed cannot load at stage {configured}; resume with "
            f"trainer.zero_stage={saved} (or leave trainer.zero_stage unset)"
        )
    return configured


def step_spec(run: RunConfig, setup: Setup) -> StepSpec:
    """What every trainer rank needs for a step, with the PPO reference decided once (``ppo_reference``)."""
    reference = ppo_reference(
        async_mode=run.sync.mode == "async",
        in_flight=run.engine.in_flight,
        trainer_prefill_bitwise=setup.contract.claims_bitwise("trainer_score", "engine_prefill"),
        prefill_everywhere=run.engine.prefill_fraction >= 1.0,
    )
    check_correction_streams(run, reference)
    log.info("PPO reference is the %s", REFERENCE_WHY[reference])
    ppo = PPOSpec(run.algo.gamma, run.algo.lam, run.algo.value_coef) if run.algo.name == "ppo" else None
    return StepSpec(
        setup.transforms,
        run.correction,
        run.trainer.micro_batch_size,
        reference,
        run.model.router_replay,
        ppo,
        run.algo.kl_coef,
        run.algo.kl_estimator,
        run.algo.entropy_coef,
        run.trainer.logits_chunk_mib,
    )


REFERENCE_WHY: dict[Reference, str] = {
    "decode": "decode stream, at each token's own version (in-flight updates, or a prefill stream on only "
    "some sequences)",
    "prefill": "prefill stream at each sequence's own version; the trainer's scoring forward is skipped "
    "(async, or the execution contract claims trainer scoring == engine prefill bitwise)",
    "score": "trainer's own scoring forward (the execution contract does not claim trainer~prefill bit "
    "equality)",
}
