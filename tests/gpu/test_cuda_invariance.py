"""The invariance claims on a CUDA device, natively (skipped without one; ``bench/gpu_check.py`` runs them).

On CUDA, ``kernels=invariant`` resolves to vLLM's batch-invariant kernels (or rlfw's Triton kernels when
vLLM is absent). Each op must give a row the same bits wherever it sits in a batch, and the whole model
the same per-token log-probs in trainer grad forward, trainer scoring, engine prefill and engine decode.
These are the CPU suite's properties on the device the contract will run on.
"""

from __future__ import annotations

import pytest
import torch

from rlfw.kernels.invariant import InvariantOps
from rlfw.kernels.triton_config import MM_SMALL_ROWS
from rlfw.model import build_preset
from rlfw.rollout.forward import pad_right
from tests.model_grads import assert_grads_close, model_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = (torch.float32, torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(7, 255), (48, 64), (1536, 512), (362, 768)])
def test_linear_row_is_batch_invariant(dtype: torch.dtype, n: int, k: int) -> None:
    ops = InvariantOps()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    x = torch.randn(700, k, device="cuda", generator=g).to(dtype)
    # across the launch-tile bound of rlfw's Triton matmul (kernels/triton_config.py)
    for rows in (1, 3, 16, 65, MM_SMALL_ROWS, MM_SMALL_ROWS + 1, 700):
        for at in {0, rows // 2, rows - 1}:
            assert _same(ops.linear(x[:rows], w)[at], ops.linear(x[at : at + 1], w)[0]), (rows, at)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_log_softmax_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    ops = InvariantOps()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(129, 70, device="cuda", generator=g).to(dtype)
    w = torch.randn(70, device="cuda", generator=g).to(dtype)
    logits = (torch.randn(129, 3001, device="cuda", generator=g) * 4).to(dtype)
    for rows in (1, 5, 64, 129):
        at = rows - 1
        assert _same(ops.rms_norm(x[:rows], w, 1e-6)[at], ops.rms_norm(x[at : at + 1], w, 1e-6)[0])
        assert _same(ops.log_softmax(logits[:rows])[at], ops.log_softmax(logits[at : at + 1])[0])


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_four_modes_give_the_same_logp_bits(preset: str, dtype: torch.dtype) -> None:
    model = build_preset(preset, dtype=dtype, seed=7, kernels="invariant").cuda()
    ids = torch.randint(4, 96, (3, 40), generator=torch.Generator().manual_seed(0)).cuda()

    def logp(logits: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        return model.ops.token_logp(logits[:, :-1], ids[rows, 1:])

    model.train()
    grad = logp(model(ids))
    model.eval()
    with torch.no_grad():
        score = logp(model(ids))
        cache = model.new_cache(3, 41)
        prefill = logp(model(ids, cache=model.new_cache(3, 41)))
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(ids.shape[1])]
        decode = logp(torch.cat(steps, dim=1))
        alone = logp(model(ids[1:2]), slice(1, 2))
    assert _same(grad.detach(), score)
    assert _same(score, prefill)
    assert _same(prefill, decode)
    assert _same(score[1:2], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_gradients_match_the_default_ops(dtype: torch.dtype) -> None:
    """The invariant op set's backward passes (the linear's matmuls, the closed form of log-softmax,
    RMSNorm's and the attention's Triton kernels) against the default op set's fp32 gradients."""
    want = model_grads("default", torch.float32, "cuda")
    assert_grads_close(model_grads("invariant", dtype, "cuda"), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_attention_backward_matches_the_torch_closed_form(dtype: torch.dtype, head_dim: int) -> None:
    """rlfw's two attention backward kernels as the GPU compiles them (``tl.dot`` in IEEE fp32, which the
    interpreter never runs) against the torch closed form: several KV tiles, a sequence starting at
    position 3, padding queries."""
    from rlfw.kernels import grads, triton_attention

    g = torch.Generator(device="cuda").manual_seed(5)
    q, grad = (torch.randn(3, 100, 8, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(3, 104, 2, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    q_pos = torch.arange(100, device="cuda").repeat(3, 1)
    q_pos[0] += 3
    q_pos[1, 60:] = -1
    want = grads.attention_grads(q.float(), k.float(), v.float(), q_pos, 0.125, grad.float())
    ours = triton_attention.attention_backward(q, k, v, q_pos, 0.125, grad)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("dq", "dk", "dv"), ours, want, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_batch_keeps_each_rows_bits_and_its_gradient_repeats(dtype: torch.dtype) -> None:
    """The trainer's cache-less forward feeds a group's shared prompt once and leaves padding out
    (``rlfw.model.packing``). On the device each row keeps the bits it has alone, and the gradient, whose
    shared tokens gather every reading row through an accumulating ``index_put_``, repeats bit for bit."""
    model = build_preset("tiny_dense", dtype=dtype, seed=1, kernels="invariant").cuda().train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 96, (9,), generator=g)
    rows = [torch.cat((prompt, torch.randint(4, 96, (n,), generator=g))).cuda() for n in (6, 11, 3, 8)]
    ids, mask = pad_right(rows)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, mask).float().log_softmax(-1)[mask.bool()].sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with torch.no_grad():
        out = model(ids, mask)
        for i, r in enumerate(rows):
            assert _same(out[i, : len(r)], model(r[None])[0])
    first, second = grads(), grads()
    assert first.keys() == second.keys() and first
    for name, grad in first.items():
        assert _same(grad, second[name]), name
