"""A batch's distinct tokens, computed once: no padding, and a prefix several rows share fed once.

The samples of a GRPO group repeat their prompt, and a padded batch ``[B, T]`` carries every row out to the
longest. A forward without a cache (training and scoring) therefore feeds each group's prompt once per
sample and computes the padding too. :class:`PackedRows` lays such a batch out as the tokens it has to
compute: a token whose whole prefix, from position 0, an earlier row also holds takes that row's token
(:func:`shared_prefixes`), and padding is left out. Linears, norms and the MLP run over these rows alone;
the attention puts each row's keys and values back at their positions, a shared token's from the row that
computed it, so every query still reduces over its own sequence.

Under batch-invariant kernels this is exact: a row's bits do not depend on which other rows the call
computes, and the attention reduces each query over the same positions in the same order whichever layout
it came from. Gradients are the same sums in another order (a shared token's gradient gathers every row
that reads it). That gather is autograd's backward of the indexing below, an accumulating ``index_put_``:
serial on the CPU, and on CUDA PyTorch's sort-based accumulation (its path for every accumulating
``index_put_`` there), which adds a token's readers in a fixed order, so gradients repeat bit for bit
(``tests/gpu`` checks it on a device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.kernels import Ops


def shared_prefixes(tokens: list[int], starts: list[int], first: list[int]) -> list[int] | None:
    """For a flat batch of ``tokens`` (row ``r`` feeds ``tokens[starts[r]:starts[r + 1]]`` from position
    ``first[r]``), each token's source: the earliest token of the batch with the same tokens up to and
    including it, from position 0. ``None`` if every token is its own source.

    Only rows fed from position 0 take part (a row continuing after cached or earlier positions has a
    prefix this batch does not see)."""
    source = list(range(len(tokens)))
    nodes: dict[tuple[int, int], int] = {}  # (source of the previous token, token) -> source
    copies = False
    for r, start in enumerate(starts[:-1]):
        if first[r] != 0:
            continue
        previous = -1
        for i in range(start, starts[r + 1]):
            key = (previous, tokens[i])
            found = nodes.get(key)
            if found is None:
                nodes[key] = i
                previous = i
            else:
                source[i] = previous = found
                copies = True
    return source if copies else None


def computed_rows(source: list[int], device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """From :func:`shared_prefixes`' sources: ``computed [n]``, whether each token is its own source (the
    tokens a forward computes), and ``index [n]``, the row of each token's source among the computed."""
    src = torch.tensor(source, device=device)
    computed = src == torch.arange(len(source), device=device)
    return computed, (computed.cumsum(0) - 1)[src]


@dataclass(eq=False)
class PackedRows:
    """The ``N`` tokens a cache-less forward over ``[B, T]`` computes, and where each batch entry reads.

    ``ids``/``positions [1, N]``: the computed tokens, row-major. ``fed [N]``: each one's place in the
    batch, as a row of the flattened ``[B * T]``, and ``q_pos [B, T]`` the position of the tokens computed
    there (``-1`` elsewhere: padding, and tokens another row computes). ``kv_at``/``kv_src [M]``: for each
    of the batch's ``M`` tokens, its place in the keys' layout (a row of the flattened ``[B * span]``: its
    batch row, its position) and the computed token that holds its keys and values.
    ``at [B, T]``: the computed token each batch entry reads its output from (padding: its row's first
    token, so that no entry of a row depends on the other rows).
    """

    ids: Tensor
    positions: Tensor
    fed: Tensor
    q_pos: Tensor
    kv_at: Tensor
    kv_src: Tensor
    at: Tensor
    span: int

    @staticmethod
    def of(input_ids: Tensor, positions: Tensor) -> PackedRows | None:
        """The layout of ``input_ids [B, T]`` at ``positions [B, T]`` (``-1``: padding, as
        :meth:`~rlfw.model.Transformer.positions` gives them); ``None`` where every entry is computed
        anyway (no padding, no shared prefix)."""
        valid = positions >= 0
        rows, cols = valid.nonzero(as_tuple=True)  # row-major: each row's tokens in position order
        n = rows.shape[0]
        if n == 0:
            return None
        counts = valid.sum(1)
        starts = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
        source = shared_prefixes(input_ids[rows, cols].tolist(), starts.tolist(), [0] * len(counts))
        if source is None and n == valid.numel():
            return None
        if source is None:  # padding only: every valid token is computed, in place
            computed = torch.ones(n, dtype=torch.bool, device=input_ids.device)
            index = torch.arange(n, device=input_ids.device)
        else:
            computed, index = computed_rows(source, input_ids.device)
        fed_rows, fed_cols = rows[computed], cols[computed]
        pos = positions[rows, cols]
        # Padding reads its row's first token: every entry of a row then depends on that row alone.
        at = index[starts[:-1].clamp(max=n - 1)][:, None].expand_as(positions).clone()
        at[rows, cols] = index
        span = int(pos.max()) + 1
        return PackedRows(
            ids=input_ids[fed_rows, fed_cols][None],
            positions=positions[fed_rows, fed_cols][None],
            fed=fed_rows * positions.shape[1] + fed_cols,
            q_pos=torch.full_like(positions, -1).index_put((fed_rows, fed_cols), pos[computed]),
            kv_at=rows * span + pos,
            kv_src=index,
            at=at,
            span=span,
        )

    def attention(self, ops: Ops, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """``ops.attention`` for the computed tokens' ``q [1, N, Hq, D]``, ``k``/``v [1, N, Hkv, D]``:
        each query in its batch row, over that row's keys and values (a shared token's from the row that
        computed it); ``[1, N, Hq, D]``.

        The padded layouts are filled and read through flat row indices (one index per row of
        ``[B * T]`` or ``[B * span]``), which torch copies a whole row at a time."""
        b, t = self.q_pos.shape
        q_bt = q.new_zeros(b * t, *q.shape[2:]).index_copy(0, self.fed, q[0]).view(b, t, *q.shape[2:])
        k_all, v_all = self._keys(k), self._keys(v)
        out = ops.attention(q_bt, k_all, v_all, self.q_pos, scale)
        return out.view(b * t, *out.shape[2:]).index_select(0, self.fed)[None]

    def _keys(self, x: Tensor) -> Tensor:
        """``x [1, N, Hkv, D]`` laid out per batch row ``[B, span, Hkv, D]``, zero past each row's tokens.

        A shared token's row is read by several batch rows, so its gradient sums theirs. On the CPU
        ``index_select``'s backward adds them in index order; on CUDA it adds them with atomics in no fixed
        order, so there the gather stays the advanced index, whose backward is the accumulating
        ``index_put_`` that sorts first (see the module's note)."""
        b = self.q_pos.shape[0]
        src = x[0].index_select(0, self.kv_src) if x.device.type == "cpu" else x[0, self.kv_src]
        layout = x.new_zeros(b * self.span, *x.shape[2:]).index_copy(0, self.kv_at, src)
        return layout.view(b, self.span, *x.shape[2:])

    def unpack(self, x: Tensor) -> Tensor:
        """``x [1, N, ...]`` per computed token -> ``[B, T, ...]`` per batch entry."""
        return x[0, self.at]
