"""Non-finite gradients: the DeepSpeed step is skipped (the weights stay as they were, at every ZeRO
stage and precision), the step says so, and a run that keeps diverging stops with a line that says why.

If one of these breaks, a diverging run (``trainer.lr=1e38``) writes NaN into the weights, logs
``grad_norm`` null from then on and exits 0 as if it had trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfw.train.phases import StalledRun, check_finite
from tests.train._run import bare_driver
from tests.trainer.one_rank import run_one_rank

# One rank of DeepSpeed in a fresh process (its process group is process-wide): a finite step, a step
# with a NaN gradient, a finite step again; prints whether each was skipped and whether weights moved.
SCRIPT = """
stage, precision = int(sys.argv[1]), sys.argv[2]
dtype = torch.bfloat16 if precision == "bf16" else torch.float32
model = build_preset("tiny_dense", seed=0, dtype=dtype).train()
backend = DeepSpeedBackend(model, OptimConfig(1e-3, 0.0, 1.0, 0, "constant", 10, stage, precision))
ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
out = []
for poison in (False, True, False):
    before = backend.full_state_dict()  # gathered: ZeRO-3 partitions the parameters
    loss = backend.module(ids).float().logsumexp(-1).mean()
    if poison:
        loss = loss * float("nan")
    backend.backward(loss)
    norm = backend.step()
    now = backend.full_state_dict()
    moved = any(not torch.equal(before[k], now[k]) for k in now)
    finite = all(bool(torch.isfinite(v).all()) for v in now.values())
    out.append({"skipped": backend.last_step_skipped, "moved": moved, "finite": finite, "norm": norm})
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "fp32")]
)
def test_a_nonfinite_step_is_skipped_and_the_next_one_trains(stage: int, precision: str) -> None:
    first, poisoned, after = run_one_rank(SCRIPT, str(stage), precision)
    assert not first["skipped"] and first["moved"]
    assert poisoned["skipped"] and not poisoned["moved"] and poisoned["finite"]
    assert not after["skipped"] and after["moved"] and after["finite"]


def test_k_nonfinite_steps_in_a_row_stop_the_run_with_the_fix(tmp_path: Path) -> None:
    d = bare_driver(tmp_path, "trainer.max_skipped_steps=2")
    bad = {"train/skipped_nonfinite": 1.0, "grad_norm": float("nan"), "loss/policy": float("nan")}
    check_finite(d, 0, bad)
    check_finite(d, 1, {"train/skipped_nonfinite": 0.0, "grad_norm": 0.5})  # a good step resets the count
    assert d.nonfinite_in_a_row == 0
    check_finite(d, 2, bad)
    with pytest.raises(StalledRun, match=r"2 steps in a row had non-finite gradients .*lower trainer\.lr"):
        check_finite(d, 3, bad)
    d.logger.close()
