"""Router record and replay (R3) for the MoE layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class RouterTrace:
    """Expert ids per token and MoE layer, recorded by a forward or replayed into one.

    ``replay``: ``[B, T, n_moe_layers, k]`` int64 ids to use instead of the router's top-k (R3). The
    router still computes its softmax over all experts and the gate weights of the replayed experts are
    gathered from it, so the router keeps its gradient. Padding positions are ignored.

    ``recorded``: filled by the forward, one ``[B, T, k]`` tensor per MoE layer, in layer order: the ids
    actually used (the replayed ones under replay). ``own``: under replay, the ids the router would have
    chosen itself, for ``router/replay_mismatch_frac`` (padding positions included).
    """

    replay: Tensor | None = None
    recorded: list[Tensor] = field(default_factory=list)
    own: list[Tensor] = field(default_factory=list)  # under replay: the router's own top-k, per layer

    def replay_mismatch_frac(self, mask: Tensor | None = None) -> float:
        """Under replay: the fraction of (token, layer) whose own top-k set differs from the replayed one.

        ``mask [B, T]`` restricts the count to real tokens (padding routes arbitrarily).
        """
        import torch

        if not self.own:
            return 0.0
        return set_mismatch_frac(torch.stack(self.own, dim=2), self.stacked(), mask)

    def mismatch_against(self, engine_ids: Tensor, mask: Tensor | None = None) -> float:
        """Without replay: the fraction of (token, layer) where the experts this forward chose differ
        from ``engine_ids`` (``[B, T, n_moe_layers, k]``, what the rollout engine chose)."""
        return set_mismatch_frac(self.stacked(), engine_ids, mask)

    def replay_ids(self, moe_index: int) -> Tensor | None:
        return None if self.replay is None else self.replay[:, :, moe_index]

    def stacked(self) -> Tensor:
        """The recorded ids as ``[B, T, n_moe_layers, k]``, the layout :attr:`replay` takes."""
        import torch

        return torch.stack(self.recorded, dim=2)


def set_mismatch_frac(a: Tensor, b: Tensor, mask: Tensor | None = None) -> float:
    """The fraction of (token, layer) whose top-k expert sets differ between ``a`` and ``b``
    (``[B, T, layers, k]``), over the tokens ``mask [B, T]`` keeps (all when None)."""
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1)  # [B, T, layers]
    if mask is None:
        return float(differs.float().mean().item())
    keep = mask.bool()[..., None].expand_as(differs)
    return float(differs[keep].float().mean().item()) if keep.any() else 0.0
