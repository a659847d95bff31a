"""iscore: replay rollout/trainer logprob dumps through every RL framework's IS correction.

>>> import iscore
>>> batch = iscore.load("data/dense_bf16.parquet")  # doctest: +SKIP
"""

from iscore.batch import TokenBatch
from iscore.dump import Dump, Problem, StepRange, load
from iscore.errors import ConfigError, DumpError, IscoreError
from iscore.replay import Replay, parse_config, replay

__all__ = [
    "ConfigError",
    "Dump",
    "DumpError",
    "IscoreError",
    "Problem",
    "Replay",
    "StepRange",
    "TokenBatch",
    "load",
    "parse_config",
    "replay",
]
