"""The per-token terms of the mismatch diagnostics and their sums per sequence: e^d, k3 both
ways, chi^2, e^|d|, the Jensen-Shannon term and the regression's products, in torch
(`token_sums`, the reference) or in two compiled passes (`compiled_token_sums`, the same values)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from iscore.packed import TokenBatch, kernels, ops

TOKEN_TERMS = (
    "S",
    "abs",
    "d2",
    "k3",
    "k3r",
    "js",
    "mult",
    "rho",
    "rho2",
    "chi",
    "rollout2",
    "rollout_d",
)
"""The per-sequence sums of `token_sums`, in the order of `kernels.token_sums`' rows (then
"negative" and "positive")."""


def token_sums(
    batch: TokenBatch,
    dm: torch.Tensor,
    absd: torch.Tensor,
    rho: torch.Tensor,
    em1: torch.Tensor,
    rollout: torch.Tensor,
    below: torch.Tensor,
    max_abs: np.ndarray,
    masked_out: torch.Tensor | None,
    buf: Callable[..., torch.Tensor],
) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """(float64 [B] per sequence: the sums of `TOKEN_TERMS` and the tokens with d < 0
    ("negative", `below`) and d > 0 ("positive"); k3 [N] of each token). dm: the log-ratios,
    0 outside the loss (`masked_out`); e^|d|, e^d and e^2d count loss tokens only; rho = e^d,
    em1 = e^d - 1; `rollout`: the rollout log-probs, 0 outside the loss (its square and
    product with d, in float64, are the regression's); max_abs: each sequence's largest |d|."""

    def loss_only(values: torch.Tensor) -> torch.Tensor:
        """Zero the non-loss tokens of a scratch tensor, in place."""
        return values if masked_out is None else values.masked_fill_(masked_out, 0.0)

    rho2 = torch.mul(rho, rho, out=buf("rho2"))
    rl = buf("rl").copy_(rollout)
    tail = torch.reciprocal(rho, out=buf("tail"))
    mult = torch.maximum(rho, tail, out=buf("mult"))  # e^|d|
    tail = torch.minimum(rho, tail, out=tail)  # e^-|d|
    k3r = buf("k3r")
    if max_abs.size > 0 and not max_abs.max() <= 700.0:  # NaN counts as huge
        torch.special.expm1(torch.neg(dm, out=k3r), out=k3r)
    else:
        torch.div(em1, rho, out=k3r).neg_()
    token: dict[str, torch.Tensor] = {
        "S": dm,
        "abs": absd,
        "d2": torch.mul(dm, dm, out=buf("d2")),
        "k3": torch.sub(em1, dm, out=buf("k3")),
        "k3r": k3r.add_(dm),
        "js": _js(absd, em1, rho, tail, buf),
        "mult": loss_only(mult),
        "rho": rho if masked_out is None else keep_where(batch.loss_mask, rho, 0.0, buf("rho")),
        "rho2": loss_only(rho2),
        "rollout2": torch.mul(rl, rl, out=buf("rollout2")),
        "rollout_d": torch.mul(rl, dm, out=buf("rollout_d")),
        "negative": below,
        "positive": ops.compare("gt", dm, 0.0, buf("above", torch.bool)),
    }
    sums = ops.segment_sums_on_host(batch, token)
    # chi = <e^(2 clamp(d, +-20))> (verl squares the clamped ratio): the same values as
    # rho2 unless some |d| > 20.
    bound = ops.SAFETY_BOUND
    if max_abs.size == 0 or max_abs.max() <= bound:
        sums["chi"] = sums["rho2"]
    else:  # e^(2 clamp(d, +-b)) = clamp(e^2d, e^-2b, e^2b)
        chi = torch.clamp(rho2, *_CHI_CLAMP, out=mult)
        sums["chi"] = ops.segment_sums_on_host(batch, {"chi": loss_only(chi)})["chi"]
    return sums, token["k3"]


_CHI_CLAMP = (math.exp(-2 * ops.SAFETY_BOUND), math.exp(2 * ops.SAFETY_BOUND))


def compiled_token_sums(
    batch: TokenBatch,
    dm: torch.Tensor,
    rho: torch.Tensor,
    em1: torch.Tensor,
    rollout: torch.Tensor,
    max_abs: np.ndarray,
    buf: Callable[..., torch.Tensor],
) -> tuple[dict[str, np.ndarray], torch.Tensor] | None:
    """`token_sums` in two compiled passes around torch's log1p (`kernels.js_argument`,
    `kernels.token_sums`): the same values, without its 20 float64 passes and 11
    reductions; None off the CPU or where the kernels do not answer (the caller leaves
    |d| > 700 to `token_sums`)."""
    if batch.device.type != "cpu" or rho.dtype != torch.float64:
        return None
    arg, k3 = buf("js"), buf("k3")
    if not kernels.js_argument(dm.numpy(), rho.numpy(), em1.numpy(), arg.numpy(), k3.numpy()):
        return None
    lg = arg.log1p_()  # torch's log1p, as the reference's
    mask = None if ops.mask_is_all(batch, batch.loss_mask) else batch.loss_mask.numpy()
    cu = batch.cu_seqlens.numpy()
    out = kernels.token_sums(
        dm.numpy(), rho.numpy(), em1.numpy(), lg.numpy(), rollout.numpy(), mask, cu, _CHI_CLAMP
    )
    if out is None:
        return None
    sums = dict(zip((*TOKEN_TERMS, "negative", "positive"), out, strict=True))
    if max_abs.size == 0 or max_abs.max() <= ops.SAFETY_BOUND:
        sums["chi"] = sums["rho2"]  # as `token_sums`: unclamped unless a |d| exceeds it
    return sums, k3


def _js(
    absd: torch.Tensor,
    em1: torch.Tensor,
    rho: torch.Tensor,
    tail: torch.Tensor,
    buf: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Per-token Jensen-Shannon term (k3(a) + k3(b)) / 2 of `DEFINITIONS["js"]`.

    With m = (e^t + e^r) / 2, e^a + e^b = 2, so the term is -(a + b) / 2 = log cosh(d / 2):
    a function of d alone. It is evaluated as -log1p(-tanh(d/2)^2) / 2 for |d| < 1 and
    |d| / 2 - log 2 + log1p(e^-|d|) beyond, both accurate to a few ulps (tanh(d/2) =
    expm1(d) / (e^d + 1)), from the exponentials computed anyway (`tail` = e^-|d|).
    """
    large = ops.compare("ge", absd, 1.0, buf("js_large", torch.bool))
    log = torch.add(rho, 1.0, out=buf("js"))
    torch.div(em1, log, out=log)  # tanh(d / 2)
    log.mul_(log).neg_()
    _copy_where(log, tail, large).log1p_()
    beyond = torch.mul(absd, 0.5, out=buf("js_beyond")).sub_(math.log(2.0)).add_(log)
    return _copy_where(log.mul_(-0.5), beyond, large)


def _copy_where(out: torch.Tensor, values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """out[where] = values[where], in place (numpy's masked copy is 5x torch.where's speed)."""
    if out.device.type == "cpu":
        np.copyto(out.numpy(), values.numpy(), where=where.numpy())
        return out
    return torch.where(where, values, out, out=out)


def keep_where(
    condition: torch.Tensor, x: torch.Tensor, value: float, out: torch.Tensor
) -> torch.Tensor:
    """torch.where(condition, x, value) into `out`."""
    other = torch.tensor(value, dtype=x.dtype, device=x.device)
    return torch.where(condition, x, other, out=out)


def seq_max(values: torch.Tensor, batch: TokenBatch) -> np.ndarray:
    """float64 [B] per-sequence max (-inf for empty sequences)."""
    if batch.device.type == "cpu":
        return ops.host_segment_max(values.numpy(), batch)
    every = torch.ones_like(values, dtype=torch.bool)
    return ops.segment_max(values, batch, every).cpu().numpy()
