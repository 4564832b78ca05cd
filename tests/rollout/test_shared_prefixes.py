"""Which tokens of a vLLM step the shared model computes once: :func:`shared_prefixes`."""

from __future__ import annotations

from rlfw.model.packing import shared_prefixes


def flat(*requests: list[int]) -> tuple[list[int], list[int]]:
    """A step's flat tokens and each request's start offset (vLLM's ``query_start_loc``)."""
    tokens = [t for r in requests for t in r]
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + len(r))
    return tokens, starts


def test_a_groups_prompt_is_computed_once() -> None:
    tokens, starts = flat([5, 6, 7], [5, 6, 7], [5, 6, 7])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_tokens_after_two_sequences_part_are_their_own() -> None:
    # the second shares [5, 6] with the first; its 9 at position 3 matches the first's token there but
    # follows a different prefix, so it is computed; the third shares the second's whole prefix.
    tokens, starts = flat([5, 6, 7, 9], [5, 6, 8, 9], [5, 6, 8, 9, 4])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) == [0, 1, 2, 3, 0, 1, 6, 7, 0, 1, 6, 7, 12]


def test_a_request_continuing_from_earlier_positions_takes_no_part() -> None:
    # the second request's tokens sit at positions 2 onwards (a cached prefix): same ids, other prefix
    tokens, starts = flat([5, 6, 7], [5, 6, 7], [5, 6])
    assert shared_prefixes(tokens, starts, [0, 2, 0]) == [0, 1, 2, 3, 4, 5, 0, 1]


def test_nothing_shared_is_none() -> None:
    tokens, starts = flat([5, 6], [6, 5], [7])
    assert shared_prefixes(tokens, starts, [0, 0, 0]) is None
    assert shared_prefixes(*flat([5, 6], [5, 6]), [0, 3]) is None
