"""Latency of interactions: Tuner queries, and the dashboard's steps through its `Workspace`.
Each is a `Run -> Measured` of `iscore.bench.base`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import iscore
from iscore import frameworks
from iscore.advice import Targets, Tuner, query
from iscore.bench.base import Measured, Run, best, row
from iscore.bench.data import subset
from iscore.dump import Dump, StepRange
from iscore.session import Workspace


def tune(run: Run) -> Measured:
    """Build a Tuner on up to `run.tune_tokens` tokens of whole steps, then time
    `run.queries` random queries (the result's `tune`)."""
    run.say("timing the Tuner")
    steps, tokens, _ = subset(run.path, run.tune_tokens)
    batch = iscore.load(run.path, steps=StepRange(0, steps - 1))
    build_s = best(run.repeats, lambda: Tuner(batch))
    tuner = Tuner(batch)
    rng = np.random.default_rng(0)
    families: list[Callable[[], Any]] = [
        lambda: tuner.token_tis(float(rng.uniform(1.05, 5.0))),
        lambda: tuner.icepop(float(rng.uniform(0.1, 0.9)), float(rng.uniform(1.1, 10.0))),
        lambda: tuner.seq_tis(float(rng.uniform(1.0, 10.0))),
        lambda: tuner.geometric_mask(
            float(rng.uniform(0.99, 0.9999)), float(rng.uniform(1.0001, 1.01))
        ),
        lambda: tuner.product_mask(float(rng.uniform(0.01, 0.9)), float(rng.uniform(1.1, 100))),
        lambda: tuner.k3_mask(float(10 ** rng.uniform(-5, -1))),
    ]
    times = []
    for i in range(run.queries):
        ask = families[i % len(families)]
        start = time.perf_counter()
        ask()
        times.append(time.perf_counter() - start)
    t = np.array(times)
    record = {
        "tokens": tokens,
        "sequences": batch.num_sequences,
        "build_s": build_s,
        "queries": run.queries,
        "query_p50_s": float(np.quantile(t, 0.5)),
        "query_p99_s": float(np.quantile(t, 0.99)),
        "query_max_s": float(t.max()),
    }
    rows = (
        row("tune: build", build_s, tokens),
        row("tune: query p99", record["query_p99_s"], None, "tune_query_p99_s"),
    )
    return Measured(rows=rows, entries={"tune": record})


def app(run: Run) -> Measured:
    """The dashboard's interactions through a `Workspace` of up to `run.tune_tokens` tokens
    (whole steps), each timed on a fresh workspace `run.repeats` times (the best kept): a
    workspace memoizes, so only a first call is an interaction's cost (the result's `app`)."""
    run.say("timing the app's interactions through its workspace")
    steps, tokens, _ = subset(run.path, run.tune_tokens)
    family, framework = "token_tis", frameworks.NAMES[0]
    fastest: dict[str, float] = {}
    added: list[float] = []
    for _ in range(max(run.repeats, 1)):
        times: dict[str, float] = {}

        def timed(key: str, fn: Callable[[], Any], times: dict[str, float] = times) -> Any:
            start = time.perf_counter()
            value = fn()
            times[key] = time.perf_counter() - start
            return value

        dump = Dump(run.path, steps=StepRange(0, steps - 1), extras=True)
        ws = timed("open_s", lambda dump=dump: Workspace.from_dump(dump))
        timed("mismatch_s", ws.mismatch)
        timed("recommend_s", lambda ws=ws: ws.recommend(framework, Targets()))
        timed("first_setting_s", lambda ws=ws: ws.setting(run.specs[0]))
        each = []
        for spec in run.specs[1:]:
            start = time.perf_counter()
            ws.setting(spec)
            each.append(time.perf_counter() - start)
        values = timed("tune_open_s", lambda ws=ws: ws.grid(family))
        tuner = ws.tuner()
        slider = []
        for point in values["upper"]:
            start = time.perf_counter()
            query(tuner, family, [point], framework)
            slider.append(time.perf_counter() - start)
        times["slider_p50_s"] = float(np.median(slider))
        times["slider_max_s"] = float(np.max(slider))
        for key, value in times.items():
            fastest[key] = min(fastest.get(key, math.inf), value)
        if not added or max(each) < max(added):
            added = each
    record = {
        "tokens": tokens,
        "steps": steps,
        **fastest,
        "add_setting_p50_s": float(np.median(added)) if added else None,
        "add_setting_max_s": float(np.max(added)) if added else None,
        "settings_added": len(added),
        "slider_points": len(values["upper"]),
    }
    rows = [
        row("app: open the dump", record["open_s"], tokens),
        row("app: mismatch diagnostics", record["mismatch_s"], tokens),
        row(f"app: recommend ({framework})", record["recommend_s"], tokens),
        row("app: first setting", record["first_setting_s"], tokens),
        row("app: open Tune", record["tune_open_s"], tokens, "app_tune_open_s"),
        row("app: Tune slider p50", record["slider_p50_s"], None, "app_slider_p50_s"),
    ]
    if added:  # with two settings or more
        slowest = record["add_setting_max_s"]
        rows.append(row("app: add a setting, slowest", slowest, None, "app_add_setting_s"))
    return Measured(rows=tuple(rows), entries={"app": record})
