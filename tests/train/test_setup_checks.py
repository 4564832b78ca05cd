"""Config-time refusals of corrections whose inputs the run would not record."""

from __future__ import annotations

import pytest

from rlfw.compose import load_config
from rlfw.train.setup import check_correction_streams
from rlfw.validation import ConfigError


@pytest.mark.parametrize("correction", ["centering", "dlc"])
def test_centring_without_a_top_k_is_refused(correction: str) -> None:
    # Without the sampler's top-k the centring term is empty: the loss would be plain policy gradient.
    run = load_config([f"correction={correction}", "engine.sampler.topk_logprobs=0"])
    with pytest.raises(ConfigError, match=r"engine\.sampler\.topk_logprobs=0"):
        check_correction_streams(run, "score")
    check_correction_streams(load_config([f"correction={correction}"]), "score")  # the default k is fine
    check_correction_streams(load_config(["correction=tis", "engine.sampler.topk_logprobs=0"]), "score")


def test_dlc_needs_the_reference_head_vllm_does_not_record() -> None:
    run = load_config(["correction=dlc", "engine=vllm"])
    with pytest.raises(ConfigError, match="engine=vllm does not record"):
        check_correction_streams(run, "prefill")
    check_correction_streams(run, "score")  # synchronous: the trainer's scoring pass has the head
    check_correction_streams(load_config(["correction=dlc"]), "prefill")  # the built-in engine records it
