"""NeMo-RL's per-step training dump, `train_data_step{N}.jsonl`.

NeMo-RL's GRPO loop writes it every step by default (`nemo_rl/algorithms/grpo.py`, through
`Logger.log_batched_dict_as_jsonl`, which walks micro-batches of size 1 and so keeps the batch
dimension of every list). One JSON object per line, one line per sequence::

    {"content": ["..."], "rewards": [r], "input_lengths": [L], "token_ids": [[...]],
     "token_loss_mask": [[0, 0, 1, 1, 0]], "sample_loss_mask": [1.0], "advantages": [[...]],
     "generation_logprobs": [[...]], "prev_logprobs": [[...]], "idx": i}

(+ `agent_ref` and `filtered_rewards` in some configurations). The per-token lists span the
whole sequence, prompt and response, padded to the longest in the batch; the value at index i
belongs to token i (0 on prompt positions). `token_loss_mask` marks the tokens the loss uses:
the generated ones, not the prompt, tool output or padding. It alone selects the tokens here.

Canonical columns:

- `step`: N from the file name; `seq_id`: `idx` (the sequence's place in the step's batch),
  else the line order.
- `rollout_logprob` <- `generation_logprobs` (vLLM/SGLang), `train_logprob` <- `prev_logprobs`
  (the Megatron/DTensor recompute), at the `token_loss_mask` positions, in order.
- `loss_mask`: `sample_loss_mask` repeated over the sequence (0 for a sequence NeMo-RL leaves
  out of the loss, e.g. by `seq_logprob_error_threshold`); true when absent.
- `advantage` (per token) <- `advantages`, `token_id` <- `token_ids`, `reward` <- `rewards`,
  when the first line has them (every line must then have them).

Not read: `content`, `input_lengths`, `filtered_rewards`, `agent_ref`. Files from NeMo-RL
versions that did not log `token_loss_mask` are refused: without it the response could only be
told from the prompt by padding values. With `force_on_policy_ratio` NeMo-RL skips the
recompute and logs zeros as `prev_logprobs`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from iscore.dump.importers import (
    ConvertedFile,
    File,
    as_floats,
    as_index,
    as_ints,
    as_mask,
    as_number,
    first_record,
    jsonl_records,
    require_lengths,
)
from iscore.dump.writer import canonical_table
from iscore.errors import DumpError, quote

DESCRIPTION = "NeMo-RL train_data_step{N}.jsonl"
_FILE = re.compile(r"^train_data_step(\d+)\.jsonl$")
_LOGPROBS = {"generation_logprobs": "rollout_logprob", "prev_logprobs": "train_logprob"}
_OPTIONAL = ("token_ids", "advantages", "rewards", "sample_loss_mask")
_COLUMNS = {**_LOGPROBS, "advantages": "advantage", "token_ids": "token_id"}


def claims(path: File) -> bool:
    """Whether `path` is a NeMo-RL training dump: by name, else by its first record's keys."""
    if _FILE.match(path.name):
        return True
    if path.suffix != ".jsonl":
        return False
    record = first_record(path)
    return record is not None and all(key in record for key in _LOGPROBS)


def read_parts(paths: list[File], *, allow_pickle: bool = False) -> Iterator[ConvertedFile]:
    """Convert each file (one step) in turn; `allow_pickle` is irrelevant to JSON."""
    for path in paths:
        yield _read(path)


def _read(path: File) -> ConvertedFile:
    match = _FILE.match(path.name)
    if match is None:
        raise DumpError(
            f"{path}: cannot tell the step: NeMo-RL names its files train_data_step{{N}}.jsonl"
        )
    step = as_index(int(match.group(1)), str(path), "the step in its name")
    ids: list[int] = []
    lengths: list[int] = []
    tokens: dict[str, list[np.ndarray]] = {}
    sequences: dict[str, list[float]] = {"reward": []}
    present: tuple[str, ...] = ()
    first_line = 0
    for count, (line, record) in enumerate(jsonl_records(path)):
        where = f"{path}: line {line}"
        if not first_line:
            present, first_line = tuple(k for k in _OPTIONAL if k in record), line
        _require_keys(record, where, present, first_line)
        mask = as_mask(_row(record, "token_loss_mask", where), where, "token_loss_mask")
        rows = {"token_loss_mask": mask}
        for key in _LOGPROBS:
            rows[key] = as_floats(_row(record, key, where), where, key)
        if "advantages" in present:
            rows["advantages"] = as_floats(_row(record, "advantages", where), where, "advantages")
        if "token_ids" in present:
            token_ids = _row(record, "token_ids", where)
            rows["token_ids"] = as_ints(token_ids, where, "token_ids", np.int32)
        require_lengths(where, rows, "token_loss_mask")
        selected = rows.pop("token_loss_mask")
        n = int(selected.sum())
        for key, values in rows.items():
            tokens.setdefault(_COLUMNS[key], []).append(values[selected])
        keep = True
        if "sample_loss_mask" in present:
            flag = [_scalar(record, "sample_loss_mask", where)]
            keep = bool(as_mask(flag, where, "sample_loss_mask")[0])
        tokens.setdefault("loss_mask", []).append(np.full(n, keep))
        if "rewards" in present:
            sequences["reward"].append(_scalar(record, "rewards", where))
        ids.append(as_index(record.get("idx", count), where, "idx"))
        lengths.append(n)
    if not ids:
        return ConvertedFile(str(path), None, notes=(f"{path}: no records",))
    table = canonical_table(
        step=step,
        seq_id=ids,
        lengths=np.array(lengths),
        tokens={k: np.concatenate(v) for k, v in tokens.items()},
        sequences={k: v for k, v in sequences.items() if v},
    )
    return ConvertedFile(str(path), table)


def _require_keys(record: dict, where: str, present: tuple[str, ...], first_line: int) -> None:
    if "token_loss_mask" not in record:
        raise DumpError(
            f"{where}: missing key 'token_loss_mask'; NeMo-RL versions that do not log it "
            "cannot be read, since only the mask tells the response from the prompt"
        )
    for key in (*_LOGPROBS, *present):
        if key not in record:
            also = f", which line {first_line} has" if key in present else ""
            raise DumpError(f"{where}: missing key {quote(key)}{also}")


def _row(record: dict, key: str, where: str) -> list:
    """A per-token list, unwrapped from NeMo-RL's batch dimension of 1 ([[...]])."""
    value = record[key]
    if not isinstance(value, list):
        raise DumpError(
            f"{where}: {quote(key)} must be a list ([[...]]), found {type(value).__name__}"
        )
    if value and isinstance(value[0], list):
        if len(value) != 1:
            raise DumpError(
                f"{where}: {quote(key)} has a batch dimension of {len(value)}; NeMo-RL writes one "
                "sequence per line ([[...]])"
            )
        return value[0]
    return value  # already one row: accepted, nothing about it is ambiguous


def _scalar(record: dict, key: str, where: str) -> float:
    """A per-sequence number, unwrapped from its batch dimension of 1 ([x])."""
    value = record[key]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return as_number(value, where, key)
