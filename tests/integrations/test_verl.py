"""verl's DataProto (verl.protocol), as RayPPOTrainer.fit holds it after the old-log-prob
recompute."""

from __future__ import annotations

import pytest

from iscore.dump.writer import DumpWriter
from iscore.errors import DumpError
from tests.batches import check_dump, expected, make_truth, verl_fields
from tests.integrations.conftest import framework

INSTALL = "pip install '.[integrations]' && pip install --no-deps verl==0.9.1"


def _data_proto(truth):
    DataProto = framework("verl", INSTALL).DataProto
    tensors, non_tensors = verl_fields(truth)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def test_a_data_proto_round_trips(tmp_path) -> None:
    truth = make_truth(seed=4)
    data = _data_proto(truth)
    with DumpWriter(tmp_path, framework="verl", rank=0) as writer:
        writer.add_batch(data, step=12)
    check_dump(tmp_path, expected("verl", truth), step=12)


def test_bypass_mode_is_refused(tmp_path) -> None:
    data = _data_proto(make_truth())
    # What apply_bypass_mode does (rollout_corr_helper.py l.1138).
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
    with (
        DumpWriter(tmp_path / "run.parquet", framework="verl") as writer,
        pytest.raises(DumpError, match="bypass_mode"),
    ):
        writer.add_batch(data, step=0)
