"""What every measurement of `iscore bench` is given and returns, and the helpers it is timed with.

A measurement is a function `Run -> Measured`: it times something on the bench dump and
returns its rows of the table and its entries of the result (JSON-ready dicts). The harness
runs those listed in `iscore.bench.harness.MEASUREMENTS`, in order; adding one is a function
and a line there.

>>> r = row("tune: query p99", 0.002, None)
>>> r["name"], r["mtok_s"]
('tune: query p99', None)
"""

from __future__ import annotations

import math
import os
import platform
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

import iscore
from iscore.bench.goals import GOAL_TEXT
from iscore.frameworks import Spec, areal, fireworks, nemo_rl, openrlhf, skyrl, slime, trl, verl

SETTINGS = (
    verl.PRESETS["decoupled_geo_rs_token_tis"],
    skyrl.PRESETS["skyrl_tldr_stack"],
    nemo_rl.PRESETS["nemo_icepop"],
    slime.PRESETS["slime_mis_example"],
    areal.PRESETS["areal_sequence_geo_mask"],
    openrlhf.PRESETS["openrlhf_icepop"],
    trl.PRESETS["trl_default"],
    fireworks.PRESETS["fireworks_default"],
)
"""One preset of each of the 8 frameworks: token and sequence truncation, masks, IcePop bands,
rejection sampling and batch normalization between them."""

COLUMNS = ("step", "seq_id", "pos", "rollout_logprob", "train_logprob", "loss_mask")
"""What `Dump` reads of a token-layout dump without policy log-probs."""


@dataclass(frozen=True, slots=True)
class Run:
    """One bench run: the dump every measurement times, and the run's options.

    Attributes:
        path: the bench dump (token layout, one row group per step).
        tokens: its tokens.
        specs: the settings replayed.
        chunk_tokens: tokens per streamed chunk.
        device: "cpu", "cuda" or None (CUDA rows when CUDA is available).
        baseline_tokens, tune_tokens, queries, repeats, marginal_repeats, memory, run_files:
            as `run_bench` takes them.
        say: called with a line of progress.
    """

    path: Path
    tokens: int
    specs: tuple[Spec, ...]
    chunk_tokens: int
    device: str | None = None
    baseline_tokens: int = 2_000_000
    tune_tokens: int = 10_000_000
    queries: int = 1000
    repeats: int = 2
    marginal_repeats: int = 5
    memory: bool = True
    run_files: int = 1000
    say: Callable[[str], None] = lambda line: None

    @property
    def names(self) -> list[str]:
        """The settings as `framework:name`."""
        return [f"{s.framework}:{s.name}" for s in self.specs]


@dataclass(frozen=True, slots=True)
class Measured:
    """What a measurement adds to the result.

    Attributes:
        rows: rows of the table (`row`), in order.
        entries: top-level entries of the result (JSON-ready), e.g. {"tune": {...}}.
    """

    rows: tuple[dict[str, Any], ...] = ()
    entries: Mapping[str, Any] = field(default_factory=dict)


Measurement = Callable[[Run], Measured]
"""Times something on the bench dump (saying what through `run.say`) and returns its rows and
entries."""


def row(name: str, seconds: float, tokens: int | None, goal: str | None = None) -> dict[str, Any]:
    """A row of the table: seconds, and tokens per second where `tokens` is given; `goal` is
    the id of the goal (`iscore.bench.goals.GOALS`) it is judged by."""
    return {
        "name": name,
        "seconds": seconds,
        "tokens": tokens,
        "mtok_s": tokens / seconds / 1e6 if tokens and seconds else None,
        "goal": goal,
        "goal_text": GOAL_TEXT.get(goal or ""),
    }


def best(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of `repeats` runs of fn(), in seconds."""
    fastest = math.inf
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def machine() -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "pandas": pd.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loadavg_start": loadavg(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def package_root() -> str:
    """The folder holding the `iscore` package, for fresh processes to import the same one."""
    return str(Path(iscore.__file__).resolve().parent.parent)
