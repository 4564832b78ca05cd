"""What the trainer reads of its LM head: the next token's log-prob, the sampler's top-k log-probs and the
entropy, in a closed-form autograd function over the distinct computed tokens, optionally in chunks of
positions whose logits the backward recomputes.

If one of these breaks, the trainer's log-probs stop being the engine's bits (the ratio factors read
mismatch where the contract holds), its gradient stops being the loss's (training follows a wrong
direction or NaN, as autograd through the masked entropy gave), or a run at a real vocabulary holds the
whole ``[n, V]`` logits again.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.kernels import get_ops, threads
from rlfw.model import distribution
from rlfw.model.distribution import Transforms, process_logits
from rlfw.trainer.logprobs import DistributionRows, trainer_logp
from tests.head_rows import head_rows
from tests.kernels.bits import assert_same_bits
from tests.properties import examples
from tests.trainer.one_rank import run_one_rank
from tests.trainer.test_step import _batch

TRANSFORMS = st.sampled_from(
    [
        Transforms(),
        Transforms(temperature=0.7),
        Transforms(temperature=1.3, top_k=7),
        Transforms(top_p=0.8),
        Transforms(temperature=0.9, min_p=0.05),
    ]
)


def _float64_reads(
    z: torch.Tensor, t: Transforms, row_of: torch.Tensor, targets: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reads by float64 autograd through the transforms (entropy's masked terms dropped, not NaN)."""
    logp = torch.log_softmax(process_logits(z, t).double(), -1)[row_of]
    kept = logp.isfinite()
    ent = -torch.where(kept, logp.exp() * logp.masked_fill(~kept, 0.0), 0.0).sum(-1)
    return logp.gather(-1, targets).squeeze(-1), logp.gather(-1, topk_ids), ent


@settings(max_examples=examples(25), deadline=None)
@given(
    data=st.data(),
    t=TRANSFORMS,
    rows=st.integers(1, 40),
    vocab=st.integers(9, 300),
    shared=st.booleans(),
    entropy_grad=st.booleans(),
)
def test_the_reads_have_the_ops_bits_and_the_float64_gradient(
    data: st.DataObject, t: Transforms, rows: int, vocab: int, shared: bool, entropy_grad: bool
) -> None:
    """Forward: the bits of gathering from ``log_softmax(process_logits(logits))`` (what the engines
    compute). Backward: float64 autograd's gradient, finite under every transform (autograd through the
    entropy's ``p log p`` gives NaN where a transform masked a token)."""
    ops = get_ops("invariant")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    z = (torch.randn(rows, vocab, generator=g) * 3).requires_grad_()
    entries = data.draw(st.integers(1, 50), "entries") if shared else rows
    row_of = torch.randint(0, rows, (entries,), generator=g) if shared else torch.arange(rows)
    # the sampled token is in the transforms' support: the most likely one, or any without masks
    targets = z.detach().argmax(-1, keepdim=True)[row_of]
    if t.top_k == 0 and t.top_p == 1.0 and t.min_p == 0.0:
        targets = torch.randint(0, vocab, (entries, 1), generator=g)
    topk_ids = torch.randint(0, vocab, (entries, 3), generator=g)  # masked ones read -inf
    reads = DistributionRows(ops.log_softmax, t, True, entropy_grad)
    block_rows = data.draw(st.integers(1, rows), "block_rows")  # rows per block of the forward and backward
    with mock.patch.object(distribution, "ROW_BLOCK_BYTES", 4 * vocab * block_rows):
        logp, topk, ent = reads.apply(z, row_of if shared else None, targets, topk_ids)
    assert logp is not None and topk is not None and ent is not None

    expected = ops.log_softmax(process_logits(z.detach(), t))[row_of]
    assert_same_bits(logp, expected.gather(-1, targets).squeeze(-1), "logp")
    assert_same_bits(topk, expected.gather(-1, topk_ids), "topk_logp")

    w = [torch.randn(entries, *k, generator=g) for k in [(), (3,), ()]]

    def loss(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        out = (a * w[0]).sum() + (b.nan_to_num(neginf=0.0) * w[1]).sum()
        return out + (c * w[2]).sum() if entropy_grad else out

    with mock.patch.object(distribution, "ROW_BLOCK_BYTES", 4 * vocab * block_rows):
        (grad,) = torch.autograd.grad(loss(logp, topk, ent), z)
    z64 = z.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(loss(*_float64_reads(z64, t, row_of, targets, topk_ids)), z64)
    assert grad.isfinite().all()
    # fp32 sums of the entries' weights: the error scales with them (a row whose support is one token
    # has a zero gradient, reached as g - g * 1)
    scale = float(want.abs().max()) + sum(float(x.abs().sum()) for x in w)
    torch.testing.assert_close(grad.double(), want, rtol=0.0, atol=1e-6 * scale)


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_head_in_chunks_gives_the_unchunked_bits_and_gradients(
    preset: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chunk_mib``: the head runs over chunks of at most that many MiB of logits (here 5 positions),
    each recomputed in the backward. Every read keeps its bits; the gradients sum the chunks' weight
    gradients in another order, so they agree to fp32 rounding."""
    threads.set_lender((lambda: 1) if compiled else None)
    try:
        model, batch = _batch(preset)
        t = Transforms(temperature=0.8)
        chunk_mib = 5 * 4 * model.args.vocab_size / 2**20  # five rows of fp32 logits
        outs, grads = [], []
        for mib in (0.0, chunk_mib):
            rows = head_rows(monkeypatch, model)
            out = trainer_logp(
                model, model, batch, t, replay=True, topk=True, entropy=True, entropy_grad=True, chunk_mib=mib
            )
            assert out.topk_logp is not None and out.entropy is not None
            loss = (out.logp * batch.mask).sum() + 0.1 * out.entropy.sum() + 0.01 * out.topk_logp.sum()
            loss.backward()
            outs.append(out)
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
            monkeypatch.undo()
            if mib > 0:  # the forward's chunks, then the backward's recomputation of each
                assert max(rows) <= 5 and sum(rows) >= 2 * int(batch.mask.sum()) - 10
        whole, chunked = outs
        assert_same_bits(chunked.logp, whole.logp, "logp")
        assert_same_bits(chunked.topk_logp, whole.topk_logp, "topk_logp")  # type: ignore[arg-type]
        assert_same_bits(chunked.entropy, whole.entropy, "entropy")  # type: ignore[arg-type]
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, rtol=0.0, atol=1e-5 * float(g.abs().max()))
    finally:
        threads.set_lender(None)


def test_the_head_in_chunks_under_zero3() -> None:
    """ZeRO-3 gathers the tied embedding where the head uses it, also when a chunk is recomputed in the
    backward: the same log-probs and gradients as stage 0."""
    script = """
from deepspeed.utils import safe_get_full_grad
from rlfw.model.distribution import Transforms
from rlfw.trainer.logprobs import DistributionRows
ids = torch.randint(4, 90, (3, 12), generator=torch.Generator().manual_seed(0))
scored = torch.zeros(3, 11, dtype=torch.bool)
scored[:, 4:] = True
targets = ids[:, 1:][scored][:, None]
runs = {}
for stage in (0, 3):
    model = build_preset("tiny_dense", seed=0, kernels="invariant").train()
    backend = DeepSpeedBackend(model, OptimConfig(1e-3, 0.0, 1.0, 0, "constant", 10, stage, "fp32"))
    reads = DistributionRows(model.ops.log_softmax, Transforms(), False, False)
    def read(logits, row_of, entries):
        return reads.apply(logits, row_of, targets[entries], None)[:1]
    (logp,) = backend.module(ids[:, :-1], None, scored=scored, read=read, chunk_rows=5)
    backend.backward(-logp.mean())
    grads = {n: safe_get_full_grad(p).clone() for n, p in backend.module.named_parameters()}
    runs[stage] = logp.detach(), grads
    backend.step()
(a, ga), (b, gb) = runs[0], runs[3]
diff = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
print(json.dumps({"same_logp": bool(torch.equal(a, b)), "grad_diff": diff}))
"""
    out = run_one_rank(script)
    assert out["same_logp"]
    assert out["grad_diff"] < 1e-6
