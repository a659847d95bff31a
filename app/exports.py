"""A setting exported for any framework, as the Export and Recommend pages show it: the snippet,
its file form, whether it is exact, and what it measures as on the loaded dump."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
from compare_list import label

from iscore.advice import (
    Syntax,
    to_file_text,
)
from iscore.advice import export as export_setting
from iscore.dump import StepRange
from iscore.frameworks import Spec
from iscore.session import (
    Workspace,
)


@dataclass(frozen=True, slots=True)
class Exported:
    """A setting written for one framework.

    Attributes:
        snippet: the text to paste into the framework's own config.
        syntax: the snippet's syntax (`iscore.advice.conversion.Syntax`).
        commented: the snippet under comment lines saying whether it is exact and what it
            could not express (`iscore.advice.conversion.Export.commented`), for downloads.
        config: the iscore config file (YAML with `framework:`), for `iscore replay --config`.
        exact: whether the framework's setting replays identically to the chosen one.
        notes: what differs, and numerical fine print.
        difference: measured on the loaded dump: a table of both settings' headline numbers.
    """

    snippet: str
    syntax: Syntax
    commented: str
    config: str
    exact: bool
    notes: tuple[str, ...]
    difference: pd.DataFrame | None


def export(ws: Workspace, spec: Spec, framework: str, steps: StepRange | None) -> Exported:
    """`spec` as a setting of `framework` (`iscore.advice.conversion.export`), measured on the
    selected steps when the framework differs; memoized with the workspace."""

    def build() -> Exported:
        batch = None if framework == spec.framework else ws.batch(steps)
        result = export_setting(spec, framework, batch=batch)
        difference = None
        if result.difference is not None:
            difference = pd.DataFrame(
                {
                    label(spec): result.difference["source"],
                    f"as {framework}": result.difference["target"],
                }
            )
        return Exported(
            result.text,
            result.syntax,
            result.commented(),
            to_file_text(result.spec),
            result.exact,
            tuple(result.notes),
            difference,
        )

    return ws.cached(("export", spec, framework, ws.selection(steps)), build)
