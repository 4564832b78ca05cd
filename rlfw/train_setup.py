"""Everything a training run fixes before its first step: tokenizer, task, warm start, contract, specs."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rlfw.config import RunConfig
from rlfw.contract import ExecutionContract, build_contract
from rlfw.distributed.specs import ModelSpec
from rlfw.kernels import get_ops
from rlfw.rollout.sampling import Transforms
from rlfw.tasks import Task, build_task
from rlfw.tokenizer import build_tiny_tokenizer, check_vocab, load_tokenizer
from rlfw.trainer.deepspeed_backend import OptimConfig
from rlfw.trainer.step import PPOSpec, StepSpec
from rlfw.trainer.warm_start import WarmStart, cached_warm_start

log = logging.getLogger(__name__)


@dataclass
class Setup:
    model: ModelSpec
    tokenizer: PreTrainedTokenizerBase
    task: Task
    transforms: Transforms
    contract: ExecutionContract
    stop_ids: list[int]


def tokenizer_of(run: RunConfig, vocab_size: int) -> PreTrainedTokenizerBase:
    if run.model.tokenizer == "tiny" or run.model.path is None:
        tok = build_tiny_tokenizer()
        check_vocab(tok, vocab_size)
        return tok
    return load_tokenizer(run.model.path, vocab_size)


def prepare(run: RunConfig, run_dir: Path) -> Setup:
    spec = ModelSpec(run.model.path, run.model.preset, run.model.dtype, run.kernels, run.model.seed)
    model = spec.build()  # also validates the checkpoint before any actor starts
    if run.engine.name == "vllm":
        from rlfw.rollout.vllm_engine import check_vllm_run

        check_vllm_run(run.model.path, model.args.head_dim, run.engine.vllm.model)
    tok = tokenizer_of(run, model.args.vocab_size)
    task = build_task(run.task.name, run.task.data_path, run.task.max_operand)
    if run.task.warm_start_steps > 0:
        ws = WarmStart(
            str(run.model.path or run.model.preset),
            f"{task.name}(max_operand={run.task.max_operand}, data_path={run.task.data_path})",
            run.task.warm_start_steps,
            run.task.warm_start_lr,
            32,
            run.seed,
        )
        folder = cached_warm_start(Path(run.logger.run_root) / ".cache", model, tok, task, ws)
        log.info("warm start: %d supervised steps, checkpoint %s", ws.steps, folder)
        spec = ModelSpec(str(folder), None, run.model.dtype, run.kernels, run.model.seed)
    t = Transforms.from_config(run.engine.sampler)
    keep_kv = run.engine.in_flight and run.engine.kv_policy == "keep"
    contract = build_contract(
        get_ops(run.kernels),
        run.model.dtype,
        run.engine.sampler.precision,
        asdict(t),
        keep_kv,
        run.engine.name,
        run.engine.vllm.model,
    )
    (run_dir / "contract.json").write_text(json.dumps(contract.to_dict(), indent=2))
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return Setup(spec, tok, task, t, contract, stop_ids)


def optim_config(run: RunConfig) -> OptimConfig:
    tr = run.trainer
    return OptimConfig(
        tr.lr,
        tr.weight_decay,
        tr.grad_clip,
        tr.warmup_steps,
        tr.lr_schedule,
        tr.steps,
        tr.zero_stage,
        tr.precision,
    )


def prefill_is_old_policy(run: RunConfig, contract: ExecutionContract) -> bool:
    """Whether the PPO reference (the log-prob under the weights that generated each token) is the
    engine's prefill stream rather than the trainer's own scoring forward.

    Synchronous mode: the trainer holds the generating weights, so its scoring forward is the reference;
    the prefill stream may stand in for it only when the contract claims the two bitwise equal.

    Asynchronous mode: always the prefill stream. The trainer is up to ``sync.max_staleness`` versions
    ahead, so its scoring forward would be the trainer before the batch (plain PPO), not the sampler's
    weights that ``ppo_sampler`` and ``dlc`` clip against (design §3); the prefill stream is the only
    record of those weights, and it is exact because the actors load weights only between requests, so a
    sequence's tokens and its prefill share one version. Every correction that reads the lag ratio
    (``ppo_sampler``, ``dlc``, ``icepop``'s clip) and the ``ess/lag`` that drives ``sync.policy=ess`` then
    measure the trainer against the weights that produced the data. Without the contract that ratio also
    carries the kernel numerics, which ``ratio/trainer_numerics/max_abs_log`` reports separately.
    """
    if run.sync.mode == "async":
        return True
    return contract.claims_bitwise("trainer_score", "engine_prefill")


def decode_is_old_policy(run: RunConfig) -> bool:
    """In-flight updates (``sync.mode=async engine.in_flight=true``): one sequence holds tokens of several
    versions, and its prefill stream is at the last of them. The decode stream is computed when each token
    is drawn, at that token's version: the reference for every token, and with ``kv_policy=keep`` it
    includes what the stale KV cache did to the distribution the token was drawn from."""
    return run.sync.mode == "async" and run.engine.in_flight


def step_spec(run: RunConfig, setup: Setup) -> StepSpec:
    reuse = prefill_is_old_policy(run, setup.contract)
    decode_old = decode_is_old_policy(run)
    if decode_old:
        log.info(
            "sync.mode=async with in-flight updates: the PPO reference is the decode stream, at each "
            "token's own version (kv_policy=%s)",
            run.engine.kv_policy,
        )
    elif run.sync.mode == "async":
        log.info(
            "sync.mode=async: the PPO reference is the prefill stream at each sequence's own version (the "
            "sampler's weights); the trainer's scoring forward is skipped"
        )
    elif reuse:
        log.info(
            "execution contract %s holds (trainer scoring == engine prefill, bitwise): the prefill stream "
            "is the old-policy log-prob; the trainer's extra scoring forward is skipped",
            setup.contract.hash,
        )
    else:
        log.info(
            "execution contract %s does not claim trainer~prefill bit equality: the trainer runs its own "
            "scoring forward for the old-policy log-prob",
            setup.contract.hash,
        )
    ppo = PPOSpec(run.algo.gamma, run.algo.lam, run.algo.value_coef) if run.algo.name == "ppo" else None
    return StepSpec(
        setup.transforms,
        run.correction,
        run.trainer.micro_batch_size,
        reuse,
        run.model.router_replay,
        ppo,
        decode_old,
    )
