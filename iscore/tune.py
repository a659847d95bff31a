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
tokens keeping their place in the denominator, as most frameworks do), or under the
`aggregation` given (`query(..., framework)` takes the framework's, as Compare does).

>>> tuner = Tuner(iscore.load("data/long_collapse.parquet"))  # doctest: +SKIP
>>> tuner.geometric_mask(0.999, 1.001).seq_masked_fraction    # doctest: +SKIP
0.278
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from iscore import frameworks, ops
from iscore.batch import TokenBatch
from iscore.canonical import Canonical, mask_component, weight_component
from iscore.errors import ConfigError
from iscore.frameworks._config import check_choice
from iscore.frameworks.base import Aggregation
from iscore.spec import Spec

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
            seq_ratio, T=T, one=np.ones_like(T), w=seq_ratio, Tw=T * seq_ratio, Tw2=T * seq_ratio**2
        )
        self._k3 = _Sorted(k3, T=T, one=np.ones_like(T))
        self._batch = batch
        self._per_sequence_rho: _Sorted | None = None

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


Statistic = Literal["token", "geometric", "product", "k3"]


@dataclass(frozen=True, slots=True)
class Family:
    """A family of threshold settings that `Tuner` answers in O(log N).

    Attributes:
        key: the `Tuner` method; its positional arguments are `bounds`, in order.
        label: for people.
        statistic: what the bounds threshold (`Tuner.quantiles` family).
        bounds: the thresholds' names.
        defaults: a common setting, one value per bound.
        span: the least range the thresholds' sliders cover, widened to the data's
            0.1%-99.9% quantiles.
        rule: the family's rule in one line.
        truncates: whether it clamps weights (else `TuneResult.truncated_fraction` is 0).
    """

    key: str
    label: str
    statistic: Statistic
    bounds: tuple[str, ...]
    defaults: tuple[float, ...]
    span: tuple[float, float]
    rule: str
    truncates: bool = False


FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family(
            "token_tis", "Token TIS cap", "token", ("upper",), (2.0,), (1.0, 10.0),
            "w = min(rho, upper) per token, rho = e^d", truncates=True,
        ),
        Family(
            "icepop", "IcePop band", "token", ("lower", "upper"), (0.5, 5.0), (0.1, 10.0),
            "w = rho where lower ≤ rho ≤ upper, else 0",
        ),
        Family(
            "seq_tis", "Sequence TIS cap", "product", ("upper",), (2.0,), (1.0, 10.0),
            "w = min(e^S, upper) for every token of the sequence, S = Σd", truncates=True,
        ),
        Family(
            "geometric_mask", "Geometric sequence mask", "geometric", ("lower", "upper"),
            (0.999, 1.001), (0.999, 1.001),
            "keep a sequence iff lower ≤ e^(S/T) ≤ upper; w = 1",
        ),
        Family(
            "product_mask", "Product sequence mask", "product", ("lower", "upper"), (0.5, 2.0),
            (0.1, 10.0), "keep a sequence iff lower ≤ e^S ≤ upper; w = 1",
        ),
        Family(
            "k3_mask", "k3 sequence mask", "k3", ("threshold",), (0.01,), (1e-4, 0.1),
            "keep a sequence iff its mean per-token k3 ≤ threshold; w = 1",
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


def grid(tuner: Tuner, family: str, points: int = 61) -> dict[str, list[float]]:
    """Log-spaced slider values per bound, from the family's span widened to the data's
    0.1%-99.9% quantiles of the statistic it thresholds, rounded to 4 significant digits,
    with the family's default among them.

    Bounds named `lower` run up to 1, `upper` from 1; a lone `threshold` covers the span.
    """
    f = FAMILIES[family]
    q = tuner.quantiles(f.statistic)
    low = max(float(np.nanmin([f.span[0], q[0.001]])), 1e-9)
    high = float(np.nanmax([f.span[1], q[0.999]]))
    ranges = {"lower": (low, 1.0), "upper": (1.0, high), "threshold": (low, high)}
    out = {}
    for bound, default in zip(f.bounds, f.defaults, strict=True):
        values = {float(f"{v:.4g}") for v in np.geomspace(*ranges[bound], points)}
        out[bound] = sorted(values | {default})
    return out


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
    (threshold,) = values
    k3 = mask_component("geometric", upper=threshold, statistic="k3", numerics="clamp_each")
    return Canonical((k3,))


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
