"""Threshold exploration at interactive speed: sort once, then every query is a binary search.

`Tuner(batch)` sorts the per-token ratios and the per-sequence statistics once and keeps
prefix sums; each query (a token cap, IcePop bounds, geometric or product sequence bounds, a
k3 threshold) is then a few `searchsorted` calls: O(log N), whatever the dump's size.

The families and their exact semantics (rho = e^clamp(d, +-20) per loss token, S and G the
sum and mean of d over a sequence's loss tokens, T their count):

- `token_tis(upper, lower)`: w = clamp(rho, lower, upper) (verl/SkyRL TIS; OpenRLHF two-sided).
- `icepop(lower, upper)`: w = rho * 1[lower <= rho <= upper] (weight zeroed, token stays).
- `seq_tis(upper)`: w = min(e^clamp(S, +-20), upper) for every token of the sequence.
- `geometric_mask(lower, upper)`: sequences kept iff lower <= e^G <= upper, w = 1.
- `product_mask(lower, upper)`: sequences kept iff lower <= e^clamp(S, +-20) <= upper, w = 1.
- `k3_mask(threshold)`: sequences kept iff mean k3 of their tokens <= threshold (verl
  `seq_mean_k3`), w = 1.

Each returns a `TuneResult`; `lr_scale` is sum(w) / N (token-mean over loss tokens, rejected
tokens keeping their place in the denominator, as most frameworks do).

>>> tuner = Tuner(iscore.load("data/long_collapse.parquet"))  # doctest: +SKIP
>>> tuner.geometric_mask(0.999, 1.001).seq_masked_fraction    # doctest: +SKIP
0.278
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from iscore import ops
from iscore.batch import TokenBatch


@dataclass(frozen=True, slots=True)
class TuneResult:
    """What one threshold setting does, over loss tokens.

    Attributes:
        weight_mean: <w>_tok.
        ess: (sum w)^2 / (N sum w^2), the effective sample size as a fraction of tokens.
        lr_scale: sum(w) / N: the token-mean loss's gradient scale relative to no correction.
        token_masked_fraction: tokens whose weight is 0.
        seq_masked_fraction: sequences all of whose tokens have weight 0 (None where a
            token-level family cannot say without a replay).
        truncated_fraction: tokens whose weight was clamped (token_tis, seq_tis).
    """

    weight_mean: float
    ess: float
    lr_scale: float
    token_masked_fraction: float
    seq_masked_fraction: float | None
    truncated_fraction: float


class _Sorted:
    """Sorted keys with prefix sums of companion values, for range sums by binary search.

    `one` (the count) is implicit: a range's count is its length. With `presorted`, the keys
    (and values) are already in order and are not sorted again.
    """

    def __init__(self, keys: np.ndarray, *, presorted: bool = False, **values: np.ndarray):
        if presorted:
            self.keys = keys
        else:
            order = np.argsort(keys, kind="stable")
            self.keys = keys[order]
            values = {name: v[order] for name, v in values.items()}
        self.prefix = {name: _prefix(v) for name, v in values.items() if name != "one"}

    def index(self, bound: float | None, *, side: str) -> int:
        if bound is None:
            return 0 if side == "left" else self.keys.size
        return int(np.searchsorted(self.keys, bound, side=side))

    def total(self, name: str, start: int, stop: int) -> float:
        """Sum of `name` over sorted positions start..stop-1."""
        if name == "one":
            return float(stop - start)
        return float(self.prefix[name][stop] - self.prefix[name][start])


def _prefix(values: np.ndarray) -> np.ndarray:
    """float64 [n + 1] running sums, from 0."""
    out = np.empty(values.size + 1, dtype=np.float64)
    out[0] = 0.0
    np.cumsum(values, dtype=np.float64, out=out[1:])
    return out


class Tuner:
    """Sorted statistics of one batch, queried per threshold in O(log N).

    Args:
        batch: the loaded dump (any device; the sorted arrays live on the host).
    """

    def __init__(self, batch: TokenBatch):
        m = batch.loss_mask
        d = ops.log_ratio(batch)
        # The ratios are their own weights: sorting them (no argsort, no gathers) is enough.
        rho = np.sort(ops.exp(d if ops.mask_is_all(batch, m) else d[m]).cpu().numpy())
        self.tokens = int(rho.size)
        self._rho = _Sorted(rho, presorted=True, w=rho, w2=rho * rho)
        T = ops.segment_count(batch, m)
        has = T > 0
        S = ops.segment_sum(d, batch, m)
        k3 = ops.segment_mean(ops.k3(ops.truncate(d, -20.0, 20.0)), batch, m)
        T, S, k3 = T[has].cpu().numpy(), S[has].cpu().numpy(), k3[has].cpu().numpy()
        self.sequences = int(T.size)
        seq_ratio = np.exp(np.clip(S, -20.0, 20.0))
        self._geo = _Sorted(S / T, T=T, one=np.ones_like(T))
        self._product = _Sorted(
            seq_ratio, T=T, one=np.ones_like(T), Tw=T * seq_ratio, Tw2=T * seq_ratio**2
        )
        self._k3 = _Sorted(k3, T=T, one=np.ones_like(T))

    def _result(
        self, w: float, w2: float, masked: float, seq_masked: float | None, truncated: float
    ) -> TuneResult:
        n = max(self.tokens, 1)
        return TuneResult(
            weight_mean=w / n,
            ess=w * w / (n * w2) if w2 > 0 else 0.0,
            lr_scale=w / n,
            token_masked_fraction=masked / n,
            seq_masked_fraction=seq_masked,
            truncated_fraction=truncated / n,
        )

    def token_tis(self, upper: float | None, lower: float | None = None) -> TuneResult:
        """w = clamp(rho, lower, upper) per token."""
        r = self._rho
        lo = r.index(lower, side="left")  # rho < lower: raised to lower
        hi = r.index(upper, side="right")  # rho > upper: cut to upper
        n_low, n_high = lo, r.keys.size - hi
        w = r.total("w", lo, hi) + (lower or 0.0) * n_low + (upper or 0.0) * n_high
        w2 = r.total("w2", lo, hi) + (lower or 0.0) ** 2 * n_low + (upper or 0.0) ** 2 * n_high
        return self._result(w, w2, 0.0, None, n_low * bool(lower) + n_high)

    def icepop(self, lower: float | None, upper: float | None) -> TuneResult:
        """w = rho inside [lower, upper], 0 outside."""
        r = self._rho
        lo, hi = r.index(lower, side="left"), r.index(upper, side="right")
        kept = max(hi - lo, 0)
        w = r.total("w", lo, hi) if kept else 0.0
        w2 = r.total("w2", lo, hi) if kept else 0.0
        return self._result(w, w2, self.tokens - kept, None, 0.0)

    def _sequence_mask(self, table: _Sorted, lo: int, hi: int) -> TuneResult:
        kept_seqs = max(hi - lo, 0)
        kept_tokens = table.total("T", lo, hi) if kept_seqs else 0.0
        seq_masked = 1.0 - kept_seqs / max(self.sequences, 1)
        return self._result(kept_tokens, kept_tokens, self.tokens - kept_tokens, seq_masked, 0.0)

    def geometric_mask(self, lower: float | None, upper: float | None) -> TuneResult:
        """Keep sequences whose e^G lies in [lower, upper]."""
        g = self._geo
        lo = g.index(None if lower is None else float(np.log(lower)), side="left")
        hi = g.index(None if upper is None else float(np.log(upper)), side="right")
        return self._sequence_mask(g, lo, hi)

    def product_mask(self, lower: float | None, upper: float | None) -> TuneResult:
        """Keep sequences whose e^clamp(S, +-20) lies in [lower, upper]."""
        p = self._product
        return self._sequence_mask(p, p.index(lower, side="left"), p.index(upper, side="right"))

    def k3_mask(self, threshold: float) -> TuneResult:
        """Keep sequences whose mean per-token k3 is at most `threshold`."""
        k = self._k3
        return self._sequence_mask(k, 0, k.index(threshold, side="right"))

    def seq_tis(self, upper: float) -> TuneResult:
        """w = min(e^clamp(S, +-20), upper), broadcast to the sequence's tokens."""
        p = self._product
        hi = p.index(upper, side="right")
        capped_tokens = p.total("T", hi, p.keys.size)
        w = p.total("Tw", 0, hi) + upper * capped_tokens
        w2 = p.total("Tw2", 0, hi) + upper**2 * capped_tokens
        return self._result(w, w2, 0.0, 0.0, capped_tokens)

    def quantiles(
        self, family: str, qs: tuple[float, ...] = (0.001, 0.01, 0.5, 0.99, 0.999)
    ) -> dict[float, float]:
        """Quantiles of the statistic a family thresholds (token ratio, e^G, e^S, mean k3):
        where sliders should start."""
        table = {
            "token": self._rho,
            "geometric": self._geo,
            "product": self._product,
            "k3": self._k3,
        }[family]
        keys = np.exp(table.keys) if family == "geometric" else table.keys
        if not keys.size:
            return {q: float("nan") for q in qs}
        return {q: float(np.quantile(keys, q)) for q in qs}
