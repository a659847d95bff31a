"""A followed run's per-step figures as TensorBoard event files (`iscore watch --tensorboard`),
what RL engineers already watch, written with the `tensorboard` package alone (no TensorFlow:
`pip install 'iscore[tensorboard]'`).

Each step's row is written at that step: every column of the trend's table as
`iscore/<column>`, and each mismatch statistic also under the name each framework logs it as,
`<framework>/<its name>` (`Framework.metrics`, as `iscore.stats.catalogue.METRIC_NAMES` lists them),
so that iscore's curves sit beside a run's own.

>>> writer = ScalarWriter("tb/")                  # doctest: +SKIP
>>> writer.write(update.rows, update.by_step)     # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iscore import frameworks
from iscore.errors import IscoreError

MISSING = (
    "--tensorboard needs the tensorboard package (TensorFlow is not needed): "
    "pip install 'iscore[tensorboard]'"
)
"""What is said where the package is missing."""


def tags(row: dict[str, Any], by_step: dict[str, Any] | None = None) -> dict[str, float]:
    """The scalars of one step: each of the trend row's columns as `iscore/<column>`, and
    each statistic of the step's `mismatch.by_step` row that a framework logs, under that
    framework's name for it (values that are not finite numbers are left out).

    >>> sorted(tags({"step": 3, "k3": 0.001}, {"k3": 0.001}))[:3]
    ['iscore/k3', 'nemo_rl/gen_kl_error (default k3)', 'prime_rl/mismatch_kl/all/mean']
    """
    out = {f"iscore/{k}": v for k, v in row.items() if k != "step"}
    for fw in frameworks.every():
        for statistic, names in fw.metrics.items():
            for name in names:
                out[f"{fw.name}/{name}"] = (by_step or {}).get(statistic)
    return {
        k: float(v)
        for k, v in out.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class ScalarWriter:
    """Writes per-step scalars to TensorBoard event files in `folder` (made if missing).

    Raises:
        IscoreError: the tensorboard package is missing (`MISSING`), or the folder cannot be
            made.
    """

    def __init__(self, folder: str | Path):
        try:
            # Imported here: an optional dependency, loaded only where asked for.
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise IscoreError(MISSING) from None
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise IscoreError(f"--tensorboard {folder}: cannot make the folder: {e}") from e
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(folder))

    def write(self, rows: Sequence[dict[str, Any]], by_step: Sequence[dict[str, Any]] = ()) -> None:
        """Write each row (`Trend.rows`) at its step, with its step's `mismatch.by_step` row
        where given, and flush."""
        details = {row["step"]: row for row in by_step}
        for row in rows:
            values = [
                self._summary.Value(tag=tag, simple_value=value)
                for tag, value in tags(row, details.get(row["step"])).items()
            ]
            self._writer.add_event(
                self._event(
                    wall_time=time.time(), step=row["step"], summary=self._summary(value=values)
                )
            )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
