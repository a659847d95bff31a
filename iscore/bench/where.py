"""What `--where` adds to a streamed analyze: a separate run, `iscore bench --where P`.

>>> WHERE_GOAL
0.2
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from iscore.bench import data
from iscore.bench.base import SETTINGS, best, loadavg, machine, row
from iscore.dump import DEFAULT_CHUNK_TOKENS, Dump
from iscore.frameworks import Setting, resolve
from iscore.passes import analyze

WHERE_PREDICATES = (
    "length > 0",
    "reward IS NOT NULL",
    "k3 >= 0 AND abs_diff_max >= 0",
)
"""Predicates that keep every sequence, so that analyze does the same work with and without
them and the difference is the predicate's own cost: one on a length (no token math), one on
a dump column (read and carried), one on the mismatch statistics (d computed per chunk)."""

WHERE_GOAL = 0.2
"""`--where` may add at most this share to a streamed analyze."""


def where_overhead(
    predicates: Sequence[str] = WHERE_PREDICATES,
    tokens: int = 50_000_000,
    settings: Sequence[Setting] = SETTINGS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    path: str | Path | None = None,
    *,
    repeats: int = 2,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time a streamed analyze of the bench dump without and with each `--where` predicate
    (on CPU, the best of `repeats` runs each); the goal is at most `WHERE_GOAL` more time.

    Args: as `iscore.bench.run_bench`; `predicates` are judged as `--where` would.

    Returns:
        A JSON-ready dict: `machine`, `dump`, `rows` (seconds, sequences kept, overhead
        against the run without a predicate) and `goal`.
    """
    say = log or (lambda line: None)
    specs = [resolve(s) for s in settings]
    with data.location(path) as (dump_path, temporary):
        result: dict[str, Any] = {
            "schema": "iscore.bench_where",
            "schema_version": 1,
            "machine": machine(),
            "settings": [f"{s.framework}:{s.name}" for s in specs],
            "chunk_tokens": chunk_tokens,
            "repeats": repeats,
            "dump": data.prepare(dump_path, tokens, say),
        }
        if temporary:
            result["dump"]["path"] = "(temporary, deleted)"
        n = result["dump"]["tokens"]
        rows = []
        for predicate in (None, *predicates):
            say(f"timing analyze, streamed, {'no --where' if predicate is None else predicate}")
            kept: list[int] = []

            def run(where: str | None = predicate, kept: list[int] = kept) -> None:
                dump = Dump(dump_path, where=where)
                a = analyze(dump, specs, max_tokens=chunk_tokens, device="cpu")
                kept.append(a.source["sequences"])

            timed = row(
                "analyze, streamed" + ("" if predicate is None else f", --where {predicate}"),
                best(repeats, run),
                n,
            )
            timed["where"], timed["sequences"] = predicate, kept[-1]
            timed["overhead"] = timed["seconds"] / rows[0]["seconds"] - 1 if rows else 0.0
            rows.append(timed)
        worst = max(rows, key=lambda r: r["overhead"])
        result["rows"] = rows
        result["goal"] = {
            "goal": f"--where adds at most {WHERE_GOAL:.0%} to a streamed analyze",
            "measured": f"{worst['overhead']:+.1%} ({worst['name']})",
            "met": worst["overhead"] <= WHERE_GOAL,
        }
        result["machine"]["loadavg_end"] = loadavg()
        return result


def format_where(result: dict[str, Any]) -> str:
    """The `where_overhead` result as a fixed-width table and its goal."""
    header = f"{'name':60s} {'seconds':>9s} {'Mtok/s':>7s} {'sequences':>10s} {'overhead':>9s}"
    lines = [header, "-" * len(header)]
    for r in result["rows"]:
        lines.append(
            f"{r['name']:60s} {r['seconds']:9.2f} {r['mtok_s']:7.2f} "
            f"{r['sequences']:10,d} {r['overhead']:+9.1%}"
        )
    goal = result["goal"]
    lines.append(f"\n[{'met' if goal['met'] else 'NOT met'}] {goal['goal']}: {goal['measured']}")
    d, m = result["dump"], result["machine"]
    lines.append(
        f"dump: {d['tokens']:,} tokens, {d['sequences']:,} sequences, {d['steps']} steps; "
        f"machine: {m['cpus']} CPUs, load average {m['loadavg_start']} -> {m['loadavg_end']}"
    )
    return "\n".join(lines)
