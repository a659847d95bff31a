"""The result of an analysis: the versioned document `iscore analyze --json` writes (every field
defined in docs/analysis.md; `SCHEMA_VERSION` changes when a field changes meaning or
disappears), and the same as pandas frames for notebooks."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pandas as pd

from iscore.advice import Attribution, Flag, Health, Trend
from iscore.stats import BANDS, DEFINITIONS, METRIC_NAMES, MismatchSummary, SettingSummary
from iscore.utils import json_ready, write_json

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Analysis:
    """The result of `analyze`, as typed values; `to_dict` is the JSON document.

    Attributes:
        source: what was read (files, where, dropped, steps, sequences, loss tokens, device).
        mismatch: the mismatch diagnostics (`iscore.stats.MismatchSummary`).
        flags: the mismatch flags, each a code, a kind and a message (`iscore.advice.Flag`).
        health: the verdict of the dump and of each step (`iscore.advice.Health`).
        attribution: where the mismatch comes from (`iscore.advice.Attribution`).
        settings: what each setting does (`iscore.stats.SettingSummary`), in the order given.
        trend: the per-step table and its events (`iscore.advice.Trend`).
    """

    source: dict[str, Any]
    mismatch: MismatchSummary
    flags: tuple[Flag, ...]
    health: Health
    attribution: Attribution
    settings: list[SettingSummary]
    trend: Trend

    def to_dict(self) -> dict[str, Any]:
        """The versioned document; NaN and infinities become null (strict JSON): the one place
        the typed values become plain ones."""
        return json_ready(
            {
                "schema": "iscore.analysis",
                "schema_version": SCHEMA_VERSION,
                "iscore_version": version("iscore"),
                "source": self.source,
                "mismatch": {
                    **self.mismatch.to_dict(),
                    "flags": [f.to_dict() for f in self.flags],
                    "names": METRIC_NAMES,
                    "definitions": DEFINITIONS,
                    "bands": BANDS,
                },
                "health": self.health.to_dict(),
                "attribution": self.attribution.to_dict(),
                "settings": [s.to_dict() for s in self.settings],
                "trend": self.trend.to_dict(),
            }
        )

    def write_json(self, path: str | Path) -> None:
        write_json(self.to_dict(), path)

    def frames(self) -> dict[str, pd.DataFrame]:
        """Tidy tables for notebooks: one row per statistic's unit (step, bucket, setting).

        Keys: `mismatch` (one row), `mismatch_by_step`, `mismatch_by_length`, `mismatch_by_prob`,
        `mismatch_by_pos`, `worst_sequences`, `worst_tokens`, `flags`, `settings` (one row per
        setting), `settings_by_step`, `settings_by_length`, `weight_quantiles` (setting x
        quantile x raw/applied).
        """
        m = self.mismatch.to_dict()
        scalars = {k: v for k, v in m.items() if not isinstance(v, list | dict)}
        out = {
            "mismatch": pd.DataFrame([scalars]),
            **{
                f"mismatch_{key}": pd.DataFrame(m[key])
                for key in ("by_step", "by_length", "by_prob", "by_pos")
            },
            "worst_sequences": pd.DataFrame(m["worst_sequences"]),
            "worst_tokens": pd.DataFrame(m["worst_tokens"]),
            "flags": pd.DataFrame(
                [{"code": f.code, "message": f.message} for f in self.flags],
                columns=["code", "message"],
            ),
        }
        rows, by_step, by_length, quantiles = [], [], [], []
        for setting in self.settings:
            s = setting.to_dict()
            key = {"setting": s["name"], "framework": s["framework"]}
            rows.append(
                {
                    **key,
                    **{
                        k: v
                        for k, v in s.items()
                        if not isinstance(v, list | dict) and k not in key
                    },
                }
            )
            by_step += [{**key, **row} for row in s["by_step"]]
            by_length += [{**key, **row} for row in s["by_length"]]
            for kind in ("weight", "raw"):
                quantiles += [
                    {**key, "of": kind, "quantile": float(q[1:]) / 100, "value": v}
                    for q, v in s[f"{kind}_quantiles"].items()
                ]
        out["settings"] = pd.DataFrame(rows)
        out["settings_by_step"] = pd.DataFrame(by_step)
        out["settings_by_length"] = pd.DataFrame(by_length)
        out["weight_quantiles"] = pd.DataFrame(quantiles)
        return out
