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
- `dppo(low, high)`: a probability trust region by the advantage's sign (DPPO), on dp =
  e^l_theta - e^l_r: a token whose sequence's advantage A > 0 is dropped iff dp > high, any
  other iff dp < -low; w = rho, unclamped, where kept, else 0. Needs the dump's `advantage`.
- `ipo(threshold)`: the symmetric one (IPO): dropped iff |dp| > threshold; w as for DPPO.

The last two compute dp and rho in float32 and compare the bounds in float32
(`iscore.packed.ops.prob_diff`), as the framework that has them does, so their masks are its
replay's token for token.

Each returns a `TuneResult`; `lr_scale` is sum(w) / N (token-mean over loss tokens, rejected
tokens keeping their place in the denominator, as most frameworks do), or under the
`aggregation` given (`query(..., framework)` takes the framework's, as Compare does).

>>> tuner = Tuner(iscore.load("data/long_collapse.parquet"))  # doctest: +SKIP
>>> tuner.geometric_mask(0.999, 1.001).seq_masked_fraction    # doctest: +SKIP
0.278
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from iscore import frameworks
from iscore.dump import Data, load_data
from iscore.errors import ConfigError
from iscore.frameworks import (
    Aggregation,
    Canonical,
    Spec,
    check_choice,
    mask_component,
    weight_component,
)
from iscore.packed import ops

_TOKEN = Aggregation()  # token-mean: sum(w) / N


@dataclass(frozen=True, slots=True)
class TuneResult:
    """What one threshold setting does, over loss tokens.

    Attributes:
        weight_mean: <w>_tok.
        ess: (sum w)^2 / (N sum w^2), the effective sample size as a fraction of tokens.
        lr_scale: the loss gradient's scale relative to no correction: sum(w) / N under
            token-mean, else under the aggregation the query was given.
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


def _float32(bound: float) -> float:
    """`bound` as a float32 tensor compares with it (rounded to the nearest float32)."""
    return float(np.float32(bound))


def _prefix(values: np.ndarray) -> np.ndarray:
    """float64 [n + 1] running sums, from 0."""
    out = np.empty(values.size + 1, dtype=np.float64)
    out[0] = 0.0
    np.cumsum(values, dtype=np.float64, out=out[1:])
    return out


class Tuner:
    """Sorted statistics of one batch, queried per threshold in O(log N).

    Args:
        data: the dump: a loaded batch (any device; the sorted arrays live on the host), an
            opened `Dump` or its path (read whole).
    """

    def __init__(self, data: Data):
        batch = load_data(data)
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
            seq_ratio, T=T, one=np.ones_like(T), w=seq_ratio, Tw=T * seq_ratio, Tw2=T * seq_ratio**2
        )
        self._k3 = _Sorted(k3, T=T, one=np.ones_like(T))
        self._batch = batch
        self._per_sequence_rho: _Sorted | None = None
        self._trust: dict[str, _Sorted] | None = None

    def _rho_by_sequence(self) -> _Sorted:
        """The token ratios sorted with each token's 1/T: what a sequence-mean aggregation
        weighs them by. Sorted on first use (an argsort), only for such aggregations."""
        if self._per_sequence_rho is None:
            batch, m = self._batch, self._batch.loss_mask
            inv_t = 1.0 / ops.segment_count(batch, m).clamp(min=1).double()
            rho = ops.exp(ops.log_ratio(batch))[m].double().cpu().numpy()
            c = ops.broadcast(inv_t, batch)[m].cpu().numpy()
            self._per_sequence_rho = _Sorted(rho, c=c, wc=rho * c)
        return self._per_sequence_rho

    def _trust_region(self) -> dict[str, _Sorted]:
        """The trust regions' statistics over loss tokens, sorted on first use: |dp| ("abs"),
        and dp of the tokens whose advantage is > 0 ("positive") and of the others ("other",
        NaN among them: `A > 0` is false there), each with rho = e^d as weight. The last two
        only where the batch carries the advantage."""
        if self._trust is None:
            batch, m = self._batch, self._batch.loss_mask
            dp = ops.prob_diff(batch)[m].double().cpu().numpy()
            rho = ops.raw_ratio(batch)[m].double().cpu().numpy()
            self._trust = {"abs": _Sorted(np.abs(dp), w=rho, w2=rho * rho)}
            advantage = ops.sequence_values(batch, "advantage")
            if advantage is not None:
                positive = (advantage[m] > 0).cpu().numpy()
                for name, rows in (("positive", positive), ("other", ~positive)):
                    self._trust[name] = _Sorted(dp[rows], w=rho[rows], w2=rho[rows] ** 2)
        return self._trust

    @property
    def advantages(self) -> bool:
        """Whether the batch carries each sequence's `advantage` (the DPPO family needs it)."""
        extra = self._batch.extra
        return extra is not None and "advantage" in extra.column_names

    def _need_advantages(self) -> None:
        if not self.advantages:
            raise ConfigError(
                "The DPPO trust region picks each token's side by its sequence's advantage, so "
                "it needs the dump's `advantage` column carried with the batch (open the dump "
                "with extras, as the app and `iscore sequences` do), which this batch lacks"
            )

    def _kept(self, w: float, w2: float, kept: int, aggregation: Aggregation) -> TuneResult:
        """A trust region's result: `kept` tokens of weight sum `w`, the others dropped."""
        if aggregation.mode != "token-mean" or aggregation.shrinks:
            raise ConfigError(
                "Expected a token-mean aggregation that keeps the dropped tokens in its count "
                f"(the sum over the step's loss tokens) for a trust region, but got "
                f"{aggregation.describe()}"
            )
        return self._result(w, w2, self.tokens - kept, None, 0.0)

    def dppo(self, low: float, high: float, *, aggregation: Aggregation = _TOKEN) -> TuneResult:
        """w = rho unless (A > 0 and dp > high) or (A <= 0 and dp < -low), then 0.

        Raises:
            ConfigError: the batch carries no advantage.
        """
        self._need_advantages()
        trust = self._trust_region()
        positive, other = trust["positive"], trust["other"]
        hi = positive.index(_float32(high), side="right")
        lo = other.index(-_float32(low), side="left")
        end = other.keys.size
        w = positive.total("w", 0, hi) + other.total("w", lo, end)
        w2 = positive.total("w2", 0, hi) + other.total("w2", lo, end)
        return self._kept(w, w2, hi + end - lo, aggregation)

    def ipo(self, threshold: float, *, aggregation: Aggregation = _TOKEN) -> TuneResult:
        """w = rho where |dp| <= threshold, else 0."""
        table = self._trust_region()["abs"]
        hi = table.index(_float32(threshold), side="right")
        return self._kept(table.total("w", 0, hi), table.total("w2", 0, hi), hi, aggregation)

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

    def token_tis(
        self, upper: float | None, lower: float | None = None, *, aggregation: Aggregation = _TOKEN
    ) -> TuneResult:
        """w = clamp(rho, lower, upper) per token."""
        r = self._rho
        lo = r.index(lower, side="left")  # rho < lower: raised to lower
        hi = r.index(upper, side="right")  # rho > upper: cut to upper
        n_low, n_high = lo, r.keys.size - hi
        w = r.total("w", lo, hi) + (lower or 0.0) * n_low + (upper or 0.0) * n_high
        w2 = r.total("w2", lo, hi) + (lower or 0.0) ** 2 * n_low + (upper or 0.0) ** 2 * n_high
        result = self._result(w, w2, 0.0, None, n_low * bool(lower) + n_high)
        if aggregation.mode != "seq-mean-token-mean":
            return result
        c = self._rho_by_sequence()
        lo, hi = c.index(lower, side="left"), c.index(upper, side="right")
        per_seq = c.total("wc", lo, hi) + (lower or 0.0) * c.total("c", 0, lo)
        per_seq += (upper or 0.0) * c.total("c", hi, c.keys.size)
        return replace(result, lr_scale=per_seq / max(self.sequences, 1))

    def icepop(
        self, lower: float | None, upper: float | None, *, aggregation: Aggregation = _TOKEN
    ) -> TuneResult:
        """w = rho inside [lower, upper], 0 outside."""
        r = self._rho
        lo, hi = r.index(lower, side="left"), r.index(upper, side="right")
        kept = max(hi - lo, 0)
        w = r.total("w", lo, hi) if kept else 0.0
        w2 = r.total("w2", lo, hi) if kept else 0.0
        result = self._result(w, w2, self.tokens - kept, None, 0.0)
        if aggregation.mode != "seq-mean-token-mean":
            return result
        c = self._rho_by_sequence()
        lo, hi = c.index(lower, side="left"), c.index(upper, side="right")
        per_seq = c.total("wc", lo, hi) if hi > lo else 0.0
        return replace(result, lr_scale=per_seq / max(self.sequences, 1))

    def _sequence_mask(
        self, table: _Sorted, lo: int, hi: int, aggregation: Aggregation
    ) -> TuneResult:
        """Sequences lo..hi-1 of `table` kept with w = 1, the others removed from the loss."""
        kept_seqs = max(hi - lo, 0)
        kept_tokens = table.total("T", lo, hi) if kept_seqs else 0.0
        seq_masked = 1.0 - kept_seqs / max(self.sequences, 1)
        result = self._result(kept_tokens, kept_tokens, self.tokens - kept_tokens, seq_masked, 0.0)
        if aggregation.mode == "seq-mean-token-mean":
            return replace(result, lr_scale=kept_seqs / max(self.sequences, 1))
        if aggregation.shrinks and aggregation.mode == "token-mean":
            # The removed tokens leave the denominator: every kept token counts 1 / kept.
            return replace(result, lr_scale=1.0 if kept_tokens else 0.0)
        return result

    def geometric_mask(
        self, lower: float | None, upper: float | None, *, aggregation: Aggregation = _TOKEN
    ) -> TuneResult:
        """Keep sequences whose e^G lies in [lower, upper]."""
        g = self._geo
        lo = g.index(None if lower is None else float(np.log(lower)), side="left")
        hi = g.index(None if upper is None else float(np.log(upper)), side="right")
        return self._sequence_mask(g, lo, hi, aggregation)

    def product_mask(
        self, lower: float | None, upper: float | None, *, aggregation: Aggregation = _TOKEN
    ) -> TuneResult:
        """Keep sequences whose e^clamp(S, +-20) lies in [lower, upper]."""
        p = self._product
        lo, hi = p.index(lower, side="left"), p.index(upper, side="right")
        return self._sequence_mask(p, lo, hi, aggregation)

    def k3_mask(self, threshold: float, *, aggregation: Aggregation = _TOKEN) -> TuneResult:
        """Keep sequences whose mean per-token k3 is at most `threshold`."""
        k = self._k3
        return self._sequence_mask(k, 0, k.index(threshold, side="right"), aggregation)

    def seq_tis(self, upper: float, *, aggregation: Aggregation = _TOKEN) -> TuneResult:
        """w = min(e^clamp(S, +-20), upper), broadcast to the sequence's tokens."""
        p = self._product
        hi = p.index(upper, side="right")
        capped_tokens = p.total("T", hi, p.keys.size)
        w = p.total("Tw", 0, hi) + upper * capped_tokens
        w2 = p.total("Tw2", 0, hi) + upper**2 * capped_tokens
        result = self._result(w, w2, 0.0, 0.0, capped_tokens)
        if aggregation.mode != "seq-mean-token-mean":
            return result
        per_seq = p.total("w", 0, hi) + upper * (p.keys.size - hi)
        return replace(result, lr_scale=per_seq / max(self.sequences, 1))

    def quantiles(self, family: str, qs: Sequence[float]) -> dict[float, float]:
        """Quantiles (nearest rank) of the statistic a family thresholds (token ratio, e^G,
        e^S, mean k3; |dp|, dp of the A > 0 tokens, -dp of the others), read off the sorted
        table: where sliders should stop."""
        if family in ("abs_prob_diff", "dppo_high", "dppo_low"):
            if family != "abs_prob_diff":
                self._need_advantages()
            trust = self._trust_region()
            keys = {
                "abs_prob_diff": lambda: trust["abs"].keys,
                "dppo_high": lambda: trust["positive"].keys,
                "dppo_low": lambda: -trust["other"].keys[::-1],  # -dp, increasing
            }[family]()
        else:
            table = {
                "token": self._rho,
                "geometric": self._geo,
                "product": self._product,
                "k3": self._k3,
            }[family]
            keys = table.keys
        n = keys.size
        if not n:
            return {q: float("nan") for q in qs}
        at = keys[np.rint(np.asarray(qs, dtype=np.float64) * (n - 1)).astype(np.int64)]
        if family == "geometric":
            at = np.exp(at)
        return dict(zip(qs, at.tolist(), strict=True))


Statistic = Literal["token", "geometric", "product", "k3", "abs_prob_diff", "dppo_low", "dppo_high"]


@dataclass(frozen=True, slots=True)
class Family:
    """A family of threshold settings that `Tuner` answers in O(log N).

    Attributes:
        key: the `Tuner` method; its positional arguments are `bounds`, in order.
        label: for people.
        statistic: what the bounds threshold (`Tuner.quantiles` family).
        bounds: the thresholds' names.
        defaults: a common setting, one value per bound.
        rule: the family's rule in one line.
        truncates: whether it clamps weights (else `TuneResult.truncated_fraction` is 0).
        per_bound: where the bounds threshold different statistics, each bound's (else
            `statistic` is every bound's).
        needs_advantage: whether `Tuner` needs the dump's `advantage` for it.
        ceiling: the largest threshold that can matter, where there is one (|dp| <= 1 for any
            two probabilities: a threshold of 1 drops nothing), the sliders' end.
    """

    key: str
    label: str
    statistic: Statistic
    bounds: tuple[str, ...]
    defaults: tuple[float, ...]
    rule: str
    truncates: bool = False
    per_bound: tuple[Statistic, ...] = ()
    needs_advantage: bool = False
    ceiling: float | None = None

    def statistic_of(self, bound: int) -> Statistic:
        """What bound number `bound` thresholds (`Tuner.quantiles` family)."""
        return self.per_bound[bound] if self.per_bound else self.statistic


FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family(
            "token_tis", "Token TIS cap", "token", ("upper",), (2.0,),
            "w = min(rho, upper) per token, rho = e^d", truncates=True,
        ),
        Family(
            "icepop", "IcePop band", "token", ("lower", "upper"), (0.5, 5.0),
            "w = rho where lower ≤ rho ≤ upper, else 0",
        ),
        Family(
            "seq_tis", "Sequence TIS cap", "product", ("upper",), (2.0,),
            "w = min(e^S, upper) for every token of the sequence, S = Σd", truncates=True,
        ),
        Family(
            "geometric_mask", "Geometric sequence mask", "geometric", ("lower", "upper"),
            (0.999, 1.001),
            "keep a sequence iff lower ≤ e^(S/T) ≤ upper; w = 1",
        ),
        Family(
            "product_mask", "Product sequence mask", "product", ("lower", "upper"), (0.5, 2.0),
            "keep a sequence iff lower ≤ e^S ≤ upper; w = 1",
        ),
        Family(
            "k3_mask", "k3 sequence mask", "k3", ("threshold",), (0.01,),
            "keep a sequence iff its mean per-token k3 ≤ threshold; w = 1",
        ),
        Family(
            "dppo", "DPPO trust region (by the advantage's sign)", "abs_prob_diff", ("low", "high"),
            (0.2, 0.2),
            "drop a token iff A > 0 and Δp > high, or A ≤ 0 and Δp < -low, Δp = e^l_theta - "
            "e^l_rollout; w = rho where kept, else 0",
            per_bound=("dppo_low", "dppo_high"), needs_advantage=True, ceiling=1.0,
        ),
        Family(
            "ipo", "IPO trust region", "abs_prob_diff", ("threshold",), (0.1,),
            "drop a token iff |Δp| > threshold, Δp = e^l_theta - e^l_rollout; w = rho where kept, "
            "else 0", ceiling=1.0,
        ),
    )
}  # fmt: skip
"""The families of `Tuner`, by its method names."""


def query(
    tuner: Tuner, family: str, values: Sequence[float], framework: str | None = None
) -> TuneResult:
    """What the setting `values` (one per bound) of `family` does, in O(log N); with a
    `framework`, `lr_scale` under the loss aggregation of that framework's setting (so Tune
    reads what Compare shows for the same setting)."""
    aggregation = _TOKEN
    if framework is not None:
        aggregation = frameworks.get(framework).aggregation(family_spec(family, values, framework))
    return getattr(tuner, FAMILIES[family].key)(*values, aggregation=aggregation)


def grid(
    tuner: Tuner,
    family: str,
    points: int = 45,
    include: Sequence[Sequence[float]] = (),
) -> dict[str, list[float]]:
    """Slider values per bound, from the data's quantiles: each step moves the share of the
    data beyond the bound by a constant factor (a quarter of it, down to one in a million), so the
    slider spends its length where the data is, however narrow (a dump whose ratios end at
    1.09 is not a sliver of a 1-10 range).

    Past the data's extreme a few values reach 3 times as far (in log-ratio, for ratio
    bounds), and a few lead from the bulk to the neutral value (1 for a ratio bound, 0 for a
    k3 threshold); an `upper` bound stays above 1 and a `lower` one below. Values are rounded
    to three significant digits of their distance from 1 (`_round`); the family's default
    and every setting of `include` (values in the family's bound order, e.g. the framework's
    default and the recommended setting) are among them.

    >>> from iscore import load
    >>> g = grid(Tuner(load("data/fp8.parquet")), "token_tis")["upper"]
    >>> g[0] > 1.0, 2.0 in g, len(g) > 30
    (True, True, True)
    """
    f = FAMILIES[family]
    out = {}
    for i, (bound, default) in enumerate(zip(f.bounds, f.defaults, strict=True)):
        tail = np.geomspace(0.25, 1e-6, points)  # the share of the data beyond the bound
        q = tuner.quantiles(f.statistic_of(i), tail if bound == "lower" else 1.0 - tail)
        data = np.array(list(q.values()), dtype=np.float64)
        if bound not in RATIO_BOUNDS:
            values = _threshold_values(data[data > 0], default)
        else:
            sign = 1.0 if bound == "upper" else -1.0
            # In log-ratio, as a distance from 1 on the bound's side.
            delta = sign * np.log(data[(sign * np.log(np.maximum(data, 1e-300))) > 0])
            values = np.exp(sign * _distances(delta, abs(math.log(default))))
        chosen = {default, *(float(v[i]) for v in include)}
        if f.ceiling is not None:
            values = np.append(values[values < f.ceiling], f.ceiling)
        out[bound] = sorted({_round(float(v), bound) for v in values} | chosen)
    return out


RATIO_BOUNDS = ("upper", "lower")
"""The bounds on a ratio (around 1); every other bound is a threshold on a statistic >= 0
(k3, |dp|, or one side of dp)."""


def _distances(delta: np.ndarray, default: float) -> np.ndarray:
    """Distances from the neutral value for a slider: the data's (`delta`, increasing, all
    positive), a few from the bulk towards 0 and a few past the extreme, clamped at the
    +-20 exponent bound; `default` stands in when the data never leaves the neutral side."""
    if not delta.size:
        delta = np.array([default])
    # Bounds closer to 1 than 1e-3 remove the bulk of any dump: the slider need not go there.
    near = np.geomspace(delta[0] / 30, delta[0], 7)[:-1] if delta[0] > 1e-3 else []
    far = np.geomspace(delta[-1], 3 * delta[-1], 7)[1:]
    return np.minimum(np.concatenate([near, delta, far]), ops.SAFETY_BOUND)


def _threshold_values(data: np.ndarray, default: float) -> np.ndarray:
    """A threshold's slider values: the data's quantiles (`data`, increasing), a few from
    the bulk towards 0 and a few past the largest, up to 3 times it."""
    if not data.size:
        data = np.array([default])
    near = np.geomspace(data[0] / 30, data[0], 7)[:-1]
    far = np.geomspace(data[-1], 3 * data[-1], 7)[1:]
    return np.concatenate([near, data, far])


def _round(value: float, bound: str, digits: int = 3) -> float:
    """`value` to `digits` significant digits of what matters: its distance from 1 for a ratio
    bound near 1 (1.001234 -> 1.00123), itself for a threshold or a ratio far below 1."""
    scale = value if bound not in RATIO_BOUNDS else min(abs(value - 1.0), value)
    if scale == 0.0:
        return value
    return round(value, digits - 1 - math.floor(math.log10(scale)))


def family_of(spec: Spec) -> tuple[str, tuple[float, ...]] | None:
    """The family and bound values `spec` is a setting of (what Tune can move), or None.

    >>> from iscore.frameworks.resolve import presets
    >>> family_of(presets()["verl:decoupled_token_is"])
    ('token_tis', (2.0,))
    >>> family_of(presets()["prime_rl:prime_rl_ipo_eps03"])
    ('ipo', (0.3,))
    """
    fw = frameworks.get(spec.framework)
    setting = fw.to_canonical(spec)
    for key in FAMILIES:
        if key not in fw.families:
            continue
        values = _bound_values(key, setting)
        if values is None or any(v is None for v in values):
            continue
        try:
            candidate = fw.to_canonical(family_spec(key, values, spec.framework))
        except ConfigError:
            continue
        if candidate == setting or candidate.loosely_equals(setting):
            return key, tuple(float(v) for v in values)
    return None


def _bound_values(family: str, setting: Canonical) -> tuple[float | None, ...] | None:
    """The bound values `setting` would have as a setting of `family`, read off its
    components (`family_of` checks that the family's setting of them is `setting`)."""
    if family in ("dppo", "ipo"):
        bands = [m for m in setting.masks if m.statistic == "prob_diff"]
        if len(bands) != 1 or bands[0].lower is None:
            return None
        (band,) = bands
        return (-band.lower, band.upper) if family == "dppo" else (band.upper,)
    if len(setting.components) != 1:
        return None
    (c,) = setting.components
    band = c.zero or c
    if len(FAMILIES[family].bounds) == 1:
        return (c.upper,)
    if band.statistic == "log_ratio" and None not in (band.lower, band.upper):
        # verl's k1 bounds are log-ratios
        return tuple(float(f"{math.exp(v):.12g}") for v in (band.lower, band.upper))
    return band.lower, band.upper


def nearest(values: Sequence[float], target: float) -> float:
    """The value of `values` closest to `target` on a log scale.

    >>> nearest([0.5, 1.0, 2.0], 1.9)
    2.0
    """
    logs = np.log(np.asarray(values, dtype=np.float64))
    return float(values[int(np.argmin(np.abs(logs - np.log(target))))])


def sweep(
    tuner: Tuner,
    family: str,
    values: Sequence[float],
    bound: int,
    xs: Sequence[float],
    framework: str | None = None,
) -> list[TuneResult]:
    """`query` with bound number `bound` set to each of `xs`, the others held at `values`."""
    out = []
    for x in xs:
        point = list(values)
        point[bound] = x
        out.append(query(tuner, family, point, framework))
    return out


def setting_name(family: str, values: Sequence[float]) -> str:
    """A default name for a tuned setting, e.g. `icepop_0.5_5`.

    >>> setting_name("icepop", (0.5, 5.0))
    'icepop_0.5_5'
    """
    return "_".join([family, *(f"{v:.4g}" for v in values)])


# --------------------------------------------------------------------------------------------
# The families as settings: framework-neutral, and in each framework's terms.


def family_setting(family: str, values: Sequence[float]) -> Canonical:
    """The framework-neutral setting `values` (one per bound) of `family` computes.

    >>> family_setting("token_tis", (2.0,)).describe()
    'token TIS: w = min(rho, 2)'
    """
    check_choice("family", family, tuple(FAMILIES))
    if family == "token_tis":
        (upper,) = values
        return Canonical((weight_component("token", upper=upper, numerics="clamp"),))
    if family == "icepop":
        band = mask_component("token", *values, numerics="clamp")
        return Canonical((weight_component("token", numerics="clamp", zero=band),))
    if family == "seq_tis":
        (upper,) = values
        return Canonical((weight_component("sequence", upper=upper, numerics="clamp"),))
    if family == "geometric_mask":
        return Canonical((mask_component("geometric", *values),))
    if family == "product_mask":
        return Canonical((mask_component("sequence", *values, numerics="clamp"),))
    if family == "dppo":
        return trust_region_setting(*values, by_advantage=True)
    if family == "ipo":
        (threshold,) = values
        return trust_region_setting(threshold, threshold, by_advantage=False)
    (threshold,) = values
    k3 = mask_component("geometric", upper=threshold, statistic="k3", numerics="clamp_each")
    return Canonical((k3,))


def trust_region_setting(low: float, high: float, *, by_advantage: bool) -> Canonical:
    """The raw ratio, not clamped, on tokens with -low <= dp <= high (dp = e^l_theta - e^l_r),
    anchored on the rollout (no PPO ratio): DPPO's band by the advantage's sign, or the symmetric
    IPO one, which removes nothing from |dp| = 1 on (no |dp| is larger) and is then no band.

    >>> trust_region_setting(1.0, 1.0, by_advantage=False).describe()
    'token TIS: w = rho; REINFORCE-style loss, no PPO ratio'
    """
    weight = weight_component("token", numerator="train")
    if not by_advantage and max(low, high) >= 1.0:
        return Canonical((weight,), anchor="none")
    band = mask_component(
        "token",
        -low,
        high,
        statistic="prob_diff",
        numerator="train",
        numerics="float32",
        by_advantage=by_advantage,
    )
    return Canonical((weight, band), anchor="none")


def frameworks_for(family: str) -> list[str]:
    """The frameworks that have `family` as a setting of their own (the same weights)."""
    return [fw.name for fw in frameworks.every() if family in fw.families]


def family_spec(
    family: str, values: Sequence[float], framework: str, name: str | None = None
) -> Spec:
    """The setting `values` of `family` as `framework`'s own spec (its weights are the family's
    up to the framework's float32 / +-20-clamp details).

    >>> family_spec("token_tis", (2.0,), "verl").is_upper
    2.0

    Raises:
        ConfigError: `framework` has no such setting, or rejects the values.
    """
    fw = frameworks.get(framework)
    spec = None
    if family in fw.families:
        spec = fw.express(family_setting(family, values), name or setting_name(family, values))
    if spec is None:
        raise ConfigError(
            f"{framework} has no {FAMILIES[family].label.lower()}; "
            f"frameworks that do: {', '.join(frameworks_for(family))}"
        )
    return spec
