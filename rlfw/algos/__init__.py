"""Pure tensor math and the algorithmic decisions: ratio decomposition, ESS, advantages, losses and
corrections, which stream is the PPO reference, the resync rule."""

from rlfw.algos.advantages import gae, group_advantages, to_tokens
from rlfw.algos.config import CorrectionConfig
from rlfw.algos.corrections import CORRECTIONS, CorrectionRule
from rlfw.algos.inputs import LossInputs
from rlfw.algos.losses import policy_loss, ratio_report
from rlfw.algos.ratios import decompose, ess, ess_from_log, ratio_metrics
from rlfw.algos.reference import REFERENCES, Reference, ppo_reference
from rlfw.algos.resync import should_resync
from rlfw.algos.value_loss import value_loss

__all__ = [
    "CORRECTIONS",
    "CorrectionConfig",
    "CorrectionRule",
    "LossInputs",
    "REFERENCES",
    "Reference",
    "decompose",
    "ess",
    "ess_from_log",
    "gae",
    "group_advantages",
    "policy_loss",
    "ppo_reference",
    "ratio_metrics",
    "ratio_report",
    "should_resync",
    "to_tokens",
    "value_loss",
]
