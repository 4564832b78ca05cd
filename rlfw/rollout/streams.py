"""The log-probability streams the engine records (design §2), computed from one place each.

* ``sampler_logp`` (mu): the processed distribution the token is drawn from, whose logits come from the
  sampler head at ``sampler.precision`` (fp32: the decode logits themselves).
* ``decode_logp`` (s^D): the decode step's full-precision logits, same transforms.
* ``prefill_logp`` (s^P): one prefill forward over the finished sequence, same transforms.

All three are ``ops.log_softmax(process_logits(logits))`` at the token (the gather of the row's
log-softmax, which ``ops.token_logp`` equals bit for bit on every backend), the exact expression the
trainer replays, so under ``kernels=invariant`` and an fp32 sampler they agree bit for bit and any
difference names its source. With a real vocabulary a batch's ``[B, V]`` logits outgrow the caches, so
the per-row work runs over blocks of rows (:func:`row_blocks`): a row's result does not depend on its
block under the invariant kernels, and each block's temporaries stay in cache.

A token drawn by a reduced-precision sampler may lie outside the decode path's kept set (a top-k/top-p
boundary moved); its ``decode_logp`` is then ``-inf``, reported, not hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlfw.kernels import Ops
from rlfw.model import Transformer
from rlfw.model.distribution import Transforms, process_logits, row_blocks
from rlfw.rollout.sampling import sampler_head


@dataclass
class NextTokenLogits:
    """fp32 processed logits ``[B, V]`` for the next token of each row, per stream."""

    decode: Tensor
    sampler: Tensor


@dataclass
class TokenStreams:
    """What a decode step records for the token of each row (``[B]`` / ``[B, K]``)."""

    sampler_logp: Tensor
    decode_logp: Tensor
    topk_ids: Tensor
    topk_logp: Tensor
    decode_topk_logp: Tensor  # the decode stream at the sampler's top-k ids

    def _fields(self) -> tuple[Tensor, ...]:
        return (self.sampler_logp, self.decode_logp, self.topk_ids, self.topk_logp, self.decode_topk_logp)

    def cpu(self) -> TokenStreams:
        """Records leave the engine on the CPU (they cross actor boundaries)."""
        return TokenStreams(*(t.cpu() for t in self._fields()))


class StreamRecords:
    """What the decode steps recorded for every running sequence, by cache slot and response position:
    one write per stream per step for the whole batch, and one copy per stream when a sequence retires
    (not a tensor per token). Rows start at ``initial`` positions and double as responses grow, up to
    ``max_positions``; a slot taken again is overwritten from position 0."""

    def __init__(self, num_slots: int, initial: int, max_positions: int) -> None:
        self.num_slots, self.max_positions = num_slots, max_positions
        self.capacity = min(initial, max_positions)
        self._buffers: tuple[Tensor, ...] | None = None  # TokenStreams' fields, [slots, capacity, ...]

    def write(self, slots_B: Tensor, positions_B: Tensor, streams: TokenStreams) -> None:
        """Row ``i`` of a decode step's ``streams`` goes to ``(slots_B[i], positions_B[i])``."""
        fields = streams._fields()
        need = int(positions_B.max()) + 1 if positions_B.numel() else 0
        if self._buffers is None:
            self.capacity = max(self.capacity, need)
            self._buffers = tuple(f.new_zeros((self.num_slots, self.capacity, *f.shape[1:])) for f in fields)
        elif need > self.capacity:
            grown = min(max(need, 2 * self.capacity), self.max_positions)
            self._buffers = tuple(_grow(b, grown) for b in self._buffers)
            self.capacity = grown
        for buffer, values in zip(self._buffers, fields, strict=True):
            buffer[slots_B, positions_B] = values

    def take(self, slot: int, length: int) -> TokenStreams:
        """The first ``length`` positions of ``slot`` (copies: the slot is reused): ``[T]`` / ``[T, K]``."""
        assert self._buffers is not None and length <= self.capacity, "no decode step recorded these"
        return TokenStreams(*(b[slot, :length].clone() for b in self._buffers))


def _grow(buffer: Tensor, capacity: int) -> Tensor:
    """``buffer [slots, P, ...]`` with room for ``capacity`` positions, the recorded ones kept."""
    out = buffer.new_zeros((buffer.shape[0], capacity, *buffer.shape[2:]))
    out[:, : buffer.shape[1]] = buffer
    return out


def next_token_logits(
    model: Transformer, hidden_BH: Tensor, transforms: Transforms, precision: str
) -> NextTokenLogits:
    """Processed decode logits and processed sampler logits from the decode step's hidden states."""
    decode = process_logits(model.ops.linear(hidden_BH, model.output_weight), transforms)
    if precision == "fp32":
        return NextTokenLogits(decode, decode)
    head = sampler_head(hidden_BH, model.output_weight, precision, model.ops.linear)
    sampler = process_logits(head, transforms)
    return NextTokenLogits(decode, sampler)


COMPILED_TOPK_MAX = 1024
"""Largest ``k`` the compiled top-k takes: it inserts each entry that enters the kept set at its rank, O(k)
apiece, so a ``k`` near half the vocabulary would cost more than a sort."""


def takes_compiled_topk(values_BV: Tensor, k: int) -> bool:
    """Whether :func:`stable_topk` runs the compiled kernel: rows of fp32 on the CPU, ``0 < k <=``
    :data:`COMPILED_TOPK_MAX`."""
    from rlfw.kernels import cpu_native

    few = 0 < k <= min(values_BV.shape[-1], COMPILED_TOPK_MAX)
    return values_BV.dim() == 2 and few and cpu_native.serves(values_BV)


def stable_topk(values_BV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of each row, largest first, ties to the lower id: the first ``k`` of a
    stable descending sort, without sorting the whole vocabulary.

    On the CPU the compiled ``stable_topk`` keeps the ``k`` best in one pass (:func:`takes_compiled_topk`;
    rows holding a NaN come back with id -1 and take the stable sort itself, which places NaN first as
    torch does; no ``torch.topk`` there, which inside vLLM is this function). Elsewhere ``torch.topk``
    finds the set; where no tie crosses its boundary (the k-th value is strictly larger than every entry
    left out) the set is exact, and ordering it by (value descending, id ascending) is a sort of ``k``
    entries. Rows with a tie at the boundary take the full stable sort.
    """
    from rlfw.kernels import cpu_native

    if takes_compiled_topk(values_BV, k):
        ids, top = cpu_native.module().stable_topk(values_BV, k)
        nan = (ids[:, 0] < 0).nonzero(as_tuple=True)[0]
        if nan.numel():
            ordered = torch.sort(values_BV[nan], dim=-1, descending=True, stable=True)
            ids[nan], top[nan] = ordered.indices[:, :k], ordered.values[:, :k]
        return ids, top
    return _sorted_topk(values_BV, k)


def _sorted_topk(values_BV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`stable_topk` with torch's ops."""
    if k == 0:
        return values_BV.new_zeros(values_BV.shape[0], 0, dtype=torch.long), values_BV[:, :0]
    top, ids = torch.topk(values_BV, k, dim=-1)
    by_id = torch.sort(ids, dim=-1).indices  # candidates in ascending id, then stably by value
    ids = ids.gather(-1, by_id)
    order = torch.sort(top.gather(-1, by_id), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(-1, order)
    crossing = (values_BV >= top.amin(-1, keepdim=True)).sum(-1) > k
    if bool(crossing.any()):
        rows = crossing.nonzero(as_tuple=True)[0]
        full = torch.sort(values_BV[rows], dim=-1, descending=True, stable=True).indices[:, :k]
        ids[rows] = full
    return ids, values_BV.gather(-1, ids)


def token_streams(ops: Ops, logits: NextTokenLogits, tokens_B: Tensor, k: int) -> TokenStreams:
    """Sampler and decode log-probs of the chosen tokens, the sampler's top-k, and the decode stream at
    those ids, a block of rows at a time. When the sampler runs on the decode logits (fp32) both streams
    are one computation, made once: the sampler's values are the decode stream's."""
    blocks = []
    for rows in row_blocks(*logits.sampler.shape):
        logp = ops.log_softmax(logits.sampler[rows])
        topk_ids, topk_logp = stable_topk(logp, min(k, logp.shape[-1]))
        sampler_logp = logp.gather(-1, tokens_B[rows, None]).squeeze(-1)
        if logits.decode is logits.sampler:
            decode_logp, decode_head = sampler_logp, topk_logp
        else:
            decode = ops.log_softmax(logits.decode[rows])
            decode_logp = decode.gather(-1, tokens_B[rows, None]).squeeze(-1)
            decode_head = decode.gather(-1, topk_ids)
        blocks.append(TokenStreams(sampler_logp, decode_logp, topk_ids, topk_logp, decode_head))
    return TokenStreams(*(torch.cat(f) for f in zip(*(b._fields() for b in blocks), strict=True)))


def response_logp(
    model: Transformer,
    hidden_SH: Tensor,
    prompt_len: int,
    response_T: Tensor,
    transforms: Transforms,
    topk_ids_TK: Tensor,
) -> tuple[Tensor, Tensor]:
    """``prefill_logp [T]`` and the prefill stream at the sampler's top-k ids ``[T, K]``, from the hidden
    states ``[P + T, hidden]`` of one finished sequence.

    Response token ``t`` is scored at position ``P - 1 + t``; the LM head runs over those positions only
    (the invariant linear's rows do not depend on which other rows it is given).
    """
    t = response_T.shape[0]
    logits = model.ops.linear(hidden_SH[prompt_len - 1 : prompt_len - 1 + t], model.output_weight)
    processed = process_logits(logits, transforms)
    ids = torch.cat([response_T[:, None], topk_ids_TK], -1).to(processed.device)
    blocks = [model.ops.log_softmax(processed[r]).gather(-1, ids[r]) for r in row_blocks(*processed.shape)]
    read = torch.cat(blocks) if blocks else ids.new_zeros(ids.shape, dtype=torch.float32)
    return read[:, 0].contiguous().cpu(), read[:, 1:].contiguous().cpu()  # a sample's own tensors
