"""prime-rl's token exports, `token_exports/step_{N}/rank_{R}.jsonl`.

With `trainer.enable_token_export=true` every trainer rank appends one JSON object per sequence
to `{output_dir}/token_exports/step_{N}/rank_{R}.jsonl` (multi-run:
`{output_dir}/{run_id}/token_exports/...`) and touches `STABLE` in the step's folder once every
rank has flushed it (`src/prime_rl/trainer/rl/token_export.py`). A record::

    {"schema_version": 1, "step": 12, "export_step": 12, "rank": 0, "micro_step": 3,
     "micro_sequence_idx": 1, "export_sequence_idx": 17, "run_id": null, "env_name": "math",
     "token_ids": [...], "position_ids": [...], "loss_mask": [...], "advantages": [...],
     "inference_logprobs": [...], "trainer_logprobs": [...], "entropy": [...],
     "mismatch_kl": [...], "importance_ratio": [...], "is_masked": [...], ...}

The per-token lists cover one whole sequence (prompt and completion; the exporter trims the
packing's padding) and align: value i belongs to token i. Non-finite floats are written as
null. `loss_mask` (true on the trained completion tokens) alone selects the tokens.

Canonical columns:

- `step`: `export_step` (the run's step; the trainer step in single-run exports), else
  `step`, else N of the `step_{N}` folder.
- `seq_id`: the string `"{rank}:{export_sequence_idx}"`, prefixed `"{run_id}/"` in multi-run
  exports. `export_sequence_idx` counts the records of one (run, step, rank) file, so with the
  rank it is unique within a step; line order stands in when a record lacks it.
- `rollout_logprob` <- `inference_logprobs`, `train_logprob` <- `trainer_logprobs` (nulls
  become NaN, which `iscore validate` reports), at the `loss_mask` positions, in order.
- `advantage` (per token) <- `advantages`, `token_id` <- `token_ids`, `entropy` <- `entropy`,
  when the first record has them (nulls become NaN).

Not read: the columns prime-rl derives from the two log-probs (`mismatch_kl`,
`importance_ratio`, `is_masked`, ...: iscore recomputes what it needs), `position_ids`,
`env_name`, rewards and loss weights. prime-rl's `trainer_logprobs` come from the training
forward itself, and its loss uses the inference log-probs as the behaviour policy: they are the
l_theta the `prime_rl` framework replays (`iscore.frameworks.prime_rl`), read as
`train_logprob`; its default loss takes the sign of each sequence's `advantage`, which this
reader keeps per token and a batch carries as the sequence's mean (prime-rl broadcasts one
advantage over a sequence's completion tokens, so the sign is the same).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from iscore.dump.importers import (
    ConvertedFile,
    File,
    as_floats,
    as_index,
    as_ints,
    as_mask,
    first_record,
    jsonl_records,
    require_lengths,
)
from iscore.dump.writer import canonical_table
from iscore.errors import DumpError, quote

DESCRIPTION = "prime-rl token_exports/step_{N}/rank_{R}.jsonl"
_FILE = re.compile(r"(?:^|/)step_(\d+)/rank_(\d+)\.jsonl$")
_LOGPROBS = {"inference_logprobs": "rollout_logprob", "trainer_logprobs": "train_logprob"}
_OPTIONAL = {"advantages": "advantage", "token_ids": "token_id", "entropy": "entropy"}


def claims(path: File) -> bool:
    """Whether `path` is a prime-rl token export: by its place, else by its first record."""
    if _FILE.search(path.as_posix()):
        return True
    if path.suffix != ".jsonl":
        return False
    record = first_record(path)
    return record is not None and all(key in record for key in _LOGPROBS)


def read_parts(paths: list[File], *, allow_pickle: bool = False) -> Iterator[ConvertedFile]:
    """Convert each file (one rank of one step) in turn; `allow_pickle` is irrelevant to JSON."""
    for path in paths:
        yield _read(path)


def _read(path: File) -> ConvertedFile:
    match = _FILE.search(path.as_posix())
    folder_step = file_rank = None
    if match:
        folder_step = as_index(int(match[1]), str(path), "the step of its folder")
        file_rank = as_index(int(match[2]), str(path), "the rank in its name")
    notes = []
    # On disk, the step's folder says whether prime-rl finished it; an upload has no folder.
    if match and isinstance(path, Path) and not (path.parent / "STABLE").exists():
        notes.append(
            f"{path.parent}: no STABLE marker; prime-rl may not have finished writing this step"
        )
    steps: list[int] = []
    ids: list[str] = []
    lengths: list[int] = []
    tokens: dict[str, list[np.ndarray]] = {}
    present: tuple[str, ...] = ()
    version = None
    first_line = 0
    for count, (line, record) in enumerate(jsonl_records(path)):
        where = f"{path}: line {line}"
        if not first_line:
            present, first_line = tuple(k for k in _OPTIONAL if k in record), line
            version = record.get("schema_version")
            if version is not None and type(version) is not int:
                found = quote(version, 60)
                raise DumpError(f"{where}: 'schema_version' must be an integer, found {found}")
        for key in ("loss_mask", *_LOGPROBS, *present):
            if key not in record:
                also = f", which line {first_line} has" if key in present else ""
                raise DumpError(f"{where}: missing key {quote(key)}{also}")
        rows = {"loss_mask": as_mask(record["loss_mask"], where, "loss_mask")}
        for key in (*_LOGPROBS, *present):
            if key == "token_ids":
                rows[key] = as_ints(record[key], where, key, np.int32)
            else:
                rows[key] = as_floats(record[key], where, key)
        require_lengths(where, rows, "loss_mask")
        selected = rows.pop("loss_mask")
        for key, values in rows.items():
            column = _LOGPROBS.get(key) or _OPTIONAL[key]
            tokens.setdefault(column, []).append(values[selected])
        steps.append(_step(record, folder_step, where))
        ids.append(_seq_id(record, file_rank, count, where))
        lengths.append(int(selected.sum()))
    if not ids:
        return ConvertedFile(str(path), None, version, (*notes, f"{path}: no records"))
    table = canonical_table(
        step=np.array(steps),
        seq_id=ids,
        lengths=np.array(lengths),
        tokens={k: np.concatenate(v) for k, v in tokens.items()},
    )
    return ConvertedFile(str(path), table, version, tuple(notes))


def _step(record: dict, folder_step: int | None, where: str) -> int:
    for key in ("export_step", "step"):
        value = record.get(key)
        if value is not None:
            return as_index(value, where, key)
    if folder_step is None:
        raise DumpError(f"{where}: no 'export_step' or 'step', and the file is not in step_{{N}}/")
    return folder_step


def _seq_id(record: dict, file_rank: int | None, count: int, where: str) -> str:
    rank = record.get("rank", file_rank)
    if rank is None:
        raise DumpError(f"{where}: no 'rank', and the file is not named rank_{{R}}.jsonl")
    rank = as_index(rank, where, "rank")
    index = as_index(record.get("export_sequence_idx", count), where, "export_sequence_idx")
    run_id = record.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise DumpError(f"{where}: 'run_id' must be a string or null, found {quote(run_id, 60)}")
    return f"{rank}:{index}" if run_id is None else f"{run_id}/{rank}:{index}"
