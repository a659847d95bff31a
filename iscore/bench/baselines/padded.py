"""The padded torch baseline: the corrections written the way the frameworks write them, on
float32 tensors padded to [B, max_len] with a loss mask, and the key statistics from them.

It is an independent implementation of the same math as the engine (`iscore.frameworks`),
never calling its replay, so that agreeing with it checks the engine, and timing it shows
what a framework-style implementation costs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from iscore.frameworks.areal import ArealCorrection
from iscore.frameworks.fireworks import FireworksTIS
from iscore.frameworks.nemo_rl import NemoRLSpec
from iscore.frameworks.openrlhf import OpenRLHFCorrection
from iscore.frameworks.skyrl import SkyRLSpec
from iscore.frameworks.slime import SlimeCorrection
from iscore.frameworks.trl import TRLCorrection
from iscore.frameworks.verl import VerlSpec
from iscore.packed import TokenBatch
from iscore.stats import aggregation_of


def pad(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """[B, max_len] float32 log-probs (0 in padding), the loss mask (false in padding), and
    each sequence's step: what a framework's trainer holds."""
    lengths = batch.lengths
    b, longest = batch.num_sequences, int(lengths.max())
    valid = torch.arange(longest)[None, :] < lengths[:, None]
    out = {}
    for name in ("rollout", "train"):
        padded = torch.zeros(b, longest, dtype=torch.float32)
        padded[valid] = getattr(batch, name)
        out[name] = padded
    mask = torch.zeros(b, longest, dtype=torch.bool)
    mask[valid] = batch.loss_mask
    out["mask"] = mask
    out["step"] = batch.step
    return out


def statistics(x: dict[str, torch.Tensor], specs: list[Any]) -> dict[str, Any]:
    """The settings' weights and key statistics on padded float32 tensors."""
    mask = x["mask"]
    m = mask.float()
    d = x["train"] - x["rollout"]
    n = m.sum()
    count = m.sum(dim=1)
    has = count > 0
    out = {
        "mismatch": {
            "k3": float(((torch.expm1(d) - d) * m).sum() / n),
            "abs_diff_mean": float((d.abs() * m).sum() / n),
        },
        "settings": [],
    }
    for spec in specs:
        weight, kept = WEIGHTS[type(spec)](spec, d, mask, count, x["step"])
        w = weight * m
        total, squares = w.sum(), (w * w).sum()
        nonzero = (w > 0) & mask
        agg = aggregation_of(spec)
        if agg.mode == "seq-mean-token-mean":
            lr = float((w.sum(dim=1)[has] / count[has]).mean())
        elif agg.shrinks:
            lr = float(total / (kept & mask).float().sum())
        else:
            lr = float(total / n)
        out["settings"].append(
            {
                "weight_mean": float(total / n),
                "token_masked_fraction": float(1 - nonzero.float().sum() / n),
                "seq_masked_fraction": float((~nonzero.any(dim=1))[has].float().mean()),
                "lr_scale": lr,
                "ess": float(total * total / (n * squares)),
            }
        )
    return out


def _seq_mean(x: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x * m).sum(dim=1) / count.clamp(min=1.0)


def verl(spec: VerlSpec, d, mask, count, step):
    """Token TIS at `is_upper` and a `seq_mean_k1` rejection band: each sequence's mean of
    k1 = -d within [log lower, log upper] of the criterion."""
    (rs,) = spec.rs
    m = mask.float()
    k1_mean = _seq_mean(-d.clamp(-20, 20), m, count)
    keep = ((k1_mean >= math.log(rs.lower)) & (k1_mean <= math.log(rs.upper)))[:, None] & mask
    weight = torch.exp(d.clamp(-20, 20)).clamp(max=spec.is_upper)
    return weight * keep, keep


def skyrl(spec: SkyRLSpec, d, mask, count, step):
    """The outlier sequence mask, the token mask, the geometric sequence mask over the tokens
    left, and token TIS at `token_tis_ratio_clip_high`."""
    rho = torch.exp(d.clamp(-20, 20))
    low, high = spec.outlier_token_is_threshold_low, spec.outlier_token_is_threshold_high
    outlier = ((rho < low) | (rho > high)) & mask
    keep = mask & ~outlier.any(dim=1, keepdim=True)
    low, high = spec.token_mask_is_threshold_low, spec.token_mask_is_threshold_high
    keep = keep & (rho >= low) & (rho <= high)
    k = keep.float()
    geo = torch.exp(((d * k).sum(dim=1) / k.sum(dim=1).clamp(min=1.0)).clamp(-20, 20))
    keep = keep & ((geo >= spec.geo_mask_low) & (geo <= spec.geo_mask_high))[:, None]
    return rho.clamp(max=spec.token_tis_ratio_clip_high) * keep, keep


def nemo(spec: NemoRLSpec, d, mask, count, step):
    """Token IcePop: the float32 ratio (0 where it overflows), zero outside [min, ratio]."""
    rho = torch.nan_to_num(torch.exp(d), nan=0.0, posinf=0.0, neginf=0.0)
    lower = spec.truncated_importance_sampling_ratio_min
    upper = spec.truncated_importance_sampling_ratio
    return torch.where((rho >= lower) & (rho <= upper), rho, 0.0), mask


def slime(spec: SlimeCorrection, d, mask, count, step):
    """mis.py: token TIS truncated at the upper bound, token RS within the RS bounds, the veto
    of sequences with a token below its threshold, then batch normalization per step."""
    mis = spec.mis
    m = mask.float()
    ratio = torch.exp(d.clamp(-20, 20))
    weight = ratio.clamp(0.0, mis.tis_upper_bound)
    veto = math.log(np.float32(mis.rs_veto_threshold))
    keep = mask & (ratio >= mis.rs_lower) & (ratio <= mis.rs_upper)
    keep = keep & ~((d < veto) & mask).any(dim=1, keepdim=True)
    # Batch normalization over each step's mask tokens (the RS-rejected ones included).
    _, group = torch.unique(step, return_inverse=True)
    num = torch.zeros(int(group.max()) + 1).index_add_(0, group, (weight * m).sum(dim=1))
    den = torch.zeros_like(num).index_add_(0, group, count)
    mean = num / den.clamp(min=1.0)
    mean = torch.where(mean > 1e-8, mean, 1.0)[group]
    return weight / mean[:, None] * keep, keep


def areal(spec: ArealCorrection, d, mask, count, step):
    """A sequence mask on the geometric-mean ratio within [lower or 0, upper]; the weight is
    that ratio."""
    rs = spec.rejection_sampling
    lower = 0.0 if rs.lower is None else rs.lower
    d = torch.where(torch.isfinite(d), d, 0.0)
    ratio = torch.exp(_seq_mean(d, mask.float(), count))
    keep = mask & ((ratio >= lower) & (ratio <= rs.upper))[:, None]
    return ratio[:, None] * keep, keep


def openrlhf(spec: OpenRLHFCorrection, d, mask, count, step):
    """Token IcePop: the unclamped ratio, zero outside [lower, upper]."""
    rho = torch.exp(d)
    return torch.where((rho >= spec.lower) & (rho <= spec.upper), rho, 0.0), mask


def trl(spec: TRLCorrection, d, mask, count, step):
    """Sequence mask: every token weighs e^S (float32), zero outside [clip_min, clip_max]
    (an open side where a bound is None)."""
    lower = 0.0 if spec.clip_min is None else spec.clip_min
    upper = math.inf if spec.clip_max is None else spec.clip_max
    ratio = torch.exp((d * mask.float()).sum(dim=1))
    keep = (ratio >= lower) & (ratio <= upper)
    return torch.where(keep, ratio, 0.0)[:, None].expand_as(d) * mask, mask


def fireworks(spec: FireworksTIS, d, mask, count, step):
    """Token TIS clamped into [0, cap]."""
    return torch.exp(d.clamp(-20, 20)).clamp(0.0, spec.cap), mask


WEIGHTS = {
    VerlSpec: verl,
    SkyRLSpec: skyrl,
    NemoRLSpec: nemo,
    SlimeCorrection: slime,
    ArealCorrection: areal,
    OpenRLHFCorrection: openrlhf,
    TRLCorrection: trl,
    FireworksTIS: fireworks,
}
"""Each framework's (weight, kept) per padded slot, for the settings `implements` accepts."""
