"""A dense block over the engine's cache in one compiled call gives the per-op path's bits.

``Ops.cached_block`` (``kernels/csrc/block.cpp``) makes the block's kernel calls from C++ instead of one
Python call per op. Everything the engine records is compared bit for bit against the same engine with
that call switched off, on Qwen3 (per-head q/k norms) and Llama (none) layouts with grouped K/V heads,
ragged prompts (padded prefills), groups sharing a prompt, stop tokens and the prefill stream.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from rlfw.kernels.block import per_op
from rlfw.model import Transformer, build_preset
from rlfw.model.config import ModelArgs
from rlfw.rollout.native import NativeEngine
from rlfw.types import GenerationRequest
from tests.rollout._helpers import counted, prompts, same_bits

QWEN3 = ModelArgs("qwen3", 96, 128, 256, 3, 4, 2, 32)
LLAMA = replace(QWEN3, model_type="llama", qk_norm=False)


def _generate(model: Transformer) -> list:  # type: ignore[type-arg]
    engine = NativeEngine(model, max_slots=5, max_model_len=40, stop_ids=[3, 5], seed=11)
    request = GenerationRequest([0, 1, 2], prompts([3, 9, 14]), n=3, max_new_tokens=12, seed=4)
    return engine.generate(request)


@pytest.mark.parametrize("args", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_the_engine_records_the_same_bits_with_blocks_in_one_call(args: ModelArgs) -> None:
    torch.manual_seed(0)
    model = Transformer(args, kernels="invariant").eval()
    with counted() as calls:
        fused = _generate(model)
    assert calls[1] > 0 and calls[1] == calls[0]  # every block of every engine forward took the call
    with per_op():
        one_by_one = _generate(model)
    assert len(fused) == len(one_by_one) == 9
    assert any(s.finish_reason == "stop" for s in fused) and any(s.finish_reason != "stop" for s in fused)
    for a, b in zip(fused, one_by_one, strict=True):
        assert torch.equal(a.response_T, b.response_T)
        for stream in ("sampler_logp", "decode_logp", "prefill_logp", "topk_logp", "topk_ids"):
            x, y = getattr(a, stream), getattr(b, stream)
            assert x is not None and same_bits(x, y), stream


def test_a_forward_over_the_cache_leaves_the_same_cache_bits() -> None:
    """Ragged rows (right-padded) into cache rows that already hold positions, as an admission or the
    prefill stream does: same output and same cache contents, padding included."""
    torch.manual_seed(1)
    model = Transformer(QWEN3, kernels="invariant").eval()
    model.prepare_for_inference()
    ids = torch.randint(8, 96, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    slots = torch.tensor([4, 0, 2])
    outs, caches = [], []
    for fused in (True, False):
        cache = model.new_cache(num_slots=5, capacity=16)
        with torch.no_grad():
            model.hidden_states(ids[:, :3], cache=cache, slots=slots)  # earlier positions
            with counted() as calls, nullcontext() if fused else per_op():
                outs.append(model.hidden_states(ids, mask, cache=cache, slots=slots))
        assert (calls[1] == QWEN3.num_layers) == fused
        caches.append(cache)
    assert same_bits(outs[0], outs[1])
    for layer in range(QWEN3.num_layers):
        assert same_bits(caches[0].k[layer], caches[1].k[layer])
        assert same_bits(caches[0].v[layer], caches[1].v[layer])
    assert torch.equal(caches[0].lengths, caches[1].lengths)


def test_the_call_steps_aside_where_the_ops_must_run_one_by_one() -> None:
    """Autograd, unpacked weights, a forward hook inside the block, MoE blocks and the default kernels
    all keep the per-op path."""
    ids = torch.randint(8, 96, (2, 5), generator=torch.Generator().manual_seed(3))

    def served(model: Transformer, grad: bool = False) -> int:
        cache = model.new_cache(num_slots=2, capacity=8)
        with counted() as calls, torch.set_grad_enabled(grad):
            model.hidden_states(ids, cache=cache)
        return calls[1]

    torch.manual_seed(2)
    model = Transformer(QWEN3, kernels="invariant").eval()
    assert served(model) == 0  # weights not packed: no engine prepared them
    model.prepare_for_inference()
    assert served(model) == QWEN3.num_layers
    assert served(model, grad=True) == 0  # the weights require grad: autograd needs the ops
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *_: None)
    assert served(model) == QWEN3.num_layers - 1  # the hooked block runs op by op
    handle.remove()
    moe = build_preset("tiny_moe", seed=1, kernels="invariant").eval()
    moe.prepare_for_inference()
    engine = NativeEngine(moe, max_slots=2, max_model_len=16)
    with counted() as calls:
        engine.generate(GenerationRequest([0], prompts([4]), n=2, max_new_tokens=3, seed=0))
    assert calls[1] == 0
    default = build_preset("tiny_dense", seed=1, kernels="default").eval()
    default.prepare_for_inference()
    assert default.ops.cached_block(ids) is None  # type: ignore[call-arg]


def test_a_cache_write_out_of_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call copies K/V rows into the cache itself, so it checks every destination: a position past
    the cache's capacity is an error, not a write past the tensor."""
    from rlfw.model.layers import ForwardContext

    model = Transformer(QWEN3, kernels="invariant").eval()
    model.prepare_for_inference()
    cache = model.new_cache(num_slots=2, capacity=8)
    original = ForwardContext.cache_write

    def past_the_end(self, layer):  # type: ignore[no-untyped-def]
        write = original(self, layer)
        return None if write is None else replace(write, pos=torch.full_like(write.pos, 8))

    monkeypatch.setattr(ForwardContext, "cache_write", past_the_end)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cache position out of range"):
        model.hidden_states(torch.tensor([[9, 10, 11]]), cache=cache, slots=torch.tensor([1]))
