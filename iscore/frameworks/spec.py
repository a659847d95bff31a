"""What a correction setting is and what its replay yields: the `Spec` protocol every
framework's setting follows, and `Replay`, the per-token weight and keep of one setting over
a batch. Framework modules build these; nothing here knows a framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
import torch

from iscore.packed import TokenBatch, ops


@dataclass(frozen=True, slots=True, eq=False)
class Replay:
    """What a correction does to each token of a batch.

    Attributes:
        weight: float32 [N], the detached factor multiplying each token's loss term; 0 where
            the method zeroes the weight and wherever `keep` is false, so `weight` is exactly
            what each token's gradient is scaled by.
        keep: bool [N], the token's loss mask after the correction: false where the method
            removes it from the loss mask and where `loss_mask` was already false.
        raw: float32 [N], the importance ratio the method starts from before truncating or
            masking (per token, or the sequence ratio broadcast for sequence-level methods).
        seq_raw: float32 [B] or None, the per-sequence ratio of sequence-level methods.
        seq_weight: float32 [B] or None, the per-sequence weight applied (after truncation).
        pre_norm: float32 [N] or None, for settings that batch-normalize the weights: the
            weight before that division (what truncation made of `raw`).
    """

    weight: torch.Tensor
    keep: torch.Tensor
    raw: torch.Tensor
    seq_raw: torch.Tensor | None = None
    seq_weight: torch.Tensor | None = None
    pre_norm: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        batch: TokenBatch,
        weight: torch.Tensor,
        keep: torch.Tensor,
        raw: torch.Tensor,
        seq_raw: torch.Tensor | None = None,
        seq_weight: torch.Tensor | None = None,
        pre_norm: torch.Tensor | None = None,
    ) -> Replay:
        """Assemble a result: AND `keep` with the loss mask, zero dropped weights, cast."""
        keep = keep & batch.loss_mask
        every = ops.all_true(keep)

        def f32(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.float()

        def zeroed(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            if not every and x.dtype == torch.float32:  # one pass to a fresh float32 [N]
                return torch.where(keep, x, x.new_zeros(()))
            out = x.to(torch.float32, copy=True)  # never the caller's own tensor
            if not every:  # zeroed in place: one float32 [N], not two
                torch.where(keep, out, out.new_zeros(()), out=out)
            return out

        return cls(
            weight=zeroed(weight),
            keep=keep,
            raw=ops.float32(raw),  # read only: shared by the settings whose raw is e^d
            seq_raw=f32(seq_raw),
            seq_weight=f32(seq_weight),
            pre_norm=zeroed(pre_norm),
        )

    def to_arrow(self, batch: TokenBatch) -> pa.Table:
        """One row per token: seq_id, pos, step, weight, keep (the `iscore replay` output)."""
        lengths = batch.lengths.cpu().numpy()
        seq_rows = pa.array(
            torch.repeat_interleave(torch.arange(batch.num_sequences), batch.lengths.cpu()).numpy()
        )
        return pa.table(
            {
                "seq_id": batch.seq_id.take(seq_rows),
                "pos": pa.array(batch.positions().cpu().numpy()),
                "step": pa.array(batch.step.cpu().numpy().repeat(lengths)),
                "weight": pa.array(self.weight.cpu().numpy()),
                "keep": pa.array(self.keep.cpu().numpy()),
            }
        )


def per_token(values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """float32 [N], each token's copy of its sequence's value in `values` [B]: what `Replay`
    stores of a per-sequence weight or ratio. The float32 values are broadcast, which gives
    the same tensor as casting the broadcast float64 ones, without the float64 [N] copy."""
    return ops.broadcast(values.float(), batch)


class Spec(Protocol):
    """A parsed, validated correction setting of one framework."""

    framework: str
    name: str

    def replay(self, batch: TokenBatch) -> Replay: ...
