"""Which stream is the PPO reference: the log-prob of each token under the weights that generated it.

Every correction that reads the lag ratio q / old (``ppo_sampler``, ``dlc``, ``icepop``'s clip) and the
``ess/lag`` that drives ``sync.policy=ess`` depend on this choice, so it is made once, here, from the run's
settings, and the trainer reads the answer.
"""

from __future__ import annotations

from typing import Literal

Reference = Literal["score", "prefill", "decode"]
REFERENCES: tuple[Reference, ...] = ("score", "prefill", "decode")


def ppo_reference(
    *, async_mode: bool, in_flight: bool, trainer_prefill_bitwise: bool, prefill_everywhere: bool = True
) -> Reference:
    """The stream that holds each token's log-prob under its generating weights.

    - ``decode`` with in-flight updates (async, ``engine.in_flight``): one sequence holds tokens of several
      versions and its prefill stream is at the last of them; the decode stream is computed when each token
      is drawn, at that token's version, and with ``kv_policy=keep`` it includes what the stale KV cache did
      to the distribution the token was drawn from.
    - ``decode`` too when the prefill stream covers only some sequences (``prefill_everywhere`` false:
      ``engine.prefill_fraction < 1``, which the run allows only where the contract claims trainer,
      prefill and decode bitwise equal, so the decode stream is the same reference to the bit).
    - ``prefill`` in every other async run: the trainer is up to ``sync.max_staleness`` versions ahead, so
      its own scoring forward would be the trainer before the batch (plain PPO), not the sampler's weights
      that ``ppo_sampler`` and ``dlc`` clip against (design §3). The prefill stream is the only record of
      those weights, and it is exact because the engines load weights only between requests. Without the
      execution contract that ratio also carries the kernel numerics, which
      ``ratio/trainer_numerics/max_abs_log`` reports separately.
    - synchronous runs: the trainer holds the generating weights, so its scoring forward (``score``) is the
      reference; the prefill stream stands in for it (``prefill``, saving a forward) only when the contract
      claims the two bitwise equal (``trainer_prefill_bitwise``).
    """
    if (async_mode and in_flight) or not prefill_everywhere:
        return "decode"
    if async_mode or trainer_prefill_bitwise:
        return "prefill"
    return "score"
