"""SkyRL's training-batch dump, `global_step_{N}_training_input.pkl`.

With `trainer.dump_data_batch=true`, SkyRL's trainer pickles each step's `TrainingInputBatch`
to `{trainer.export_path}/dumped_data/global_step_{N}_training_input.pkl`, after computing
advantages and before training (`skyrl/train/trainer.py`, `dump_data`; `TensorBatch.save` is
a plain `pickle.dump`). The batch is a dict of tensors plus `metadata`:

- `sequences` [B, S]: prompt + response token ids, left-padded; `attention_mask` [B, S].
- response-level [B, R], RIGHT-aligned, padding on the left
  (`convert_prompts_responses_to_batch_tensors`): `response_mask` (1 = response token),
  `loss_mask` (1 = trained; 0 e.g. on tool output), `rollout_logprobs` (vLLM; None without
  `generator.sampling_params.logprobs`), `action_log_probs` (the trainer's forward before the
  update), `base_action_log_probs`, `values`, `advantages`, `returns`, `kl`, ...
- `metadata`: `pad_size` (rows appended so the batch divides by the data-parallel size:
  copies of row 0 with a zero loss mask), `policy_prompt_boundaries` ((start, end) rows of
  each prompt), `response_length`, `avg_response_length`, ... SkyRL drops `uids` and
  `rewards` before dumping, so there is no reward.

Canonical columns:

- `step`: N from the file name; `seq_id`: the row, 0..B-1 without the `pad_size` padding rows.
- `rollout_logprob` <- `rollout_logprobs`, `train_logprob` <- `action_log_probs`, at the
  `response_mask` positions in order (at the `loss_mask` ones when there is no
  `response_mask`); `loss_mask` <- `loss_mask` there.
- `token_id`: the last R columns of `sequences` at the same positions (a row's response ends
  both); `advantage` (per token) <- `advantages`; `group_id`: the prompt's index in
  `policy_prompt_boundaries`, when the batch has them.

Safety. A pickle can run any code while it loads, so these files are read only with
`allow_pickle=True`, and then by `_Unpickler`, which needs neither SkyRL nor trust: its
`find_class` resolves exactly the names below and refuses every other, so even with the flag
no arbitrary callable runs (not `os.system`, not `builtins.eval`, not a SkyRL function).

- `TrainingInputBatch`, `TensorBatch`, `TrainingOutputBatch` and `_rebuild_tensor_batch` of
  `skyrl.backends.skyrl_train.training_batch` (and of the older `skyrl_train.training_batch`)
  resolve to `_Batch` and `_rebuild_batch`: a plain dict stand-in whose `__setstate__` decodes
  SkyRL's tensor state itself: `{"format": "numpy", "data", "shape", "dtype"}` with
  `np.frombuffer` (numeric dtypes only), `{"format": "torch", "data"}` and the older raw
  `torch.save` bytes with `torch.load(weights_only=True)`, and tensor lists.
- `torch._utils._rebuild_tensor_v2` (refusing backward hooks) and `torch.storage.
  _load_from_bytes`, replaced by `torch.load(weights_only=True)` of the storage bytes (torch's
  own would unpickle them freely): tensors pickled directly, as a batch's dict items were
  before SkyRL defined `TensorBatch.__reduce__` (Mar 2026).
- `torch.device` (the batch's device) and `collections.OrderedDict` (a tensor's hook dict).

Dicts, lists, tuples, strings, numbers and bytes are pickle opcodes, not globals: they need
no allowance and run nothing.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import torch

from iscore.dump.importers import (
    ConvertedFile,
    File,
    as_index,
    load_weights_only,
    open_binary,
    unpickling_detail,
)
from iscore.dump.writer import canonical_table
from iscore.errors import DumpError, quote

DESCRIPTION = "SkyRL global_step_{N}_training_input.pkl"
_FILE = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
_MODULES = ("skyrl.backends.skyrl_train.training_batch", "skyrl_train.training_batch")
_RESPONSE = (
    "response_mask",
    "loss_mask",
    "rollout_logprobs",
    "action_log_probs",
    "advantages",
)
"""The [B, R] fields read; each must have the shape of `rollout_logprobs`."""


def claims(path: File) -> bool:
    """Whether `path` is a SkyRL batch dump: by name, else by the class its pickle names first."""
    if _FILE.match(path.name):
        return True
    if path.suffix != ".pkl":
        return False
    try:
        with open_binary(path) as f:
            head = f.read(4096)  # the batch's global is the first thing pickled
    except OSError:
        return False
    return b"training_batch" in head and b"Batch" in head


def read_parts(paths: list[File], *, allow_pickle: bool = False) -> Iterator[ConvertedFile]:
    """Convert each file (one step) in turn.

    Raises:
        DumpError: `allow_pickle` is false (the files are pickles), or a file is malformed
            or names a global the restricted unpickler refuses.
    """
    if paths and not allow_pickle:  # before reading: no file is at fault
        raise DumpError(
            f"{paths[0]}: a pickle (SkyRL's TrainingInputBatch); loading a pickle can run "
            "code, so iscore reads one only when asked: pass --allow-pickle (Python: "
            "allow_pickle=True). Even then it rebuilds only SkyRL's batch, torch tensors "
            "and plain containers"
        )
    return (_part(path) for path in paths)


def _part(path: File) -> ConvertedFile:
    table, notes = _table(path, _unpickle(path))
    return ConvertedFile(str(path), table, notes=notes)


class _Batch(dict):
    """Stand-in for SkyRL's TensorBatch classes: the tensors (by field) and `metadata`."""

    metadata: dict | None = None

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("batch_dict"), dict):
            raise pickle.UnpicklingError("a TensorBatch whose state has no 'batch_dict' dict")
        # Replaces any raw tensors the older dict-subclass pickles set item by item first.
        self.clear()
        for key, value in state["batch_dict"].items():
            self[key] = _decode(value, key)
        metadata = state.get("metadata")
        self.metadata = metadata if isinstance(metadata, dict) else None


def _rebuild_batch(cls: object, state: object) -> _Batch:
    """Stand-in for SkyRL's `_rebuild_tensor_batch(cls, state)`."""
    if cls is not _Batch:
        raise pickle.UnpicklingError(f"_rebuild_tensor_batch of {quote(cls)}, not a SkyRL batch")
    batch = _Batch()
    batch.__setstate__(state)
    return batch


def _decode(value: object, key: str) -> object:
    """One field of SkyRL's serialized batch state: a tensor as numpy, a list, or None."""
    if value is None:
        return None
    if isinstance(value, bytes):  # before Jan 2026: torch.save of each tensor
        return _torch_bytes(value, key)
    if not isinstance(value, dict):
        raise pickle.UnpicklingError(f"field {quote(key)}: unexpected {type(value).__name__}")
    kind = value.get("format", "numpy")  # the first numpy states had no "format"
    if kind == "tensor_list":
        return [_decode(item, key) for item in value.get("items", ())]
    if kind == "torch":
        return _torch_bytes(value.get("data"), key)
    if kind != "numpy":
        raise pickle.UnpicklingError(f"field {quote(key)}: unknown tensor format {quote(kind)}")
    dtype = np.dtype(str(value.get("dtype")))
    if dtype.kind not in "biuf":
        raise pickle.UnpicklingError(f"field {quote(key)}: refused dtype {dtype}")
    shape = tuple(int(d) for d in value.get("shape", ()))
    return np.frombuffer(value.get("data"), dtype=dtype).reshape(shape)


def _torch_bytes(data: object, key: str) -> object:
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError(f"field {quote(key)}: tensor bytes expected")
    try:
        value = load_weights_only(io.BytesIO(data))
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"field {quote(key)}: torch.load(weights_only=True) refused its bytes "
            f"({unpickling_detail(e)})"
        ) from None
    if value is not None and not isinstance(value, torch.Tensor):
        raise pickle.UnpicklingError(f"field {quote(key)}: {type(value).__name__}, not a tensor")
    return value if value is None else _own_values(value)


def _own_values(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, unless it claims more values than its storage holds (a stride of 0 repeats
    one value over any shape: a [2^20, 2^20] tensor over 4 bytes, which numpy would then
    allocate in full). SkyRL saves tensors that hold their own values."""
    needed = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if needed > held:
        raise pickle.UnpicklingError(
            f"a tensor of shape {list(tensor.shape)} ({needed:,} bytes) over a storage of "
            f"{held:,} bytes: its values repeat (a stride of 0); iscore reads tensors that "
            "hold their own values"
        )
    return tensor


def _rebuild_tensor(
    storage: object,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    hooks: object,
    metadata: object = None,
) -> torch.Tensor:
    """torch's `_rebuild_tensor_v2`, for storages `_load_storage` built, without hooks."""
    if not isinstance(storage, torch.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"a tensor over {type(storage).__name__}, not a storage")
    if hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks")
    tensor = torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())
    return _own_values(tensor)


def _load_storage(data: object) -> object:
    """`torch.storage._load_from_bytes` without its unrestricted unpickling."""
    if not isinstance(data, bytes):
        raise pickle.UnpicklingError("tensor storage bytes expected")
    try:
        storage = load_weights_only(io.BytesIO(data))
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(f"tensor storage refused ({unpickling_detail(e)})") from None
    if not isinstance(storage, torch.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError(f"tensor storage bytes hold a {type(storage).__name__}")
    return storage


_ALLOWED = {
    **{(m, n): _Batch for m in _MODULES for n in ("TrainingInputBatch", "TensorBatch")},
    **{(m, "TrainingOutputBatch"): _Batch for m in _MODULES},
    **{(m, "_rebuild_tensor_batch"): _rebuild_batch for m in _MODULES},
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): OrderedDict,
}
"""Every global the restricted unpickler resolves; the module docstring says why each."""


class _Unpickler(pickle.Unpickler):
    """Resolves only `_ALLOWED`; every other global is refused before anything calls it."""

    def find_class(self, module: str, name: str) -> object:
        target = _ALLOWED.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: iscore's restricted unpickler rebuilds only "
                "SkyRL's batch classes, torch tensors and plain containers"
            )
        return target


def _unpickle(path: File) -> _Batch:
    try:
        with open_binary(path) as f:
            batch = _Unpickler(f).load()
    except (pickle.UnpicklingError, EOFError) as e:
        raise DumpError(f"{path}: {e}") from None
    except Exception as e:
        # Only the allowed callables ran, on hostile input: a malformed stream (wrong arguments
        # to an allowed callable, a bad memo index, a damaged torch.save inside: struct.error,
        # ..., a size beyond memory).
        raise DumpError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(batch, _Batch):
        raise DumpError(
            f"{path}: expected SkyRL's TrainingInputBatch, found {type(batch).__name__}"
        )
    return batch


def _array(value: object, path: File, key: str) -> np.ndarray:
    """A [B, R] or [B, S] field as numpy: a tensor, or an array SkyRL's numpy format held."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.float()  # bf16: numpy has none
        return value.numpy()
    if not isinstance(value, np.ndarray):  # a tensor list, say: SkyRL's fields are tensors
        raise DumpError(f"{path}: {quote(key)} must be a tensor, found {type(value).__name__}")
    return value


def _table(path: File, batch: _Batch) -> tuple[pa.Table, tuple[str, ...]]:
    """The batch's canonical table, and notes on what was left out."""
    match = _FILE.match(path.name)
    if match is None:
        raise DumpError(
            f"{path}: cannot tell the step: SkyRL names its files "
            "global_step_{N}_training_input.pkl"
        )
    for key in ("rollout_logprobs", "action_log_probs"):
        if batch.get(key) is None:
            hint = (
                "; SkyRL logged no rollout log-probs (generator.sampling_params.logprobs)"
                if key == "rollout_logprobs"
                else ""
            )
            raise DumpError(f"{path}: the batch has no {quote(key)}{hint}")
    fields = {k: _array(batch[k], path, k) for k in _RESPONSE if batch.get(k) is not None}
    shape = fields["rollout_logprobs"].shape
    if len(shape) != 2:
        raise DumpError(f"{path}: 'rollout_logprobs' must be [B, R], found {list(shape)}")
    for key, array in fields.items():
        if array.shape != shape:
            raise DumpError(
                f"{path}: {quote(key)} has shape {list(array.shape)} but 'rollout_logprobs' has "
                f"{list(shape)}"
            )
    selector = "response_mask" if "response_mask" in fields else "loss_mask"
    if selector not in fields:
        raise DumpError(f"{path}: the batch has neither 'response_mask' nor 'loss_mask'")
    for key in ("response_mask", "loss_mask"):
        odd = fields[key][(fields[key] != 0) & (fields[key] != 1)] if key in fields else ()
        if len(odd):
            raise DumpError(f"{path}: {quote(key)} must hold 0 or 1, found {odd[0].item()}")
    metadata = batch.metadata or {}
    pad = metadata.get("pad_size") or 0
    if type(pad) is not int or not 0 <= pad <= shape[0]:
        raise DumpError(f"{path}: metadata pad_size {quote(pad)} is not a row count <= {shape[0]}")
    rows = shape[0] - pad
    selected = fields[selector][:rows] != 0
    loss_mask = fields.get("loss_mask", np.ones(shape))[:rows] != 0
    tokens = {
        "rollout_logprob": fields["rollout_logprobs"][:rows][selected],
        "train_logprob": fields["action_log_probs"][:rows][selected],
        "loss_mask": loss_mask[selected],
    }
    if "advantages" in fields:
        tokens["advantage"] = fields["advantages"][:rows][selected]
    if batch.get("sequences") is not None:
        sequences = _array(batch["sequences"], path, "sequences")
        if sequences.ndim != 2 or sequences.shape[0] != shape[0] or sequences.shape[1] < shape[1]:
            raise DumpError(
                f"{path}: 'sequences' has shape {list(sequences.shape)}; expected "
                f"[{shape[0]}, S] with S >= {shape[1]}"
            )
        tokens["token_id"] = sequences[:rows, sequences.shape[1] - shape[1] :][selected]
    groups, notes = _groups(metadata.get("policy_prompt_boundaries"), rows, shape[0])
    table = canonical_table(
        step=as_index(int(match.group(1)), str(path), "the step in its name"),
        seq_id=np.arange(rows, dtype=np.int64),
        lengths=selected.sum(axis=1),
        tokens=tokens,
        sequences={} if groups is None else {"group_id": groups},
    )
    return table, tuple(f"{path}: {note}" for note in notes)


def _groups(boundaries: object, rows: int, size: int) -> tuple[np.ndarray | None, list[str]]:
    """Each row's prompt index from SkyRL's (start, end) prompt boundaries, if they cover all;
    else None, with a note when they are there but malformed (group_id is optional: the
    log-probs are read without it)."""
    if boundaries is None:
        return None, []
    left_out = "group_id not imported: metadata policy_prompt_boundaries"
    if not isinstance(boundaries, list | tuple):
        return None, [f"{left_out} is a {type(boundaries).__name__}, not a list"]
    group = np.full(rows, -1, dtype=np.int64)
    for index, bounds in enumerate(boundaries):
        if not (
            isinstance(bounds, list | tuple)
            and len(bounds) == 2
            and all(type(b) is int for b in bounds)
            and 0 <= bounds[0] <= bounds[1] <= size
        ):
            found = quote(bounds, 60)
            return None, [f"{left_out}[{index}] is {found}, not (start, end) rows within {size}"]
        group[bounds[0] : bounds[1]] = index
    return (group if (group >= 0).all() else None), []
