"""The registry of frameworks: their names, and each one's `base.Framework` (its module's
`FRAMEWORK`, imported on first use)."""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

from iscore.errors import ConfigError
from iscore.frameworks._config import check_choice
from iscore.frameworks.names import NAMES

if TYPE_CHECKING:
    from iscore.frameworks.base import Framework


def get(name: str) -> Framework:
    """The framework called `name` (its module is imported on first use).

    Raises:
        ConfigError: no such framework; the message lists them and the nearest match.
    """
    check_choice("framework", name, NAMES)
    return _module(name).FRAMEWORK


@cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"iscore.frameworks.{name}")


def every() -> tuple[Framework, ...]:
    """Every registered framework, in `NAMES` order."""
    return tuple(get(name) for name in NAMES)


def of(spec: object) -> Framework:
    """The framework a spec belongs to.

    Raises:
        ConfigError: `spec` is not a setting of a registered framework.
    """
    for framework in every():
        if framework.owns(spec):
            return framework

    raise ConfigError(
        f"Expected `spec` to be a setting of one of {', '.join(NAMES)}, "
        f"but got {type(spec).__name__}"
    )
