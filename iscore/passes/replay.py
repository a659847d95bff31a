"""Replay one setting over a dump: per token, the weight multiplying its loss and whether it
stays in the loss (`replay` of a batch in memory, `write_replay` of a streamed dump into a
Parquet file, what `iscore replay` writes).

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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from iscore.dump import Data, Dump, load_data
from iscore.errors import ConfigError, IscoreError, clip
from iscore.frameworks import Replay, Setting, Spec, resolve
from iscore.utils import output_path


def replay(data: Data, config: Setting) -> Replay:
    """Replay one correction setting over a dump held in memory.

    Args:
        data: the dump: a loaded batch (any device), or what `iscore.load` takes.
        config: a spec, a framework config mapping, a preset name (`verl:decoupled_geo_rs`)
            or the path of a YAML config: what `iscore.frameworks.resolve.resolve` takes.

    Raises:
        ConfigError: the config is invalid, or the setting cannot replay this dump (e.g. it
            needs a column the dump lacks); the message starts with `framework:name`.

    >>> import iscore
    >>> r = replay(iscore.load("data/fp8.parquet"), {"framework": "fireworks", "tis": {"cap": 2}})
    >>> float(r.weight.max()) <= 2.0, r.keep.shape == r.weight.shape
    (True, True)
    >>> replay(iscore.load("data/fp8.parquet"), "verl:bypass_ppo_clip")
    Traceback (most recent call last):
    iscore.errors.ConfigError: verl:bypass_ppo_clip: `algorithm.rollout_correction.bypass_mode...
    """
    spec = resolve(config)
    batch = load_data(data)
    try:
        return spec.replay(batch)
    except ConfigError as e:
        raise ConfigError(f"{spec.framework}:{clip(spec.name)}: {e}") from e


@dataclass(frozen=True, slots=True)
class Written:
    """What `write_replay` wrote: its rows (the dump's tokens), those kept in the loss and
    those kept with weight 0."""

    tokens: int
    kept: int
    zero: int


def write_replay(
    dump: Dump,
    spec: Spec,
    path: str | Path,
    *,
    max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> Written:
    """Replay `spec` over `dump`, chunk by chunk, into the Parquet file `path`: one row per
    token in the dump's order (`Replay.to_arrow`); the file appears only when every chunk
    replayed.

    Args:
        dump: the dump, streamed in chunks of whole training steps (batch-normalizing
            settings divide by a step's mean weight).
        spec: the setting.
        path: the output file (`.parquet`).
        max_tokens: tokens per chunk.
        progress: called with the tokens of each chunk done.

    Raises:
        IscoreError: the dump has nothing to replay, or the output cannot be written.
        ConfigError: the setting cannot replay this dump (`replay`).
    """
    tokens = kept = zero = 0
    with output_path(path, suffixes=(".parquet",)) as tmp:
        writer = None
        for batch in dump.batches(max_tokens=max_tokens, whole_steps=True):
            result = replay(batch, spec)
            table = result.to_arrow(batch)
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
            writer.write_table(table)
            tokens += batch.num_tokens
            kept += int(result.keep.sum())
            zero += int((result.keep & (result.weight == 0)).sum())
            if progress is not None:
                progress(batch.num_tokens)
        if writer is None:
            raise IscoreError(f"{dump.files[0].path}: {dump.why_empty()}; nothing written")
        writer.close()
    return Written(tokens, kept, zero)
