"""Recommend a correction setting for your framework from your own dump (docs/recommend.md).

First, what numerical noise looks like in this dump, robustly (medians and MADs), and what
stands out of it: broken sequences (a stale replica: every token off), a global offset,
long-sequence collapse, drift over steps. Thresholds are then placed where the data stops
looking like noise: token bounds at the healthy tokens' extreme 0.1% tails, sequence bounds
just outside the healthy sequences (none is dropped), or just inside the nearest broken one.
Candidates are framework-neutral kinds (token TIS, IcePop, token and geometric masks, k3 masks,
sequence-level weights) kept where the framework expresses them; each is replayed exactly as
the framework would (`iscore.impact.quick_stats`), held to the targets (and, with broken
sequences, to removing them), and ranked: meeting the targets, then reweighting, then the least
healthy data dropped, then the LR scale nearest 1, then ESS.

>>> rec = recommend(iscore.load("data/long_collapse.parquet"), "verl")  # doctest: +SKIP
>>> rec.best.spec.name, rec.regimes, rec.pick                          # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from iscore import frameworks, ops
from iscore.batch import TokenBatch
from iscore.canonical import Canonical, Component, mask_component, weight_component
from iscore.errors import ConfigError
from iscore.frameworks.base import Framework
from iscore.impact import quick_stats
from iscore.spec import Replay, Spec


@dataclass(frozen=True, slots=True)
class Targets:
    """What a good setting does to this data.

    Attributes:
        max_token_drop: at most this share of loss tokens may lose their gradient (weight 0).
        max_seq_drop: at most this share of sequences may be dropped entirely.
        lr_scale: the effective learning-rate scale must lie in [lo, hi].
        min_ess: the effective sample size (fraction of tokens) must be at least this.
    """

    max_token_drop: float = 0.01
    max_seq_drop: float = 0.05
    lr_scale: tuple[float, float] = (0.8, 1.25)
    min_ess: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_token_drop", "max_seq_drop", "min_ess"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Expected `{name}` to be a fraction in [0, 1], but got {value}")
        lo, hi = self.lr_scale
        if not 0.0 < lo <= 1.0 <= hi:
            raise ConfigError(
                f"Expected `lr_scale` to be a range lo <= 1 <= hi with lo > 0, but got {lo}:{hi}"
            )

    def grade(self, key: str, value: float | None) -> Literal["good", "fair", "bad"] | None:
        """Whether `value` of statistic `key` (a column of the settings table) is good, fair or
        bad for training, against these targets where they say (None for a missing value):

        - `lr_scale`: good within `lr_scale`, fair within half its low and twice its high end;
        - `ess`: good from `min_ess` (at least 0.8), fair from 0.3;
        - `weight_mean`, `weight_mean_seq`: good within [0.9, 1.1], fair within [0.5, 2];
        - dropped and truncated shares: good up to `max_token_drop` (tokens),
          `max_seq_drop` (sequences) or 0.01 (truncation), fair up to 5 times that.

        >>> Targets().grade("ess", 0.043), Targets().grade("lr_scale", 1.0)
        ('bad', 'good')
        """
        if value is None or value != value:
            return None
        if key == "lr_scale":
            lo, hi = self.lr_scale
            good, fair = lo <= value <= hi, lo / 2 <= value <= hi * 2
        elif key == "ess":
            good, fair = value >= max(self.min_ess, 0.8), value >= 0.3
        elif key in ("weight_mean", "weight_mean_seq"):
            good, fair = 0.9 <= value <= 1.1, 0.5 <= value <= 2
        else:
            limit = {
                "token_masked_fraction": self.max_token_drop,
                "seq_masked_fraction": self.max_seq_drop,
            }.get(key, 0.01)
            good, fair = value <= limit, value <= 5 * limit
        return "good" if good else "fair" if fair else "bad"

    def violations(self, stats: dict[str, float]) -> list[str]:
        """The targets a candidate's statistics miss, in words."""
        missed = []
        if stats["token_masked_fraction"] > self.max_token_drop:
            missed.append(f"drops {stats['token_masked_fraction']:.1%} of tokens")
        if stats["seq_masked_fraction"] > self.max_seq_drop:
            missed.append(f"drops {stats['seq_masked_fraction']:.1%} of sequences")
        lo, hi = self.lr_scale
        if not lo <= stats["lr_scale"] <= hi:
            missed.append(f"LR scale {stats['lr_scale']:.4g} outside [{lo:g}, {hi:g}]")
        if stats["ess"] < self.min_ess:
            missed.append(f"ESS {stats['ess']:.1%} below {self.min_ess:.0%}")
        return missed


RULE_SYMBOLS = (
    "d = train - rollout log-prob, rho = e^d per token, k3 = rho - 1 - d, S = the sum of d "
    "over a sequence's loss tokens, G = S / their number"
)
"""The symbols of `Candidate.rule`, as the CLI prints them after it."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting, replayed on the data.

    Attributes:
        spec: the framework's setting.
        kind: the framework-neutral kind it is (`_KINDS`).
        stats: `iscore.impact.quick_stats` of it, plus the objective's terms
            (`broken_gradient_kept`, `healthy_token_dropped`, `healthy_seq_dropped`).
        missed: the targets it misses, in words.
        reason: one line: what it is, where its thresholds come from, what it does.
        rule: the setting's rule as the framework computes it (`Canonical.describe`), in the
            symbols of `RULE_SYMBOLS`.
    """

    spec: Spec
    kind: str
    stats: dict[str, float]
    missed: tuple[str, ...]
    reason: str
    rule: str

    @property
    def passes(self) -> bool:
        return not self.missed

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "kind": self.kind,
            "config": self.spec.to_config(),
            "passes": self.passes,
            "missed": list(self.missed),
            "reason": self.reason,
            "rule": self.rule,
            **self.stats,
        }


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Candidates ranked best first, the regimes found, and warnings about traps.

    Attributes:
        framework: the framework's name.
        targets: the targets the candidates were held to.
        candidates: best first.
        regimes: what was found in the data and why it matters for the pick, one line each.
        warnings: the traps that bite this data.
        pick: why the best beat the runner-up, and what would change the pick.
        thresholds: the bounds placed from the data (token ratio band and cap, e^G band,
            mean-k3 bound), how many sequences were found broken, and the global offset of
            the token log-ratios where there is one (a semantics bug; None otherwise).
    """

    framework: str
    targets: Targets
    candidates: tuple[Candidate, ...]
    regimes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)
    pick: str = ""
    thresholds: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def runner_up(self) -> Candidate | None:
        return self.candidates[1] if len(self.candidates) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        """The document `iscore recommend --json` writes: each candidate's `config` is what
        `iscore replay --config` reads (with `framework:`)."""
        return {
            "framework": self.framework,
            "targets": {
                "max_token_drop": self.targets.max_token_drop,
                "max_seq_drop": self.targets.max_seq_drop,
                "lr_scale": list(self.targets.lr_scale),
                "min_ess": self.targets.min_ess,
            },
            "regimes": list(self.regimes),
            "best": self.best.to_dict(),
            "runner_up": None if self.runner_up is None else self.runner_up.to_dict(),
            "pick": self.pick,
            "thresholds": self.thresholds,
            "candidates": [c.to_dict() for c in self.candidates],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, slots=True)
class _Normal:
    """What numerical noise looks like in this dump, robustly, and what stands out of it.

    The centre and spread come from medians and MADs (1.4826 MAD estimates a normal's standard
    deviation), so a few broken sequences cannot move them. A sequence is *broken* when the
    median log-ratio of its tokens lies more than `Z_BROKEN` standard errors from the centre
    (the median of T noisy tokens errs by about 1.25 spread / sqrt(T)): a stale replica, every
    token off by ~1 nat, is hundreds of errors away; noise, even with a few outlier tokens or
    a routing-flip span in a sequence, moves a median very little. Where the sequences' medians
    spread wider than that (a context-dependent bug), the test widens by their own spread.
    """

    d_center: float  # median per-token log-ratio d over loss tokens
    d_spread: float  # 1.4826 MAD of d
    g_center: float  # median per-sequence G
    g_spread: float  # 1.4826 MAD of G
    broken: np.ndarray  # bool [B]: sequences far outside the noise
    G: np.ndarray  # float64 [B], 0 where a sequence has no loss token
    k3: np.ndarray  # float64 [B]: mean per-token k3
    T: np.ndarray  # float64 [B]: loss tokens
    d: np.ndarray  # float64 [N loss tokens]
    token_broken: np.ndarray  # bool [N loss tokens]: tokens of broken sequences
    rollout: np.ndarray  # float32 [N loss tokens]: the rollout's log-prob of each

    @property
    def offset(self) -> bool:
        """Whether the token log-ratios are centred away from 0: a semantics bug. By more than
        a quarter of the noise's spread, and by `Z_OFFSET` standard errors of the median (1.25
        spread / sqrt(tokens)), so that a tiny dump's noise is not called a bug."""
        stderr = 1.2533 * self.d_spread / math.sqrt(max(self.d.size, 1))
        return abs(self.d_center) > max(0.25 * self.d_spread, Z_OFFSET * stderr, 1e-3)

    @classmethod
    def of(cls, batch: TokenBatch) -> _Normal:
        m = batch.loss_mask
        d_all = ops.log_ratio(batch).double()
        T = ops.segment_count(batch, m).double().cpu().numpy()
        S = ops.segment_sum(d_all, batch, m).cpu().numpy()
        k3 = ops.segment_sum(ops.k3(d_all.clamp(-20.0, 20.0)), batch, m).cpu().numpy()
        has = T > 0
        G = np.where(has, S / np.maximum(T, 1.0), 0.0)
        k3 = np.where(has, k3 / np.maximum(T, 1.0), 0.0)
        every = ops.mask_is_all(batch, m)  # then views, not copies (only ever read)
        d = (d_all if every else d_all[m]).cpu().numpy()
        d_center, d_spread = _median_mad(d)
        g_center, g_spread = _median_mad(G[has])
        medians = _segment_medians(d, T)
        stderr = 1.2533 * max(d_spread, 1e-12) / np.sqrt(np.maximum(T, 1.0))
        z = np.abs(medians - d_center) / stderr
        # Where sequences differ by more than their tokens' noise explains (a bug whose size
        # varies with the context), their own spread widens the test: |z| of iid noise has
        # median 0.6745, and a few broken sequences cannot move the median.
        widen = max(1.0, float(np.median(z[has])) / 0.6745) if has.any() else 1.0
        broken = has & (z > Z_BROKEN * widen)
        token_broken = np.repeat(broken, T.astype(np.int64))
        rollout = (batch.rollout if every else batch.rollout[m]).cpu().numpy()
        return cls(
            d_center, d_spread, g_center, g_spread, broken, G, k3, T, d, token_broken, rollout
        )

    @property
    def broken_share(self) -> float:
        return float(self.broken.sum()) / max(int((self.T > 0).sum()), 1)


Z_BROKEN = 8.0
"""Standard errors from the noise's centre beyond which a sequence is called broken."""

Z_OFFSET = 5.0
"""Standard errors from 0 beyond which the tokens' median log-ratio is called a global offset."""

_MARGIN = 1.05  # sequence bounds placed this much beyond the healthy sequences
_INSIDE = 0.9  # or this far inside the nearest broken sequence, if that is closer
CAP_QUANTILE = 0.999
"""A token TIS cap truncates the healthy tokens' ratios above this quantile: the extreme
0.1% tail, whose weights would otherwise dominate the gradient's variance (a cap beyond every
ratio truncates nothing: on MoE-like dumps it came out at 7e6)."""


def _segment_medians(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float64 [B]: the median of each segment's values (0 for an empty one); segment i holds
    the next `counts[i]` values.

    Segments of similar length are sorted together as the rows of a block, each row padded
    with +inf to the next power of two (so never more than twice the values, and at most
    `_MEDIAN_CELLS` at a time): 15x faster than one lexsort of (segment, value).

    >>> _segment_medians(np.array([3.0, 1.0, 2.0, 5.0, 4.0, 7.0]), np.array([3, 0, 2, 1]))
    array([2. , 0. , 4.5, 7. ])
    """
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    medians = np.zeros(n.size)
    width = np.left_shift(1, np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
    for w in np.unique(width[n > 0]):
        rows = np.flatnonzero((n > 0) & (width == w))
        columns = np.arange(w)
        for part in np.array_split(rows, -(-rows.size * int(w) // _MEDIAN_CELLS)):
            k = n[part]
            block = np.full((part.size, w), np.inf)
            valid = columns < k[:, None]
            block[valid] = values[(starts[part][:, None] + columns)[valid]]
            block.sort(axis=1)
            r = np.arange(part.size)
            medians[part] = 0.5 * (block[r, (k - 1) // 2] + block[r, k // 2])
    return medians


_MEDIAN_CELLS = 1 << 20
"""Values (padding included) sorted per block by `_segment_medians`: 8 MB."""


def _median_mad(x: np.ndarray) -> tuple[float, float]:
    if not x.size:
        return 0.0, 0.0
    center = float(np.median(x))
    return center, 1.4826 * float(np.median(np.abs(x - center)))


@dataclass(frozen=True, slots=True)
class _Thresholds:
    """Thresholds placed where the data stops looking like numerical noise.

    A token band sits at the healthy tokens' `CAP_QUANTILE` on each side (it masks only the
    noise's extreme tails) and a token cap at the upper one (it truncates only the top tail),
    broken sequences or not. A sequence mask's bound sits just outside every healthy sequence
    (none is dropped), or just inside the nearest broken one where that is closer (the mask
    drops them); broken sequences are a sequence-level signature, removed at that level.
    """

    token_cap: float
    band: tuple[float, float]  # token ratio band
    geo: tuple[float, float]  # e^G band
    k3: float  # mean per-token k3 upper bound
    normal: _Normal

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
        }.get(kind, "cap 2, the frameworks' usual sequence-level cap")

    @classmethod
    def of(cls, normal: _Normal) -> _Thresholds:
        healthy_tokens = normal.d[~normal.token_broken] - normal.d_center
        has = normal.T > 0
        healthy = has & ~normal.broken
        g_dev = normal.G - normal.g_center
        # Token bounds at the healthy tokens' `CAP_QUANTILE` tails (a band beyond every token
        # masks nothing, and where a few tokens are far off, fp8 outliers or routing flips, it
        # lands in the millions and lets them weigh that much). Broken sequences do not move
        # them: a stale replica's likely tokens have d near 0 (both log-probs near 0), so a
        # token bound reaching them would cut the healthy noise; the sequence bounds drop them.
        low_q = high_q = 0.0
        if healthy_tokens.size:
            quantiles = np.quantile(healthy_tokens, [1.0 - CAP_QUANTILE, CAP_QUANTILE])
            low_q, high_q = (float(q) for q in quantiles)
        below, above = max(-low_q, 1e-3), max(high_q, 1e-3)  # the band's reach in d
        # Sequence bounds keep every healthy sequence, pulled in to just inside the nearest
        # broken one where it lies closer.
        g_half = max(_MARGIN * float(np.abs(g_dev[healthy]).max(initial=0.0)), 1e-4)
        k3_cap = max(_MARGIN * float(normal.k3[healthy].max(initial=0.0)), 1e-6)
        if normal.broken.any():
            g_half = min(g_half, _INSIDE * float(np.abs(g_dev[normal.broken]).min()))
            k3_cap = min(k3_cap, _INSIDE * float(normal.k3[normal.broken].min()))
        return cls(
            token_cap=max(_round_up(ops.exp_of(normal.d_center + high_q)), 1.001),
            band=(
                _round_down(ops.exp_of(normal.d_center - below)),
                _round_up(ops.exp_of(normal.d_center + above)),
            ),
            geo=(
                _round_down(ops.exp_of(normal.g_center - g_half), 5),
                _round_up(ops.exp_of(normal.g_center + g_half), 5),
            ),
            k3=max(_round_up(k3_cap), 1e-9),  # frameworks take a positive bound
            normal=normal,
        )


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


# Per framework: (kind, description, config builder) for each candidate family. Geometric bounds
# (lo, hi) are on e^G; `band` on token ratios.
_Builder = Callable[[_Thresholds], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Kind:
    """A framework-neutral kind of candidate: its setting for the data's thresholds."""

    key: str
    description: str
    setting: Callable[[_Thresholds], Canonical]


def _token_weight(upper: float | None = None, zero: Component | None = None) -> Component:
    return weight_component("token", upper=upper, numerics="clamp", zero=zero)


def _token_band(t: _Thresholds) -> Component:
    return mask_component("token", *t.band, numerics="clamp")


def _sequence_weight(level: Literal["sequence", "geometric"]) -> Component:
    # Sequence-level weights are capped where the frameworks' own examples cap them.
    return weight_component(level, upper=2.0, numerics="clamp")


def _geo_mask(t: _Thresholds) -> Component:
    return mask_component("geometric", *t.geo)


_KINDS = (
    _Kind("token_tis", "token TIS", lambda t: Canonical((_token_weight(t.token_cap),))),
    _Kind(
        "icepop",
        "token IcePop band",
        lambda t: Canonical(
            (_token_weight(zero=mask_component("token", *t.band, numerics="clamp")),)
        ),
    ),
    _Kind(
        "token_mask",
        "token mask (no weight)",
        lambda t: Canonical((_token_band(t),)),
    ),
    _Kind(
        "token_mask_tis",
        "token mask, kept tokens weighted by their ratio",
        lambda t: Canonical((_token_weight(), _token_band(t))),
    ),
    _Kind("geo_mask", "geometric sequence mask", lambda t: Canonical((_geo_mask(t),))),
    _Kind(
        "geo_mask_geo_tis",
        "geometric sequence mask, kept sequences weighted by e^G",
        lambda t: Canonical((weight_component("geometric", numerics="clamp"), _geo_mask(t))),
    ),
    _Kind(
        "geo_mask_token_tis",
        "geometric mask + token TIS",
        lambda t: Canonical((_token_weight(t.token_cap), _geo_mask(t))),
    ),
    _Kind(
        "seq_mask_tis",
        "seq-mask-tis (geometric mask, raw token weights)",
        lambda t: Canonical((_token_weight(zero=_geo_mask(t)),)),
    ),
    _Kind(
        "k3_mask",
        "k3 sequence mask",
        lambda t: Canonical(
            (mask_component("geometric", upper=t.k3, statistic="k3", numerics="clamp_each"),)
        ),
    ),
    _Kind(
        "geo_tis",
        "sequence (geometric-mean) TIS",
        lambda t: Canonical((_sequence_weight("geometric"),)),
    ),
    _Kind(
        "seq_tis",
        "sequence (product) TIS",
        lambda t: Canonical((_sequence_weight("sequence"),)),
    ),
)
"""The candidates, in the order they are tried; each framework gets those it can express."""


def recommend(
    batch: TokenBatch,
    framework: str,
    targets: Targets | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Recommendation:
    """Rank the framework's candidate settings on `batch` against `targets` (docs/recommend.md).

    Args:
        batch: the loaded dump.
        framework: one of `iscore.frameworks.NAMES`.
        targets: what a good setting does; defaults to `Targets()`.
        progress: called after each candidate is replayed with (candidates replayed,
            candidates in all).

    >>> import iscore
    >>> rec = recommend(iscore.load("data/fp8.parquet"), "skyrl")
    >>> rec.best.passes, rec.best.stats["token_masked_fraction"] <= 0.01
    (True, True)
    """
    fw = frameworks.get(framework)
    targets = targets or Targets()
    with ops.shared(batch):  # d, e^d and the sequence sums, computed once for every candidate
        return _recommend(batch, fw, targets, progress)


def _recommend(
    batch: TokenBatch,
    fw: Framework,
    targets: Targets,
    progress: Callable[[int, int], None] | None,
) -> Recommendation:
    framework = fw.name
    normal = _Normal.of(batch)
    thresholds = _Thresholds.of(normal)
    expressed = [
        (kind, fw.express(kind.setting(thresholds), f"{framework} {kind.description}"))
        for kind in _KINDS
    ]
    expressed = [(kind, spec) for kind, spec in expressed if spec is not None]
    candidates = []
    for kind, spec in expressed:
        stats = _measure(batch, spec, normal)
        canonical = fw.to_canonical(spec)
        # Reweighting by the ratio is what removes the mismatch's bias; a mask alone does not.
        stats["reweights"] = float(bool(canonical.weights))
        stats["components"] = float(len(canonical.components))  # the simpler, the fewer
        missed = tuple(_violations(targets, normal, stats))
        reason = _reason(f"{kind.description}, {thresholds.describe(kind.key)}", stats, missed)
        candidates.append(Candidate(spec, kind.key, stats, missed, reason, canonical.describe()))
        if progress is not None:
            progress(len(candidates), len(expressed))
    ranked = tuple(sorted(candidates, key=_preference))
    regimes = _regimes(batch, normal)
    if normal.broken.any() and not any(c.passes for c in ranked):
        regimes.append(_elsewhere(batch, fw, normal, targets))
    found = {
        "token_band": list(thresholds.band),
        "token_cap": thresholds.token_cap,
        "geometric_band": list(thresholds.geo),
        "k3": thresholds.k3,
        "broken_sequences": int(normal.broken.sum()),
        "global_offset": normal.d_center if normal.offset else None,
    }
    warnings = _warnings(batch, fw, normal)
    if normal.offset:
        warnings.insert(
            0,
            f"Fix the semantics bug first: the token log-ratios are centred at "
            f"{normal.d_center:+.3g}, not 0 (processed vs raw log-probs, a temperature on one "
            "side). No IS correction removes it; the pick only keeps its damage within "
            "the targets meanwhile.",
        )
    return Recommendation(
        framework,
        targets,
        ranked,
        tuple(regimes),
        tuple(warnings),
        _pick(ranked),
        found,
    )


def broken_sequences(batch: TokenBatch) -> np.ndarray:
    """bool [B]: the sequences `recommend` calls broken (far outside the dump's noise)."""
    return _Normal.of(batch).broken


def _measure(batch: TokenBatch, spec: Spec, normal: _Normal) -> dict[str, float]:
    """`quick_stats` of a candidate and the objective's terms, from one replay of it."""
    result = spec.replay(batch)
    return quick_stats(batch, spec, result) | _terms(batch, result, normal)


def _terms(batch: TokenBatch, result: Replay, normal: _Normal) -> dict[str, float]:
    """The objective's terms beyond `quick_stats`: what a setting does to the broken sequences
    and to the rest (docs/recommend.md)."""
    m = batch.loss_mask
    w = ops.segment_sum(result.weight.double(), batch, m).cpu().numpy()
    kept_tokens = ops.segment_count(batch, result.keep & (result.weight != 0)).cpu().numpy()
    healthy = (normal.T > 0) & ~normal.broken
    broken = normal.broken
    dropped = normal.T - kept_tokens
    return {
        "broken_gradient_kept": float(w[broken].sum() / normal.T[broken].sum())
        if broken.any()
        else 0.0,
        "healthy_token_dropped": float(dropped[healthy].sum() / max(normal.T[healthy].sum(), 1)),
        "healthy_seq_dropped": float((kept_tokens[healthy] == 0).sum() / max(healthy.sum(), 1)),
    }


MAX_BROKEN_KEPT = 0.10
"""With broken sequences found, a setting must remove at least 90% of their gradient."""

MAX_HEALTHY_SEQ_DROP = 0.02
"""and drop at most 2% of the healthy sequences."""


def _violations(targets: Targets, normal: _Normal, stats: dict[str, float]) -> list[str]:
    """The targets a candidate misses. With broken sequences found, the drop budgets hold for
    the healthy data (dropping the broken is the point), and the broken must go."""
    if not normal.broken.any():
        return targets.violations(stats)
    healthy = stats | {
        "token_masked_fraction": stats["healthy_token_dropped"],
        "seq_masked_fraction": stats["healthy_seq_dropped"],
    }
    missed = targets.violations(healthy)
    if stats["broken_gradient_kept"] > MAX_BROKEN_KEPT:
        missed.append(
            f"keeps {stats['broken_gradient_kept']:.0%} of the broken sequences' gradient"
        )
    if stats["healthy_seq_dropped"] > MAX_HEALTHY_SEQ_DROP:
        missed.append(f"drops {stats['healthy_seq_dropped']:.1%} of the healthy sequences")
    return missed


def _preference(c: Candidate) -> tuple[Any, ...]:
    """The order among candidates (docs/recommend.md): meeting the targets, then reweighting
    (which corrects the mismatch's bias; a mask alone does not), then the least healthy data
    dropped (to 0.1%), then the LR scale's distance from 1 in buckets of whole percents of
    |ln LR scale| (0.997 and 0.995 tie in bucket 0; 0.991 and 0.989 fall either side of 1%
    and do not), then the highest ESS, then the fewer components (weights and masks). The
    buckets keep most 0.00x differences in LR scale from outranking a higher ESS; a fixed key
    keeps the order transitive, at the price of those edges."""
    s = c.stats
    return (
        len(c.missed),
        -s["reweights"],
        round(s["healthy_token_dropped"], 3),
        math.floor(100 * abs(math.log(max(s["lr_scale"], 1e-12)))),  # |ln| in whole percents
        -round(s["ess"], 3),
        s["components"],
    )


def _pick(ranked: tuple[Candidate, ...]) -> str:
    """Why the best beat the runner-up, and what would change the pick."""
    if len(ranked) < 2:
        return "the only setting this framework expresses"
    best, second = ranked[0], ranked[1]
    head = f"{best.spec.name} over the runner-up, {second.spec.name}: "
    if second.missed and not best.missed:
        return head + (
            f"the runner-up misses the targets ({'; '.join(second.missed)}); targets that "
            "allow that would put it in the running"
        )
    if best.missed:
        return head + "no setting meets every target; this one misses the fewest"
    a, b = _preference(best), _preference(second)
    if a[1] != b[1]:
        why = "it reweights by the ratio, which removes the mismatch's bias; a mask alone does not"
    elif a[2] != b[2]:
        why = (
            f"it drops less healthy data ({best.stats['healthy_token_dropped']:.1%} of tokens "
            f"against {second.stats['healthy_token_dropped']:.1%})"
        )
    elif a[3] != b[3]:
        why = (
            f"its LR scale is nearer 1 ({best.stats['lr_scale']:.4g} against "
            f"{second.stats['lr_scale']:.4g})"
        )
    elif a[4] != b[4]:
        why = f"its ESS is higher ({best.stats['ess']:.1%} against {second.stats['ess']:.1%})"
    elif a[5] != b[5]:
        why = (
            f"they tie on every term, and it is simpler: {best.stats['components']:.0f} weight "
            f"or mask against {second.stats['components']:.0f}"
        )
    else:
        why = "they tie on every term, and it comes first in the candidates' order"
    return head + why


def _regimes(batch: TokenBatch, normal: _Normal) -> list[str]:
    """The signatures found, and why each matters for the pick."""
    found = []
    if normal.broken.any():
        found.append(
            f"broken sequences: {int(normal.broken.sum())} ({normal.broken_share:.1%}) have a "
            f"mean log-ratio more than {Z_BROKEN:g} standard errors from the rest (a stale "
            "replica or a bad rank, not noise): the pick must mask them"
        )
    if normal.offset:
        found.append(
            f"global offset: the median token log-ratio is {normal.d_center:+.3g} (noise spread "
            f"{normal.d_spread:.3g}): a semantics bug (processed vs raw log-probs, temperature) "
            "that no IS correction removes; the bands are centred on it"
        )
    long = _long_weight(normal)
    if long is not None and not 0.5 <= long[2] <= 2.0:
        found.append(
            f"long-sequence collapse: at {long[0]:,.0f} tokens (your p90 length) "
            f"e^(mean d x length) is {long[2]:.2g}: product weights would scale the LR there, "
            "geometric or token-level settings do not"
        )
    has = normal.T > 0
    steps = batch.step.cpu().numpy()
    if np.unique(steps).size > 2:
        by_step = [float(normal.k3[(steps == s) & has].mean()) for s in np.unique(steps)]
        if by_step[0] > 0 and by_step[-1] > 2.0 * by_step[0]:
            found.append(
                f"drift: the sequences' mean k3 grows {by_step[-1] / by_step[0]:.1f}x over the "
                f"steps ({by_step[0]:.3g} to {by_step[-1]:.3g}, averaged per sequence): re-run "
                "this on the latest steps (--steps) before trusting a bound"
            )
    if not found:
        found.append("numerical noise only: nothing stands out, so no sequence should be dropped")
    broken = normal.token_broken.any()  # without, no copies of the token arrays
    d = normal.d[~normal.token_broken] if broken else normal.d
    k3 = np.clip(d, -20.0, 20.0)
    np.expm1(k3, out=k3)
    k3 -= d
    unlikely = (normal.rollout[~normal.token_broken] if broken else normal.rollout) < math.log(0.1)
    if k3.sum() > 0 and unlikely.any():
        share = float(k3[unlikely].sum() / k3.sum())
        if share > 0.5:
            found.append(
                f"low-probability-token noise: {share:.0%} of the mismatch (k3) sits in the "
                f"{unlikely.mean():.0%} of tokens the rollout gave < 10% probability: token-level "
                "settings act on those tokens alone, where a sequence mask drops whole sequences"
            )
    return found


def _long_weight(normal: _Normal) -> tuple[float, float, float] | None:
    """(the p90 length L, the healthy tokens' mean d, e^(mean d x L)): the e^S product weights
    give a sequence of length L whose tokens are independent. A model: steadier than the median
    e^S of the few sequences that long, which spread over orders of magnitude (None without
    healthy tokens)."""
    has = normal.T > 0
    d = normal.d[~normal.token_broken] if normal.token_broken.any() else normal.d  # no copy
    if not has.any() or not d.size:
        return None
    long_t = float(np.quantile(normal.T[has], 0.9))
    mu = float(np.mean(d))
    return long_t, mu, math.exp(min(mu * long_t, 700.0))


def _elsewhere(batch: TokenBatch, fw: Framework, normal: _Normal, targets: Targets) -> str:
    """Which other framework's setting removes the broken sequences, when this one cannot."""
    thresholds = _Thresholds.of(normal)
    for other in frameworks.every():
        if other is fw:
            continue
        for kind in _KINDS:
            spec = other.express(kind.setting(thresholds), f"{other.name} {kind.description}")
            if spec is None:
                continue
            stats = _measure(batch, spec, normal)
            if not _violations(targets, normal, stats):
                return (
                    f"{fw.name} cannot express a setting that removes the broken sequences "
                    f"within the targets; {other.name}'s {kind.description} does (keeps "
                    f"{stats['broken_gradient_kept']:.0%} of their gradient, drops "
                    f"{stats['healthy_seq_dropped']:.1%} of the healthy sequences)"
                )
    return (
        f"{fw.name} cannot express a setting that removes the broken sequences within the targets"
    )


def _reason(description: str, stats: dict[str, float], missed: tuple[str, ...]) -> str:
    effect = (
        f"LR scale {stats['lr_scale']:.4g}, ESS {stats['ess']:.1%}, "
        f"{stats['token_masked_fraction']:.2%} of tokens and {stats['seq_masked_fraction']:.1%} "
        "of sequences dropped"
    )
    if missed:
        return f"{description}: misses the targets ({'; '.join(missed)}); {effect}"
    return f"{description}: meets the targets; {effect}"


def _warnings(batch: TokenBatch, framework: Framework, normal: _Normal) -> list[str]:
    """The traps that bite this data: sequence-weight collapse, and the framework's own."""
    warnings = []
    long = _long_weight(normal)
    if long is not None and long[2] < 0.5:
        warnings.append(
            f"Product (sequence-level) weights collapse at your lengths: at {long[0]:,.0f} "
            f"tokens (your p90 length) e^(mean d x length) is {long[2]:.2g} (mean d "
            f"{long[1]:.2g} per token), so sequence IS cuts the effective LR there; prefer "
            "token-level or geometric-mean weights."
        )
    for trap in framework.traps:
        warning = trap.warning(batch, lambda spec: quick_stats(batch, spec))
        if warning is not None:
            warnings.append(warning)
    return warnings
