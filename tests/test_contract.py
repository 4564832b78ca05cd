"""The execution contract: a stable hash of bit-relevant choices, and mismatches named entry by entry."""

from __future__ import annotations

import json
from pathlib import Path

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


_PROBE = """
import hashlib, json, logging, torch
from rlfw.contract import build_contract
from rlfw.fingerprint import model_fingerprint
from rlfw.kernels import get_ops
from rlfw.model import build_preset
logging.getLogger().setLevel(logging.DEBUG)
m = build_preset("tiny_moe", seed=7, kernels="invariant")
ids = torch.randint(4, 96, (3, 20), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    bits = hashlib.sha256(m(ids).numpy().tobytes()).hexdigest()
c = build_contract(get_ops("invariant"), "float32", "fp32", {}, model=model_fingerprint(m.args))
print(json.dumps({"bits": bits, "hash": c.hash}))
"""


def _probe(**env: str) -> dict[str, str]:
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=base | env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out.splitlines()[-1]))


@pytest.mark.skipif(
    __import__("torch").backends.cpu.get_cpu_capability() == "DEFAULT", reason="needs a vectorised CPU"
)
def test_a_cpu_capability_that_changes_bits_changes_the_hash() -> None:
    here, portable = _probe(), _probe(ATEN_CPU_CAPABILITY="default")
    assert here["bits"] != portable["bits"]  # ATen's vectorised exp/softmax differ from the portable path
    assert here["hash"] != portable["hash"]
    # Neutral changes: a logging level (set inside the probe), a variable no kernel reads, thread count.
    assert _probe(RLFW_UNRELATED="1", OMP_NUM_THREADS="2") == here


def test_model_architecture_and_shapes_are_in_the_hash() -> None:
    from rlfw.fingerprint import model_fingerprint
    from rlfw.model import build_preset

    dense, moe = (model_fingerprint(build_preset(p).args) for p in ("tiny_dense", "tiny_moe"))
    a, b = _contract(model=dense), _contract(model=moe)
    assert a.hash != b.hash
    assert any(line.startswith("model.num_experts:") for line in a.diff(b))


def test_settle_environment_refuses_or_bounds_a_differing_engine(tmp_path: Path) -> None:
    from rlfw.compose import load_config
    from rlfw.fingerprint import environment_fingerprint
    from rlfw.model import build_preset
    from rlfw.train.setup import Setup, make_contract, settle_environment

    here = environment_fingerprint()
    other = json.loads(json.dumps(here))
    other["device"]["cpu_capability"] = "DEFAULT"
    args = build_preset("tiny_dense").args
    run = load_config([])
    setup = Setup(None, None, None, None, make_contract(run, args), [], args)  # type: ignore[arg-type]
    same = settle_environment(run, setup, tmp_path, {"trainer rank 0": here, "engine 0": here})
    assert same.contract.hash == setup.contract.hash
    assert same.contract.claims_bitwise("trainer_score", "engine_prefill")
    fingerprints = {"trainer rank 0": here, "engine 0": here, "engine 1": other}
    with pytest.raises(ContractMismatch, match=r"engine 1: device\.cpu_capability: '.*' != 'DEFAULT'"):
        settle_environment(run, setup, tmp_path, fingerprints)
    bounded = settle_environment(load_config(["environment_mismatch=bound"]), setup, tmp_path, fingerprints)
    assert not any(p["bitwise"] for p in bounded.contract.pairs.values())
    assert bounded.contract.environment["accepted_mismatch"] == ["device.cpu_capability"]
    assert json.loads((tmp_path / "contract.json").read_text())["hash"] == bounded.contract.hash


@pytest.mark.parametrize(
    "name", ["TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION", "TRITON_F32_DEFAULT", "MKL_CBWR"]
)
def test_bit_relevant_environment_variables_enter_the_fingerprint(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Triton's fma fusion and fp32 dot settings change the bits of every Triton kernel that does not pin
    them (vLLM's), so two processes that differ in them must not share a hash."""
    from rlfw.fingerprint import environment_fingerprint

    monkeypatch.delenv(name, raising=False)
    unset = environment_fingerprint()
    monkeypatch.setenv(name, "0")
    set_ = environment_fingerprint()
    assert set_["env"][name] == "0" and name not in unset["env"] and set_ != unset
