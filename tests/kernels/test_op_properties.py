"""Property tests of every invariant op besides the linear: a row gets the same bits whatever the batch.

``kernels=invariant`` promises that a row's result depends on that row alone. Each property computes a
row alone (a one-row batch, no grad) and again inside a drawn batch, then compares bits. Drawn, never
picked: sizes from 1 up, mostly not multiples of 4, 8 or 16 (head_dim down to 4, vocabularies across the
1024-element reduction chunk, a handful of experts), the row's index in a batch of up to three leading
dims, what the neighbours hold (random, zeros, ~1e30 whose squares overflow, copies of the row), what the
row holds (ties, signed zeros, subnormals, ``-inf`` for processed logits), fp32 or bf16, and whether the
batch runs as the trainer's grad forward or as scoring. Attention gets the same treatment per query:
a query's output does not depend on its batch index, the other sequences, how many queries of its
sequence run together (a prefill chunk against one-token decode steps) or the cache slots past its
position. If one of these breaks, trainer and engine log-probs stop being bitwise equal on some shapes.

The default run is bounded (about 10 s of test time on two cores); 20 times as many examples (about
3 minutes):

    RLFW_HYPOTHESIS_PROFILE=long pytest tests/kernels/test_op_properties.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlfw.kernels.invariant import InvariantOps
from rlfw.kernels.reduce import SUM_CHUNK
from tests.kernels.bits import NEIGHBOURS, assert_same_bits, surround
from tests.properties import examples

INV = InvariantOps(backend="torch")
CONTENTS = ("normal", "wide", "ties", "signed_zeros", "subnormal")
"""What the row under test holds; logits may also be ``masked`` (``-inf`` where a top-k/top-p removed
a token, as the trainer and engine feed them to log_softmax and token_logp)."""
STALE = ("nan", "huge", "random", "zeros")
"""What cache slots past a sequence's written length hold (memory never written, or left by another)."""

seeds = st.integers(0, 2**16)
neighbours = st.sampled_from(NEIGHBOURS)
contents = st.sampled_from(CONTENTS)


def _dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def _values(shape: tuple[int, ...], dtype: torch.dtype, content: str, seed: int) -> Tensor:
    """A tensor of ``content`` (see :data:`CONTENTS`), rounded once to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if content == "wide":
        x = x * 30.0
    elif content == "ties":  # few distinct values: exact ties, exact zeros
        x = torch.randint(-2, 3, shape, generator=g).float()
    elif content == "signed_zeros":  # about half the entries zero, keeping the sign of the draw
        x = torch.where(torch.rand(shape, generator=g) < 0.5, x * 0.0, x)
    elif content == "subnormal":
        x = x * 1e-39
    elif content == "masked":  # about half the entries -inf, at least one finite per row
        x = x.masked_fill(torch.rand(shape, generator=g) < 0.5, float("-inf"))
        keep = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=g)
        x = x.scatter(-1, keep, torch.randn((*shape[:-1], 1), generator=g))
    elif content != "normal":
        raise ValueError(f"content={content!r}")
    return x.to(dtype)


@st.composite
def placements(
    draw: st.DrawFn, min_dims: int = 1, max_dims: int = 3, max_size: int = 9
) -> tuple[tuple[int, ...], ...]:
    """``(lead, at)``: a batch shape of ``min_dims..max_dims`` dims and the row's index in it."""
    lead = tuple(draw(st.lists(st.integers(1, max_size), min_size=min_dims, max_size=max_dims)))
    return lead, tuple(draw(st.integers(0, n - 1)) for n in lead)


def _scored(fn: Callable[..., Any], *inputs: Tensor) -> Any:
    with torch.no_grad():
        return fn(*inputs)


def _run(grad: bool, fn: Callable[..., Any], *inputs: Tensor) -> Any:
    """``fn(*inputs)`` as the trainer's grad forward (float inputs require grad) or as scoring."""
    if not grad:
        return _scored(fn, *inputs)
    inputs = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)
    with torch.enable_grad():
        return fn(*inputs)


def _ids(row: Tensor, lead: tuple[int, ...], at: tuple[int, ...], kind: str, bound: int, seed: int) -> Tensor:
    """Integer ids ``[*lead, *row.shape]``: copies of ``row`` or random ids below ``bound``, ``row`` at
    ``at``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "copies":
        batch = row.expand((*lead, *row.shape)).clone()
    else:
        batch = torch.randint(0, bound, (*lead, *row.shape), generator=g)
    batch[at] = row
    return batch


@settings(max_examples=examples(120), deadline=None)
# Found by the long profile: a zero bf16 row with eps=0 normalises to NaN, and the final bf16
# `weight * normed` gives it the NaN 0x7fc0 alone (torch's scalar path) but 0xffff as one of 32
# contiguous elements (its 32-wide SIMD path): a row's bits then depend on the batch.
@example(
    d=1, place=((32,), (0,)), kind="random", content="signed_zeros", eps=0.0, bf16=True, grad=False, seed=0
)
@given(
    d=st.integers(1, SUM_CHUNK + 300),
    place=placements(),
    kind=neighbours,
    content=contents,
    eps=st.sampled_from([0.0, 1e-6, 1e-5]),
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_rms_norm(
    d: int,
    place: tuple[tuple[int, ...], ...],
    kind: str,
    content: str,
    eps: float,
    bf16: bool,
    grad: bool,
    seed: int,
) -> None:
    """``eps`` may be 0 (a config may say so): a zero row then normalises to NaN, whose bits must not
    depend on the batch either."""
    lead, at = place
    dtype = _dtype(bf16)
    row, weight = _values((d,), dtype, content, seed), _values((d,), dtype, "normal", seed + 1)

    def op(x: Tensor, w: Tensor) -> Tensor:
        return INV.rms_norm(x, w, eps)

    alone = _scored(op, row[None], weight)[0]
    batch = surround(row, lead, at, kind, seed + 2)
    assert_same_bits(_run(grad, op, batch, weight)[at], alone, f"rms_norm d={d} lead={lead} at={at}")


@settings(max_examples=examples(120), deadline=None)
@given(
    heads=st.integers(1, 6),
    d=st.integers(1, 160),
    place=placements(min_dims=2, max_dims=2, max_size=7),
    kind=neighbours,
    content=contents,
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_rope(
    heads: int,
    d: int,
    place: tuple[tuple[int, ...], ...],
    kind: str,
    content: str,
    bf16: bool,
    grad: bool,
    seed: int,
) -> None:
    """One token ``x [H, D]`` with its fp32 ``cos``/``sin [D]``, at ``(b, t)`` of ``[B, T, H, D]``."""
    (b, t), at = place
    x = _values((heads, d), _dtype(bf16), content, seed)
    angle = torch.rand(d, generator=torch.Generator().manual_seed(seed + 1)) * 100.0
    cos, sin = angle.cos(), angle.sin()
    alone = _scored(INV.rope, x[None, None], cos[None, None], sin[None, None])[0, 0]
    xs = surround(x, (b, t), at, kind, seed + 2)
    coss, sins = (surround(c, (b, t), at, kind, seed + 3 + i) for i, c in enumerate((cos, sin)))
    got = _run(grad, INV.rope, xs, coss, sins)[at]
    assert_same_bits(got, alone, f"rope H={heads} D={d} B={b} T={t} at={at}")


@settings(max_examples=examples(120), deadline=None)
@given(
    d=st.integers(1, 300),
    place=placements(),
    kind=neighbours,
    content=contents,
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_silu_mul(
    d: int, place: tuple[tuple[int, ...], ...], kind: str, content: str, bf16: bool, grad: bool, seed: int
) -> None:
    # Without grad silu_mul runs its IEEE ops in place on one buffer; `grad` checks that path too.
    lead, at = place
    dtype = _dtype(bf16)
    gate, up = _values((d,), dtype, content, seed), _values((d,), dtype, "wide", seed + 1)
    alone = _scored(INV.silu_mul, gate[None], up[None])[0]
    gates, ups = surround(gate, lead, at, kind, seed + 2), surround(up, lead, at, kind, seed + 3)
    assert_same_bits(_run(grad, INV.silu_mul, gates, ups)[at], alone, f"silu_mul d={d} lead={lead} at={at}")


def _stale(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> Tensor:
    """Cache slots nobody wrote for this sequence (see :data:`STALE`)."""
    if kind == "nan":
        return torch.full(shape, float("nan"), dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (x * 1e30 if kind == "huge" else x).to(dtype)


def _decode_alone(q: Tensor, k: Tensor, v: Tensor, p: int, scale: float) -> Tensor:
    """Query ``p`` of a sequence as a one-token decode step: a one-row batch whose cache holds exactly
    slots ``0..p`` (``q [L, Hq, D]``, ``k``/``v [L, Hkv, D]``); ``[Hq, D]``."""
    with torch.no_grad():
        out = INV.attention(
            q[None, p : p + 1], k[None, : p + 1], v[None, : p + 1], torch.tensor([[p]]), scale
        )
    return out[0, 0]


@settings(max_examples=examples(150), deadline=None)
@given(
    hkv=st.integers(1, 3),
    group=st.integers(1, 4),
    d=st.integers(4, 80),
    length=st.integers(1, 48),
    content=contents,
    kind=neighbours,
    stale=st.sampled_from(STALE),
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
    data=st.data(),
)
def test_attention(
    hkv: int,
    group: int,
    d: int,
    length: int,
    content: str,
    kind: str,
    stale: str,
    bf16: bool,
    grad: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    """Queries ``start..length-1`` of a sequence (a prefill chunk after ``start`` cached tokens, padded
    left or right) in a batch of other sequences with their own positions and padding, over a cache of
    capacity ``S >= length`` whose slots past ``length`` hold stale values, give each query the bits of
    that query decoded alone over a cache of exactly its visible slots."""
    dtype, hq, scale = _dtype(bf16), hkv * group, d**-0.5
    start = data.draw(st.integers(0, length - 1), "start")
    pad = data.draw(st.integers(0, 3), "pad")
    left = data.draw(st.booleans(), "left_padded")
    capacity = length + data.draw(st.integers(0, 40), "capacity_beyond_length")
    rows = data.draw(st.integers(1, 4), "rows")
    at = data.draw(st.integers(0, rows - 1), "at")
    n_q = length - start + pad

    q, k, v = (_values((length, h, d), dtype, content, seed + i) for i, h in enumerate((hq, hkv, hkv)))
    want = [_decode_alone(q, k, v, p, scale) for p in range(start, length)]

    pad_q = _values((pad, hq, d), dtype, "wide", seed + 3)  # padding queries: their content is irrelevant
    q_row = torch.cat([pad_q, q[start:]] if left else [q[start:], pad_q])
    k_row, v_row = (
        torch.cat([x, _stale((capacity - length, hkv, d), dtype, stale, seed + 5 + i)])
        for i, x in enumerate((k, v))
    )
    chunk = torch.arange(start, length)
    no_pos = torch.full((pad,), -1)
    pos_row = torch.cat([no_pos, chunk] if left else [chunk, no_pos])

    qs = surround(q_row, (rows,), (at,), kind, seed + 7)
    ks = surround(k_row, (rows,), (at,), kind, seed + 8)
    vs = surround(v_row, (rows,), (at,), kind, seed + 9)
    pos = pos_row.expand(rows, n_q).clone()
    for r in [r for r in range(rows) if r != at]:  # each neighbour: its own positions, padded either side
        n = data.draw(st.integers(0, min(n_q, capacity)), f"row{r}_queries")
        first = data.draw(st.integers(0, capacity - n), f"row{r}_first_position")
        pos[r] = torch.cat([torch.full((n_q - n,), -1), torch.arange(first, first + n)])
        if data.draw(st.booleans(), f"row{r}_right_padded"):
            pos[r] = pos[r].roll(-(n_q - n))

    out = _run(grad, lambda *t: INV.attention(*t, scale), qs, ks, vs, pos)[at]
    got, padding = (out[pad:], out[:pad]) if left else (out[: length - start], out[length - start :])
    assert bool((padding == 0).all()), "padding queries must return zeros"
    for i, p in enumerate(range(start, length)):
        what = f"attention Hq={hq} Hkv={hkv} D={d} q_pos={p} chunk={start}..{length} S={capacity}"
        assert_same_bits(got[i], want[i], f"{what} rows={rows} at={at}")


logit_contents = st.sampled_from((*CONTENTS, "masked"))
vocab = st.integers(1, 3 * SUM_CHUNK + 50)  # across the 1024-element chunks of the row sums


@settings(max_examples=examples(100), deadline=None)
@given(
    v=vocab,
    place=placements(max_dims=2),
    kind=neighbours,
    content=logit_contents,
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_log_softmax(
    v: int, place: tuple[tuple[int, ...], ...], kind: str, content: str, bf16: bool, grad: bool, seed: int
) -> None:
    lead, at = place
    row = _values((v,), _dtype(bf16), content, seed)
    alone = _scored(INV.log_softmax, row[None])[0]
    batch = surround(row, lead, at, kind, seed + 1)
    assert_same_bits(_run(grad, INV.log_softmax, batch)[at], alone, f"log_softmax V={v} lead={lead} at={at}")


@settings(max_examples=examples(100), deadline=None)
@given(
    v=vocab,
    token=st.integers(0, 2**20),
    place=placements(max_dims=2),
    kind=neighbours,
    content=logit_contents,
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_token_logp(
    v: int,
    token: int,
    place: tuple[tuple[int, ...], ...],
    kind: str,
    content: str,
    bf16: bool,
    grad: bool,
    seed: int,
) -> None:
    """The engine's ``token_logp`` of a token, whatever the batch, has the bits of the trainer's
    ``log_softmax`` gathered at that token."""
    lead, at = place
    row, token_id = _values((v,), _dtype(bf16), content, seed), torch.tensor(token % v)
    alone = _scored(INV.token_logp, row[None], token_id[None])[0]
    assert_same_bits(
        alone, _scored(INV.log_softmax, row[None])[0, token_id], f"gather V={v} token={token_id}"
    )
    batch, ids = surround(row, lead, at, kind, seed + 1), _ids(token_id, lead, at, kind, v, seed + 2)
    assert_same_bits(
        _run(grad, INV.token_logp, batch, ids)[at], alone, f"token_logp V={v} lead={lead} at={at}"
    )


@settings(max_examples=examples(100), deadline=None)
@given(
    v=vocab,
    place=placements(max_dims=2),
    kind=neighbours,
    content=contents,
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_entropy(
    v: int, place: tuple[tuple[int, ...], ...], kind: str, content: str, bf16: bool, grad: bool, seed: int
) -> None:
    lead, at = place
    row = _values((v,), _dtype(bf16), content, seed)
    alone = _scored(INV.entropy, row[None])[0]
    batch = surround(row, lead, at, kind, seed + 1)
    assert_same_bits(_run(grad, INV.entropy, batch)[at], alone, f"entropy V={v} lead={lead} at={at}")


experts = st.integers(1, 24)


@settings(max_examples=examples(120), deadline=None)
@given(
    e=experts,
    k=st.integers(1, 24),
    place=placements(max_dims=1, max_size=40),
    kind=neighbours,
    content=contents,
    norm=st.booleans(),
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_router_topk(
    e: int,
    k: int,
    place: tuple[tuple[int, ...], ...],
    kind: str,
    content: str,
    norm: bool,
    bf16: bool,
    grad: bool,
    seed: int,
) -> None:
    """A token's experts (ties to the lowest index) and gate weights do not depend on the other tokens;
    replaying those experts (R3) gives the router's weights bit for bit."""
    (n,), at = place
    k = 1 + (k - 1) % e

    def topk(x: Tensor) -> tuple[Tensor, Tensor]:
        return INV.router_topk(x, k, norm)

    row = _values((e,), _dtype(bf16), content, seed)
    w_alone, ids_alone = _scored(topk, row[None])
    logits = surround(row, (n,), at, kind, seed + 1)
    w, ids = _run(grad, topk, logits)
    what = f"router_topk E={e} k={k} N={n} at={at} norm={norm}"
    assert torch.equal(ids[at], ids_alone[0]), (
        f"{what}: experts {ids[at].tolist()} != {ids_alone[0].tolist()}"
    )
    assert_same_bits(w[at], w_alone[0], what)
    assert_same_bits(_run(grad, lambda x: INV.router_weights(x, ids, norm), logits), w, f"{what} replay")


@settings(max_examples=examples(120), deadline=None)
@given(
    e=experts,
    k=st.integers(1, 24),
    place=placements(max_dims=1, max_size=40),
    kind=neighbours,
    content=contents,
    norm=st.booleans(),
    bf16=st.booleans(),
    grad=st.booleans(),
    seed=seeds,
)
def test_router_weights(
    e: int,
    k: int,
    place: tuple[tuple[int, ...], ...],
    kind: str,
    content: str,
    norm: bool,
    bf16: bool,
    grad: bool,
    seed: int,
) -> None:
    """Replayed experts (any ``k`` distinct ids, not necessarily the router's choice) get gate weights
    that do not depend on the other tokens or on their replayed experts."""
    (n,), at = place
    k = 1 + (k - 1) % e
    g = torch.Generator().manual_seed(seed)
    row, chosen = _values((e,), _dtype(bf16), content, seed), torch.randperm(e, generator=g)[:k]
    alone = _scored(lambda x, i: INV.router_weights(x, i, norm), row[None], chosen[None])[0]
    logits = surround(row, (n,), at, kind, seed + 1)
    ids = (
        chosen.expand(n, k).clone() if kind == "copies" else torch.rand(n, e, generator=g).argsort(-1)[:, :k]
    )
    ids[at] = chosen
    got = _run(grad, lambda x, i: INV.router_weights(x, i, norm), logits, ids)[at]
    assert_same_bits(got, alone, f"router_weights E={e} k={k} N={n} at={at} norm={norm}")
