"""Any form of a setting resolved to a spec: a framework config (parsed), a preset name, a
config file's path, a mapping or a spec.

A config is the framework's own (same keys and nesting as its config file) plus a top-level
`framework:` and an optional `name:`. Parsing validates it once into a frozen spec; a spec
can also be built directly from Python (typed fields, no string mini-languages).

>>> import iscore, torch
>>> b = iscore.TokenBatch(
...     rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([-0.2, -1.1]),
...     cu_seqlens=torch.tensor([0, 2]),
... )
>>> rc = {"rollout_is": "token", "rollout_is_threshold": 2.0}
>>> cfg = {"framework": "verl", "algorithm": {"rollout_correction": rc}}
>>> [round(w, 4) for w in iscore.replay(b, cfg).weight.tolist()]  # doctest: +SKIP
[2.0, 0.9048]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from iscore import frameworks
from iscore.errors import ConfigError, clip, quote
from iscore.frameworks._config import nearest
from iscore.frameworks.spec import Spec

MAX_CONFIG_BYTES = 1_000_000
"""The largest config text read; real framework configs are a few kilobytes."""


class _NoAliasLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses aliases (`*name`, and so `<<: *name` merges).

    Expanding aliases is how a few hundred bytes of YAML ("billion laughs") become gigabytes
    of nested lists; frameworks' configs do not need them, so the first alias stops parsing.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(
                f"line {mark.line + 1}: YAML aliases (*name) are not allowed in a config; "
                "write the value out"
            )
        return super().compose_node(parent, index)


def load_config_text(text: str | bytes, source: str = "<config>") -> Any:
    """Parse config text (YAML or JSON) into plain Python values, within memory bounds.

    The text is capped at `MAX_CONFIG_BYTES` and aliases are refused, so a pasted or uploaded
    config cannot grow beyond a few times its size in memory.

    >>> load_config_text("framework: verl\\nname: a")
    {'framework': 'verl', 'name': 'a'}

    Raises:
        ConfigError: too large, not valid YAML, uses aliases or nests too deeply; the message
            starts with `source`.
    """
    size = len(text.encode() if isinstance(text, str) else text)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: the config is larger than {MAX_CONFIG_BYTES:,} bytes; "
            "expected a framework config of a few kilobytes"
        )
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:
        # Its str() spans several lines with a snippet; one line says where, which is enough.
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: not valid YAML: {e.problem}{where}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {clip(' '.join(str(e).split()))}") from None
    except RecursionError:
        raise ConfigError(f"{source}: the config nests too deeply to be a config") from None


def parse_config(config: Mapping[str, Any] | str | Path) -> Spec:
    """Parse a framework config (a mapping, or a YAML file's path) into its frozen spec.

    Raises:
        ConfigError: unknown framework, unknown key, wrong type, or a combination the
            framework itself rejects; the message names the key.
    """
    source = None
    if isinstance(config, str | Path):
        source = str(config)
        try:
            # One byte past the cap tells an oversized file apart without reading all of it
            # (it may be /dev/zero or a FIFO that never ends).
            with open(config, "rb") as f:
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{source}: cannot read the config: {e}") from e
        config = load_config_text(data, source)
    if not isinstance(config, Mapping) or "framework" not in config:
        where = f"{source}: " if source else ""
        raise ConfigError(
            f"{where}Expected a mapping with a top-level `framework:` "
            f"(one of {', '.join(frameworks.NAMES)}), but got {type(config).__name__}"
        )
    try:
        return frameworks.get(config["framework"]).parse(config)
    except ConfigError as e:
        if source is None:
            raise
        raise ConfigError(f"{source}: {e}") from e


Setting = Spec | Mapping[str, Any] | str | Path
"""A setting: a spec, a framework config mapping, a YAML config path, or a preset name."""


def presets() -> dict[str, Spec]:
    """Every framework's named settings, as `framework:name`."""
    return {
        f"{framework.name}:{name}": spec
        for framework in frameworks.every()
        for name, spec in framework.presets().items()
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
    if not isinstance(setting, str | os.PathLike):
        raise ConfigError(
            "Expected a setting: a preset name, a config file's path, a config mapping or a "
            f"spec, but got {type(setting).__name__}"
        )
    text = os.fspath(setting)
    known = presets()
    if text in known:
        return known[text]
    matches = [key for key in known if key.split(":", 1)[1] == text]
    if len(matches) == 1:
        return known[matches[0]]
    if len(matches) > 1:
        raise ConfigError(f"preset {quote(text)} is ambiguous: say which of {', '.join(matches)}")
    if Path(text).is_file():
        return parse_config(text)
    framework, colon, _ = text.partition(":")
    own = sorted(k for k in known if colon and k.startswith(f"{framework}:"))
    listed = f"{framework}'s presets: {', '.join(own)}" if own else "see `iscore presets`"
    raise ConfigError(
        f"{quote(text)} is neither a config file nor a preset{nearest(text, known)}; {listed}"
    )


def resolve_all(settings: Setting | Sequence[Setting]) -> list[Spec]:
    """Specs from one setting or a list of them: a string, a path, a mapping or a spec is one
    setting (never a list of characters or keys).

    >>> [s.name for s in resolve_all("verl:decoupled_geo_rs")]
    ['decoupled_geo_rs']
    >>> [s.name for s in resolve_all(["trl:trl_default", {"framework": "fireworks"}])]
    ['trl_default', 'fireworks']

    Raises:
        ConfigError: as `resolve`, for the first setting that fails.
    """
    if isinstance(settings, Sequence) and not isinstance(settings, str):
        return [resolve(s) for s in settings]
    return [resolve(settings)]
