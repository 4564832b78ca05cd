"""The op-set records feed the execution contract hash: JSON-serialisable, naming every choice."""

from __future__ import annotations

import json

import pytest
import torch

from rlfw.kernels import get_ops
from rlfw.kernels.describe import describe_default
from rlfw.kernels.invariant import InvariantOps

OPS = ("linear", "rms_norm", "rope", "silu_mul", "attention", "log_softmax", "token_logp", "entropy")


def test_registry_builds_invariant_ops() -> None:
    ops = get_ops("invariant")
    assert isinstance(ops, InvariantOps) and ops.name == "invariant"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_record_is_json_and_complete(backend: str) -> None:
    record = InvariantOps(backend=backend).describe()
    assert json.loads(json.dumps(record)) == record
    assert record["backend"] == backend
    for op in (*OPS, "router_topk", "router_weights"):
        assert op in record, op
    assert record["router_topk"]["tie_rule"] == "lowest_index"
    expected = "cpp_row_two_pass_softmax" if backend == "torch" else "triton_tiled_online_softmax"
    assert record["attention"]["impl"] == expected  # this machine has no CUDA: the compiled kernel
    assert json.loads(json.dumps(describe_default())) == describe_default()


def test_backends_differ_in_record() -> None:
    assert InvariantOps(backend="torch").describe() != InvariantOps(backend="triton").describe()


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed values"):
        InvariantOps(backend="cuda")


def test_cuda_dispatch_picks_vllms_kernels_when_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which op set a CUDA machine gets (checked here without one): vLLM's batch-invariant kernels when
    vLLM is installed, rlfw's Triton kernels otherwise; the compiled CPU kernels without CUDA."""
    from rlfw.kernels import invariant, vllm_ops

    assert invariant._resolve_backend("auto") == "torch"  # this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_ops, "available", lambda: True)
    assert invariant._resolve_backend("auto") == "vllm"
    monkeypatch.setattr(vllm_ops, "available", lambda: False)
    assert invariant._resolve_backend("auto") == "triton"
    with pytest.raises(ValueError, match="backend='vllm' needs a CUDA device"):
        invariant._resolve_backend("vllm")


def test_the_contract_records_which_implementation_serves_each_op_on_cuda() -> None:
    from rlfw.kernels.describe import describe_invariant
    from rlfw.kernels.vllm_ops import vllm_version

    record = describe_invariant("vllm")
    assert json.loads(json.dumps(record)) == record
    assert record["backend"] == "vllm"
    assert record["linear"]["impl"] == "vllm_persistent_matmul" and record["linear"]["split_k"] is False
    assert record["linear"]["library"] == "vllm.model_executor.determinism.batch_invariant"
    assert record["linear"]["vllm"] == vllm_version()
    assert record["rms_norm"]["impl"] == "vllm_rms_norm"
    assert record["log_softmax"]["impl"] == "vllm_log_softmax"
    assert record["attention"]["impl"] == "vllm_flash_attn_paged_num_splits_1"
    assert record["attention"]["fp32_impl"] == "rlfw_triton_tiled_online_softmax"  # no fp32 FlashAttention
    assert record["attention"]["page_size"] == 16 and record["attention"]["vllm"] == vllm_version()
    assert record["router_topk"]["tie_rule"] == "lowest_index"
    assert record != describe_invariant("triton") != describe_invariant("torch")


def test_vllm_backend_is_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        InvariantOps(backend="vllm")
