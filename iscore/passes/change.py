"""`iscore why`: a token-mean metric's change between two steps of a dump split, for each
factor (the rollout probability, the response length, the position, the turn, a column of
the dump), into composition (the token mix moved across the factor's bins) and within (each
bin's value moved), terms that add up to the change exactly (docs/why.md).

Only the two steps are read (a piece of each file for each step, where the files are on disk),
chunk by chunk, into `iscore.stats.MixStats`; `iscore.advice.shift` splits the change.

>>> w = why("run/", 10, 40)                                  # doctest: +SKIP
>>> w.composition, w.best.factor                             # doctest: +SKIP
(0.93, 'prob')
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from iscore.advice import FactorShift, best_factor, share_of, shift_share, split_sentence
from iscore.dump import DEFAULT_CHUNK_TOKENS, Data, Dump, open_data
from iscore.errors import ConfigError, DumpError
from iscore.packed import TokenBatch
from iscore.passes.parts import device_for
from iscore.stats import ORDERED, SHIFT_METRICS, MixStats, bins_by_value
from iscore.utils import write_json

SCHEMA = "iscore.why"
SCHEMA_VERSION = 1
"""The JSON document's name and version (docs/why.md#the-document)."""


@dataclass(frozen=True, slots=True)
class Why:
    """A metric's change between two steps, split by each factor (`why`).

    Attributes:
        metric: the token-mean metric (`iscore.stats.SHIFT_METRICS`).
        steps: the step it is measured from and the step it is measured at.
        baseline, value: the metric at each.
        tokens: each step's loss tokens.
        by: the split by each factor, in the order asked.
        best: the factor whose composition explains the largest share of the change (None
            without a change).
        sentence: the split in words.
    """

    metric: str
    steps: tuple[int, int]
    baseline: float
    value: float
    tokens: tuple[int, int]
    by: tuple[FactorShift, ...]
    best: FactorShift | None
    sentence: str

    @property
    def change(self) -> float:
        return self.value - self.baseline

    @property
    def composition(self) -> float | None:
        """The best factor's composition as a fraction of the change (None without one)."""
        return None if self.best is None else share_of(self.best.composition, self.change)

    @property
    def within(self) -> float | None:
        """1 - `composition`: what no factor's token mix explains."""
        return None if self.composition is None else 1.0 - self.composition

    def factor(self, name: str) -> FactorShift:
        """The split by factor `name`."""
        return next(s for s in self.by if s.factor == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "metric": self.metric,
            "from": self.steps[0],
            "to": self.steps[1],
            "tokens": list(self.tokens),
            "baseline": self.baseline,
            "value": self.value,
            "change": self.change,
            "composition": self.composition,
            "within": self.within,
            "factor": None if self.best is None else self.best.factor,
            "sentence": self.sentence,
            "by": [s.to_dict(self.change) for s in self.by],
        }

    def write_json(self, path: str | Path) -> None:
        """Write `to_dict()` as JSON (non-finite numbers as null)."""
        write_json(self.to_dict(), path)


def why(
    source: Data,
    from_step: int,
    to_step: int,
    *,
    metric: str = "k3",
    by: Sequence[str] | None = None,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
) -> Why:
    """Split the change of `metric` from step `from_step` to step `to_step` by each factor.

    Args:
        source: a dump (a path, directory, glob, URI or opened `Dump`; only the two steps
            are read where its files are on disk) or a loaded batch.
        from_step, to_step: the two steps.
        metric: a token-mean metric, one of `iscore.stats.SHIFT_METRICS`.
        by: the factors: "prob" (the rollout probability of the sampled token), "length"
            (the response's loss tokens), "position", "turn" (with a `turn` column), or a
            per-sequence column of the dump of integers, strings or booleans (a bin a value);
            default the first three, and the turn where the dump has one.
        max_tokens: tokens per streamed chunk.
        device: where to bin; default CUDA when available, else CPU.

    Raises:
        ConfigError: an unknown metric or factor, or the same step twice.
        DumpError: a step not in the dump (the steps it has are named), or one without
            loss tokens.

    >>> w = why("data/drift.parquet", 0, 3)                 # doctest: +SKIP
    >>> round(w.composition + w.within, 12)                  # doctest: +SKIP
    1.0
    """
    if metric not in SHIFT_METRICS:
        raise ConfigError(
            f"Expected metric to be one of {', '.join(SHIFT_METRICS)}, but got {metric!r}"
        )
    if from_step == to_step:
        raise ConfigError(f"Expected two different steps, but got {from_step} twice")
    steps = (from_step, to_step)
    if isinstance(source, Dump | TokenBatch):
        opened = open_data(source)
    else:  # a dump's other columns are read only to split by one
        opened = open_data(source, extras=any(f not in ORDERED for f in by or ()))
    factors = _factors(opened, by)
    stats = MixStats(steps=steps, metric=metric, factors=factors)
    where = device_for(device, "local")
    for chunk in _chunks(opened, steps, max_tokens):
        stats.update(chunk.to(where))
    for slot, step in enumerate(steps):
        if not stats.sequences[slot]:
            raise _missing(opened, step)
    tables = stats.compute()
    tokens = tables[0].tokens.sum(axis=1)
    for slot, step in enumerate(steps):
        if not tokens[slot]:
            raise DumpError(
                f"step {step} has no loss tokens ({stats.sequences[slot]:,} sequences, none "
                f"in the loss): {metric} has no value there"
            )
    baseline, value = (float(v) for v in tables[0].sums.sum(axis=1) / tokens)
    shifts = tuple(shift_share(t) for t in tables)
    best = best_factor(shifts, value - baseline)
    return Why(
        metric=metric,
        steps=steps,
        baseline=baseline,
        value=value,
        tokens=(int(tokens[0]), int(tokens[1])),
        by=shifts,
        best=best,
        sentence=split_sentence(metric, steps, (baseline, value), best),
    )


def _factors(opened: Dump | TokenBatch, by: Sequence[str] | None) -> tuple[str, ...]:
    """The factors asked for, checked against what the dump has (default the built-in ones
    it can be split by).

    Raises:
        ConfigError: a factor that is neither built in nor a column of integers, strings or
            booleans, `turn` without the column, or none at all.
    """
    if isinstance(opened, TokenBatch):
        has_turn = opened.turn is not None
        columns = {} if opened.extra is None else {f.name: f.type for f in opened.extra.schema}
    else:
        has_turn = "turn" in opened.files[0].columns
        columns = {f.name: f.type for f in opened.carried}
    if by is None:
        return tuple(f for f in ORDERED if f != "turn" or has_turn)
    if not by:
        raise ConfigError("Expected at least one factor to split by, but got none")
    choices = [f for f in ORDERED if f != "turn" or has_turn] + sorted(columns)
    for factor in by:
        if factor not in choices:
            extra = "; the dump has no turn column" if factor == "turn" else ""
            raise ConfigError(
                f"Expected each factor to be one of {', '.join(choices)}, but got {factor!r}{extra}"
            )
        if factor in columns and not bins_by_value(columns[factor]):
            raise ConfigError(
                f"Expected a factor column of integers, strings or booleans (a bin a value), "
                f"but {factor!r} is {columns[factor]}"
            )
    return tuple(dict.fromkeys(by))


def _chunks(
    opened: Dump | TokenBatch, steps: tuple[int, int], max_tokens: int
) -> Iterator[TokenBatch]:
    """What is read of the two steps: for files on disk, each file's piece of each step
    (its row groups of other steps are never read); else the whole dump, whose tokens of
    other steps `MixStats` leaves out."""
    if isinstance(opened, TokenBatch):
        yield opened
        return
    if opened.in_memory:
        yield from opened.batches(max_tokens, part=True)
        return
    for step in steps:
        selected = opened.steps.within(step, step)
        if selected is None:
            continue
        for index in range(len(opened.files)):
            yield from opened.piece(index, selected).open().batches(max_tokens, part=True)


def _missing(opened: Dump | TokenBatch, step: int) -> DumpError:
    """The error of a step with no sequence read, naming the steps the dump has."""
    if isinstance(opened, TokenBatch):
        have = np.unique(opened.step.cpu().numpy()).tolist()
    else:
        have = _steps_of(opened)
        if step in have:
            return DumpError(f"no sequence of step {step} is in the {opened.describe_selection()}")
    return DumpError(f"step {step} is not in the dump; it has {_step_list(have)}")


def _steps_of(dump: Dump) -> list[int]:
    """The steps of the dump's files that its step selection holds (the step column alone
    is read)."""
    found: set[int] = set()
    for info, dataset in zip(dump.files, dump.datasets(), strict=True):
        column = info.columns.source.get("step")
        if column is None:  # a file without steps is step 0
            found.add(0)
            continue
        found.update(pc.unique(dataset.to_table(columns=[column])[column]).to_pylist())
    return sorted(s for s in found if dump.steps.covers(s, s))


def _step_list(steps: list[int]) -> str:
    """Steps in words, runs of consecutive ones joined: 'steps 0-3, 7'.

    >>> _step_list([0, 1, 2, 3, 7]), _step_list([5]), _step_list([])
    ('steps 0-3, 7', 'step 5', 'no steps')
    """
    if not steps:
        return "no steps"
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    words = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return f"step{'s' * (len(steps) > 1)} {', '.join(words)}"
