"""Whole-model property: under ``kernels=invariant`` a sequence's log-probs have the same bits in every
mode and batch, on drawn, awkward model shapes.

``tests/model/test_invariance.py`` locks the promise on the two tiny presets; here the architecture is
drawn too: hidden sizes from 3 up (mostly not multiples of 4), head_dim down to 4, one to three KV heads
with GQA groups of one to three, one or two layers, a handful of experts with any top-k, odd
vocabularies, tied or untied embeddings, Qwen3 (q/k norm) or Llama, fp32 or bf16. For a drawn target
sequence among drawn neighbours, the per-token log-probs of

* the trainer's grad forward (``train()``, grad enabled; for MoE optionally replaying the experts the
  engine recorded, R3),
* the trainer's scoring forward (no grad),
* the engine's prefill (through a KV cache whose rows may hold another sequence's stale K/V), and
* the engine's decode (a prompt prefill, then one token at a time through the cache, finished rows
  dropped from the step or masked out)

must equal, bit for bit, those of the sequence scored alone. Each mode places the sequence at its own
drawn batch row and cache slot, padded left or right. If this breaks, the trainer and decode factors of
the importance ratio stop being exactly 1 on some model shapes.

The default run is 40 examples per family (about 10 s of test time on two cores); 20 times as many
(about 4 minutes):

    RLFW_HYPOTHESIS_PROFILE=long pytest tests/model/test_model_properties.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlfw.model import KVCache, ModelArgs, RouterTrace, Transformer
from tests.kernels.bits import assert_same_bits
from tests.model.test_invariance import _token_logp
from tests.properties import examples

MAX_LEN = 14


@st.composite
def model_args(draw: st.DrawFn, family: str) -> ModelArgs:
    kv_heads = draw(st.integers(1, 3), "kv_heads")
    model_type = "qwen3_moe" if family == "moe" else draw(st.sampled_from(["qwen3", "llama"]), "model_type")
    moe: dict[str, object] = {}
    if family == "moe":
        experts = draw(st.integers(2, 6), "experts")
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=draw(st.integers(1, experts), "top_k"),
            moe_intermediate_size=draw(st.integers(1, 24), "moe_intermediate_size"),
            norm_topk_prob=draw(st.booleans(), "norm_topk_prob"),
        )
    return ModelArgs(
        model_type=model_type,
        vocab_size=draw(st.integers(3, 160), "vocab_size"),
        hidden_size=draw(st.integers(3, 40), "hidden_size"),
        intermediate_size=draw(st.integers(1, 40), "intermediate_size"),
        num_layers=draw(st.integers(1, 2), "num_layers"),
        num_heads=kv_heads * draw(st.integers(1, 3), "gqa_group"),
        num_kv_heads=kv_heads,
        head_dim=2 * draw(st.integers(2, 12), "head_dim_half"),  # rotate-half RoPE needs an even size
        tie_word_embeddings=draw(st.booleans(), "tie_word_embeddings"),
        qk_norm=model_type != "llama",
        max_position_embeddings=64,
        **moe,  # type: ignore[arg-type]
    )


def _build(args: ModelArgs, dtype: torch.dtype, seed: int, std: float) -> Transformer:
    """What :func:`rlfw.model.build_preset` does, for drawn arguments instead of a preset."""
    model = Transformer(args, kernels="invariant")
    model.init_weights(seed, std=std)
    return model.to(dtype).eval()


def _span(width: int, n: int, left: bool) -> slice:
    return slice(width - n, width) if left else slice(0, n)


def _pad(rows: list[Tensor], left: bool) -> tuple[Tensor, Tensor]:
    """``rows [n_i, ...]`` padded to one batch ``[B, W, ...]`` (zeros) and its mask ``[B, W]``."""
    width = max(r.shape[0] for r in rows)
    out = torch.zeros((len(rows), width, *rows[0].shape[1:]), dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        span = _span(width, r.shape[0], left)
        out[i, span], mask[i, span] = r, 1
    return out, mask


def _dirty_cache(model: Transformer, num_slots: int, capacity: int, seed: int) -> KVCache:
    """A cache whose every slot row was filled by another sequence and then freed (stale K/V stay)."""
    cache = model.new_cache(num_slots, capacity)
    ids = torch.randint(
        0, model.args.vocab_size, (num_slots, capacity), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        model(ids, cache=cache)
    cache.reset(torch.arange(num_slots))
    return cache


@pytest.mark.parametrize("family", ["dense", "moe"])
@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), bf16=st.booleans(), std=st.sampled_from([0.02, 0.5]), seed=st.integers(0, 2**16))
def test_four_modes_and_any_batch_give_a_sequence_the_same_bits(
    family: str, data: st.DataObject, bf16: bool, std: float, seed: int
) -> None:
    args = data.draw(model_args(family), "args")
    model = _build(args, torch.bfloat16 if bf16 else torch.float32, seed, std)
    vocab = args.vocab_size
    g = torch.Generator().manual_seed(seed)

    target = torch.randint(0, vocab, (data.draw(st.integers(2, MAX_LEN), "length"),), generator=g)
    seqs = [target]  # index 0 is the target
    copies = data.draw(st.booleans(), "neighbours_copy_the_target")
    for i in range(data.draw(st.integers(0, 3), "neighbours")):
        n = data.draw(st.integers(1, MAX_LEN), f"neighbour{i}_length")
        seqs.append(target.repeat(MAX_LEN)[:n] if copies else torch.randint(0, vocab, (n,), generator=g))
    n_seqs, length = len(seqs), len(target)

    def placement(mode: str) -> tuple[list[int], bool]:
        """``(order, left)``: the sequence at each batch row, and the padding side."""
        order = data.draw(st.permutations(range(n_seqs)), f"{mode}_rows")
        return order, data.draw(st.booleans(), f"{mode}_left_padded")

    def target_logits(logits: Tensor, order: list[int], left: bool) -> Tensor:
        return logits[order.index(0), _span(logits.shape[1], length, left)]

    def logp(logits: Tensor) -> Tensor:
        """Per-token log-probs ``[L - 1]`` of the target from its logits ``[L, V]``."""
        return _token_logp(model, logits[None], target[None])[0]

    with torch.no_grad():
        want = logp(model(target[None])[0])
    capacity = MAX_LEN + data.draw(st.integers(0, 9), "capacity_beyond_longest")

    # Engine prefill: rows in drawn cache slots of a cache that served other sequences before.
    order, left = placement("prefill")
    ids, mask = _pad([seqs[i] for i in order], left)
    cache = _dirty_cache(model, n_seqs, capacity, seed + 1)
    slots = torch.tensor(data.draw(st.permutations(range(n_seqs)), "prefill_slots"))
    trace = RouterTrace() if args.is_moe else None
    with torch.no_grad():
        prefill = target_logits(model(ids, mask, cache=cache, slots=slots, routing=trace), order, left)
    assert_same_bits(logp(prefill), want, f"prefill {args}")

    # Trainer grad forward, replaying the engine's experts (R3) when drawn.
    routing = None
    if trace is not None and data.draw(st.booleans(), "replay_experts"):
        recorded = trace.stacked()
        per_seq = {s: recorded[r, _span(ids.shape[1], len(seqs[s]), left)] for r, s in enumerate(order)}
        order, left = placement("grad")
        routing = RouterTrace(replay=_pad([per_seq[i] for i in order], left)[0])
    else:
        order, left = placement("grad")
    ids, mask = _pad([seqs[i] for i in order], left)
    model.train()
    with torch.enable_grad():
        grad_logits = model(ids, mask, routing=routing)
    model.eval()
    assert grad_logits.requires_grad
    assert_same_bits(logp(target_logits(grad_logits, order, left)), want, f"grad forward {args}")

    # Trainer scoring forward.
    order, left = placement("score")
    ids, mask = _pad([seqs[i] for i in order], left)
    with torch.no_grad():
        score = target_logits(model(ids, mask), order, left)
    assert_same_bits(logp(score), want, f"scoring {args}")

    # Engine decode: a prompt prefill, then one token per step; a finished row leaves the step
    # (continuous batching) or stays in it masked out.
    prompt = [data.draw(st.integers(1, len(s)), f"decode_prompt{i}") for i, s in enumerate(seqs)]
    order, left = placement("decode")
    slot_of = data.draw(st.permutations(range(n_seqs)), "decode_slots")  # the slot of each sequence
    drop_finished = data.draw(st.booleans(), "drop_finished_rows")
    cache = _dirty_cache(model, n_seqs, capacity, seed + 2)
    with torch.no_grad():
        ids, mask = _pad([seqs[i][: prompt[i]] for i in order], left)
        out = model(ids, mask, cache=cache, slots=torch.tensor([slot_of[i] for i in order]))
        steps = [out[order.index(0), _span(ids.shape[1], prompt[0], left)]]
        done = list(prompt)
        while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
            live = [i for i in order if done[i] < len(seqs[i])]
            rows = live if drop_finished else order
            step_ids = torch.tensor([[seqs[i][done[i]] if i in live else 0] for i in rows])
            step_mask = torch.tensor([[int(i in live)] for i in rows])
            slots = torch.tensor([slot_of[i] for i in rows])
            out = model(step_ids, step_mask, cache=cache, slots=slots)
            if 0 in live:
                steps.append(out[rows.index(0)])
            for i in live:
                done[i] += 1
    assert cache.lengths.tolist() == [len(seqs[slot_of.index(r)]) for r in range(n_seqs)]
    assert_same_bits(logp(torch.cat(steps)), want, f"decode {args}")
