"""iscore: replay rollout/trainer logprob dumps through every RL framework's IS correction.

The Python API in one screen:

>>> import iscore
>>> batch = iscore.load("data/fp8.parquet")        # a packed TokenBatch (flat + cu_seqlens)
>>> result = iscore.replay(batch, {"framework": "trl"})   # per-token weight and keep
>>> analysis = iscore.analyze(batch, ["verl:decoupled_geo_rs"])
>>> analysis.settings[0]["lr_scale"]
1.0
>>> best = iscore.recommend(batch, "skyrl").best.spec
>>> print(iscore.export(best, "skyrl").text.splitlines()[0])
trainer:

`iscore.DumpWriter` writes the canonical Parquet dump from a training loop's own batch objects
(`add_batch`) or padded tensors (`add`);
`iscore.frameworks` is the registry of frameworks.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# The public names, imported on first use: `import iscore.cli` and `iscore --help` stay free of
# torch (PEP 562 module __getattr__).
_EXPORTS = {
    "ConfigError": "iscore.errors",
    "Dump": "iscore.dump",
    "DumpError": "iscore.errors",
    "DumpWriter": "iscore.dump.writer",
    "IscoreError": "iscore.errors",
    "Problem": "iscore.errors",
    "Replay": "iscore.frameworks.spec",
    "StepRange": "iscore.dump",
    "TokenBatch": "iscore.packed.batch",
    "analyze": "iscore.passes.analysis",
    "export": "iscore.advice.conversion:convert",
    "load": "iscore.dump",
    "parse_config": "iscore.frameworks.resolve",
    "recommend": "iscore.advice.recommendation",
    "replay": "iscore.passes.replay",
}

if TYPE_CHECKING:
    from iscore.advice.conversion import convert as export
    from iscore.advice.recommendation import recommend
    from iscore.dump import Dump, StepRange, load
    from iscore.dump.writer import DumpWriter
    from iscore.errors import ConfigError, DumpError, IscoreError, Problem
    from iscore.frameworks.resolve import parse_config
    from iscore.frameworks.spec import Replay
    from iscore.packed.batch import TokenBatch
    from iscore.passes.analysis import analyze
    from iscore.passes.replay import replay


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'iscore' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "ConfigError",
    "Dump",
    "DumpError",
    "DumpWriter",
    "IscoreError",
    "Problem",
    "Replay",
    "StepRange",
    "TokenBatch",
    "analyze",
    "export",
    "load",
    "parse_config",
    "recommend",
    "replay",
]
