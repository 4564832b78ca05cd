"""The PPO reference: which stream holds each token's log-prob under the weights that generated it.

If one of these breaks, a lag-ratio correction (ppo_sampler, dlc, icepop's clip) and the ESS resync rule
measure the trainer against the wrong policy: the trainer before the batch instead of the sampler's
weights, or a sequence's final version instead of each token's own.
"""

from __future__ import annotations

import pytest

from rlfw.algos import REFERENCES, ppo_reference


@pytest.mark.parametrize(
    ("async_mode", "in_flight", "bitwise", "expected"),
    [
        # sync: the trainer holds the generating weights; the prefill stream stands in only when bitwise equal
        (False, False, False, "score"),
        (False, False, True, "prefill"),
        # in-flight has no effect in sync mode (weights move only between steps)
        (False, True, False, "score"),
        (False, True, True, "prefill"),
        # async: the trainer is ahead, so its own forward is never the reference, contract or not
        (True, False, False, "prefill"),
        (True, False, True, "prefill"),
        # in-flight: tokens of one sequence carry different versions; only the decode stream has each one's
        (True, True, False, "decode"),
        (True, True, True, "decode"),
    ],
)
def test_the_reference_follows_who_holds_the_generating_weights(
    async_mode: bool, in_flight: bool, bitwise: bool, expected: str
) -> None:
    got = ppo_reference(async_mode=async_mode, in_flight=in_flight, trainer_prefill_bitwise=bitwise)
    assert got == expected and got in REFERENCES


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_prefill_stream_on_some_sequences_only_makes_decode_the_reference(async_mode: bool) -> None:
    """``engine.prefill_fraction < 1`` (allowed only under the contract): the prefill stream is missing on
    some sequences; the decode stream, bitwise equal there, is the reference everywhere."""
    got = ppo_reference(
        async_mode=async_mode, in_flight=False, trainer_prefill_bitwise=True, prefill_everywhere=False
    )
    assert got == "decode"
