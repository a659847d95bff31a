"""SkyRL's TrainingInputBatch, built by SkyRL's own preprocessing and padding, handed to
iscore's DumpCallback through SkyRL's CallbackHandler as RayPPOTrainer.train does."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

from iscore.dump.writer import DumpWriter
from iscore.frameworks.skyrl import DumpCallback
from tests.batches import check_dump, expected, make_truth
from tests.integrations.conftest import framework

INSTALL = "pip install '.[integrations]' && pip install --no-deps skyrl==0.3.0"


def _skyrl_module(name: str) -> types.ModuleType:
    """A module of skyrl 0.3.0 without the `__init__` of its package, which imports far more
    than the module: skyrl/backends/__init__.py the Tinker API (whose pydantic models refuse
    typing.TypedDict before Python 3.12), skyrl/train/utils/__init__.py skyrl_gym. The modules
    read here (training_batch.py, callbacks.py) import neither."""
    skyrl = framework("skyrl", INSTALL)
    package = name.rpartition(".")[0]
    if package not in sys.modules:
        stub = types.ModuleType(package)
        stub.__path__ = [str(Path(skyrl.__file__).parent.joinpath(*package.split(".")[1:]))]
        sys.modules[package] = stub
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"{name} is not importable ({e}); {INSTALL}")


def test_a_training_input_batch_round_trips_through_the_callback(tmp_path) -> None:
    training_batch = _skyrl_module("skyrl.backends.skyrl_train.training_batch")
    preprocess = framework("skyrl.train.dataset.preprocess", INSTALL)
    callbacks = _skyrl_module("skyrl.train.utils.callbacks")
    truth = make_truth(seed=7)
    (sequences, attention, response_mask, _, loss_mask, rollout, _) = (
        preprocess.convert_prompts_responses_to_batch_tensors(
            types.SimpleNamespace(pad_token_id=0),
            [p.tolist() for p in truth.prompts],
            [r.tolist() for r in truth.responses],
            [[0.0] * r.size for r in truth.responses],
            [m.astype(int).tolist() for m in truth.loss],
            [r.tolist() for r in truth.rollout],
        )
    )
    width = response_mask.shape[1]
    train = torch.zeros_like(rollout)
    advantages = torch.zeros_like(rollout)
    for i, t in enumerate(truth.train):  # the trainer's forward, right-aligned like the rest
        train[i, width - t.size :] = torch.from_numpy(t)
        advantages[i, width - t.size :] = float(truth.advantages[i])
    batch = training_batch.TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": rollout,
            "action_log_probs": train,
            "advantages": advantages,
        }
    )
    uids = [f"p{g}" for g in truth.groups]
    batch.metadata = {"policy_prompt_boundaries": preprocess.compute_prompt_boundaries(uids)}
    batch = training_batch.pad_training_input_batch(batch, 2)  # a dp size of 4
    assert batch.metadata["pad_size"] == 2 and len(batch["rollout_logprobs"]) == 8

    writer = DumpWriter(tmp_path, framework="skyrl", rank=0)
    handler = callbacks.CallbackHandler([DumpCallback(writer)])
    control = callbacks.TrainingControl()

    def event(**fields):
        return callbacks.CallbackInput(
            global_step=4, epoch=0, total_steps=9, steps_per_epoch=9, **fields
        )

    handler.on_train_start(None, event(), control)
    handler.on_step_end(None, event(batch=batch, metrics={}), control)
    handler.on_train_end(None, event(), control)
    check_dump(tmp_path, expected("skyrl", truth), step=4)
