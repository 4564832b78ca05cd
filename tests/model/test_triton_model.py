"""The whole tiny model on ``kernels=invariant`` with the Triton backend gives a sequence the same bits in
every mode and every batch placement.

``tests/model/test_invariance.py`` locks this promise for the torch backend; this file locks it for the
Triton kernels (matmul, RMSNorm, attention, log-softmax/token gather) as the model composes them, under
``TRITON_INTERPRET=1`` on CPU. If a change breaks it, trainer and engine log-probs differ on CUDA runs,
and the trainer and decode factors of the ratio are no longer exactly 1.

``TRITON_INTERPRET`` is set here, as ``tests/kernels/conftest.py`` does, before any Triton kernel module
is imported: Triton 3.x reads it when ``@triton.jit`` decorates a kernel (and ``rlfw.kernels.triton_dot``
when it is imported), not when ``triton`` itself is imported. Those modules are imported only by
``InvariantOps(backend="triton")``, so setting it at collection is early enough; ``_triton_model`` checks it.

The model is built with ``kernels=invariant`` and its op set is then swapped for the Triton backend
(``Transformer.ops`` is what every forward reads). The interpreter runs each kernel program in Python
(2 to 3 s per forward of the tiny model), so the sequences are short: 5 tokens, one 32-slot KV tile;
the tile boundary and chunked-prefill splits are covered on the torch backend in ``test_invariance``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from rlfw.kernels.invariant import InvariantOps  # noqa: E402
from rlfw.model import Transformer, build_preset  # noqa: E402
from tests.kernels.bits import assert_same_bits  # noqa: E402

pytestmark = pytest.mark.slow

T = 5
"""Tokens per sequence. In the batch the target's flattened rows are 5..9 of a 64-row matmul tile,
alone they are rows 0..4: a different place in the tile, where BLAS-like orders would differ."""
LENGTHS = (T - 2, T)
"""Row 0 is right-padded, so every mode also runs with an attention mask and a padded neighbour."""
TARGET = 1


def _seq(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``ids, mask [2, T]``: the target sequence at row ``TARGET`` after a shorter neighbour."""
    ids = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, :n], mask[row, :n] = _seq(n, 10 + row), 1
    return ids, mask


def _triton_model(preset: str, dtype: torch.dtype) -> Transformer:
    pytest.importorskip("triton")
    from rlfw.kernels import triton_dot

    assert triton_dot.INTERPRETED, "rlfw.kernels.triton_* was imported before TRITON_INTERPRET=1 was set"
    model = build_preset(preset, dtype=dtype, seed=7, kernels="invariant")
    model.ops = InvariantOps(backend="triton")
    return model


def _logp(model: Transformer, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs ``[B, T-1]`` fp32 of ``ids[:, 1:]``, by the model's own op set."""
    return model.ops.token_logp(logits[:, :-1], ids[:, 1:])


def _check(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor, what: str) -> None:
    """Bits equal at the real tokens; on failure, say how far apart the values are."""
    a, b = a.detach()[valid], b.detach()[valid]
    gap = (a - b).abs().max().item()
    assert_same_bits(a, b, f"{what} (max |d logp| = {gap:.3g})")


# Dense in fp32 and MoE in bf16 (each case costs ~25 s under the interpreter; the other two combinations
# add no op the two do not run: `RLFW_TRITON_ALL_CASES=1` runs all four).
CASES = [("tiny_dense", torch.float32), ("tiny_moe", torch.bfloat16)]
if os.environ.get("RLFW_TRITON_ALL_CASES") == "1":
    CASES = [(p, d) for p in ("tiny_dense", "tiny_moe") for d in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("preset", "dtype"), CASES)
def test_four_modes_and_batch_placement_give_the_same_logp_bits(preset: str, dtype: torch.dtype) -> None:
    model = _triton_model(preset, dtype)
    ids, mask = _batch()
    valid = mask[:, 1:].bool()  # positions whose next token is real
    with torch.no_grad():
        score = _logp(model, model(ids, mask), ids)
        cache = model.new_cache(num_slots=len(LENGTHS), capacity=T)
        prefill = _logp(model, model(ids, mask, cache=cache), ids)
        cache = model.new_cache(num_slots=len(LENGTHS), capacity=T)
        steps = [model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache) for t in range(T)]
        decode = _logp(model, torch.cat(steps, dim=1), ids)
        alone = _logp(model, model(ids[TARGET : TARGET + 1]), ids[TARGET : TARGET + 1])
    assert cache.lengths.tolist() == list(LENGTHS)
    grad = _logp(model, model.train()(ids, mask), ids)
    assert grad.requires_grad

    _check(grad, score, valid, "trainer grad forward vs trainer scoring")
    _check(score, prefill, valid, "trainer scoring vs engine prefill")
    _check(prefill, decode, valid, "engine prefill vs engine decode")
    _check(score[TARGET : TARGET + 1], alone, valid[TARGET : TARGET + 1], "row in a batch vs alone")

    # Identical bits are worth something only if they are right: the Triton model agrees with the torch
    # backend's to rounding (not bitwise: the order inside a tile differs).
    model.ops = InvariantOps(backend="torch")
    with torch.no_grad():
        reference = _logp(model, model.eval()(ids, mask), ids)
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # measured: 5e-7 fp32, 6e-3 bf16 (tiny_dense)
    torch.testing.assert_close(score[valid], reference[valid], atol=tol, rtol=tol)
