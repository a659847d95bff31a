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

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={"registry": ["NAMES", "every", "get", "of"]},
)
