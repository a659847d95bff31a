"""Reading a framework's config mapping with typed getters and exact error messages.

>>> s = Section({"cap": 2, "level": "token"}, "tis")
>>> s.float("cap", 5.0, gt=0), s.choice("level", "token", ("token", "sequence"))
(2.0, 'token')
>>> s.done()
>>> Section({"cap": "x"}, "tis").float("cap", 5.0)
Traceback (most recent call last):
...
iscore.errors.ConfigError: Expected `tis.cap` to be a float, but got 'x'
"""

from __future__ import annotations

import argparse
import difflib
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from iscore.errors import ConfigError, clip, quote

_MISSING = object()


class Section:
    """A mapping being parsed: typed getters that record the keys read.

    Args:
        data: the mapping (None counts as empty).
        path: its dotted location in the config, for messages.
    """

    def __init__(self, data: Mapping[str, Any] | None, path: str = ""):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"Expected `{path}` to be a mapping, but got {type(data).__name__}: {quote(data)}"
            )
        self.data = data
        self.path = path
        self.read: set[str] = set()

    def key(self, key: str) -> str:
        """The dotted path of `key`, for messages."""
        return clip(f"{self.path}.{key}" if self.path else key)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        """The value as given; required when no default."""
        self.read.add(key)
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(f"Missing required key `{self.key(key)}`")
        return default

    def section(self, key: str) -> Section:
        """A nested mapping (empty if absent or null)."""
        return Section(self.raw(key, None), self.key(key))

    def bool(self, key: str, default: bool | None) -> bool | None:
        value = self.raw(key, default)
        if value is None and default is None:
            return None
        if not isinstance(value, bool):
            raise ConfigError(f"Expected `{self.key(key)}` to be a bool, but got {quote(value)}")
        return value

    def float(
        self,
        key: str,
        default: float | None,
        *,
        gt: float | None = None,
        ge: float | None = None,
        nullable: bool = False,
    ) -> float | None:
        """A number (ints and numeric strings such as "2.0" accepted, as YAML/OmegaConf do)."""
        value = self.raw(key, default)
        if value is None and (nullable or default is None):
            return None
        return as_float(value, self.key(key), gt=gt, ge=ge)

    def int(self, key: str, default: int | None, *, ge: int | None = None) -> int | None:
        value = self.raw(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or (ge is not None and value < ge):
            bound = f" >= {ge}" if ge is not None else ""
            raise ConfigError(
                f"Expected `{self.key(key)}` to be an int{bound}, but got {quote(value)}"
            )
        return value

    def choice(self, key: str, default: str | None, choices: Sequence[str | None]) -> str | None:
        value = self.raw(key, default)
        check_choice(self.key(key), value, choices)
        return value

    def done(self, ignore: Sequence[str] = ()) -> None:
        """Reject keys that were never read (typos, keys of another framework or version)."""
        unknown = [k for k in self.data if k not in self.read and k not in ignore]
        if unknown:
            raise ConfigError(
                f"Unknown key{'s' * (len(unknown) > 1)} "
                + ", ".join(f"`{self.key(k)}`{nearest(k, self.read)}" for k in unknown)
                + (f"; expected {', '.join(sorted(self.read))}" if self.read else "")
            )


def check_choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise ConfigError naming `key`, the allowed values and the nearest one, unless `value` is
    one of `choices`.

    >>> check_choice("level", "tokne", ("token", "sequence"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    iscore.errors.ConfigError: Expected `level` ... but got 'tokne' (did you mean 'token'?)
    """
    if value in choices:
        return
    allowed = ", ".join("null" if c is None else repr(c) for c in choices)
    hint = nearest(value, [c for c in choices if isinstance(c, str)])
    raise ConfigError(f"Expected `{key}` to be one of {allowed}, but got {quote(value)}{hint}")


def check_number(
    key: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    nullable: bool = False,
) -> None:
    """Raise ConfigError naming `key` unless `value` is a number (not a bool, not NaN) within
    the bounds, or None where `nullable`."""
    if value is None and nullable:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and _real(value) is not None
    if not ok or (gt is not None and not value > gt) or (ge is not None and not value >= ge):
        bound = f" > {gt}" if gt is not None else f" >= {ge}" if ge is not None else ""
        null = " or null" if nullable else ""
        raise ConfigError(
            f"Expected `{key}` to be a float{bound}{null}, but got {quote(value)}{_unheld(value)}"
        )


def check_bool(key: str, value: Any) -> None:
    """Raise ConfigError naming `key` unless `value` is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"Expected `{key}` to be a bool, but got {quote(value)}")


def nearest(value: Any, options: Any, cutoff: float = 0.6) -> str:
    """ " (did you mean 'x'?)" for the closest of `options` to a string `value` (difflib's
    similarity at least `cutoff`), else ""."""
    if not isinstance(value, str):
        return ""
    match = difflib.get_close_matches(value, [str(o) for o in options], n=1, cutoff=cutoff)
    return f" (did you mean {match[0]!r}?)" if match else ""


def as_float(value: Any, key: str, *, gt: float | None = None, ge: float | None = None) -> float:
    """`value` as a float, checked against the bounds; the message names `key`."""
    bound = f" > {gt}" if gt is not None else f" >= {ge}" if ge is not None else ""
    number = None if isinstance(value, bool) else _real(value)
    if number is None or not (gt is None or number > gt) or not (ge is None or number >= ge):
        raise ConfigError(
            f"Expected `{key}` to be a float{bound}, but got {quote(value)}{_unheld(value)}"
        )
    return number


def _unheld(value: Any) -> str:
    """ ", which no float holds" for an integer beyond float64's range, else ""."""
    if type(value) is int and abs(value) > sys.float_info.max:
        return ", an integer no float holds"
    return ""


def _real(value: Any) -> float | None:
    """`value` as the float a framework's `float(value)` gives, or None where that raises or
    gives NaN (every bound check a framework makes is false for NaN).

    Infinity is a number (`.inf`, 1e999 and "inf" all read as it, and a cap there never
    binds, as iscore's own exports spell "no cap"); an integer no float holds (10**400) is
    not: `float()` raises on it.
    """
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isnan(number) else number


def top_level(config: Mapping[str, Any], framework: str) -> tuple[Section, str]:
    """The config's top-level section and the setting's display name.

    `framework:` and `name:` are iscore's own top-level keys; everything else belongs to
    the framework.
    """
    section = Section(config, "")
    section.raw("framework")
    name = section.raw("name", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"Expected `name` to be a string, but got {quote(name)}")
    return section, name or framework


def version(section: Section, versions: Sequence[str]) -> str | None:
    """The config's `version:` (iscore's own top-level key): None, the pinned release, or one
    of `versions` (a framework's `base.Version` names)."""
    value = section.raw("version", None)
    if value is not None and value not in versions:
        known = ", ".join(versions) or "none but its pinned release"
        raise ConfigError(
            f"Expected `version` to be null (the pinned release) or one of {known}, "
            f"but got {quote(value)}"
        )
    return value


class _FlagParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing and exiting."""

    def error(self, message: str):
        raise ConfigError(f"`args`: {message}")


def flag_parser(framework: str) -> argparse.ArgumentParser:
    """An argparse parser for a framework's CLI flags given as one `args:` string."""
    return _FlagParser(prog=framework, add_help=False, allow_abbrev=False, exit_on_error=False)


def parse_flags(parser: argparse.ArgumentParser, args: Any) -> argparse.Namespace:
    """Parse `args` (one shell-quoted string or a list of strings); unknown flags raise."""
    if isinstance(args, str):
        argv = shlex.split(args)
    elif isinstance(args, Sequence) and all(isinstance(a, str) for a in args):
        argv = list(args)
    else:
        raise ConfigError(f"Expected `args` to be a string of CLI flags, but got {quote(args)}")
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"`args`: {e}") from e
