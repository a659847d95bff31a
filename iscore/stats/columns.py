"""The columns each setting gets in the tables of a dump's statistics: the sequence table's
(`iscore.passes.sequences`) and a run's per-step table (`iscore.advice.trend`), named from the
setting so that two tables agree."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from iscore.errors import IscoreError, quote
from iscore.frameworks import Spec

SETTING_STATISTICS = ("weight", "kept", "share")
"""Per-setting columns, as suffixes of the setting's name."""


def setting_columns(
    specs: Sequence[Spec], taken: Collection[str] = (), *, number_repeats: bool = False
) -> list[str]:
    """The column prefix of each setting: its name in lower case with every run of other
    characters than letters, digits and `_` as one `_`, prefixed by its framework where two
    settings would share it; with `number_repeats`, a setting of the same framework and name
    as an earlier one gets `_2`, `_3`, ... (the trend's columns), where it is refused
    otherwise.

    Raises:
        IscoreError: two settings with the same framework and name (without
            `number_repeats`), or a column that the dump already has.

    >>> from iscore.frameworks.resolve import presets
    >>> setting_columns([presets()["verl:decoupled_geo_rs"]])
    ['decoupled_geo_rs']
    """

    def clean(text: str) -> str:
        return re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_") or "setting"

    names = [clean(spec.name) for spec in specs]
    out = [
        clean(f"{spec.framework}_{spec.name}") if names.count(name) > 1 else name
        for spec, name in zip(specs, names, strict=True)
    ]
    seen: dict[str, int] = {}
    for i, name in enumerate(list(out)):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1 and number_repeats:
            out[i] = f"{name}_{seen[name]}"
        elif seen[name] > 1:
            raise IscoreError(
                f"two settings are both named {quote(specs[i].name)} ({specs[i].framework}); "
                "rename one of them (a config's `name:` key) to tell their columns apart"
            )
        clash = [f"{name}_{s}" for s in SETTING_STATISTICS if f"{name}_{s}" in taken]
        if clash:
            raise IscoreError(
                f"setting {quote(specs[i].name)}'s column {clash[0]} is already a column of "
                "the dump; rename the setting (its config's `name:` key)"
            )
    return out
