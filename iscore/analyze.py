"""`iscore analyze`: one streamed pass over a dump computing the mismatch diagnostics and, for
each correction setting, what it does to the data; as a versioned JSON document or pandas frames.

>>> settings = ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"]
>>> result = analyze("data/long_collapse.parquet", settings)  # doctest: +SKIP
>>> [round(s["lr_scale"], 3) for s in result.settings]  # doctest: +SKIP
[0.059, 1.0]

Every field of the JSON document is defined in docs/analysis.md; `SCHEMA_VERSION` changes when a
field changes meaning or disappears.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from iscore.batch import TokenBatch
from iscore.dump import DEFAULT_CHUNK_TOKENS, Dump
from iscore.errors import ConfigError
from iscore.impact import SettingStats
from iscore.mismatch import DEFINITIONS, METRIC_NAMES, MismatchStats
from iscore.replay import FRAMEWORKS, Spec, framework_module, parse_config

SCHEMA_VERSION = 1

Setting = Spec | Mapping[str, Any] | str | Path
"""A setting: a spec, a framework config mapping, a YAML config path, or a preset name."""


def presets() -> dict[str, Spec]:
    """Every framework's named settings, as `framework:name`."""
    return {
        f"{framework}:{name}": spec
        for framework in FRAMEWORKS
        for name, spec in framework_module(framework).PRESETS.items()
    }


def resolve(setting: Setting) -> Spec:
    """A spec from any form of setting.

    Strings name a preset (`verl:decoupled_geo_rs`, or just `decoupled_geo_rs` when only one
    framework has it) or a YAML config file.
    """
    if hasattr(setting, "replay"):
        return setting  # type: ignore[return-value]
    if isinstance(setting, Mapping):
        return parse_config(setting)
    text = str(setting)
    known = presets()
    if text in known:
        return known[text]
    matches = [key for key in known if key.split(":", 1)[1] == text]
    if len(matches) == 1:
        return known[matches[0]]
    if len(matches) > 1:
        raise ConfigError(f"preset {text!r} is ambiguous: say which of {', '.join(matches)}")
    if Path(text).is_file():
        return parse_config(text)
    raise ConfigError(
        f"{text!r} is neither a config file nor a preset; presets: {', '.join(sorted(known))}"
    )


@dataclass(slots=True)
class Analysis:
    """The result of `analyze`: plain dicts and lists, JSON-ready.

    Attributes:
        source: what was read (files, layout, steps, sequences, tokens).
        mismatch: the mismatch diagnostics (see `iscore.mismatch`).
        settings: one dict per setting (see `iscore.impact`), in the order given.
    """

    source: dict[str, Any]
    mismatch: dict[str, Any]
    settings: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """The versioned document; NaN and infinities become null (strict JSON)."""
        return _clean(
            {
                "schema": "iscore.analysis",
                "schema_version": SCHEMA_VERSION,
                "iscore_version": version("iscore"),
                "source": self.source,
                "mismatch": {**self.mismatch, "names": METRIC_NAMES, "definitions": DEFINITIONS},
                "settings": self.settings,
            }
        )

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    def frames(self) -> dict[str, pd.DataFrame]:
        """Tidy tables for notebooks: one row per statistic's unit (step, bucket, setting).

        Keys: `mismatch` (one row), `mismatch_by_step`, `mismatch_by_length`, `mismatch_by_prob`,
        `mismatch_by_pos`, `worst_sequences`, `worst_tokens`, `flags`, `settings` (one row per
        setting), `settings_by_step`, `settings_by_length`, `weight_quantiles` (setting x
        quantile x raw/applied).
        """
        m = self.mismatch
        scalars = {k: v for k, v in m.items() if not isinstance(v, list | dict)}
        out = {
            "mismatch": pd.DataFrame([scalars]),
            **{
                f"mismatch_{key}": pd.DataFrame(m[key])
                for key in ("by_step", "by_length", "by_prob", "by_pos")
            },
            "worst_sequences": pd.DataFrame(m["worst_sequences"]),
            "worst_tokens": pd.DataFrame(m["worst_tokens"]),
            "flags": pd.DataFrame(m["flags"], columns=["code", "message"]),
        }
        rows, by_step, by_length, quantiles = [], [], [], []
        for s in self.settings:
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


def analyze(
    source: str | Path | Dump | TokenBatch,
    settings: Sequence[Setting] = (),
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    progress: Callable[[int], None] | None = None,
) -> Analysis:
    """Stream a dump once, computing the mismatch diagnostics and every setting's statistics.

    Args:
        source: a dump path (file, directory, glob), an opened `Dump`, or a loaded batch.
        settings: specs, config mappings, YAML paths or preset names (see `resolve`).
        max_tokens: tokens per streamed chunk; chunks always hold whole training steps, which
            batch-normalizing settings need.
        device: where to compute; default CUDA when available, else CPU.
        progress: called with the number of tokens of each chunk done.
    """
    specs = [resolve(s) for s in settings]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mismatch = MismatchStats()
    stats = [SettingStats(spec) for spec in specs]
    if isinstance(source, TokenBatch):
        chunks: Any = [source]
        files = []
    else:
        dump = source if isinstance(source, Dump) else Dump(source)
        chunks = dump.batches(max_tokens=max_tokens, whole_steps=True)
        files = [f.path for f in dump.files]
    for chunk in chunks:
        batch = chunk.to(device)
        mismatch.update(batch)
        for spec, acc in zip(specs, stats, strict=True):
            acc.update(batch, spec.replay(batch))
        if progress is not None:
            progress(batch.num_tokens)
    summary = mismatch.compute()
    result = Analysis(
        source={
            "files": files,
            "steps": [row["step"] for row in summary["by_step"]],
            "sequences": summary.get("sequences", 0),
            "loss_tokens": summary.get("tokens", 0),
            "device": device.type,
        },
        mismatch=summary,
        settings=[acc.compute() for acc in stats],
    )
    return result


def _clean(value: Any) -> Any:
    """JSON-ready: NaN/inf floats to None, numpy scalars to Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, float) or hasattr(value, "dtype"):
        number = value.item() if hasattr(value, "item") else value
        if isinstance(number, float) and not math.isfinite(number):
            return None
        return number
    return value
