"""SkyRL's global_step_{N}_training_input.pkl: right-aligned [B, R] tensors in a pickle.

The fixtures pickle stand-ins registered in sys.modules under SkyRL's module paths, which
serialize themselves the way SkyRL's `TensorBatch` does in each of its versions, so the files
name exactly the globals SkyRL's would. SkyRL itself is not installed.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.dump.importers import convert, detect, read
from iscore.errors import DumpError
from tests.unit.importers.conftest import Seq, assert_rows, make_seqs, provenance

NEW = "skyrl.backends.skyrl_train.training_batch"
OLD = "skyrl_train.training_batch"
PAD = 0
PROMPTS = [5, 2, 8, 3, 4, 6]


def _numpy_state(tensor: torch.Tensor) -> dict:
    """SkyRL's fast path, with torch.save for dtypes numpy lacks (bfloat16)."""
    try:
        array = tensor.numpy()
    except TypeError:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return {"format": "torch", "data": buffer.getvalue()}
    return {
        "format": "numpy",
        "data": array.tobytes(),
        "shape": array.shape,
        "dtype": str(array.dtype),
    }


def _bytes_state(tensor: torch.Tensor) -> bytes:
    """The first versions: torch.save of every field."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.fixture
def skyrl(monkeypatch):
    """install(module, style) -> TrainingInputBatch stand-in pickling as that SkyRL version.

    Styles: "reduce" (Mar 2026 on: `__reduce__` -> `_rebuild_tensor_batch(cls, state)`,
    numpy state), "items" (Jan-Mar 2026: default dict-subclass pickling, the items as raw
    tensors, then numpy state), "bytes" (before: default pickling, torch.save bytes state).
    """

    def install(module_name: str, style: str) -> types.ModuleType:
        parts = module_name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
        module = types.ModuleType(module_name)
        encode = _bytes_state if style == "bytes" else _numpy_state

        class TensorBatch(dict):
            metadata = None

            def __getstate__(self):
                return {
                    "batch_dict": {k: None if v is None else encode(v) for k, v in self.items()},
                    "batch_size": len(self["sequences"]),
                    "device": torch.device("cpu"),
                    "metadata": self.metadata,
                }

            if style == "reduce":

                def __reduce__(self):
                    return (module._rebuild_tensor_batch, (type(self), self.__getstate__()))

        class TrainingInputBatch(TensorBatch):
            pass

        def _rebuild_tensor_batch(cls, state):
            raise AssertionError("only iscore's stand-in is ever called")

        for obj in (TensorBatch, TrainingInputBatch, _rebuild_tensor_batch):
            obj.__module__ = module_name
            obj.__qualname__ = obj.__name__
            setattr(module, obj.__name__, obj)
        monkeypatch.setitem(sys.modules, module_name, module)
        return module

    return install


def training_input(module: types.ModuleType, seqs: list[Seq], *, pad_size: int = 0):
    """A TrainingInputBatch as SkyRL builds and dumps it.

    `sequences` left-padded; response-level tensors right-aligned (left padding, zeros);
    `pad_size` rows appended as copies of row 0 with a zero loss mask; `uids` and `rewards`
    already dropped, as the trainer does before dumping.
    """
    b, r = len(seqs), max(s.n for s in seqs)
    s_len = max(p + s.n for p, s in zip(PROMPTS, seqs, strict=False))
    sequences = torch.full((b, s_len), PAD, dtype=torch.long)
    attention = torch.zeros((b, s_len), dtype=torch.long)
    fields = {k: torch.zeros((b, r)) for k in ("loss", "rollout", "action", "adv", "base")}
    response_mask = torch.zeros((b, r), dtype=torch.long)
    for i, (p, s) in enumerate(zip(PROMPTS, seqs, strict=False)):
        start = s_len - p - s.n
        sequences[i, start : start + p] = torch.arange(p) + 7
        sequences[i, start + p :] = torch.tensor(s.token_id)
        attention[i, start:] = 1
        response_mask[i, r - s.n :] = 1
        fields["loss"][i, r - s.n :] = torch.tensor(s.loss_mask, dtype=torch.float32)
        fields["rollout"][i, r - s.n :] = torch.tensor(s.rollout)
        fields["action"][i, r - s.n :] = torch.tensor(s.train)
        fields["adv"][i, r - s.n :] = s.advantage
        fields["base"][i, r - s.n :] = torch.tensor(s.train) - 0.01

    def padded(t: torch.Tensor, zero: bool = False) -> torch.Tensor:
        extra = torch.zeros_like(t[:1]).repeat(pad_size, *[1] * (t.dim() - 1))
        return torch.cat([t, extra if zero else t[[0] * pad_size]])

    batch = module.TrainingInputBatch(
        sequences=padded(sequences),
        attention_mask=padded(attention),
        response_mask=padded(response_mask),
        loss_mask=padded(fields["loss"], zero=True),
        rollout_logprobs=padded(fields["rollout"]),
        rollout_expert_indices=None,
        router_padding_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        action_log_probs=padded(fields["action"]),
        base_action_log_probs=padded(fields["base"]),
        values=None,
        returns=padded(fields["adv"]),
        advantages=padded(fields["adv"]),
    )
    groups = sorted({s.group for s in seqs})
    batch.metadata = {
        "policy_mini_batch_boundaries": [(0, b)],
        "policy_prompt_boundaries": [
            (
                min(i for i, s in enumerate(seqs) if s.group == g),
                1 + max(i for i, s in enumerate(seqs) if s.group == g),
            )
            for g in groups
        ],
        "response_length": r,
        "avg_response_length": float(np.mean([s.n for s in seqs])),
        "pad_size": pad_size,
        "metrics": {"avg_final_rewards": 0.5},
    }
    return batch


def dump(batch: object, folder: Path, step: int) -> Path:
    """TensorBatch.save: a plain pickle.dump to dumped_data/global_step_{N}_training_input.pkl."""
    path = folder / "dumped_data" / f"global_step_{step}_training_input.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f)
    return path


COLUMNS = ("loss_mask", "token_id", "advantage_per_token", "group_id")


class TestRead:
    @pytest.mark.parametrize(
        ("module", "style"), [(NEW, "reduce"), (NEW, "items"), (OLD, "bytes"), (OLD, "items")]
    )
    def test_right_aligned_rows_by_response_mask(self, tmp_path, skyrl, module, style):
        seqs = make_seqs([4, 1, 7, 3])
        dump(training_input(skyrl(module, style), seqs, pad_size=2), tmp_path, 12)
        table = read(tmp_path, allow_pickle=True)
        assert_rows(table, [replace(s, seq_id=i) for i, s in enumerate(seqs)], 12, COLUMNS)
        assert table.column_names == [
            "step",
            "seq_id",
            "rollout_logprob",
            "train_logprob",
            "loss_mask",
            "advantage",
            "token_id",
            "group_id",
        ]
        assert provenance(table.schema)["framework"] == "skyrl"

    def test_bfloat16_goes_through_torch_bytes(self, tmp_path, skyrl):
        seqs = make_seqs([3, 2], holes=False)
        batch = training_input(skyrl(NEW, "reduce"), seqs)
        batch["action_log_probs"] = batch["action_log_probs"].bfloat16()
        dump(batch, tmp_path, 1)
        table = read(tmp_path, allow_pickle=True)
        for i, s in enumerate(seqs):
            expected = torch.tensor(s.train).bfloat16().float().numpy()
            np.testing.assert_array_equal(table["train_logprob"][i].as_py(), expected)

    def test_without_boundaries_no_group(self, tmp_path, skyrl):
        batch = training_input(skyrl(NEW, "reduce"), make_seqs([2, 2]))
        del batch.metadata["policy_prompt_boundaries"]
        dump(batch, tmp_path, 1)
        assert "group_id" not in read(tmp_path, allow_pickle=True).column_names

    def test_convert_and_load(self, tmp_path, skyrl):
        module = skyrl(NEW, "reduce")
        steps = {1: make_seqs([3, 5], seed=1), 2: make_seqs([2, 2, 4], seed=2)}
        for step, seqs in steps.items():
            dump(training_input(module, seqs, pad_size=1), tmp_path, step)
        assert detect(tmp_path) == "skyrl"
        out = tmp_path / "skyrl.parquet"
        report = convert(tmp_path, out, allow_pickle=True)
        assert (report.files, report.steps, report.sequences) == (2, 2, 5)
        assert pq.ParquetFile(out).num_row_groups == 2
        every = [s for seqs in steps.values() for s in seqs]
        batch = iscore.load(out)
        np.testing.assert_array_equal(
            batch.rollout.numpy(), np.concatenate([s.rollout for s in every])
        )
        np.testing.assert_array_equal(
            batch.loss_mask.numpy(), np.concatenate([s.loss_mask for s in every])
        )
        assert batch.step.tolist() == [1, 1, 2, 2, 2]


class _Call:
    """Pickles as a call of `func(*args)`: what a malicious pickle does."""

    def __init__(self, func: object, *args: object):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


class TestSafety:
    @pytest.mark.parametrize(
        "attack",
        [
            lambda m: _Call(os.system, f"touch {m}"),
            lambda m: _Call(builtins.eval, f"open({str(m)!r}, 'w')"),
            lambda m: _Call(builtins.exec, f"open({str(m)!r}, 'w')"),
        ],
        ids=["os.system", "eval", "exec"],
    )
    def test_arbitrary_callables_never_run(self, tmp_path, attack):
        marker = tmp_path / "pwned"
        path = dump(attack(marker), tmp_path, 1)
        with pytest.raises(DumpError, match=rf"{path}: refused global .*(system|eval|exec)"):
            read(path, allow_pickle=True)
        assert not marker.exists()

    def test_refused_without_the_flag(self, tmp_path):
        marker = tmp_path / "pwned"
        path = dump(_Call(os.system, f"touch {marker}"), tmp_path, 1)
        with pytest.raises(DumpError, match=rf"{path}: a pickle .*--allow-pickle"):
            read(tmp_path)
        assert not marker.exists()

    def test_attack_inside_tensor_bytes(self, tmp_path, skyrl):
        module = skyrl(NEW, "reduce")
        marker = tmp_path / "pwned"
        buffer = io.BytesIO()
        torch.save(_Call(os.system, f"touch {marker}"), buffer)
        state = {
            "batch_dict": {"rollout_logprobs": {"format": "torch", "data": buffer.getvalue()}},
            "batch_size": 1,
            "device": None,
            "metadata": {},
        }
        path = dump(
            _Call(module._rebuild_tensor_batch, module.TrainingInputBatch, state), tmp_path, 1
        )
        with pytest.raises(DumpError, match=r"rollout_logprobs.*refused its bytes.*system"):
            read(path, allow_pickle=True)
        assert not marker.exists()

    def test_attack_inside_storage_bytes(self, tmp_path):
        marker = tmp_path / "pwned"
        evil = pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=2)
        path = dump(_Call(torch.storage._load_from_bytes, evil), tmp_path, 1)
        with pytest.raises(DumpError, match="tensor storage refused"):
            read(path, allow_pickle=True)
        assert not marker.exists()

    def test_object_dtype_refused(self, tmp_path, skyrl):
        module = skyrl(NEW, "reduce")
        field = {"format": "numpy", "data": b"\0" * 8, "shape": (1,), "dtype": "object"}
        state = {"batch_dict": {"rollout_logprobs": field}, "metadata": {}}
        path = dump(
            _Call(module._rebuild_tensor_batch, module.TrainingInputBatch, state), tmp_path, 1
        )
        with pytest.raises(DumpError, match="refused dtype object"):
            read(path, allow_pickle=True)


class TestMalformed:
    def test_no_rollout_logprobs(self, tmp_path, skyrl):
        batch = training_input(skyrl(NEW, "reduce"), make_seqs([2]))
        batch["rollout_logprobs"] = None
        path = dump(batch, tmp_path, 1)
        with pytest.raises(
            DumpError, match=rf"{path}: the batch has no 'rollout_logprobs'.*logprobs"
        ):
            read(path, allow_pickle=True)

    def test_shapes_differ(self, tmp_path, skyrl):
        batch = training_input(skyrl(NEW, "reduce"), make_seqs([2, 3]))
        batch["action_log_probs"] = batch["action_log_probs"][:, 1:]
        path = dump(batch, tmp_path, 1)
        with pytest.raises(DumpError, match=r"'action_log_probs' has shape \[2, 2\] but"):
            read(path, allow_pickle=True)

    def test_truncated(self, tmp_path, skyrl):
        path = dump(training_input(skyrl(NEW, "reduce"), make_seqs([2, 3])), tmp_path, 1)
        path.write_bytes(path.read_bytes()[:-40])
        with pytest.raises(DumpError, match=str(path)):
            read(path, allow_pickle=True)

    def test_not_a_batch(self, tmp_path):
        path = dump({"rollout_logprobs": [1.0]}, tmp_path, 1)
        with pytest.raises(DumpError, match="expected SkyRL's TrainingInputBatch, found dict"):
            read(path, allow_pickle=True)
