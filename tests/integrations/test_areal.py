"""AReaL's rollout_batch: per-sample dicts as its RLVR workflow returns them, grouped with
AReaL's concat_padded_tensors, and prox_logp through batched_call as actor.compute_logp does."""

from __future__ import annotations

import torch

from iscore.dump.writer import DumpWriter
from tests.batches import areal_prox_logp, areal_trajectories, check_dump, expected, make_truth
from tests.integrations.conftest import framework

INSTALL = "pip install '.[integrations]' && pip install --no-deps areal==1.0.4"


def test_a_rollout_batch_round_trips(tmp_path) -> None:
    data = framework("areal.utils.data", INSTALL)
    truth = make_truth(seed=6)
    samples = areal_trajectories(truth)
    rollout_batch = [data.concat_padded_tensors(samples[g : g + 2]) for g in range(0, 6, 2)]

    def compute_logp(batched: dict) -> torch.Tensor:  # the engine's forward, on the concat
        return areal_prox_logp(batched, truth, list(range(truth.count)))

    for traj, logp in zip(
        rollout_batch, data.batched_call(compute_logp, rollout_batch), strict=True
    ):
        traj["prox_logp"] = logp  # rl_trainer.py l.653-654
    with DumpWriter(tmp_path, framework="areal", rank=0) as writer:
        writer.add_batch(rollout_batch, step=8)
    check_dump(tmp_path, expected("areal", truth), step=8)
