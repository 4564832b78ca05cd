"""Builders for loss inputs with chosen ratio factors, shared by the algos tests."""

from __future__ import annotations

import torch
from torch import Tensor

from rlfw.algos import LossInputs

F64 = torch.float64


def t(values: list[float] | list[list[float]], grad: bool = False) -> Tensor:
    """A float64 tensor, optionally a leaf that requires grad."""
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def streams(
    q: Tensor, r_trainer: list[float], r_decode: list[float], r_sampler: list[float]
) -> dict[str, Tensor]:
    """Prefill, decode and sampler log-probs such that the factor ratios are the given ones:
    prefill = q - log r_trainer, decode = prefill - log r_decode, sampler = decode - log r_sampler."""
    log = torch.log
    prefill = q.detach() - log(t(r_trainer))
    decode = prefill - log(t(r_decode))
    sampler = decode - log(t(r_sampler))
    return {"prefill_logp": prefill, "decode_logp": decode, "sampler_logp": sampler}


# One sequence of three tokens whose per-token factor ratios are (trainer, decode, sampler):
#   token 0: (1.5, 1.0, 2.0)  total 3.0   numerical (decode x sampler) 2.0
#   token 1: (1.0, 0.8, 1.0)  total 0.8   numerical 0.8
#   token 2: (0.5, 1.0, 0.4)  total 0.2   numerical 0.4
# q = [-1, -2, -0.5], A = [1, -2, 0.5]; num_tokens = 4 (the global count includes another micro-batch).
Q = [[-1.0, -2.0, -0.5]]
ADV = [[1.0, -2.0, 0.5]]
R_TRAINER = [[1.5, 1.0, 0.5]]
R_DECODE = [[1.0, 0.8, 1.0]]
R_SAMPLER = [[2.0, 1.0, 0.4]]
NUM_TOKENS = 4


def three_tokens(**overrides: object) -> LossInputs:
    """The three-token sequence above as LossInputs, with a fresh grad leaf for trainer_logp."""
    q = t(Q, grad=True)
    fields: dict[str, object] = {
        "trainer_logp": q,
        **streams(q, R_TRAINER, R_DECODE, R_SAMPLER),
        "advantages": t(ADV),
        "mask": torch.ones(1, 3, dtype=torch.bool),
        "num_tokens": NUM_TOKENS,
    }
    fields.update(overrides)
    return LossInputs(**fields)
