"""`iscore validate`: read a whole dump once, list its problems or summarize it.

The summary is what a user checks before trusting any number downstream: how many steps,
sequences and tokens were read, how long the sequences are, which of the file's columns fed
which canonical column, a first look at the mismatch (mean |d|, k3) and its health verdict
(`iscore.advice.health.assess_values`: the published bands, broken sequences and E_rollout[e^d] =
1). It works on numpy arrays: checking a dump needs no torch (a `--where` predicate is judged by
the engine's sequence table, which does).

>>> report = validate(Dump("data/dense_bf16.parquet"))  # doctest: +SKIP
>>> report.ok, report.tokens                             # doctest: +SKIP
(True, 150_000)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from iscore.advice import assess_values
from iscore.dump import DEFAULT_CHUNK_TOKENS, Data, DropReport, Dump, describe_runs, open_data
from iscore.errors import DumpError, Problem, clip, counted
from iscore.stats import noise
from iscore.utils import json_ready

QUANTILES = (0.1, 0.5, 0.9, 0.99)

_SUMMARY = (
    "steps", "sequences", "tokens", "loss_tokens", "length", "abs_diff_mean", "abs_diff_max", "k3",
    "health",
)  # fmt: skip
"""The `Report` fields that summarize a valid dump."""


@dataclass(slots=True)
class Report:
    """What `validate` found.

    Attributes:
        files: the files read.
        layout: "token" or "sequence".
        columns: canonical column -> source column names (one per file if they differ).
        steps: the distinct training steps, ascending.
        sequences, tokens: counts read.
        loss_tokens: tokens whose loss_mask is true.
        length: min, quantiles (`p10`, `p50`, `p90`, `p99`) and max of the sequence lengths.
        abs_diff_mean, abs_diff_max, k3: mean and max |d| and mean exp(d) - 1 - d over loss
            tokens, with d = train_logprob - rollout_logprob.
        health: the verdict (`verdict`, `summary`, `bands` as `iscore.advice.health.Health.to_dict`
            writes them) from the published bands, broken sequences and E_rollout[e^d] = 1;
            `iscore analyze` also tests for a one-sided temperature or offset, step by step.
        problems: everything wrong; empty when the dump is valid.
        dropped: sequences dropped with `drop_invalid`.
        provenance: per file, the framework dump it was imported from (empty if none).
        imported: whether `files` is a framework's own dump, read directly (converted to
            Parquet in memory; `provenance` lists its files).
        where: the `--where` predicate the summary's sequences satisfy (problems are
            looked for in every sequence read), or None.
    """

    files: list[str]
    layout: str
    columns: dict[str, list[str]]
    steps: list[int] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    length: dict[str, int] = field(default_factory=dict)
    abs_diff_mean: float = float("nan")
    abs_diff_max: float = float("nan")
    k3: float = float("nan")
    health: dict | None = None
    problems: list[Problem] = field(default_factory=list)
    dropped: DropReport = field(default_factory=DropReport)
    provenance: list[dict] = field(default_factory=list)
    imported: bool = False
    where: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the dump has no problems."""
        return not self.problems

    def to_dict(self) -> dict:
        """The report as strict JSON types: the summary (steps, counts, lengths, mismatch)
        describes a valid dump, so it is null where the dump has problems (a chunk with
        problems is not counted: 0 sequences would read as an empty dump), and a statistic
        that is not a number is null, never NaN."""
        out = asdict(self)
        out["problems"] = [str(p) for p in self.problems]
        out["ok"] = self.ok
        for key in _SUMMARY if not self.ok else ():
            out[key] = None
        return json_ready(out)

    def render(self) -> str:
        """The report as lines of text for a terminal."""
        where = self.files[0] if len(self.files) == 1 else f"{len(self.files)} files"
        if not self.ok:
            lines = [f"{where}: {len(self.problems)} problem{'s' * (len(self.problems) > 1)}"]
            return "\n".join(lines + [f"  - {p}" for p in self.problems])
        steps = self.steps
        span = f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
        quantiles = " · ".join(f"{k} {v:,}" for k, v in self.length.items())
        files = f"{len(self.files)} file{'s' * (len(self.files) > 1)}"
        if self.imported:
            files = "converted on reading (see imported)"
        lines = [
            f"{where}: OK",
            f"  layout      {self.layout}, {files}",
            f"  steps       {len(steps)} ({span})",
            f"  sequences   {self.sequences:,}"
            + ("" if self.where is None else f" where {clip(self.where)}"),
            f"  tokens      {self.tokens:,} ({self.loss_tokens:,} in the loss)",
            f"  length      {quantiles}",
            "  columns     "
            + ", ".join(
                name if srcs == [name] else f"{name} <- {' | '.join(srcs)}"
                for name, srcs in self.columns.items()
            ),
            f"  mismatch    mean |d| {self.abs_diff_mean:.4g} · max |d| {self.abs_diff_max:.4g}"
            f" · k3 {self.k3:.3g}   (d = train - rollout, loss tokens)",
        ]
        if self.health is not None:
            lines.append(f"  health      {self.health['summary']}")
        lines += [
            f"  written     {line.removeprefix('written ')}"
            for line in describe_runs(self.provenance)
        ]
        for origin in self.provenance:
            if origin.get("framework") and "rank" not in origin:
                sources = origin.get("source_files", [])
                lines.append(
                    f"  imported    from {clip(origin['framework'])}: {len(sources)} file(s), "
                    f"steps {clip(str(origin.get('steps', [])))}"
                )
        if self.dropped.sequences:
            dropped = self.dropped
            reasons = ", ".join(f"{k}: {counted(v, 'value')}" for k, v in dropped.reasons.items())
            lines.append(
                f"  dropped     {counted(dropped.sequences, 'sequence')} "
                f"({counted(dropped.tokens, 'token')}) with invalid log-probs ({reasons})"
            )
        return "\n".join(lines)


def validate(
    data: Data,
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Read all of `dump` in chunks of `max_tokens`, collecting problems and a summary.

    Args:
        data: the dump's files: a path, a directory or a glob (or a list of them), or an
            opened `Dump`; a loaded batch has no files left to check.
        max_tokens: tokens per chunk; memory stays bounded by it.
        progress: called with the number of tokens of each chunk read.

    Raises:
        DumpError: `data` is a loaded batch, or is no form of data (`open_data`).
    """
    dump = open_data(data)
    if not isinstance(dump, Dump):
        raise DumpError(
            "Expected data to be a dump's files (a path, a directory, a glob or a Dump) to "
            "validate, but got a loaded TokenBatch: its values were checked when it was read"
        )
    columns: dict[str, list[str]] = {}
    for f in dump.files:
        for name, source in f.columns.source.items():
            columns.setdefault(name, [])
            if source not in columns[name]:
                columns[name].append(source)
    report = Report(
        [f.path for f in dump.files],
        dump.layout,
        columns,
        dropped=dump.dropped,
        provenance=dump.provenance,
        imported=dump.imported,
        where=None if dump.where is None else dump.where.text,
    )
    lengths: list[np.ndarray] = []
    steps: set[int] = set()
    abs_sum = k3_sum = 0.0
    abs_max = 0.0
    health = _HealthSums()
    for problems, chunk in dump.scan(max_tokens):
        report.problems.extend(problems)
        if chunk is None:
            continue
        lengths.append(chunk["lengths"])
        steps.update(np.unique(chunk["step"]).tolist())
        d = chunk["train"].astype(np.float64) - chunk["rollout"]  # exact, as ops.log_ratio
        rollout = chunk["rollout"]
        T = chunk["lengths"]
        if "loss_mask" in chunk and not chunk["loss_mask"].all():
            mask = chunk["loss_mask"]
            T = np.bincount(np.repeat(np.arange(T.size), T), weights=mask, minlength=T.size)
            d, rollout = d[mask], rollout[mask]
        if d.size:
            absd = np.abs(d)
            abs_sum += float(absd.sum())
            abs_max = max(abs_max, float(absd.max()))
            with np.errstate(over="ignore"):  # |d| > 709: k3 is inf, as in the engine
                k3_sum += float((np.expm1(d) - d).sum())
        health.update(d, rollout, T.astype(np.int64), chunk["step"])
        report.loss_tokens += d.size
        if progress is not None:
            progress(int(chunk["lengths"].sum()))
    if not lengths:
        if not report.problems:
            report.problems.append(Problem(report.files[0], None, dump.why_empty()))
        return report
    all_lengths = np.concatenate(lengths)
    report.steps = sorted(steps)
    report.sequences = int(all_lengths.size)
    report.tokens = int(all_lengths.sum())
    report.length = {"min": int(all_lengths.min())}
    for q in QUANTILES:
        report.length[f"p{round(q * 100)}"] = int(np.quantile(all_lengths, q))
    report.length["max"] = int(all_lengths.max())
    if not report.loss_tokens and not report.problems:
        report.problems.append(dump.nothing_in_loss(report.sequences, report.tokens))
    if report.loss_tokens:
        report.abs_diff_mean = abs_sum / report.loss_tokens
        report.abs_diff_max = abs_max
        report.k3 = k3_sum / report.loss_tokens
        report.health = health.verdict(report.k3)
    return report


@dataclass(slots=True)
class _HealthSums:
    """What the health verdict needs, summed chunk by chunk in numpy: the bands' statistics
    over the loss tokens; per step and chunk, the noise (`iscore.stats.noise.Noise`); and per
    sequence its median d, its tokens either side of 0, those far from the noise of their
    probability bin (`iscore.stats.noise.FAR`) and the sums of e^d and e^2d, for the
    sequences outside their step's noise and the test of E_rollout[e^d] = 1 on the rest (as
    `iscore.stats.mismatch` decides both)."""

    sums: np.ndarray = field(default_factory=lambda: np.zeros(6))  # n, d, e^d, e^|d|, chi, js
    seq: list[tuple[np.ndarray, ...]] = field(default_factory=list)
    noise: list[tuple[int, noise.Noise]] = field(default_factory=list)

    def update(self, d: np.ndarray, rollout: np.ndarray, T: np.ndarray, step: np.ndarray) -> None:
        with np.errstate(over="ignore"):  # as the engine: an overflow is inf
            rho, mult = np.exp(d), np.exp(np.abs(d))
            chi = np.exp(2.0 * np.clip(d, -20.0, 20.0))
        js = 0.5 * np.abs(d) + np.log1p(np.exp(-np.abs(d))) - np.log(2.0)  # log cosh(d/2)
        self.sums += [d.size, d.sum(), rho.sum(), mult.sum(), chi.sum(), js.sum()]
        starts = np.cumsum(T) - T
        has = T > 0
        per_seq = np.zeros((4, T.size))
        if d.size:
            with np.errstate(over="ignore"):
                for row, values in enumerate((rho, rho * rho, d > 0, d < 0)):
                    per_seq[row, has] = np.add.reduceat(values, starts[has])
        noises, far = noise.step_noise(d, rollout, T, step)
        self.noise += noises
        median = noise.segment_medians(d, T)
        self.seq.append((step.astype(np.int64), T, median, far, *per_seq))

    def verdict(self, k3: float) -> dict:
        with np.errstate(all="ignore"):  # a ratio past float64 (|d| > 709) is inf, as k3
            return self._verdict(k3)

    def _verdict(self, k3: float) -> dict:
        n, d, rho, mult, chi, js = self.sums
        step, T, median, far, rho_seq, rho2_seq, positive, negative = (
            np.concatenate(parts) for parts in zip(*self.seq, strict=True)
        )
        broken = noise.outside_parts(median, T, positive, negative, far, step, self.noise)
        healthy = ~broken & (T > 0)
        tokens = float(T[healthy].sum())
        ratio = float(rho_seq[healthy].sum()) / tokens if tokens else 1.0
        spread = float(rho2_seq[healthy].sum()) / tokens - ratio * ratio if tokens else 0.0
        stderr = math.sqrt(max(spread, 0.0) / tokens) if tokens else 0.0
        ratio_all, rho2 = rho / n, rho2_seq.sum() / n
        values = {
            "k1": -d / n,
            "k3": k3,
            "js": js / n,
            "token_mult_prob_error": mult / n,
            "chi2_token": chi / n - 1.0,
            "ratio_mean": ratio_all,
            "ess": ratio_all * ratio_all / rho2 if rho2 > 0 else 0.0,
        }
        health = assess_values(values, int(broken.sum()), ratio, stderr).to_dict()
        return {key: health[key] for key in ("verdict", "summary", "reasons", "bands")}
