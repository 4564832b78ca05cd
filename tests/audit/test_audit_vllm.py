"""``rlfw audit engine=vllm``: every stream from a real vLLM, numbers that match a direct comparison,
both the stock vLLM model and the shared model registered in it, and clear errors on bad input.

The shared model on the invariant op set runs the trainer's arithmetic inside vLLM on CPU (the shared
attention over vLLM's paged cache, the shared log-softmax in vLLM's sampler), so its pairs are claimed
and found bitwise, dense and MoE, fp32 and bf16; vLLM's stock model keeps a bound."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlfw.audit.ladder import PROMPT_LENS, RESPONSE_LENS
from rlfw.cli import main
from rlfw.model import from_pretrained
from tests.conftest import make_hf_checkpoint

if os.environ.get("RLFW_WITH_VLLM") == "0":
    pytest.skip("installed with RLFW_WITH_VLLM=0: no vLLM", allow_module_level=True)

from rlfw.config import EngineConfig  # noqa: E402
from rlfw.rollout.vllm.engine import VllmEngine  # noqa: E402
from rlfw.types import GenerationRequest  # noqa: E402

PAIRS = [
    "trainer_grad~trainer_score",
    "trainer_score~engine_prefill",
    "engine_prefill~engine_decode",
    "engine_decode~sampler",
]


def audit(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, dict]:
    code = main(["audit", "engine=vllm", "model.dtype=float32", *overrides])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("impl", ["rlfw", "stock"])
def test_dense_checkpoint_every_stream_and_direct_comparison(
    impl: str, dense_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = audit(capsys, "model=hf", f"model.path={dense_ckpt}", f"engine.vllm.model={impl}")
    assert code == 0 and report["contract"]["holds"]
    assert report["engine"] == "vllm" and report["vllm"]["model"] == impl
    assert list(report["pairs"]) == PAIRS
    assert report["tokens_compared"] == len(PROMPT_LENS) * max(RESPONSE_LENS)
    if impl == "rlfw":  # the shared arithmetic: every pair claimed and found bitwise
        assert report["contract"]["claims_bitwise"] == PAIRS
        assert all(report["pairs"][name]["bits_match"] for name in PAIRS)
    else:  # vLLM's own model: declared as bounded, and within the bound on CPU fp32
        assert report["contract"]["claims_bitwise"] == ["trainer_grad~trainer_score"]
        for name in PAIRS[1:]:
            assert report["pairs"][name]["within_contract"]
            assert 0.0 <= report["pairs"][name]["max_abs_dlogp"] <= 1e-3

    # A direct comparison, outside the ladder: the same prompts and seed through vLLM, the trainer's
    # scoring forward by hand, and the largest |d log p| between it and vLLM's prefill stream.
    gen = torch.Generator().manual_seed(0)
    model = from_pretrained(str(dense_ckpt), kernels="invariant")
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    cfg = EngineConfig(name="vllm", max_slots=8, max_model_len=256)
    cfg.vllm.model = impl
    engine = VllmEngine(str(dense_ckpt), cfg, kernels="invariant")
    samples = engine.generate(
        GenerationRequest([0, 1, 2, 3], prompts, n=1, max_new_tokens=max(RESPONSE_LENS), seed=0)
    )
    engine.shutdown()
    worst = {
        "trainer_score~engine_prefill": 0.0,
        "engine_prefill~engine_decode": 0.0,
        "engine_decode~sampler": 0.0,
    }
    with torch.no_grad():
        for s in samples:
            p = s.prompt_P.shape[0]
            q = model.ops.token_logp(model(s.tokens[None])[0][p - 1 : -1], s.response_T)
            worst["trainer_score~engine_prefill"] = max(
                worst["trainer_score~engine_prefill"], float((q - s.prefill_logp).abs().max())
            )
            worst["engine_prefill~engine_decode"] = max(
                worst["engine_prefill~engine_decode"], float((s.prefill_logp - s.decode_logp).abs().max())
            )
            worst["engine_decode~sampler"] = max(
                worst["engine_decode~sampler"], float((s.decode_logp - s.sampler_logp).abs().max())
            )
    for name, value in worst.items():
        assert report["pairs"][name]["max_abs_dlogp"] == pytest.approx(value, abs=2e-7), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_checkpoint_holds_bitwise(moe_ckpt: Path, dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = audit(capsys, "model=hf", f"model.path={moe_ckpt}", f"model.dtype={dtype}")
    assert code == 0 and report["architecture"] == "qwen3_moe" and report["dtype"] == dtype
    assert report["contract"]["claims_bitwise"] == PAIRS
    assert all(report["pairs"][name]["bits_match"] for name in PAIRS)


def test_vllms_own_attention_under_the_claim_fails_and_is_localised(
    dense_ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leave vLLM's CPU attention in place while the contract claims the shared one: the audit exits 1
    and the recorder inside vLLM finds the first difference in attention."""
    from rlfw.rollout.vllm.attention import SharedPagedAttention

    monkeypatch.setattr(SharedPagedAttention, "replacing", classmethod(lambda cls, impl: impl))
    code, report = audit(capsys, "model=hf", f"model.path={dense_ckpt}")
    assert code == 1
    assert not report["pairs"]["trainer_score~engine_prefill"]["within_contract"]
    assert report["localise"]["vllm_prefill~score"]["op"].endswith(":attention#0")


def test_bad_inputs_exit_2_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    code = main(["audit", "engine=vllm", "model=hf", f"model.path={tmp_path / 'broken'}"])
    assert code == 2 and "config.json has no 'hidden_size'" in capsys.readouterr().err
    small = make_hf_checkpoint(tmp_path / "hd16", "dense", head_dim=16)
    code = main(["audit", "engine=vllm", "model=hf", f"model.path={small}", "model.dtype=float32"])
    err = capsys.readouterr().err
    assert code == 2 and "head_dim=16 is not supported by vLLM's CPU attention" in err
    code = main(["train", "engine=vllm", "engine.vllm.model=stock", "engine.sampler.precision=fp8"])
    err = capsys.readouterr().err
    assert code == 2 and "needs the shared model's sampler head: set engine.vllm.model=rlfw" in err
    code = main(
        ["train", "engine=vllm", "engine.vllm.model=stock", "model=tiny_moe", "model.router_replay=true"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "use engine.vllm.model=rlfw" in err


def test_missing_vllm_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from rlfw.rollout.vllm import checks

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(checks.VllmUnavailableError, match="scripts/test.sh|pip install"):
        checks.require_vllm()
