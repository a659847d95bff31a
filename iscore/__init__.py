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

`iscore.DumpWriter` writes the canonical Parquet dump from a training loop's padded tensors;
`iscore.frameworks` is the registry of frameworks.
"""

from iscore.analyze import analyze
from iscore.batch import TokenBatch
from iscore.dump import Dump, Problem, StepRange, load
from iscore.errors import ConfigError, DumpError, IscoreError
from iscore.export import convert as export
from iscore.recommend import recommend
from iscore.replay import parse_config, replay
from iscore.spec import Replay
from iscore.writer import DumpWriter

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
