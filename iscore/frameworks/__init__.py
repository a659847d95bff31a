"""What a correction setting is and does: the `Spec` protocol and a setting's `Replay`
(`spec`), the registry of frameworks (`registry`), one module per framework (`verl`, `skyrl`,
`nemo_rl`, `slime`, `areal`, `openrlhf`, `trl`, `fireworks`, `roll`: its config keys, `parse`,
replay, presets, canonical form, snippet, loss aggregation, metric names and traps), the contract
they follow (`base`), the framework-neutral description of a setting (`canonical`), the text forms
of a config (`snippets`) and any form of a setting resolved to a spec (`resolve`).

Rule: the only folder that names a framework; imports `iscore.packed` and `iscore.utils`
below it. Everything outside asks the registry and never imports one framework's module.
Adding a framework is one module and one entry of `NAMES` (docs/adding-a-framework.md).

>>> from iscore import frameworks
>>> [fw.name for fw in frameworks.every()][:3]
['verl', 'skyrl', 'nemo_rl']
>>> frameworks.get("verI")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
iscore.errors.ConfigError: Expected `framework` ... but got 'verI' (did you mean 'verl'?)
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "_config": ["check_choice"],
        "base": [
            "Aggregation",
            "BatchFields",
            "Citation",
            "Framework",
            "HealthBand",
            "ReferencePoint",
            "limits",
        ],
        "canonical": [
            "Canonical",
            "Component",
            "mask_component",
            "sentence",
            "weight_component",
            "without_segments",
        ],
        "names": ["NAMES"],
        "registry": ["every", "get", "of"],
        "resolve": [
            "Setting",
            "load_config_text",
            "parse_config",
            "presets",
            "resolve",
            "resolve_all",
        ],
        "snippets": ["yaml_text"],
        "spec": ["Replay", "Spec"],
    },
)
