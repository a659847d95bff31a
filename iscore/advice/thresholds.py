"""Thresholds placed from the data: what numerical noise looks like in a dump (`Normal`), and the
bounds each kind of setting gets from it (`Thresholds`): the loosest token cap within the
variance budget, token bands, and sequence bounds between the noise and the broken sequences."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from iscore.packed import TokenBatch, ops
from iscore.stats import broken_sequences, noise, ratio_bias


@dataclass(frozen=True, slots=True)
class Normal:
    """What numerical noise looks like in this dump, robustly, and what stands out of it.

    The centre and spread come from medians and MADs (1.4826 MAD estimates a normal's standard
    deviation), so a few broken sequences cannot move them; which sequences are broken is
    `iscore.stats.noise`'s decision, each judged against its own step's noise.
    """

    d_center: float  # median per-token log-ratio d over loss tokens
    d_spread: float  # 1.4826 MAD of d
    g_center: float  # median per-sequence G
    g_spread: float  # 1.4826 MAD of G
    broken: np.ndarray  # bool [B]: sequences far outside the noise
    G: np.ndarray  # float64 [B], 0 where a sequence has no loss token
    k3: np.ndarray  # float64 [B]: mean per-token k3
    mult_error: np.ndarray  # float64 [B]: mean per-token e^|d| (NeMo-RL's E), 0 without a token
    T: np.ndarray  # float64 [B]: loss tokens
    d: np.ndarray  # float64 [N loss tokens]
    token_broken: np.ndarray  # bool [N loss tokens]: tokens of broken sequences
    rollout: np.ndarray  # float32 [N loss tokens]: the rollout's log-prob of each
    ratio: float  # <e^d> over the healthy tokens
    ratio_z: float | None  # its distance from 1 in standard errors where that breaks the identity
    rho: np.ndarray  # float64 [N loss tokens]: e^clamp(d, +-20)
    # With a current policy (`policy_logprob`), float64 [N loss tokens], else None: its lag
    # behind the recompute e^clamp(policy - train), and its ratio over the rollout
    # e^clamp(policy - rollout), the weight a token's gradient should then carry.
    lag: np.ndarray | None = None
    target: np.ndarray | None = None

    @property
    def offset(self) -> bool:
        """Whether the healthy tokens break E_rollout[e^d] = 1: a semantics bug (the test of
        the mismatch flags, `iscore.stats.noise.ratio_bias`). A noisier engine moves the median d
        below 0 by itself (E[d] = -KL) and is not one."""
        return self.ratio_z is not None

    @classmethod
    def of(cls, batch: TokenBatch) -> Normal:
        m = batch.loss_mask
        d_all = ops.log_ratio(batch).double()
        T = ops.segment_count(batch, m).double().cpu().numpy()
        S = ops.segment_sum(d_all, batch, m).cpu().numpy()
        clamped = d_all.clamp(-20.0, 20.0)
        k3 = ops.segment_sum(ops.k3(clamped), batch, m).cpu().numpy()
        error = ops.segment_sum(clamped.abs().exp(), batch, m).cpu().numpy()
        has = T > 0
        G = np.where(has, S / np.maximum(T, 1.0), 0.0)
        k3 = np.where(has, k3 / np.maximum(T, 1.0), 0.0)
        error = np.where(has, error / np.maximum(T, 1.0), 0.0)
        every = ops.mask_is_all(batch, m)  # then views, not copies (only ever read)
        d = (d_all if every else d_all[m]).cpu().numpy()
        d_center, d_spread = noise.median_mad(d)
        g_center, g_spread = noise.median_mad(G[has])
        broken = broken_sequences(batch)
        token_broken = np.repeat(broken, T.astype(np.int64))
        rollout = (batch.rollout if every else batch.rollout[m]).cpu().numpy()
        rho = np.exp(np.clip(d, -20.0, 20.0))
        healthy = rho[~token_broken] if broken.any() else rho
        ratio = float(healthy.mean()) if healthy.size else 1.0
        stderr = math.sqrt(max(float(healthy @ healthy) / max(healthy.size, 1) - ratio**2, 0.0))
        ratio_z = ratio_bias(ratio, stderr / math.sqrt(max(healthy.size, 1)))
        lag = target = None
        if batch.policy is not None:
            e = ops.log_ratio(batch, "policy")
            e = (e if every else e[m]).cpu().numpy()
            lag = np.exp(np.clip(e - d, -20.0, 20.0))
            target = np.exp(np.clip(e, -20.0, 20.0))
        return cls(
            d_center,
            d_spread,
            g_center,
            g_spread,
            broken,
            G,
            k3,
            error,
            T,
            d,
            token_broken,
            rollout,
            ratio,
            ratio_z,
            rho,
            lag,
            target,
        )

    @property
    def broken_share(self) -> float:
        return float(self.broken.sum()) / max(int((self.T > 0).sum()), 1)


_MARGIN = 1.05  # sequence bounds placed this much beyond the healthy sequences


_INSIDE = 0.9  # or this far inside the nearest broken sequence, if that is closer


VARIANCE_WEIGHT = 1.0
"""The objective's weight of the variance a setting's weights add against the gradient they
misweight (docs/recommend.md): 1 counts 1% more variance as much as 1% of the gradient
misweighted."""


VARIANCE_BUDGET = 0.05
"""The most variance a token cap may add (1/ESS - 1 of its weights on the healthy tokens,
0.05: ESS >= 95%): the cap is the loosest of `CAPS` within it."""


PPO_CLIP = 0.2
"""PPO's clip range, the default of every framework replayed (`clip_ratio`, `eps_clip`,
`ratio_clip_min/max`, `epsilon`: 0.2): with a current policy, the objective weighs a PPO
loss's ratio through it."""


CAPS = (1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)
"""The token caps and bands' upper bounds tried, tightest first; 5 is the loosest the
frameworks' own examples use (IcePop's [0.5, 5])."""


def variance_added(w: np.ndarray) -> float:
    """1/ESS - 1 of weights `w` (Kish's ESS = (sum w)^2 / (N sum w^2)): how much the weights
    inflate the variance of a mean over the tokens, against weighing each alike (0 for equal
    weights, inf where every weight is 0).

    >>> variance_added(np.ones(4)), variance_added(np.array([1.0, 1.0, 2.0, 0.0]))
    (0.0, 0.5)
    """
    total = float(w.sum())
    return w.size * float(w @ w) / (total * total) - 1.0 if total > 0 else math.inf


def _loosest_cap(rho: np.ndarray) -> float:
    """The loosest of `CAPS` whose truncated weights min(rho, cap) add at most
    `VARIANCE_BUDGET` of variance over the healthy tokens' ratios `rho` (the tightest where
    none does). The more the ratios spread, the more variance every cap adds, so the cap never
    loosens as the mismatch grows."""
    for cap in reversed(CAPS):
        if variance_added(np.minimum(rho, cap)) <= VARIANCE_BUDGET:
            return cap
    return CAPS[0]


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Thresholds placed by the objective (docs/recommend.md).

    A token cap is the loosest of `CAPS` (the least gradient truncated) whose weights add at
    most `VARIANCE_BUDGET` of variance on the healthy tokens; a token band is [1/cap, cap].
    The wider the ratios spread, the tighter both are. A sequence mask's bound sits just
    outside every healthy sequence (none is dropped), or just inside the nearest broken one
    where that is closer (the mask drops them): the least gradient misweighted, since a
    healthy sequence's ideal weight is its ratio and a broken one's is 0.
    """

    token_cap: float
    band: tuple[float, float]  # token ratio band
    geo: tuple[float, float]  # e^G band
    k3: float  # mean per-token k3 upper bound
    mult_error: float  # upper bound on a sequence's mean e^|d| (NeMo-RL's E)
    normal: Normal
    # With a current policy: the cap and band placed likewise on its ratios over the rollout.
    policy_cap: float | None = None
    policy_band: tuple[float, float] | None = None

    @property
    def trust_region(self) -> tuple[float, float]:
        """(low, high): the probability-difference trust region that keeps every token the
        ratio band keeps. Inside [L, U], dp = e^l_theta - e^l_r = p_r (rho - 1) lies in
        [-(1 - L), U - 1] at any rollout probability p_r <= 1, so a DPPO band of
        `dppo_mask_low` 1 - L, `dppo_mask_high` U - 1 (an IPO threshold of the larger) drops
        only tokens the ratio band drops, and keeps the low-probability ones whose large
        ratios move the probability little.

        >>> from types import SimpleNamespace
        >>> Thresholds.trust_region.fget(SimpleNamespace(band=(0.666, 1.5)))
        (0.334, 0.5)
        """
        low, high = self.band
        return float(f"{1.0 - low:.12g}"), float(f"{high - 1.0:.12g}")

    def describe(self, kind: str) -> str:
        """Where a kind's thresholds come from, in words."""
        band = f"band [{self.band[0]:g}, {self.band[1]:g}] on token ratios"
        geo = f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}]"
        return {
            "token_tis": f"cap {self.token_cap:g}",
            "icepop": band,
            "token_mask": band,
            "token_mask_tis": band,
            "geo_mask": geo,
            "geo_mask_geo_tis": geo,
            "geo_mask_token_tis": f"{geo}, token cap {self.token_cap:g}",
            "seq_mask_tis": geo,
            "k3_mask": f"mean k3 <= {self.k3:.3g}",
            "mult_error_mask": f"mean e^|d| <= {self.mult_error:.6g}",
            "bypass_ppo": "no weight: the PPO ratio itself is e^(policy - rollout)",
            "dppo_trust_region": f"dp band [-{self.trust_region[0]:g}, {self.trust_region[1]:g}] "
            f"by the advantage's sign, the reach of the token {band}",
            "ipo_trust_region": f"|dp| <= {max(self.trust_region):g}, the reach of the token "
            f"{band}",
            **self._describe_policy(),
        }.get(kind, "cap 2, the frameworks' usual sequence-level cap")

    def _describe_policy(self) -> dict[str, str]:
        """Where the current-policy kinds' thresholds come from; none without a policy."""
        if self.policy_cap is None or self.policy_band is None:
            return {}
        cap = f"cap {self.policy_cap:g} on current-policy ratios"
        low, high = self.policy_band
        return {
            "policy_token_tis": cap,
            "policy_icepop": f"band [{low:g}, {high:g}] on current-policy ratios",
            "policy_token_tis_ppo": cap,
        }

    @classmethod
    def of(cls, normal: Normal) -> Thresholds:
        rho = normal.rho[~normal.token_broken] if normal.token_broken.any() else normal.rho
        has = normal.T > 0
        healthy = has & ~normal.broken
        g_dev = normal.G - normal.g_center
        cap = _loosest_cap(rho)
        # Sequence bounds keep every healthy sequence, pulled in to just inside the nearest
        # broken one beyond them where it lies closer. A broken sequence among the healthy
        # ones on a statistic (spread wider than noise, its mean d no further off) cannot be
        # dropped by a bound on it without dropping them: it stays, and counts against it.
        g_half = _sequence_bound(np.abs(g_dev), healthy, normal.broken, 1e-4)
        k3_cap = _sequence_bound(normal.k3, healthy, normal.broken, 1e-6)
        # E >= 1: the bound is placed on its excess over 1, as k3's on k3.
        excess = _sequence_bound(normal.mult_error - 1.0, healthy, normal.broken, 1e-6)
        return cls(
            token_cap=cap,
            band=(_round_down(1.0 / cap), cap),
            geo=(
                _round_down(ops.exp_of(normal.g_center - g_half), 5),
                _round_up(ops.exp_of(normal.g_center + g_half), 5),
            ),
            k3=max(_round_up(k3_cap), 1e-9),  # frameworks take a positive bound
            mult_error=1.0 + _round_up(excess),
            normal=normal,
            **_policy_thresholds(normal),
        )


def _sequence_bound(
    distance: np.ndarray, healthy: np.ndarray, broken: np.ndarray, floor: float
) -> float:
    """The bound on a sequence statistic (its distance from the healthy centre, >= 0): `_MARGIN`
    beyond every healthy sequence's, or `_INSIDE` the nearest broken one's beyond them all
    where that is closer; at least `floor`.

    >>> d = np.array([0.1, 0.2, 0.3, 1.0, 0.05])
    >>> broken = np.array([False, False, False, True, True])
    >>> round(_sequence_bound(d, ~broken, broken, 1e-4), 3)  # 0.05 lies among the healthy
    0.315
    >>> d[3] = 0.33  # the nearest broken one beyond them: the bound just inside it
    >>> round(_sequence_bound(d, ~broken, broken, 1e-4), 3)
    0.297
    """
    reach = float(distance[healthy].max(initial=0.0))
    bound = max(_MARGIN * reach, floor)
    beyond = broken & (distance > reach)
    if beyond.any():
        bound = min(bound, _INSIDE * float(distance[beyond].min()))
    return bound


def _policy_thresholds(normal: Normal) -> dict[str, Any]:
    """The cap and band on the current policy's ratios over the rollout, placed as the token
    ones are (`_loosest_cap`), on the healthy tokens; none without a current policy."""
    if normal.target is None:
        return {}
    target = normal.target[~normal.token_broken] if normal.token_broken.any() else normal.target
    cap = _loosest_cap(target)
    return {"policy_cap": cap, "policy_band": (_round_down(1.0 / cap), cap)}


def _round_up(x: float, digits: int = 3) -> float:
    if not math.isfinite(x) or x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def _round_down(x: float, digits: int = 3) -> float:
    if not math.isfinite(x) or x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale) / scale
