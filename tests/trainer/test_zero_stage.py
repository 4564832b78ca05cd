"""Which ZeRO stage a run trains at: unset, stage 0 on one rank and 1 on more; a resumed run keeps the
stage its checkpoint was written at, read from the checkpoint's own files; a stage that cannot load that
checkpoint is refused with the fix.

If one of these breaks, a run resumed after the default changed (or with the stage set differently) dies
inside DeepSpeed's loader with an AttributeError or a missing-file error, or trains a rank count at a
stage that only copies gradients around.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfw.compose import load_config
from rlfw.train.setup import zero_stage
from rlfw.trainer.deepspeed_backend import saved_zero_stage
from rlfw.validation import ConfigError
from tests.trainer.one_rank import run_one_rank

# One rank of DeepSpeed in a fresh process: a step and a checkpoint at each stage and precision, then what
# saved_zero_stage reads from each checkpoint folder.
SCRIPT = """
ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
read = {}
cases = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
for stage, precision in cases:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_preset("tiny_dense", seed=0, dtype=dtype).train()
    backend = DeepSpeedBackend(model, OptimConfig(1e-3, 0.0, 1.0, 0, "constant", 10, stage, precision))
    backend.backward(backend.module(ids).float().logsumexp(-1).mean())
    backend.step()
    folder = tempfile.mkdtemp()
    backend.save(folder, "step000000")
    read[f"{stage}-{precision}"] = saved_zero_stage(Path(folder) / "step000000")
print(json.dumps(read))
"""


def test_the_stage_a_checkpoint_was_written_at_is_read_from_its_files() -> None:
    read = run_one_rank(SCRIPT)
    # stage 2 writes stage 1's layout (each loads the other's checkpoints), so it reads as 1
    assert read == {"0-fp32": 0, "0-bf16": 0, "1-fp32": 1, "1-bf16": 1, "2-fp32": 1, "3-fp32": 3, "3-bf16": 3}


@pytest.mark.parametrize(
    ("overrides", "saved", "stage"),
    [
        ([], None, 0),  # one rank: nothing to partition
        (["trainer.num_ranks=2"], None, 1),
        ([], 1, 1),  # resumed: the checkpoint's stage, whatever the default is now
        (["trainer.num_ranks=2"], 0, 0),
        (["trainer.zero_stage=3"], None, 3),
        (["trainer.zero_stage=2"], 1, 2),  # stages 1 and 2 load each other's checkpoints
    ],
)
def test_an_unset_stage_follows_the_rank_count_or_the_checkpoint(
    overrides: list[str], saved: int | None, stage: int
) -> None:
    assert zero_stage(load_config(overrides), saved) == stage


@pytest.mark.parametrize(("configured", "saved"), [(0, 1), (1, 0), (3, 1), (2, 3)])
def test_a_stage_that_cannot_load_the_checkpoint_is_refused_with_the_fix(configured: int, saved: int) -> None:
    with pytest.raises(ConfigError, match=rf"written at ZeRO stage {saved}.*trainer\.zero_stage={saved}"):
        zero_stage(load_config([f"trainer.zero_stage={configured}"]), saved)


def test_a_missing_checkpoint_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no trainer checkpoint 'step000003' under "):
        saved_zero_stage(tmp_path / "step000003")
