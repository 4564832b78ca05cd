"""The native engine's seeded Gumbel-max draw: the noise is what ``gumbel_noise`` states, a row depends on
its seed alone, and the draws follow the softmax of the logits."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.rollout.sampling import draw, gumbel_noise, step_seed
from tests.kernels.bits import assert_same_bits, torch_threads
from tests.properties import examples

M64 = 2**64


def _noise_as_stated(seed: int, j: int) -> float:
    """Element ``j`` of seed ``seed``'s row, spelt in Python: SplitMix64's (j + 1)-th output, its top 52 bits
    a uniform in (0, 1), ``-log(-log(u))`` with the C library's log, rounded to fp32."""
    z = (seed + (j + 1) * 0x9E3779B97F4A7C15) % M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    u = (((z ^ (z >> 31)) >> 12) + 0.5) * 2.0**-52
    value: float = struct.unpack("f", struct.pack("f", -math.log(-math.log(u))))[0]
    return value


def test_noise_is_the_stated_sequence() -> None:
    seeds = [0, 1, 2**62 + 12345, step_seed(7, 3, 11), 2**63 - 1]
    noise = gumbel_noise(torch.tensor(seeds), 50)
    want = torch.tensor([[_noise_as_stated(s, j) for j in range(50)] for s in seeds])
    assert_same_bits(noise, want, "gumbel noise")
    assert bool(torch.isfinite(noise).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_depends_on_its_seed_alone(threads: int) -> None:
    seeds = torch.tensor([step_seed(0, i, 5) for i in range(9)])
    with torch_threads(threads):
        batch = gumbel_noise(seeds, 362)
    for i in range(len(seeds)):
        assert_same_bits(gumbel_noise(seeds[i : i + 1], 362)[0], batch[i], f"row {i}")
    assert_same_bits(gumbel_noise(seeds.flip(0), 362).flip(0), batch, "reversed batch")


def test_draws_follow_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 40_000
    seeds = torch.tensor([step_seed(123, i, 0) for i in range(n)])
    tokens = draw(logits.expand(n, -1), seeds)
    freq = torch.bincount(tokens, minlength=5).double() / n
    p = torch.softmax(logits.double(), -1)
    sigma = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() < 5 * sigma).all()), (freq.tolist(), p.tolist())


def test_tokens_without_probability_are_never_drawn() -> None:
    logits = torch.full((64, 7), float("-inf"))
    logits[:, 4] = 0.0  # top-k / top-p leave -inf; the finite logit takes every draw
    assert draw(logits, torch.arange(64)).tolist() == [4] * 64


@settings(max_examples=examples(60), deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 12),
    vocab=st.integers(1, 3000),
    scale=st.sampled_from([0.0, 1e-6, 0.3, 3.0, 40.0, 1e5]),
)
def test_the_compiled_draw_is_the_exact_argmax(
    data: st.DataObject, rows: int, vocab: int, scale: float
) -> None:
    """``draw`` on the CPU bounds every entry with a cheap log and computes the exact noise only where an
    entry can win; its token is ``argmax(logits + gumbel_noise)``'s, ties to the lowest id, on drawn
    logits with masked (-inf) and infinite entries, rows of one finite entry, forced ties and NaN rows."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed"))
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    logits = torch.randn(rows, vocab, generator=g) * scale
    noise = gumbel_noise(seeds, vocab)
    for r in range(rows):
        case = data.draw(st.sampled_from(["plain", "masked", "ties", "inf", "all-masked", "nan"]), f"row {r}")
        if case == "masked":  # what top-k / top-p leave
            logits[r, torch.rand(vocab, generator=g) < 0.9] = float("-inf")
        elif case == "ties":  # entries whose noisy value is the same float: the lowest id must win
            tied = torch.randint(0, vocab, (3,), generator=g)
            logits[r, tied] = logits[r].max() + 50.0 - noise[r, tied]
        elif case == "inf":
            logits[r, torch.randint(0, vocab, (2,), generator=g)] = float("inf")
        elif case == "all-masked":
            logits[r] = float("-inf")
        elif case == "nan":
            logits[r, torch.randint(0, vocab, (1,), generator=g)] = float("nan")
    want = torch.argmax(logits + noise, dim=-1)
    assert draw(logits, seeds).tolist() == want.tolist()
