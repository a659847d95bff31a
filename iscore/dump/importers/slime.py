"""slime's train-side debug dumps (`--save-debug-train-data`, `--dump-details`), `.pt` files.

Format version 2 (slime since Aug 2026, `slime/observability/train_data_utils.py`): one file
per rollout, written by the last pipeline stage's TP0/CP0 rank after re-assembling
context-parallel shards, samples in rollout order::

    {"format_version": 2, "rollout_id": 7, "rank": 0, "raw_reward": [...], "dp_shards": [...],
     "samples": [{"sample_index": 12, "rollout_position": 3, "data_parallel_rank": 0,
                  "tokens": LongTensor[total_length], "response_lengths": 40,
                  "loss_masks": IntTensor[40], "rollout_log_probs": FloatTensor[40],
                  "log_probs": FloatTensor[40], "advantages": FloatTensor[40], ...}, ...]}

The older layout (Jul 2025 - Aug 2026) is one file per rank,
`{"rollout_id", "rank", "rollout_data": {key: one entry per sample}}`, with `partition` (each
sample's place in the rollout) and `sample_indices`. Every rank wrote one: tensor-parallel
replicas repeat samples (each is read once; the report counts the repeats), earlier pipeline
stages hold no `log_probs` (their files are skipped, with a note), and context-parallel ranks
hold shards of the response fields, which iscore cannot reassemble (refused).

Files are loaded only with `torch.load(path, weights_only=True, map_location="cpu")`, as
slime's own e2e test loads them; a file that needs more is refused, never unpickled.

Canonical columns, per sample (response-token fields are 1-D, `response_lengths` long, and
cover the response only, so every position is a token):

- `step`: `rollout_id`; `seq_id`: `sample_index` (slime's `Sample.index`), else
  `rollout_position`.
- `rollout_logprob` <- `rollout_log_probs` (SGLang), `train_logprob` <- `log_probs` (the
  Megatron recompute, or a snapshot of the training forward when the recompute is skipped).
- `loss_mask` <- `loss_masks` (true when absent); `token_id`: the last `response_lengths` of
  `tokens` (prompt + response); `advantage` (per token) <- `advantages`; `entropy`.
- `reward`: the reward before slime's post-processing: `local_raw_reward`, else
  `raw_reward[rollout_position]` (`raw_reward` spans the whole rollout), else the rollout
  dump's `reward`. The per-sample `rewards` are post-processed (e.g. group-normalized for
  GRPO) and not read.
- `group_id`: the prompt group (`group_index`), which only the rollout dump holds
  (`--dump-details DIR` writes `DIR/rollout_data/{rollout_id}.pt` beside `DIR/train_data/`).
  slime pickles that file's Sample dicts and loads it with `weights_only=False`, so iscore
  opens it only with `allow_pickle=True`, and even then with `weights_only=True` plus numpy
  arrays: no arbitrary callable runs. Joined on `rollout_position` (the sample's place in the
  rollout dump), checked against `sample_index` == `index`. Without `allow_pickle` the
  conversion goes on without `group_id` and its notes say so.
"""

from __future__ import annotations

import math
import pickle
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from iscore.dump.importers import (
    ConvertedFile,
    File,
    as_floats,
    as_index,
    as_ints,
    as_mask,
    load_weights_only,
    open_binary,
    unpickling_detail,
)
from iscore.dump.writer import canonical_table
from iscore.errors import DumpError, counted, quote

DESCRIPTION = "slime train dump (.pt from --save-debug-train-data or --dump-details)"
_PER_TOKEN = {"advantages": "advantage", "entropy": "entropy"}
_COLUMNS = {
    "rollout_log_probs": "rollout_logprob",
    "log_probs": "train_logprob",
    "loss_masks": "loss_mask",
    "tokens": "token_id",
    **_PER_TOKEN,
}
_ROLLOUT_DUMP = (
    "{path}: this is slime's rollout dump (--save-debug-rollout-data), which has no trainer "
    "log-probs; convert the train dump (--save-debug-train-data, or DIR/train_data/ of "
    "--dump-details)"
)
_ROLLOUT_NOTE = (
    "group_id not imported: it lives only in slime's rollout dumps "
    "(DIR/rollout_data/{rollout_id}.pt), which are general pickles; pass allow_pickle=True "
    "(--allow-pickle) to join them"
)


def claims(path: File) -> bool:
    """Whether `path` is a slime train dump, from the key names in its pickle (not unpickled).

    The rollout dump (`samples` of Sample dicts) and eval dumps are not claimed.
    """
    head = _head(path)
    return b"format_version" in head or b"rollout_data" in head


def _head(path: File) -> bytes:
    """The pickled structure of a `.pt` file, as bytes: key names show, nothing is run."""
    if path.suffix != ".pt":
        return b""
    # The top-level keys come first (slime's dicts start with format_version, or rollout_id
    # and rank before rollout_data; a rollout dump's first sample shows group_index), so a
    # prefix suffices, however many samples follow.
    size = 1 << 20
    try:
        with open_binary(path) as f:
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as archive:
                    # data.pkl holds the object structure; tensors are separate entries.
                    name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
                    if name is None:
                        return b""
                    with archive.open(name) as member:
                        return member.read(size)
            f.seek(0)
            return f.read(size)  # the legacy format pickles the structure first
    except (
        OSError,
        EOFError,
        ValueError,
        RuntimeError,
        NotImplementedError,
        zipfile.BadZipFile,
        zlib.error,
    ):
        return b""  # a damaged archive claims nothing; reading it says what is wrong


def read_parts(paths: list[File], *, allow_pickle: bool = False) -> Iterator[ConvertedFile]:
    """Convert each file (a rollout, or one rank of it in the older layout) in turn.

    Args:
        paths: the train dump files.
        allow_pickle: also open the rollout dumps beside them (on disk), for `group_id`.
    """
    seen: set[tuple[int, int]] = set()  # (rollout, sample) already read, across rank files
    for path in paths:
        yield _read(path, allow_pickle, seen)


def _load(path: File, *, rollout_dump: bool = False) -> object:
    """torch.load with weights_only=True; the rollout dump also gets numpy arrays."""
    allowed = _numpy_globals() if rollout_dump else []
    try:
        with open_binary(path) as f:
            magic = f.read(2)
    except OSError as e:
        raise DumpError(f"{path}: cannot read it ({e})") from None
    # A zip archive, or a legacy torch.save (pickle protocol 2: 0x80 0x02): anything else is
    # no torch file, and its parse errors would only confuse the refusal messages below.
    if magic not in (b"PK", b"\x80\x02"):
        raise DumpError(f"{path}: not a file torch.save wrote (neither a zip archive nor a pickle)")
    try:
        with open_binary(path) as f:
            return load_weights_only(f, allowed)
    except pickle.UnpicklingError as e:
        if rollout_dump:
            raise DumpError(
                f"{path}: holds objects iscore does not rebuild, even with allow_pickle "
                f"({unpickling_detail(e)}); it loads tensors, numpy arrays and plain containers"
            ) from None
        raise DumpError(
            f"{path}: torch.load(weights_only=True) refused it ({unpickling_detail(e)}); iscore "
            "never unpickles arbitrary objects from a train dump. Save it again holding only "
            "tensors, lists, dicts, strings and numbers"
        ) from None
    except Exception as e:
        # A damaged file fails torch.load in any way (IndexError, KeyError, struct.error, ...
        # from its legacy format); nothing of iscore's runs inside it, and the weights-only
        # unpickler calls no arbitrary code.
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise DumpError(f"{path}: not a file torch.save wrote ({why})") from None


def _numpy_globals() -> list:
    """What numpy arrays and scalars need under weights_only, by numpy 1 and 2 names."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    allowed: list = [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar]
    for prefix in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed += [(multiarray._reconstruct, f"{prefix}._reconstruct")]
        allowed += [(multiarray.scalar, f"{prefix}.scalar")]
    # numpy 2 pickles a dtype through its class (numpy.dtypes.Float32DType, ...).
    return allowed + [
        cls for cls in vars(np.dtypes).values() if isinstance(cls, type) and cls is not np.dtype
    ]


def _samples(payload: object, path: File) -> tuple[list[dict], object, int | None, bool]:
    """(samples, raw_reward, format_version, older layout) of a loaded train dump."""
    if not isinstance(payload, dict):
        raise DumpError(
            f"{path}: expected a dict (slime torch.saves one), found {type(payload).__name__}"
        )
    if "format_version" in payload:
        if payload["format_version"] != 2:
            raise DumpError(
                f"{path}: format_version {quote(payload['format_version'])}; iscore reads slime's "
                "format_version 2 and the older per-rank layout"
            )
        samples = payload.get("samples")
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise DumpError(f"{path}: 'samples' must be a list of dicts (format_version 2)")
        return samples, payload.get("raw_reward"), 2, False
    if "rollout_data" in payload:
        return (*_transpose(payload["rollout_data"], path), None, True)
    if "samples" in payload:
        raise DumpError(_ROLLOUT_DUMP.format(path=path))
    raise DumpError(
        f"{path}: neither slime's format_version 2 train dump (keys format_version, samples) "
        f"nor its older per-rank layout (key rollout_data); found keys {sorted(map(str, payload))}"
    )


def _transpose(data: object, path: File) -> tuple[list[dict], object]:
    """The older layout's {key: list over samples} as one dict per sample, v2's names."""
    if not isinstance(data, dict) or not _per_sample(data.get("response_lengths")):
        raise DumpError(f"{path}: 'rollout_data' must be a dict with a 'response_lengths' list")
    count = len(data["response_lengths"])
    renamed = {"sample_indices": "sample_index", "partition": "rollout_position"}
    samples: list[dict] = [{} for _ in range(count)]
    for key, values in data.items():
        # raw_reward spans the whole rollout (indexed by position), not this rank's samples.
        if key == "raw_reward" or not _per_sample(values):
            continue
        if len(values) == count:
            for sample, value in zip(samples, values, strict=True):
                sample[renamed.get(key, key)] = value
        elif key in _READ:  # a record cut short: its samples would be read without it
            raise DumpError(
                f"{path}: rollout_data {quote(key)} has {counted(len(values), 'entry', 'entries')} "
                f"but 'response_lengths' has {count}; every field holds one per sample"
            )
    return samples, data.get("raw_reward")


_READ = {*_COLUMNS, "response_lengths", "sample_indices", "partition", "local_raw_reward"}
"""The older layout's per-sample fields iscore reads."""


def _per_sample(values: object) -> bool:
    return isinstance(values, list | tuple) or (
        isinstance(values, torch.Tensor) and values.dim() >= 1
    )


def _numpy(value: object) -> object:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return (value.double() if value.is_floating_point() else value).numpy()
    return value


def _read(path: File, allow_pickle: bool, seen: set[tuple[int, int]]) -> ConvertedFile:
    if not claims(path) and b"group_index" in _head(path):
        raise DumpError(_ROLLOUT_DUMP.format(path=path))
    payload = _load(path)
    samples, raw_reward, version, older = _samples(payload, path)
    rollout_id = as_index(_numpy(payload.get("rollout_id")), str(path), "rollout_id")
    notes: list[str] = []
    if older and samples and all("log_probs" not in s for s in samples):
        notes.append(
            f"{path}: no log_probs (written by a rank of an earlier pipeline stage); skipped"
        )
        return ConvertedFile(str(path), None, version, tuple(notes))
    joined = _rollout_samples(path, rollout_id, allow_pickle, notes)
    columns = _Columns(older)
    repeats = 0
    for i, sample in enumerate(samples):
        where = f"{path}: sample {i}"
        index, position = sample.get("sample_index"), sample.get("rollout_position")
        if index is not None:
            index = as_index(_numpy(index), where, "sample_index")
            where += f" (sample_index {index})"
        if position is not None:
            position = as_index(_numpy(position), where, "rollout_position")
        seq_id = index if index is not None else position
        if seq_id is None:
            raise DumpError(f"{where}: neither 'sample_index' nor 'rollout_position' is set")
        key = (rollout_id, seq_id)
        if key in seen:
            if not older:
                raise DumpError(f"{where}: sample {seq_id} of rollout {rollout_id} read twice")
            repeats += 1  # a tensor-parallel replica's copy
            continue
        seen.add(key)
        columns.add(sample, seq_id, where)
        columns.reward.append(_reward(sample, raw_reward, position, joined))
        if joined is not None:
            columns.group.append(_group(joined, index, position, where))
    if repeats:
        notes.append(f"{path}: {repeats} samples already read from another rank's file; skipped")
    table = columns.table(rollout_id, notes)
    return ConvertedFile(str(path), table, version, tuple(notes))


class _Columns:
    """One file's samples, gathered for `canonical_table`."""

    def __init__(self, older: bool):
        self.older = older
        self.ids: list[int] = []
        self.lengths: list[int] = []
        self.tokens: dict[str, list[np.ndarray]] = {}
        self.reward: list[float | None] = []
        self.group: list[object] = []
        self.optional: tuple[str, ...] | None = None  # fixed by the first sample
        self.first = ""

    def add(self, sample: dict, seq_id: int, where: str) -> None:
        if self.optional is None:
            self.optional = tuple(k for k in ("tokens", *_PER_TOKEN) if k in sample)
            self.first = where
        for key in ("response_lengths", "rollout_log_probs", "log_probs", *self.optional):
            if sample.get(key) is None:
                also = f", which {self.first} has" if key in self.optional else ""
                raise DumpError(f"{where}: no {quote(key)}{also}")
        n = as_index(_numpy(sample["response_lengths"]), where, "response_lengths")
        floats = ("rollout_log_probs", "log_probs", *(k for k in _PER_TOKEN if k in self.optional))
        rows = {key: as_floats(_numpy(sample[key]), where, key) for key in floats}
        if "loss_masks" in sample:
            rows["loss_masks"] = as_mask(_numpy(sample["loss_masks"]), where, "loss_masks")
        else:
            rows["loss_masks"] = np.ones(n, dtype=bool)
        for key, values in rows.items():
            if values.size != n:
                cp = (
                    "; this older per-rank layout holds context-parallel shards, which iscore "
                    "cannot reassemble: dump again with slime's format_version 2"
                    if self.older
                    else ""
                )
                raise DumpError(
                    f"{where}: {quote(key)} has {values.size} values but response_lengths is "
                    f"{n}{cp}"
                )
        if "tokens" in self.optional:
            tokens = as_ints(_numpy(sample["tokens"]), where, "tokens", np.int32)
            if tokens.size < n:
                raise DumpError(
                    f"{where}: 'tokens' has {tokens.size} ids, fewer than response_lengths {n}"
                )
            rows["tokens"] = tokens[tokens.size - n :]
        for key, values in rows.items():
            self.tokens.setdefault(_COLUMNS[key], []).append(values)
        self.ids.append(seq_id)
        self.lengths.append(n)

    def table(self, rollout_id: int, notes: list[str]) -> pa.Table | None:
        """The canonical table, or None without samples; notes what was left out."""
        if not self.ids:
            return None
        sequences: dict[str, list] = {}
        if all(r is not None for r in self.reward):
            sequences["reward"] = self.reward
        elif any(r is not None for r in self.reward):
            notes.append("reward not imported: only some samples have a numeric raw_reward")
        if self.group:
            if all(isinstance(g, int) and not isinstance(g, bool) for g in self.group):
                sequences["group_id"] = self.group
            else:
                notes.append("group_id not imported: the rollout dump lacks some group_index")
        return canonical_table(
            step=rollout_id,
            seq_id=self.ids,
            lengths=np.array(self.lengths),
            tokens={k: np.concatenate(v) for k, v in self.tokens.items()},
            sequences=sequences,
        )


def _rollout_samples(
    path: File, rollout_id: int, allow_pickle: bool, notes: list[str]
) -> list[dict] | None:
    """The rollout dump's samples beside a --dump-details train dump on disk, if any and
    allowed (a file held in memory has nothing beside it)."""
    if not isinstance(path, Path) or path.parent.name != "train_data":
        return None
    other = path.parent.parent / "rollout_data" / f"{rollout_id}.pt"
    if not other.is_file():
        return None
    if not allow_pickle:
        notes.append(_ROLLOUT_NOTE)
        return None
    payload = _load(other, rollout_dump=True)
    samples = payload.get("samples") if isinstance(payload, dict) else None
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise DumpError(f"{other}: expected slime's rollout dump, a dict with a list of samples")
    return samples


def _scalar(value: object) -> float | None:
    """A reward as a float (an integer beyond float64's range infinite); None if it is not
    one real number."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic) and np.size(value) == 1:
        value = np.asarray(_numpy(value)).item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _reward(
    sample: dict, raw_reward: object, position: object, joined: list[dict] | None
) -> float | None:
    """The sample's reward before post-processing (None if the dumps do not say).

    From its `local_raw_reward` (slime's DP-local copy), else the rollout-wide `raw_reward`
    at its position, else the rollout dump's `reward`.
    """
    if sample.get("local_raw_reward") is not None:
        return _scalar(sample["local_raw_reward"])
    if not isinstance(position, int) or position < 0:
        return None
    if _per_sample(raw_reward) and position < len(raw_reward):
        return _scalar(raw_reward[position])
    if joined is not None and position < len(joined):
        return _scalar(joined[position].get("reward"))
    return None


def _group(joined: list[dict], index: int | None, position: int | None, where: str) -> object:
    """The sample's group_index in the rollout dump, checking the two dumps belong together."""
    if position is None or not position < len(joined):
        raise DumpError(
            f"{where}: rollout_position {quote(position)} is not a sample of the rollout dump "
            f"({len(joined)} samples)"
        )
    other = joined[position]
    expected = other.get("index")
    if expected is not None:
        expected = as_index(_numpy(expected), f"{where}: the rollout dump's sample", "index")
    if index is not None and expected is not None and index != expected:
        raise DumpError(
            f"{where}: the rollout dump's sample {position} has index {expected}, not "
            f"{index}: the two dumps are not of the same rollout"
        )
    return other.get("group_index")
