"""The text forms of a framework config: YAML with its nesting, Hydra-style overrides, launch
flags, and the Python call a config is written as. Each framework module's `render` composes
these; nothing here knows a framework.

>>> print(yaml_text({"tis": {"cap": 2.0}}), end="")
tis:
  cap: 2.0
>>> print(overrides({"algorithm": {"rollout_correction": {"rollout_rs_threshold": "0.5_2.0"}}}))
"algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    """Quotes strings that start like a number: verl's "0.5_5.0" must not be read back as one
    by a YAML loader with looser number rules than PyYAML's."""


_NUMBER_LIKE = re.compile(r"[-+.]?\d")


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "'" if _NUMBER_LIKE.match(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def yaml_text(data: Mapping[str, Any]) -> str:
    """`data` as block YAML, keys in their order."""
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def flag_lines(args: str) -> str:
    """A launch-flag string as one flag (with its values) per line, ` \\` continued; no flag at
    all (the framework's defaults) is an empty text."""
    groups: list[list[str]] = []
    for token in shlex.split(args):
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return " \\\n".join(shlex.join(group) for group in groups)


def overrides(data: Mapping[str, Any]) -> str:
    """Hydra-style `a.b.c=value` overrides of a nested config, one per line."""
    return " \\\n".join(_override(key, value) for key, value in _flatten(data))


def option_flags(data: Mapping[str, Any]) -> str:
    """`--key value` command-line options of a flat config, one per line; None values left out."""
    return " \\\n".join(
        f"--{key} {_scalar(value)}" for key, value in data.items() if value is not None
    )


def python_call(name: str, values: Mapping[str, Any]) -> str:
    """`name(k=v, ...)` with reprs; a `Raw` value is written as is (a nested call)."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


class Raw(str):
    """A string written without quotes by `python_call` (a nested call)."""

    def __repr__(self) -> str:
        return str(self)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_.,:+\-]*")


def _scalar(value: Any) -> str:
    """A value as YAML / Hydra read it back: null, true/false, repr of floats."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _override(key: str, value: Any) -> str:
    """A Hydra override; strings that would read as something else are quoted for Hydra, and
    the whole token for the shell."""
    if isinstance(value, str) and (
        not _PLAIN.fullmatch(value) or value in ("null", "true", "false", "inf", "nan")
    ):
        # Hydra would read "0.5_5.0" as a string anyway, but a list separator or a word like
        # null would not: quote it for Hydra, and the token for the shell.
        quoted = f"{key}='{value}'"
        return f'"{quoted}"' if _SHELL_SAFE.fullmatch(value) else shlex.quote(quoted)
    return f"{key}={_scalar(value)}"


def nested(data: Mapping[str, Any], fmt: str | None) -> str:
    """A nested (Hydra/OmegaConf) config: YAML, or `key=value` overrides for "flags"."""
    return overrides(data) if fmt == "flags" else yaml_text(data)
