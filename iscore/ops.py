"""Primitives over packed sequences: the pieces every framework's correction is made of.

Each framework module composes these in its own order, so its quirks stay visible there.
Per-token tensors are flat [N]; per-sequence tensors are [B]; `batch.seq_index` maps one
to the other. Sequence reductions accumulate in float64 whatever the input dtype.

>>> import torch
>>> from iscore.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3), cu_seqlens=torch.tensor([0, 2, 3]))
>>> segment_sum(torch.tensor([1.0, 2.0, 4.0]), b).tolist()
[3.0, 4.0]
>>> band(torch.tensor([0.5, 1.0, 2.0, 2.5]), 0.5, 2.0).tolist()
[True, True, True, False]
"""

from __future__ import annotations

import torch

from iscore.batch import TokenBatch

SAFETY_BOUND = 20.0
"""The +-20 clamp on log-ratios that verl, SkyRL, slime's mis.py and Fireworks apply."""


def log_ratio(batch: TokenBatch, numerator: str = "train") -> torch.Tensor:
    """float64 [N] log-ratio of `numerator` ("train" or "policy") over the rollout log-probs.

    Differences of float32 values are exact in float64, so this is the exact d (or e).
    """
    top = getattr(batch, numerator)
    if top is None:
        raise ValueError(f"the batch has no {numerator} log-probs")
    return top.double() - batch.rollout.double()


def exp(x: torch.Tensor, bound: float | None = SAFETY_BOUND) -> torch.Tensor:
    """e^x, with x first clamped to [-bound, bound] unless `bound` is None."""
    return torch.exp(x if bound is None else x.clamp(-bound, bound))


def truncate(
    w: torch.Tensor, lower: float | None = None, upper: float | None = None
) -> torch.Tensor:
    """Clamp weights into [lower, upper]; None leaves that side open."""
    if lower is None and upper is None:
        return w
    return w.clamp(min=lower, max=upper)


def band(x: torch.Tensor, lower: float | None = None, upper: float | None = None) -> torch.Tensor:
    """bool mask of lower <= x <= upper (inclusive; None is unbounded; NaN is outside)."""
    keep = ~torch.isnan(x)
    if lower is not None:
        keep &= x >= lower
    if upper is not None:
        keep &= x <= upper
    return keep


def segment_sum(
    x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 [B] sum of x over each sequence's tokens (where `mask`)."""
    values = x.double() if mask is None else torch.where(mask, x.double(), 0.0)
    out = torch.zeros(batch.num_sequences, dtype=torch.float64, device=x.device)
    return out.index_add_(0, batch.seq_index, values)


def segment_count(batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] number of tokens of each sequence where `mask`."""
    return segment_sum(mask, batch)


def segment_mean(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] mean of x over each sequence's `mask` tokens; 0 where none are."""
    return segment_sum(x, batch, mask) / segment_count(batch, mask).clamp(min=1.0)


def segment_max(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] max of x over each sequence's `mask` tokens; -inf where none are."""
    values = torch.where(mask, x.double(), -torch.inf)
    out = torch.full((batch.num_sequences,), -torch.inf, dtype=torch.float64, device=x.device)
    return out.scatter_reduce_(0, batch.seq_index, values, reduce="amax")


def segment_min(x: torch.Tensor, batch: TokenBatch, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B] min of x over each sequence's `mask` tokens; +inf where none are."""
    return -segment_max(-x.double(), batch, mask)


def segment_all(x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """bool [B], whether x holds for every token of a sequence (true for empty ones)."""
    return segment_sum(~x, batch) == 0


def broadcast(values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """[N] per-token copy of per-sequence `values` [B]."""
    return values[batch.seq_index]


def k1(d: torch.Tensor) -> torch.Tensor:
    """k1 = -d: the per-token estimate of KL(rollout || train) when d = train - rollout."""
    return -d


def k2(d: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2."""
    return 0.5 * d * d


def k3(d: torch.Tensor) -> torch.Tensor:
    """k3 = e^d - 1 - d (verl, NeMo-RL, slime): unbiased, >= 0, for KL(rollout || train)."""
    return torch.special.expm1(d) - d


def k3_reverse(d: torch.Tensor) -> torch.Tensor:
    """e^-d - 1 + d: AReaL's `kl_k3` and NeMo-RL's `policy_kl_error`, for KL(train || rollout)."""
    return torch.special.expm1(-d) + d


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 scalar mean of x over `mask` tokens (NaN where none are)."""
    return torch.where(mask, x.double(), 0.0).sum() / mask.sum()
