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

from iscore.batch import TokenBatch
from iscore.impact import aggregation_of


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
        weight, kept = WEIGHTS[f"{spec.framework}:{spec.name}"](d, mask, count, x["step"])
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


def verl(d, mask, count, step):
    m = mask.float()
    k1_mean = _seq_mean(-d.clamp(-20, 20), m, count)
    keep = ((k1_mean >= math.log(0.999)) & (k1_mean <= math.log(1.001)))[:, None] & mask
    weight = torch.exp(d.clamp(-20, 20)).clamp(max=2.0)
    return weight * keep, keep


def skyrl(d, mask, count, step):
    rho = torch.exp(d.clamp(-20, 20))
    outlier = ((rho < 1e-4) | (rho > 100.0)) & mask
    keep = mask & ~outlier.any(dim=1, keepdim=True)
    keep = keep & (rho >= 0.5) & (rho <= 2.0)
    k = keep.float()
    geo = torch.exp(((d * k).sum(dim=1) / k.sum(dim=1).clamp(min=1.0)).clamp(-20, 20))
    keep = keep & ((geo >= 0.99) & (geo <= 1.01))[:, None]
    return rho.clamp(max=2.0) * keep, keep


def nemo(d, mask, count, step):
    rho = torch.nan_to_num(torch.exp(d), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0), mask


def slime(d, mask, count, step):
    m = mask.float()
    ratio = torch.exp(d.clamp(-20, 20))
    weight = ratio.clamp(0.0, 2.0)
    veto = math.log(np.float32(1e-4))
    # Token RS within the TIS bounds [0.5, 2], then the veto of whole sequences.
    keep = mask & (ratio >= 0.5) & (ratio <= 2.0)
    keep = keep & ~((d < veto) & mask).any(dim=1, keepdim=True)
    # Batch normalization over each step's mask tokens (the RS-rejected ones included).
    _, group = torch.unique(step, return_inverse=True)
    num = torch.zeros(int(group.max()) + 1).index_add_(0, group, (weight * m).sum(dim=1))
    den = torch.zeros_like(num).index_add_(0, group, count)
    mean = num / den.clamp(min=1.0)
    mean = torch.where(mean > 1e-8, mean, 1.0)[group]
    return weight / mean[:, None] * keep, keep


def areal(d, mask, count, step):
    d = torch.where(torch.isfinite(d), d, 0.0)
    ratio = torch.exp(_seq_mean(d, mask.float(), count))
    keep = mask & (ratio <= 5.0)[:, None]
    return ratio[:, None] * keep, keep


def openrlhf(d, mask, count, step):
    rho = torch.exp(d)
    return torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0), mask


def trl(d, mask, count, step):
    ratio = torch.exp((d * mask.float()).sum(dim=1))
    keep = ratio <= 3.0
    return torch.where(keep, ratio, 0.0)[:, None].expand_as(d) * mask, mask


def fireworks(d, mask, count, step):
    return torch.exp(d.clamp(-20, 20)).clamp(0.0, 5.0), mask


WEIGHTS = {
    "verl:decoupled_geo_rs_token_tis": verl,
    "skyrl:skyrl_tldr_stack": skyrl,
    "nemo_rl:nemo_icepop": nemo,
    "slime:slime_mis_example": slime,
    "areal:areal_sequence_geo_mask": areal,
    "openrlhf:openrlhf_icepop": openrlhf,
    "trl:trl_default": trl,
    "fireworks:fireworks_default": fireworks,
}
"""Each default setting's (weight, kept) per padded slot, from its formulas."""
