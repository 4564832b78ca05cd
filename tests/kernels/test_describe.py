"""The op-set records feed the execution contract hash: JSON-serialisable, naming every choice."""

from __future__ import annotations

import json

import pytest

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
