"""Independent implementations of the default settings' corrections, to check and time iscore by.

- `padded`: float32 tensors padded to [B, max_len], the way the frameworks write them, and the
  key statistics;
- `dataframe`: pandas groupby in float64, and every statistic `analyze` reports;
- `comparison`: both beside iscore on the same tokens, their agreement and their timings.

Neither calls the engine's replay: they restate each framework's formulas.
"""

from __future__ import annotations

from typing import Any

from iscore.bench.baselines import padded


def implements(spec: Any) -> bool:
    """Whether the baselines implement `spec`."""
    return f"{spec.framework}:{spec.name}" in padded.WEIGHTS
