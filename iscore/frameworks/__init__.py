"""The registry of frameworks: one module each, every one exposing a `base.Framework` named
`FRAMEWORK`. Everything outside this package asks the registry and never imports one
framework's module.

Each module holds that framework's semantics in one place: its config keys and `parse(config)
-> Spec`, the spec dataclasses (typed fields, validated in `__post_init__`) whose `replay(batch)`
composes `iscore.packed.ops` primitives in the framework's own order, its presets, its canonical
form both ways, its snippet text, its loss aggregation, the metric names it logs and its traps.
Adding a framework is one module and one entry of `NAMES` (docs/adding-a-framework.md).

>>> from iscore import frameworks
>>> [fw.name for fw in frameworks.every()][:3]
['verl', 'skyrl', 'nemo_rl']
>>> frameworks.get("verI")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
iscore.errors.ConfigError: Expected `framework` ... but got 'verI' (did you mean 'verl'?)
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

from iscore.errors import ConfigError
from iscore.frameworks._config import check_choice

if TYPE_CHECKING:
    from iscore.frameworks.base import Framework

NAMES = ("verl", "skyrl", "nemo_rl", "slime", "areal", "openrlhf", "trl", "fireworks")
"""The frameworks whose corrections iscore replays, each a module of this package."""


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
