"""The execution contract: every bit-relevant choice of every case, with a stable content hash.

A *case* is one path that produces log-probs: the trainer's grad forward, the trainer's scoring forward,
the engine's prefill, the engine's decode and the sampler. The contract records, per case, which
implementation serves each op (``ops.describe()``), the dtypes, the execution path and the logits head;
plus the sampling transforms, the tie rules, the state each weight sync invalidates, and for every
adjacent pair of cases whether bits are claimed equal or a bound on |d log p| is declared instead. It also
records the environment fingerprint of the trainer (library versions, device, CPU capability, BLAS mode:
`rlfw.fingerprint`) and the model's architecture and shapes, so a contract built on another machine,
stack or model does not share its hash.

Trainer and engine exchange the hash before every weight sync; a mismatch refuses to proceed with an
error naming the differing entries. The hash covers only bit-relevant content, serialised canonically
(sorted keys), so reordering entries changes nothing and changing a tile size changes the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from rlfw.kernels import Ops

CASES = ("trainer_grad", "trainer_score", "engine_prefill", "engine_decode", "sampler")
PAIRS = (
    ("trainer_grad", "trainer_score"),
    ("trainer_score", "engine_prefill"),
    ("engine_prefill", "engine_decode"),
    ("engine_decode", "sampler"),
)
# What |d log p| a pair may show when bits are not claimed equal. Plain torch ops round differently with
# the batch shape (about 1e-6 in fp32 on the tiny models, about 1e-2 in bf16); a reduced-precision
# sampler head shows its quantisation error (measured on the tiny models, see bench/RESULTS.md).
DEFAULT_KERNEL_BOUND = {"float32": 1e-3, "bfloat16": 0.25}
SAMPLER_BOUND = {"bf16": 0.25, "fp8": 1.0}


class ContractMismatch(RuntimeError):
    """Trainer and engine disagree on a bit-relevant choice; the message lists every differing entry."""


def pair_name(a: str, b: str) -> str:
    return f"{a}~{b}"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    return out


@dataclass(frozen=True)
class ExecutionContract:
    """See the module docstring. Build one with :func:`build_contract`."""

    cases: dict[str, dict[str, Any]]
    transforms: dict[str, Any]
    tie_rules: dict[str, str]
    state_obligations: dict[str, list[str]]
    pairs: dict[str, dict[str, Any]]  # "a~b" -> {"bitwise": bool, "max_abs_dlogp": float | None}
    notes: dict[str, str] = field(default_factory=dict)  # human-readable context; not hashed
    environment: dict[str, Any] = field(default_factory=dict)  # rlfw.fingerprint.environment_fingerprint
    model: dict[str, Any] = field(default_factory=dict)  # rlfw.fingerprint.model_fingerprint

    def bit_relevant(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "transforms": self.transforms,
            "tie_rules": self.tie_rules,
            "state_obligations": self.state_obligations,
            "pairs": self.pairs,
            "environment": self.environment,
            "model": self.model,
        }

    def canonical_json(self) -> str:
        return json.dumps(self.bit_relevant(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return self.bit_relevant() | {"notes": self.notes, "hash": self.hash}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecutionContract:
        return cls(
            d["cases"],
            d["transforms"],
            d["tie_rules"],
            d["state_obligations"],
            d["pairs"],
            d.get("notes", {}),
            d.get("environment", {}),
            d.get("model", {}),
        )

    def case(self, name: str) -> dict[str, Any]:
        """A named case's spec; a log-prob path that is not a named case is refused."""
        if name not in self.cases:
            raise KeyError(f"{name!r} is not a case of this contract; cases: {', '.join(self.cases)}")
        return self.cases[name]

    def claims_bitwise(self, a: str, b: str) -> bool:
        return bool(self.pairs[pair_name(a, b)]["bitwise"])

    def diff(self, other: ExecutionContract) -> list[str]:
        """Dotted keys whose values differ, e.g. ``cases.engine_decode.ops.attention.kv_tile: 16 != 32``."""
        mine, theirs = _flatten(self.bit_relevant()), _flatten(other.bit_relevant())
        return [
            f"{k}: {mine.get(k, '<absent>')!r} != {theirs.get(k, '<absent>')!r}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k, "<absent>") != theirs.get(k, "<absent>")
        ]

    def require_same(self, other: ExecutionContract, who: str = "engine") -> None:
        """Refuse to proceed when ``other`` (e.g. the engine's contract) differs from this one."""
        if other.hash == self.hash:
            return
        differences = "\n  ".join(self.diff(other)) or "(same entries; hashes differ by version)"
        raise ContractMismatch(
            f"execution contract mismatch: trainer {self.hash} vs {who} {other.hash}; differing entries:\n  "
            f"{differences}\nRun trainer and {who} with the same kernels, dtype and sampler settings."
        )


def _case(ops: Ops, dtype: str, path: str, head: str) -> dict[str, Any]:
    return {
        "ops": ops.describe(),
        "param_dtype": dtype,
        "path": path,
        "logits_head": head,
        "logprob_dtype": "float32",
    }


def _vllm_ops(ops: Ops, vllm_model: str, shared: bool) -> dict[str, Any]:
    """What serves each op inside vLLM: the shared ops (with the shared attention over vLLM's paged cache
    when ``shared``, else vLLM's attention around them), or vLLM's own model."""
    if vllm_model == "stock":
        return {"all": "vllm_stock_model"}
    if shared:
        return ops.describe() | {"attention_cache": "vllm_paged_blocks", "log_softmax_in_vllm": "shared"}
    return ops.describe() | {"attention": "vllm_paged_attention"}


def vllm_shares_numerics(kernels: str, vllm_model: str, device_type: str) -> bool:
    """Whether vLLM runs the trainer's arithmetic end to end: the shared model on the invariant op set on
    a CPU, whose attention and log-softmax inside vLLM are then rlfw's (:mod:`rlfw.rollout.vllm.attention`).
    On GPUs vLLM's own attention runs, so its pairs keep a bound."""
    return kernels == "invariant" and vllm_model == "rlfw" and device_type == "cpu"


def build_contract(
    ops: Ops,
    param_dtype: str,
    sampler_precision: str,
    transforms: dict[str, Any],
    in_flight_keep_kv: bool = False,
    engine: str = "native",
    vllm_model: str = "rlfw",
    environment: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    accepted_mismatch: list[str] | None = None,
) -> ExecutionContract:
    """The contract of the trainer on ``ops`` and an engine (``native`` or ``vllm``).

    Native engine: bits are claimed equal between two cases when both run the invariant op set with
    identical specs; the sampler joins that claim only at fp32 (it then reads the decode logits
    themselves). With in-flight updates that keep the stale KV cache, prefill and decode knowingly differ
    after an update, so that pair is declared unbounded.

    vLLM engine: with the shared model on the invariant op set on a CPU (:func:`vllm_shares_numerics`),
    vLLM's prefill, decode and sampler run the trainer's arithmetic (the shared attention over vLLM's
    paged cache, the shared log-softmax in its sampler and rescoring pass), and the same pairs as the
    native engine's are claimed bitwise. Otherwise (vLLM's attention on GPUs, or its whole stock model)
    every pair that touches vLLM declares a bound instead of bits.

    ``environment`` is the trainer's fingerprint (default: this process's); ``model`` the architecture
    (`rlfw.fingerprint.model_fingerprint`). ``accepted_mismatch`` lists fingerprint entries where some
    engine or rank differs and the user accepted it (``contract.environment_mismatch=bound``): no pair
    is then claimed bitwise; each declares the default kernels' bound instead.
    """
    if environment is None:
        from rlfw.fingerprint import environment_fingerprint

        environment = environment_fingerprint(engine)
    if accepted_mismatch:
        environment = environment | {"accepted_mismatch": sorted(accepted_mismatch)}
    head = "lm_head_full_precision"
    sampler_head = head if sampler_precision == "fp32" else f"lm_head_{sampler_precision}"
    cases = {
        "trainer_grad": _case(ops, param_dtype, "full_sequence_autograd", head),
        "trainer_score": _case(ops, param_dtype, "full_sequence_no_grad", head),
        "engine_prefill": _case(ops, param_dtype, "full_sequence_no_grad", head),
        "engine_decode": _case(ops, param_dtype, "slotted_cache_one_token", head),
        "sampler": _case(ops, param_dtype, "slotted_cache_one_token", sampler_head),
    }
    device_type = environment.get("device", {}).get("type", "cpu")
    vllm_shared = engine == "vllm" and vllm_shares_numerics(ops.name, vllm_model, device_type)
    if engine == "vllm":
        vllm_ops = _vllm_ops(ops, vllm_model, vllm_shared)
        # shared numerics: the prefill forward's hidden states at the response, scored by the shared head
        prefill_path = "vllm_prefill_hidden_states" if vllm_shared else "vllm_prompt_logprobs"
        cases["engine_prefill"] |= {"ops": vllm_ops, "path": prefill_path}
        cases["engine_decode"] |= {"ops": vllm_ops, "path": "vllm_paged_decode_raw_logits"}
        cases["sampler"] |= {"ops": vllm_ops, "path": "vllm_processed_logprobs"}
    invariant = ops.name == "invariant"
    claims_bits = invariant and not accepted_mismatch
    pairs: dict[str, dict[str, Any]] = {}
    for a, b in PAIRS:
        if b == "sampler" and sampler_precision != "fp32":
            pairs[pair_name(a, b)] = {"bitwise": False, "max_abs_dlogp": SAMPLER_BOUND[sampler_precision]}
        elif a == "engine_prefill" and in_flight_keep_kv:
            pairs[pair_name(a, b)] = {"bitwise": False, "max_abs_dlogp": None}
        elif claims_bits and (engine == "native" or vllm_shared or a == "trainer_grad"):
            pairs[pair_name(a, b)] = {"bitwise": True, "max_abs_dlogp": 0.0}
        else:
            pairs[pair_name(a, b)] = {"bitwise": False, "max_abs_dlogp": DEFAULT_KERNEL_BOUND[param_dtype]}
    obligations = (
        ["kv_cache", "prefix_cache", "sampler_quantized_weights"] if engine == "native" else ["prefix_cache"]
    )
    return ExecutionContract(
        cases=cases,
        transforms=transforms,
        tie_rules={
            "router_topk": "lowest_index" if invariant else "unspecified",
            "sampling_draw": "gumbel_argmax_lowest_index" if engine == "native" else "vllm_sampler",
            "top_k_boundary": "keep_all_ties",
            "top_p_order": "stable_descending",
        },
        state_obligations={
            "weight_sync": obligations,
            "in_flight_update": ["kv_cache" if not in_flight_keep_kv else "none(kv_policy=keep)"],
        },
        pairs=pairs,
        notes={"kernels": ops.name, "sampler_precision": sampler_precision, "engine": engine},
        environment=environment,
        model=model or {},
    )
