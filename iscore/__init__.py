"""iscore: replay rollout/trainer logprob dumps through every RL framework's IS correction.

The Python API in one screen:

>>> import iscore
>>> batch = iscore.load("data/fp8.parquet")        # a packed TokenBatch (flat + cu_seqlens)
>>> result = iscore.replay(batch, {"framework": "trl"})   # per-token weight and keep
>>> analysis = iscore.analyze(batch, ["verl:decoupled_geo_rs"])
>>> analysis.settings[0].lr_scale
1.0
>>> best = iscore.recommend(batch, "skyrl").best.spec
>>> print(iscore.export(best, "skyrl").text.splitlines()[0])
trainer:
>>> iscore.diff("data/dense_bf16.parquet", "data/fp8.parquet").metric("k3").verdict
'worse'

`iscore.DumpWriter` writes the canonical Parquet dump from a training loop's own batch objects
(`add_batch`) or padded tensors (`add`);
`iscore.frameworks` is the registry of frameworks.
"""

import lazy_loader

# The public names, imported on first use from the folders' faces: `import iscore.cli` and
# `iscore --help` stay free of torch.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["frameworks"],
    submod_attrs={
        "advice": ["export", "recommend"],
        "dump": ["Dump", "DumpWriter", "StepRange", "load"],
        "errors": ["ConfigError", "DumpError", "IscoreError", "Problem"],
        "frameworks": ["Replay", "parse_config"],
        "packed": ["TokenBatch"],
        "passes": ["analyze", "diff", "replay", "why"],
    },
)
