"""The optimizer side of the trainer on DeepSpeed (ZeRO 0-3; on CPU over gloo).

Gradient accumulation is ours, not DeepSpeed's: the trainer's loss is already normalised by the step's
global token count, so DeepSpeed runs with ``managed_gradient_accumulation: false`` (every ``step()`` is
the boundary) and ``backward(..., scale_wrt_gas=False)``. DeepSpeed *averages* gradients over data-
parallel ranks; a globally normalised loss needs their *sum*, so the loss is multiplied by the world size
before backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlfw.model import Transformer
from rlfw.model.transformer import VALUE_HEAD


@dataclass
class OptimConfig:
    """The few optimizer settings the backend needs (mirrors ``trainer.*`` in the config)."""

    lr: float
    weight_decay: float
    grad_clip: float
    warmup_steps: int
    lr_schedule: str  # constant | cosine
    total_steps: int
    zero_stage: int
    precision: str  # fp32 | bf16


# ZeRO stages whose checkpoints load into one another. Stage 0 keeps the optimizer state whole in the
# model file; stages 1 and 2 partition it the same way (per rank, beside the model file); stage 3 also
# partitions the parameters. DeepSpeed cannot load a checkpoint across these groups.
CHECKPOINT_LAYOUTS: tuple[tuple[int, ...], ...] = ((0,), (1, 2), (3,))


def default_zero_stage(num_ranks: int) -> int:
    """Stage 0 on one rank: there is nothing to partition, and stage 1 would still keep flat copies of the
    parameters and gradients for its one partition (a 13M GRPO step's peak RSS 1,228 -> 1,148 MiB at
    stage 0; its time the same within noise, 0.98-1.03x). Stage 1 on more."""
    return 0 if num_ranks == 1 else 1


def saved_zero_stage(folder: Path) -> int:
    """The ZeRO stage a DeepSpeed checkpoint (one tag folder) was written at, as far as its layout tells:
    0, 1 (which stage 2 loads too) or 3, read from the file names DeepSpeed gives each layout."""
    if not folder.is_dir():
        raise FileNotFoundError(f"no trainer checkpoint {folder.name!r} under {folder.parent}")
    names = [p.name for p in folder.iterdir()]
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return 3  # the parameters are partitioned: one model file per rank
    if any(n.endswith("_optim_states.pt") for n in names):
        return 1
    return 0


def same_checkpoint_layout(a: int, b: int) -> bool:
    return any(a in group and b in group for group in CHECKPOINT_LAYOUTS)


def lr_lambda(cfg: OptimConfig) -> Any:
    """Linear warm-up, then constant or cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def ds_config(cfg: OptimConfig) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class DeepSpeedBackend:
    """``module`` (the DeepSpeed engine), ``backward(loss)``, ``step() -> grad norm``."""

    def __init__(self, model: Transformer, cfg: OptimConfig) -> None:
        import deepspeed
        import torch.distributed as dist

        if model.lm_head is None and cfg.zero_stage == 3:
            # Tied head: the embedding matrix is used outside the embedding module's own forward.
            deepspeed.zero.register_external_parameter(model, model.model.embed_tokens.weight)
        # fused: one pass over each parameter for the whole update (on CPU about 10x faster than the
        # per-tensor loop at 13M parameters, which was 2% of a train step)
        fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(cfg)
        )
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.world == 1 and cfg.zero_stage == 0:
            # One rank at stage 0: the all-reduce at step() would flatten every gradient into a buffer,
            # reduce it over the one rank, divide it by 1 and copy it back (about 1% of a 13M step on
            # CPU); step() does the one other thing it did, zeros for a parameter without a gradient.
            # From stage 1 up the optimizer's own partitions need that pass.
            self.engine.enable_backward_allreduce = False
        self.model = model
        self.zero_stage = cfg.zero_stage
        self.last_step_skipped = False  # the last step's gradients were not finite: no update was made

    @property
    def module(self) -> nn.Module:
        return self.engine

    def backward(self, loss: Tensor) -> None:
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip, update, schedule; the global grad norm before clipping.

        A step whose gradients are not finite is skipped (no update, no schedule step, the gradients
        dropped) and :attr:`last_step_skipped` says so. From ZeRO stage 1 up DeepSpeed detects that itself
        (its overflow check, also for fp32 and bf16) and every rank agrees, since the norm is global. At
        stage 0 the gradients are already all-reduced in backward, so each rank's own check agrees too.

        DeepSpeed reports the norm from ZeRO stage 1 up; at stage 0 it does not, so the norm is taken from
        the gradients before the step, which is the global norm only on a single rank (NaN otherwise).
        """
        local = self._local_norm() if self.zero_stage == 0 else None
        if local is not None and not math.isfinite(local):
            self.engine.zero_grad()
            self.last_step_skipped = True
            return local
        if not self.engine.enable_backward_allreduce:
            self._zero_missing_grads()
        self.engine.step()
        self.last_step_skipped = bool(getattr(self.engine.optimizer, "overflow", False))
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return local if (local is not None and self.world == 1) else float("nan")
        return float(norm)

    def _zero_missing_grads(self) -> None:
        """Zeros for every trainable parameter that got no gradient this step (an MoE expert no token
        reached), as DeepSpeed's all-reduce pass gives them: AdamW then still steps it (momentum, weight
        decay), where it would skip a parameter whose gradient is ``None``."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _local_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if grads
            else 0.0
        )

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every policy parameter, gathered (ZeRO-3 partitions them), on CPU, under the HF names.

        The critic's value head stays with the trainer: engines have no use for it.
        """
        import deepspeed

        params = {k: v for k, v in self.model.named_parameters() if k != VALUE_HEAD}
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            return {k: v.detach().clone().cpu() for k, v in params.items()}

    def save(self, folder: str, tag: str) -> None:
        self.engine.save_checkpoint(folder, tag=tag)

    def load(self, folder: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(folder, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no trainer checkpoint {tag!r} under {folder}")
