"""The execution contract: a stable hash of bit-relevant choices, and mismatches named entry by entry."""

from __future__ import annotations

import json

import pytest

from rlfw.contract import CASES, ContractMismatch, ExecutionContract, build_contract
from rlfw.kernels import get_ops

T = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _contract(kernels: str = "invariant", precision: str = "fp32", **kw: object) -> ExecutionContract:
    return build_contract(get_ops(kernels), "float32", precision, dict(T), **kw)  # type: ignore[arg-type]


def test_hash_is_stable_and_ignores_entry_order_and_notes() -> None:
    a = _contract()
    d = json.loads(json.dumps(a.to_dict()))
    reordered = ExecutionContract.from_dict({k: d[k] for k in reversed(list(d))} | {"notes": {"who": "x"}})
    assert reordered.hash == a.hash == _contract().hash
    assert len(a.hash) == 16


def test_hash_changes_on_a_tile_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfw.kernels import reduce

    before = ExecutionContract.from_dict(json.loads(json.dumps(_contract().to_dict())))
    monkeypatch.setattr(reduce, "SUM_CHUNK", reduce.SUM_CHUNK * 2)
    after = _contract()
    assert after.hash != before.hash
    assert (
        f"cases.engine_decode.ops.rms_norm.sum_chunk: {reduce.SUM_CHUNK} != {reduce.SUM_CHUNK // 2}"
        in after.diff(before)
    )


@pytest.mark.parametrize(
    ("other", "entry"),
    [
        (lambda: _contract("default"), "cases.engine_decode.ops.linear.impl"),
        (lambda: _contract(precision="fp8"), "cases.sampler.logits_head"),
        (
            lambda: build_contract(get_ops("invariant"), "float32", "fp32", T | {"temperature": 0.7}),
            "transforms.temperature",
        ),
        (lambda: _contract(in_flight_keep_kv=True), "pairs.engine_prefill~engine_decode.bitwise"),
    ],
)
def test_mismatch_refuses_and_names_the_entries(other, entry: str) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = _contract(), other()
    assert mine.hash != theirs.hash
    with pytest.raises(ContractMismatch, match=entry.replace(".", r"\.").replace("~", "~")):
        mine.require_same(theirs)


def test_cases_are_named_and_unknown_paths_are_refused() -> None:
    c = _contract()
    assert tuple(c.cases) == CASES
    with pytest.raises(KeyError, match="not a case of this contract"):
        c.case("engine_speculative")


def test_claims_follow_kernels_and_sampler_precision() -> None:
    assert all(v["bitwise"] for v in _contract().pairs.values())
    assert not any(v["bitwise"] for v in _contract("default").pairs.values())
    fp8 = _contract(precision="fp8")
    assert not fp8.claims_bitwise("engine_decode", "sampler") and fp8.claims_bitwise(
        "engine_prefill", "engine_decode"
    )
    assert fp8.pairs["engine_decode~sampler"]["max_abs_dlogp"] > 0
