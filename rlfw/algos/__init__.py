"""Pure tensor math: ratio decomposition, ESS, advantages, losses and corrections, resync rule."""

from rlfw.algos.advantages import gae, group_advantages, to_tokens
from rlfw.algos.config import CorrectionConfig
from rlfw.algos.corrections import CORRECTIONS
from rlfw.algos.inputs import LossInputs
from rlfw.algos.losses import policy_loss, ratio_report
from rlfw.algos.ratios import decompose, ess, ess_from_log, ratio_metrics
from rlfw.algos.resync import should_resync
from rlfw.algos.value_loss import value_loss

__all__ = [
    "CORRECTIONS",
    "CorrectionConfig",
    "LossInputs",
    "decompose",
    "ess",
    "ess_from_log",
    "gae",
    "group_advantages",
    "policy_loss",
    "ratio_metrics",
    "ratio_report",
    "should_resync",
    "to_tokens",
    "value_loss",
]
