"""OpenRLHF's Experience blocks, concatenated from per-sample experiences as
`split_rollout_samples` does (Experience.concat_experiences)."""

from __future__ import annotations

from iscore.dump.writer import DumpWriter
from tests.batches import check_dump, expected, make_truth, openrlhf_samples
from tests.integrations.conftest import framework

INSTALL = "pip install '.[integrations]' && pip install --no-deps openrlhf==0.11.2"


def test_experiences_round_trip(tmp_path) -> None:
    Experience = framework("openrlhf.trainer.ppo_utils.experience", INSTALL).Experience
    truth = make_truth(seed=5)
    samples = [Experience(**sample) for sample in openrlhf_samples(truth)]
    blocks = [
        Experience.concat_experiences(samples[i : i + 4], pad_token_id=0)
        for i in range(0, len(samples), 4)
    ]
    assert blocks[0].action_mask.shape[0] == 4  # a real concatenated block
    with DumpWriter(tmp_path, framework="openrlhf", rank=0) as writer:
        writer.add_batch(blocks, step=2)
    check_dump(tmp_path, expected("openrlhf", truth), step=2)
