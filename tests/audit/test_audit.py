"""`rlfw audit`: the ladder's JSON, its exit code, and localisation of a planted mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlfw.audit.ladder import run_audit
from rlfw.cli import main
from rlfw.compose import load_config
from rlfw.kernels.block import per_op
from rlfw.kernels.invariant import InvariantOps

PAIR_KEYS = [
    "trainer_grad~trainer_score",
    "trainer_score~engine_prefill",
    "engine_prefill~engine_decode",
    "engine_decode~sampler",
]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_invariant_audit_on_hf_checkpoints_holds_bitwise(
    kind: str, dense_ckpt: Path, moe_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = dense_ckpt if kind == "dense" else moe_ckpt
    code = main(["audit", "model=hf", f"model.path={path}", "model.dtype=float32"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert list(report["pairs"]) == PAIR_KEYS
    assert all(p["bits_match"] and p["max_abs_dlogp"] == 0.0 for p in report["pairs"].values())
    assert report["batch_invariance"]["bits_match"] and report["batch_invariance"]["placements_checked"] > 20
    assert report["contract"]["holds"] and len(report["contract"]["claims_bitwise"]) == 4
    assert report["transformers"]["max_abs_dlogit"] <= 1e-4


def test_default_kernels_report_the_differences_they_find() -> None:
    report, code = run_audit(load_config(["kernels=default"]))
    assert code == 0  # nothing bitwise is claimed under default kernels
    decode = report["pairs"]["engine_prefill~engine_decode"]
    assert not decode["bits_match"] and 0 < decode["max_abs_dlogp"] <= 1e-3
    assert report["localise"]["score~decode"]["op"].startswith("model.layers.0.")


def test_fp8_sampler_is_isolated_to_the_sampler_pair() -> None:
    report, code = run_audit(load_config(["model=tiny_moe", "engine.sampler.precision=fp8"]))
    assert code == 0
    pairs = report["pairs"]
    assert (
        not pairs["engine_decode~sampler"]["bits_match"]
        and pairs["engine_decode~sampler"]["max_abs_dlogp"] > 0
    )
    assert all(pairs[k]["bits_match"] for k in PAIR_KEYS[:3])


def test_a_non_invariant_op_under_a_bitwise_claim_fails_and_is_localised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plant the classic bug: single-row decode takes torch's GEMV path while claiming invariance."""
    honest = InvariantOps.linear

    def sneaky(self: InvariantOps, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1:
            return F.linear(x, weight)
        return honest(self, x, weight)

    monkeypatch.setattr(InvariantOps, "linear", sneaky)
    # the planted bug lives in the per-op linear; an engine's dense blocks otherwise make their kernel
    # calls from C++ in one call per block (Ops.cached_block), which this Python op is not part of
    with per_op():
        report, code = run_audit(load_config([]))
    assert code == 1 and not report["contract"]["holds"]
    assert not report["pairs"]["engine_prefill~engine_decode"]["bits_match"]
    assert report["localise"]["score~decode"]["op"] == "model.layers.0.self_attn.q_proj:linear#0"


def test_a_mismatch_inside_a_packed_batch_is_localised_to_its_op_and_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batched mode's forward computes its distinct tokens only (``[1, N]`` rows, padding left out);
    the localiser still compares the target's own tokens, op by op."""
    from rlfw.audit import localise as loc
    from rlfw.model import build_preset

    model = build_preset("tiny_dense", seed=1, kernels="invariant")
    seq = torch.randint(4, 96, (9,), generator=torch.Generator().manual_seed(0))
    honest = InvariantOps.linear

    def sneaky(self: InvariantOps, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = honest(self, x, weight)
        return out + 1e-3 if x.dim() == 3 and x.shape[1] > seq.shape[0] + 3 else out  # only packed calls

    monkeypatch.setattr(InvariantOps, "linear", sneaky)
    assert loc.localise(model, seq, "score", "decode") is None
    found = loc.localise(model, seq, "score", "batched")
    assert found is not None and found["op"] == "model.layers.0.self_attn.q_proj:linear#0"
    assert 0 <= found["first_token"] < seq.shape[0]


# Shapes that broke invariance or the audit before: hidden 70 (not a multiple of 4) with 8 experts (an MoE
# router of width 8 over an inner size of 70), K/V projections 2 * 4 = 8 wide (head_dim 4, GQA 3:1), odd
# vocabulary.
AWKWARD = dict(
    vocab_size=101,
    hidden_size=70,
    intermediate_size=90,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=4,
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_audit_on_awkward_shapes_holds_bitwise_and_keeps_every_rung(
    kind: str, dtype: str, tmp_path: Path
) -> None:
    from tests.conftest import make_hf_checkpoint

    extra = {"num_experts": 8, "moe_intermediate_size": 30} if kind == "moe" else {}
    path = make_hf_checkpoint(tmp_path / kind, kind, **AWKWARD, **extra)
    report, code = run_audit(load_config(["model=hf", f"model.path={path}", f"model.dtype={dtype}"]))
    assert code == 0, json.dumps(report, indent=1, default=str)[:3000]
    assert all(p["bits_match"] for p in report["pairs"].values())
    assert report["batch_invariance"]["bits_match"]
    assert report["contract"]["model"]["hidden_size"] == 70
    # The comparison with transformers is kept either as a number or as the error it raised.
    assert "max_abs_dlogit" in report["transformers"] or "error" in report["transformers"]


def test_a_failing_rung_is_reported_and_the_others_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfw.audit import ladder

    def broken(*args: object) -> None:
        raise RuntimeError("strides should be multiple of 16 bytes")

    monkeypatch.setattr(ladder, "transformers_diff", broken)
    report, code = run_audit(load_config([]))
    assert report["transformers"] == {"error": "RuntimeError: strides should be multiple of 16 bytes"}
    assert code == 0 and report["contract"]["holds"]  # not a claim of the contract: the exit code stands
    assert all(p["bits_match"] for p in report["pairs"].values())

    monkeypatch.setattr(ladder, "batch_invariance", broken)
    report, code = run_audit(load_config([]))
    assert report["batch_invariance"] == {"error": "RuntimeError: strides should be multiple of 16 bytes"}
    assert code == 1 and not report["contract"]["holds"]  # a claimed check that did not run did not hold
    assert all(p["bits_match"] for p in report["pairs"].values())


def test_audit_prints_the_environment_fingerprint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit"]) == 0
    contract = json.loads(capsys.readouterr().out)["contract"]
    assert contract["environment"]["device"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert contract["environment"]["libraries"]["torch"] == torch.__version__
    assert contract["model"]["model_type"] == "qwen3"
