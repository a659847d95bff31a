"""`iscore gate`: a dump's mismatch held to bounds, the published bars shipped as versioned,
cited tables, and a user's own in the same format (docs/compare.md#gates).

A bound names one of the analysis' mismatch metrics (`GATED`) in iscore's names; where the
framework that publishes the bar logs another quantity under its own name (another reduction,
another estimator), the table says so beside it, as docs/corrections.md does.

>>> [c.passed for c in judge({"k3": 0.02}, TABLES["prime-rl-ci"].bounds)]
[False]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from iscore.errors import ConfigError, clip, quote
from iscore.frameworks import Citation, every, limits
from iscore.stats import RETENTION_BANDS, MismatchSummary

_SCALARS = (
    "k1", "k2", "k3", "k3_reverse", "chi2_token", "chi2_seq", "abs_diff_mean", "abs_diff_max",
    "token_mult_prob_error", "js", "log_ppl_abs_diff", "ratio_mean", "ess",
)  # fmt: skip

_FLOOR = {
    "floor_k3": "k3",
    "floor_abs_diff_mean": "abs_diff_mean",
    "k3_ratio": "k3_ratio",
    "abs_diff_ratio": "abs_diff_ratio",
}

_RETENTION = {
    f"{kind}_retention_{band}": (where, band)
    for kind, where in (("token", "token"), ("seq", "sequence"))
    for band in RETENTION_BANDS
}

_DISTRIBUTION = {
    "kl_lower": ("kl", "lower"),
    "kl_estimate": ("kl", "estimate"),
    "top1_agreement": ("top1_agreement", None),
}

GATED = (*_SCALARS, "broken_share", *_FLOOR, *_RETENTION, *_DISTRIBUTION)
"""The metrics a bound may name: the analysis document's `mismatch.*`; `broken_share`
(`broken_sequences` / `sequences`); the noise floor's (`mismatch.floor`: `floor_k3`,
`floor_abs_diff_mean`, `k3_ratio`, `abs_diff_ratio`; NaN without a floor column); MaxText's
retention, the share of loss tokens and of sequences inside each ratio band
(`mismatch.retention`: `token_retention_strict`, `seq_retention_1pct`, ...); the whole
distribution's (`mismatch.distribution`: `kl_lower`, `kl_estimate`, `top1_agreement`; NaN
without top-k columns)."""

TABLES_VERSION = 1
"""The shipped tables' version: a table's bounds change only with it."""


@dataclass(frozen=True, slots=True)
class Bound:
    """One bar: `metric` at most `high` and at least `low` (either may be None).

    Attributes:
        metric: one of `GATED`.
        low, high: the limits, included.
        source: where the bar is published (None for a user's own).
        note: how the publisher's metric differs from iscore's, where it does.
    """

    metric: str
    low: float | None
    high: float | None
    source: Citation | None = None
    note: str = ""

    def describe(self) -> str:
        """The bar in symbols: "k3 <= 0.015", "ess >= 0.9", "ratio_mean in [0.99, 1.01]"."""
        return f"{self.metric} {limits(self.low, self.high)}"


@dataclass(frozen=True, slots=True)
class Table:
    """A named set of bars.

    Attributes:
        name: how `--table` names it; version: its version; about: what it is.
        bounds: its bars.
    """

    name: str
    version: int
    about: str
    bounds: tuple[Bound, ...]


@dataclass(frozen=True, slots=True)
class Check:
    """One bar held against a dump.

    Attributes:
        metric: the metric; check: the bar in words ("k3 <= 0.015").
        value: the dump's value (a NaN never passes: a metric the dump cannot give is within
            no bar).
        passed: whether it holds.
        table: the table the bar is from ("command line", a table's name, "against").
        source: where the bar is published; note: how the publisher's metric differs.
    """

    metric: str
    check: str
    value: float
    passed: bool
    table: str
    source: Citation | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        source = self.source
        return {
            "metric": self.metric,
            "check": self.check,
            "value": self.value,
            "passed": self.passed,
            "table": self.table,
            "source": None if source is None else {"name": source.name, "url": source.url},
            "note": self.note,
        }


def _health() -> Table:
    """The bands the health verdict judges by (each framework's `bands`), as a table."""
    bounds = tuple(
        Bound(band.statistic, band.low, band.high, band.source, f"{fw.title} {band.logged_as}")
        for fw in every()
        for band in fw.bands
        if band.statistic in GATED
    )
    return Table(
        "health", TABLES_VERSION, "the bands the health verdict judges by (iscore analyze)", bounds
    )


def _framework_tables() -> list[Table]:
    """A table of each framework's own CI bars (`Framework.gates`), named `<framework>-ci`."""
    return [
        Table(
            f"{fw.name.replace('_', '-')}-ci",
            TABLES_VERSION,
            f"{fw.title}'s own bars",
            tuple(
                Bound(
                    g.statistic, g.low, g.high, g.source, f"{fw.title} {g.logged_as}: {g.meaning}"
                )
                for g in fw.gates
            ),
        )
        for fw in every()
        if fw.gates
    ]


_VIME = Citation("vime PR #94", "https://github.com/vllm-project/vime/pull/94")

TABLES: dict[str, Table] = {
    table.name: table
    for table in (
        Table(
            "vime-ci",
            TABLES_VERSION,
            "vime's CI assertion (vLLM's RL parity tests)",
            (
                Bound(
                    "abs_diff_mean",
                    None,
                    0.1,
                    _VIME,
                    "its abs_diff averages each sample's tokens first, then the samples",
                ),
            ),
        ),
        *_framework_tables(),
        _health(),
    )
}
"""The shipped tables by name (`iscore gate --list-tables`). MaxText's retention bands are
metrics (`token_retention_strict`, ...), not a table: MaxText reports the share inside each band
and publishes no share a run must reach (docs/compare.md#gates)."""


def gated_values(summary: MismatchSummary) -> dict[str, float]:
    """Every `GATED` metric of an analysis' mismatch (NaN where the dump gives none).

    >>> from iscore.passes import analyze
    >>> values = gated_values(analyze("data/fp8.parquet", store=None).mismatch)
    >>> round(values["k3"], 4), values["k3_ratio"], round(values["token_retention_5pct"], 3)
    (0.0498, nan, 0.763)
    """
    values = {name: float(getattr(summary, name)) for name in _SCALARS}
    values["broken_share"] = summary.broken_sequences / max(summary.sequences, 1)
    floor = summary.floor or {}
    for name, key in _FLOOR.items():
        value = floor.get(key)
        values[name] = math.nan if value is None else float(value)
    kept = summary.retention
    for name, (where, band) in _RETENTION.items():
        values[name] = math.nan if kept is None else float(kept[where][band])
    whole = summary.distribution
    for name, (key, inner) in _DISTRIBUTION.items():
        value = None if whole is None else whole[key] if inner is None else whole[key][inner]
        values[name] = math.nan if value is None else float(value)
    return values


def judge(values: Mapping[str, float], bounds: Sequence[Bound], table: str = "") -> list[Check]:
    """Each bound held against `values` (metric -> value)."""
    checks = []
    for bound in bounds:
        value = float(values.get(bound.metric, math.nan))
        passed = not math.isnan(value)
        passed &= bound.low is None or value >= bound.low
        passed &= bound.high is None or value <= bound.high
        checks.append(
            Check(
                bound.metric, bound.describe(), value, bool(passed), table, bound.source, bound.note
            )
        )
    return checks


def parse_bound(text: str, flag: str) -> Bound:
    """A bound from `--max METRIC=VALUE` or `--min METRIC=VALUE` (`flag`).

    Raises:
        ConfigError: not METRIC=VALUE, an unknown metric or a value that is not a finite number.
    """
    metric, sep, number = text.partition("=")
    if not sep:
        raise ConfigError(f"Expected {flag} to be METRIC=VALUE, but got {quote(clip(text))}")
    value = _number(number, f"{flag} {metric}")
    _known(metric.strip(), flag)
    low, high = (value, None) if flag == "--min" else (None, value)
    return Bound(metric.strip(), low, high)


def read_table(path: str | Path) -> Table:
    """A user's table: YAML `{name: ..., bounds: [{metric: k3, max: 0.01}, ...]}`, each
    bound with `max`, `min` or both, and optionally `source: {name, url}` and `note`.

    Raises:
        ConfigError: the file cannot be read, or is not such a table (naming the key).
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read the gate table: {clip(str(e))}") from None
    if not isinstance(data, dict) or not isinstance(data.get("bounds"), list) or not data["bounds"]:
        raise ConfigError(f"{path}: expected a mapping with a non-empty list `bounds`")
    bounds = []
    for i, item in enumerate(data["bounds"]):
        where = f"{path}: bounds[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("metric"), str):
            raise ConfigError(f"{where}: expected a mapping with a `metric`")
        _known(item["metric"], where)
        low, high = (
            None if item.get(k) is None else _number(item[k], f"{where}.{k}")
            for k in ("min", "max")
        )
        if low is None and high is None:
            raise ConfigError(f"{where}: expected `max`, `min` or both")
        source = item.get("source")
        citation = None
        if source is not None:
            try:
                citation = Citation(str(source["name"]), str(source["url"]))
            except (TypeError, KeyError, ValueError):
                raise ConfigError(
                    f"{where}.source: expected {{name, url}} with an https url"
                ) from None
        bounds.append(Bound(item["metric"], low, high, citation, str(item.get("note", ""))))
    name = str(data.get("name") or Path(path).stem)
    return Table(name, int(data.get("version") or 1), str(data.get("about", "")), tuple(bounds))


def _number(text: object, where: str) -> float:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(
            f"Expected {where} to be a finite number, but got {quote(clip(str(text)))}"
        )
    return value


def _known(metric: str, where: str) -> None:
    if metric not in GATED:
        raise ConfigError(
            f"{where}: expected a metric among {', '.join(GATED)}, but got {quote(clip(metric))}"
        )
