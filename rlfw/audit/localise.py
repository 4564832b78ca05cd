"""The ladder's first rung: localise a mismatch to the first op whose output bits differ between two modes.

Both modes run the same sequence; every op call on the log-probability path is recorded with the module
that made it (``model.layers.0.self_attn:linear#1``). Records are aligned per token, so a decode run
(one token per step) is compared with a full pass row by row. Expert-internal calls are skipped (their
rows are whichever tokens the router sent); the MoE block's output is compared instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from rlfw.kernels import Ops
from rlfw.model import KVCache, RouterTrace, Transformer
from rlfw.model.packing import PackedRows

ENGINE_ATTENTION = ".attn"  # submodule name of an engine's attention layer inside a shared-model block
Runner = Callable[[Transformer], tuple[int, int]]  # runs the model, returns (row, number of leading pads)


class _Recorder:
    """Wraps an op set; records each op's ``[B, T, ...]`` output under the calling module's name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.packed: PackedRows | None = None  # the current forward's layout, when it computes fewer rows
        self.stack: list[str] = ["model"]
        self.calls: dict[str, int] = defaultdict(int)
        self.records: dict[str, list[Tensor]] = defaultdict(list)
        self.order: list[str] = []

    def begin_step(self) -> None:
        self.calls.clear()

    def cached_block(self, *_: Any) -> None:
        """Never one call per block here: localising needs every op's output."""
        return None

    def __getattr__(self, op: str) -> Any:
        fn = getattr(self.inner, op)
        if not callable(fn):
            return fn

        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            where = self.stack[-1]
            if isinstance(out, Tensor) and out.dim() >= 3 and ".experts." not in where:
                self.record(f"{where}:{op}", out)
            return out

        return recorded

    def record(self, name: str, out: Tensor) -> None:
        packed = self.packed
        if packed is not None and out.shape[:2] == packed.ids.shape != packed.q_pos.shape:
            out = packed.unpack(out)  # a packed forward's op, one row per computed token: per batch entry
        key = f"{name}#{self.calls[name]}"
        self.calls[name] += 1
        if key not in self.records:
            self.order.append(key)
        self.records[key].append(out.detach().clone())


@contextmanager
def recording(model: Transformer) -> Iterator[_Recorder]:
    rec = _Recorder(model.ops)
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
            rec.stack.append(name)

        def post(m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
            rec.stack.pop()
            if type(m).__name__ == "MoE" and isinstance(out, Tensor):
                rec.record(f"{name}:output", out)
            elif name.endswith(ENGINE_ATTENTION) and isinstance(out, Tensor):
                # an engine's own attention layer inside the shared model (vLLM's paged attention):
                # recorded under the name the shared attention op has, in its [1, T, H, D] layout
                parent = name.removesuffix(ENGINE_ATTENTION)
                rec.record(f"{parent}:attention", out.view(1, out.shape[0], -1, model.args.head_dim))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def new_forward(_m: nn.Module, _a: Any) -> None:
        rec.packed = None  # until the forward says how it lays out its rows (an engine's never does)

    def packing(
        input_ids: Tensor, positions: Tensor, cache: KVCache | None, routing: RouterTrace | None
    ) -> PackedRows | None:
        """The layout the model's own forward computes in, as it works it out (``None``: every batch
        entry is computed, as with a cache)."""
        rec.packed = Transformer.packing(input_ids, positions, cache, routing)
        return rec.packed

    handles.append(model.register_forward_pre_hook(new_forward))
    original = model.ops
    model.ops = cast(Ops, rec)  # records every op call, then forwards it
    model.packing = packing  # type: ignore[method-assign]
    try:
        yield rec
    finally:
        model.ops = original
        del model.packing
        for h in handles:
            h.remove()


def capture(
    model: Transformer, run: Callable[[Transformer, _Recorder], tuple[int, int]]
) -> tuple[list[str], dict[str, Tensor]]:
    """Per-op outputs for one sequence, ``[T, ...]`` each, in first-call order."""
    with recording(model) as rec, torch.no_grad():
        row, skip = run(model, rec)
    per_token = {k: torch.cat([t[row] for t in ts], dim=0)[skip:] for k, ts in rec.records.items()}
    return rec.order, per_token


def first_difference(
    a: tuple[list[str], dict[str, Tensor]], b: tuple[list[str], dict[str, Tensor]]
) -> dict[str, Any] | None:
    """The first op (in mode a's call order) whose outputs differ in bits, or None if all agree."""
    order, ra = a
    _, rb = b
    for key in order:
        if key not in rb:
            return {"op": key, "reason": "not called in the other mode"}
        x, y = ra[key], rb[key]
        n = min(x.shape[0], y.shape[0])
        x, y = x[:n], y[:n]
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            diff = (x.float() - y.float()).abs()
            token = int(diff.flatten(1).amax(dim=1).argmax().item())
            return {"op": key, "max_abs_diff": float(diff.max().item()), "first_token": token}
    return None


def full_pass(ids: Tensor) -> Callable[[Transformer, _Recorder], tuple[int, int]]:
    def run(model: Transformer, rec: _Recorder) -> tuple[int, int]:
        model(ids[None])
        return 0, 0

    return run


def decode_steps(ids: Tensor) -> Callable[[Transformer, _Recorder], tuple[int, int]]:
    def run(model: Transformer, rec: _Recorder) -> tuple[int, int]:
        cache = model.new_cache(num_slots=1, capacity=ids.shape[0])
        for t in range(ids.shape[0]):
            rec.begin_step()
            model(ids[None, t : t + 1], cache=cache)
        return 0, 0

    return run


def inside_batch(
    ids: Tensor, batch_size: int = 5, row: int = 2
) -> Callable[[Transformer, _Recorder], tuple[int, int]]:
    def run(model: Transformer, rec: _Recorder) -> tuple[int, int]:
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(0, model.args.vocab_size, (batch_size, ids.shape[0] + 3), generator=gen)
        mask = torch.ones_like(batch)
        batch[row, :3], mask[row, :3] = 0, 0  # the target is left-padded by 3
        batch[row, 3:] = ids
        model(batch, mask)
        return row, 3

    return run


MODES = {"score": full_pass, "decode": decode_steps, "batched": inside_batch}


def localise(model: Transformer, ids: Tensor, mode_a: str, mode_b: str) -> dict[str, Any] | None:
    """Run ``ids [T]`` in two modes (score, decode, batched) and name the first op whose bits differ."""
    return first_difference(capture(model, MODES[mode_a](ids)), capture(model, MODES[mode_b](ids)))
