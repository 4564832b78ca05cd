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
    report, code = run_audit(load_config([]))
    assert code == 1 and not report["contract"]["holds"]
    assert not report["pairs"]["engine_prefill~engine_decode"]["bits_match"]
    assert report["localise"]["score~decode"]["op"] == "model.layers.0.self_attn.q_proj:linear#0"
