"""`iscore validate`: read a whole dump once, list its problems or summarize it.

The summary is what a user checks before trusting any number downstream: how many steps,
sequences and tokens were read, how long the sequences are, which of the file's columns fed
which canonical column, and a first look at the mismatch (mean |d|, k3). It works on numpy
arrays: checking a dump needs no torch (a `--where` predicate is judged by the engine's
sequence table, which does).

>>> report = validate(Dump("data/dense_bf16.parquet"))  # doctest: +SKIP
>>> report.ok, report.tokens                             # doctest: +SKIP
(True, 150_000)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from iscore.dump import DEFAULT_CHUNK_TOKENS, DropReport, Dump, Problem
from iscore.errors import clip, counted

QUANTILES = (0.1, 0.5, 0.9, 0.99)


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
        """The report as plain JSON-able types."""
        out = asdict(self)
        out["problems"] = [str(p) for p in self.problems]
        out["ok"] = self.ok
        return out

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
        for origin in self.provenance:
            if origin.get("framework"):
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
    dump: Dump,
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Read all of `dump` in chunks of `max_tokens`, collecting problems and a summary.

    Args:
        dump: the opened dump.
        max_tokens: tokens per chunk; memory stays bounded by it.
        progress: called with the number of tokens of each chunk read.
    """
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
    for problems, chunk in dump.scan(max_tokens):
        report.problems.extend(problems)
        if chunk is None:
            continue
        lengths.append(chunk["lengths"])
        steps.update(np.unique(chunk["step"]).tolist())
        d = chunk["train"].astype(np.float64) - chunk["rollout"]  # exact, as ops.log_ratio
        if "loss_mask" in chunk and not chunk["loss_mask"].all():
            d = d[chunk["loss_mask"]]
        if d.size:
            absd = np.abs(d)
            abs_sum += float(absd.sum())
            abs_max = max(abs_max, float(absd.max()))
            with np.errstate(over="ignore"):  # |d| > 709: k3 is inf, as in the engine
                k3_sum += float((np.expm1(d) - d).sum())
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
    return report
