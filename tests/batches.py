"""Each framework's batch object, built from known per-sequence values, and the check that a
dump written from it holds exactly those values.

`LIKE[name](truth)` builds an object shaped as that framework's (plain dicts and namespaces,
in the framework's own layout, alignment and field names); tests/integrations builds the real
objects with the frameworks' own classes and functions from the same `Truth`. Either way
`expected(name, truth)` is what the dump must hold, and `check_dump` compares every value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import iscore
from iscore.dump import resolve_files

PAD = 7.0  # a value no log-prob takes: if it shows up in a dump, padding leaked in


@dataclass
class Truth:
    """Per-sequence values of one step: B sequences with a prompt and a response each."""

    prompts: list[np.ndarray]  # token ids
    responses: list[np.ndarray]  # token ids
    rollout: list[np.ndarray]  # float32, one per response token
    train: list[np.ndarray]
    loss: list[np.ndarray]  # bool, one per response token (tool output: False)
    advantages: np.ndarray  # [B] float32, one per sequence
    rewards: np.ndarray  # [B] float32
    groups: np.ndarray  # [B] int, prompt groups of 2

    @property
    def count(self) -> int:
        return len(self.responses)


def make_truth(seed: int = 0, lengths: tuple[int, ...] = (5, 1, 8, 3, 6, 2)) -> Truth:
    rng = np.random.default_rng(seed)
    rollout = [(-rng.exponential(0.7, n)).astype(np.float32) for n in lengths]
    loss = [rng.random(n) > 0.2 for n in lengths]
    for mask in loss:
        mask[0] = True
    return Truth(
        prompts=[rng.integers(10, 1000, rng.integers(2, 5)) for _ in lengths],
        responses=[rng.integers(10, 1000, n) for n in lengths],
        rollout=rollout,
        train=[np.minimum(r + rng.normal(0, 0.05, r.size), 0).astype(np.float32) for r in rollout],
        loss=loss,
        advantages=rng.normal(0, 1, len(lengths)).astype(np.float32),
        rewards=rng.integers(0, 2, len(lengths)).astype(np.float32),
        groups=np.arange(len(lengths)) // 2,
    )


def padded(rows: list[np.ndarray], width: int, *, right: bool = True, fill: Any = PAD):
    """[B, width] tensor of `rows`, left-aligned (padding on the right) or right-aligned."""
    dtype = torch.float32 if rows and rows[0].dtype.kind == "f" else torch.long
    if rows and rows[0].dtype.kind == "b":
        dtype = torch.long
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        if row.size:
            values = torch.as_tensor(row.astype(np.int64) if row.dtype.kind == "b" else row)
            if right:
                out[i, : row.size] = values
            else:
                out[i, width - row.size :] = values
    return out


def ones(truth: Truth) -> list[np.ndarray]:
    return [np.ones(r.size, dtype=bool) for r in truth.responses]


def per_token(truth: Truth, values: np.ndarray) -> list[np.ndarray]:
    return [
        np.full(r.size, v, dtype=np.float32) for r, v in zip(truth.responses, values, strict=True)
    ]


# ------------------------------------------------------------------ framework-shaped objects


def verl_fields(truth: Truth) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The tensors and non-tensors of verl's DataProto ([B, R], left-aligned)."""
    width = max(r.size for r in truth.responses) + 1
    scores = [np.zeros(r.size, np.float32) for r in truth.responses]
    for s, reward in zip(scores, truth.rewards, strict=True):
        s[-1] = reward  # verl places the score on the last response token
    tensors = {
        "rollout_log_probs": padded(truth.rollout, width),
        "old_log_probs": padded(truth.train, width),
        "response_mask": padded(ones(truth), width, fill=0),
        "responses": padded(truth.responses, width, fill=0),
        "advantages": padded(per_token(truth, truth.advantages), width),
        "token_level_scores": padded(scores, width, fill=0.0),
    }
    return tensors, {"uid": np.array([f"g{g}" for g in truth.groups], dtype=object)}


def trl_inputs(truth: Truth) -> dict[str, torch.Tensor]:
    """TRL's loss inputs ([B, C], right-padded), with a tool mask."""
    width = max(r.size for r in truth.responses)
    return {
        "sampling_per_token_logps": padded(truth.rollout, width, fill=0.0),
        "old_per_token_logps": padded(truth.train, width),
        "completion_mask": padded(ones(truth), width, fill=0),
        "tool_mask": padded(truth.loss, width, fill=1),
        "completion_ids": padded(truth.responses, width, fill=0),
        "advantages": torch.from_numpy(truth.advantages),
    }


class _SkyRLBatch(dict):
    metadata: dict | None = None


def skyrl_batch(truth: Truth) -> _SkyRLBatch:
    """SkyRL's TrainingInputBatch: [B, R] right-aligned, one padding row, prompt boundaries."""
    width = max(r.size for r in truth.responses)
    seqs = [np.concatenate([p, r]) for p, r in zip(truth.prompts, truth.responses, strict=True)]
    total = max(s.size for s in seqs)
    batch = _SkyRLBatch(
        sequences=padded(seqs, total, right=False, fill=0),
        response_mask=padded(ones(truth), width, right=False, fill=0),
        loss_mask=padded(truth.loss, width, right=False, fill=0),
        rollout_logprobs=padded(truth.rollout, width, right=False),
        action_log_probs=padded(truth.train, width, right=False),
        advantages=padded(per_token(truth, truth.advantages), width, right=False),
    )
    for key, value in batch.items():  # SkyRL's pad row: a copy of row 0, loss mask 0
        extra = torch.zeros_like(value[:1]) if key == "loss_mask" else value[:1]
        batch[key] = torch.cat([value, extra])
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], truth.groups])))
    ends = np.append(starts[1:], truth.count)
    batch.metadata = {
        "pad_size": 1,
        "policy_prompt_boundaries": [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)],
    }
    return batch


def openrlhf_samples(truth: Truth) -> list[dict[str, Any]]:
    """One sample per sequence as OpenRLHF's samples generator builds it ([1, T], action
    columns shifted by one: action_mask = mask[1:])."""
    samples = []
    for i in range(truth.count):
        p, r = truth.prompts[i], truth.responses[i]
        seq = np.concatenate([p, r])
        action = np.zeros(seq.size - 1, dtype=bool)
        action[p.size - 1 :] = True
        rollout = np.zeros(seq.size - 1, np.float32)
        train = np.zeros(seq.size - 1, np.float32)
        rollout[action], train[action] = truth.rollout[i], truth.train[i]
        samples.append(
            {
                "sequences": torch.from_numpy(seq)[None],
                "attention_mask": torch.ones(1, seq.size, dtype=torch.long),
                "action_mask": torch.from_numpy(action)[None],
                "rollout_log_probs": torch.from_numpy(rollout)[None],
                "action_log_probs": torch.from_numpy(train)[None],
                "advantages": torch.from_numpy(np.where(action, truth.advantages[i], 0))[None],
                "rewards": torch.tensor([truth.rewards[i]]),
                "index": [i],
            }
        )
    return samples


def openrlhf_blocks(truth: Truth, size: int = 4) -> list[SimpleNamespace]:
    """Experiences of `size` samples, right-padded to the block's longest."""
    samples = openrlhf_samples(truth)
    blocks = []
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        block = {}
        for key in chunk[0]:
            if key == "index":
                block[key] = [i for s in chunk for i in s[key]]
            elif key == "rewards":
                block[key] = torch.cat([s[key] for s in chunk])
            else:
                width = max(s[key].shape[1] for s in chunk)
                block[key] = torch.cat(
                    [torch.nn.functional.pad(s[key], (0, width - s[key].shape[1])) for s in chunk]
                )
        blocks.append(SimpleNamespace(**block))
    return blocks


def areal_trajectories(truth: Truth) -> list[dict[str, torch.Tensor]]:
    """One dict per sequence as AReaL's RLVR workflow returns it ([1, S])."""
    out = []
    for i in range(truth.count):
        p, r = truth.prompts[i], truth.responses[i]
        out.append(
            {
                "input_ids": torch.from_numpy(np.concatenate([p, r]).astype(np.int32))[None],
                "loss_mask": torch.tensor([0] * p.size + [1] * r.size, dtype=torch.int32)[None],
                "logprobs": torch.from_numpy(
                    np.concatenate([np.zeros(p.size, np.float32), truth.rollout[i]])
                )[None],
                "attention_mask": torch.ones(1, p.size + r.size, dtype=torch.bool),
                "rewards": torch.tensor([truth.rewards[i]]),
            }
        )
    return out


def areal_prox_logp(traj: dict[str, torch.Tensor], truth: Truth, rows: list[int]) -> torch.Tensor:
    """What AReaL's actor.compute_logp returns for a group: the trainer's log-prob of the NEXT
    token at each position."""
    out = torch.zeros(traj["input_ids"].shape)
    for k, i in enumerate(rows):
        start = truth.prompts[i].size - 1
        out[k, start : start + truth.responses[i].size] = torch.from_numpy(truth.train[i])
    return out


def areal_batch(truth: Truth) -> list[dict[str, torch.Tensor]]:
    """AReaL's rollout_batch: one dict per group of 2, [2, S] padded, with prox_logp."""
    trajs = areal_trajectories(truth)
    batch = []
    for g in range(0, truth.count, 2):
        group = trajs[g : g + 2]
        width = max(t["input_ids"].shape[1] for t in group)
        traj = {
            key: torch.cat(
                [
                    t[key]
                    if t[key].ndim == 1
                    else torch.nn.functional.pad(t[key], (0, width - t[key].shape[1]))
                    for t in group
                ]
            )
            for key in group[0]
        }
        traj["prox_logp"] = areal_prox_logp(traj, truth, list(range(g, g + len(group))))
        batch.append(traj)
    return batch


def nemo_train_data(truth: Truth) -> dict[str, torch.Tensor]:
    """NeMo-RL's train_data: [B, S] over prompt + response, right-padded."""
    seqs = [np.concatenate([p, r]) for p, r in zip(truth.prompts, truth.responses, strict=True)]
    width = max(s.size for s in seqs)

    def full(values: list[np.ndarray], fill: Any) -> torch.Tensor:
        rows = [
            np.concatenate([np.zeros(p.size, v.dtype), v])
            for p, v in zip(truth.prompts, values, strict=True)
        ]
        return padded(rows, width, fill=fill)

    return {
        "input_ids": padded(seqs, width, fill=0),
        "generation_logprobs": full(truth.rollout, 0.0),
        "prev_logprobs": full(truth.train, 0.0),
        "token_mask": full(ones(truth), 0),
        "sample_mask": torch.from_numpy(
            (truth.rewards >= 0) & (np.arange(truth.count) != 1)
        ).float(),
        "advantages": full(per_token(truth, truth.advantages), 0.0),
    }


def slime_rollout_data(truth: Truth) -> dict[str, Any]:
    """slime's per-rank rollout_data: per-sample lists."""
    return {
        "tokens": [
            torch.from_numpy(np.concatenate([p, r]))
            for p, r in zip(truth.prompts, truth.responses, strict=True)
        ],
        "response_lengths": [int(r.size) for r in truth.responses],
        "loss_masks": [torch.from_numpy(m.astype(np.int32)) for m in truth.loss],
        "rollout_log_probs": [torch.from_numpy(r) for r in truth.rollout],
        "log_probs": [torch.from_numpy(t) for t in truth.train],
        "advantages": [torch.from_numpy(a) for a in per_token(truth, truth.advantages)],
        "rewards": [float(r) for r in truth.rewards],
        "partition": [100 + 3 * i for i in range(truth.count)],
    }


LIKE = {
    "verl": lambda t: SimpleNamespace(batch=verl_fields(t)[0], non_tensor_batch=verl_fields(t)[1]),
    "trl": trl_inputs,
    "skyrl": skyrl_batch,
    "openrlhf": openrlhf_blocks,
    "areal": areal_batch,
    "nemo_rl": nemo_train_data,
    "slime": slime_rollout_data,
}
"""Each framework with an adapter -> a plain object shaped as its batch object."""


def expected(name: str, truth: Truth) -> dict[str, list]:
    """The per-sequence values a dump of `name`'s object must hold, by canonical column."""
    count = range(truth.count)
    out: dict[str, list] = {"rollout_logprob": truth.rollout, "train_logprob": truth.train}
    out["token_id"] = list(truth.responses)
    if name in ("verl", "skyrl", "openrlhf", "nemo_rl", "slime"):
        out["advantage"] = per_token(truth, truth.advantages)
    if name == "trl":
        out["advantage"] = list(truth.advantages)
    if name in ("trl", "skyrl", "slime"):
        out["loss_mask"] = truth.loss
    if name == "nemo_rl":
        out["loss_mask"] = [np.full(truth.responses[i].size, i != 1) for i in count]
    if name in ("verl", "openrlhf", "areal", "slime"):
        out["reward"] = list(truth.rewards)
    if name == "verl":
        out["group_id"] = [f"g{g}" for g in truth.groups]
    if name in ("skyrl", "areal"):
        out["group_id"] = list(truth.groups)
    if name == "openrlhf":
        out["seq_id"] = list(count)
    if name == "slime":
        out["seq_id"] = [100 + 3 * i for i in count]
    return out


def read_dump(source: str | Path) -> pa.Table:
    """Every row of a dump (a file or a run folder), ordered by (step, seq_id)."""
    tables = [pq.read_table(f) for f in resolve_files(source)]
    table = pa.concat_tables(tables, promote_options="default")
    return table.sort_by([("step", "ascending"), ("seq_id", "ascending")])


def check_dump(source: str | Path, want: dict[str, list], *, step: int | None = None) -> None:
    """The dump at `source` holds exactly `want` (one step), and iscore reads it."""
    table = read_dump(source)
    if step is not None:
        assert table["step"].to_pylist() == [step] * table.num_rows
    for column, values in want.items():
        got = table[column].to_pylist()
        assert len(got) == len(values), column
        for i, (g, w) in enumerate(zip(got, values, strict=True)):
            w = np.asarray(w)
            if w.dtype.kind == "f":
                np.testing.assert_array_equal(
                    np.asarray(g, np.float32), w, err_msg=f"{column}[{i}]"
                )
            else:
                assert np.asarray(g).tolist() == w.tolist(), f"{column}[{i}]"
    batch = iscore.load(source)
    np.testing.assert_array_equal(batch.rollout.numpy(), np.concatenate(want["rollout_logprob"]))
    np.testing.assert_array_equal(batch.train.numpy(), np.concatenate(want["train_logprob"]))


TRAIN_KEY = {
    "verl": "old_log_probs",
    "trl": "old_per_token_logps",
    "skyrl": "action_log_probs",
    "openrlhf": "action_log_probs",
    "areal": "prox_logp",
    "nemo_rl": "prev_logprobs",
    "slime": "log_probs",
}
"""Where each framework's object holds the trainer's log-probs."""


def without(obj: Any, key: str) -> Any:
    """`obj` with `key` removed wherever it holds it (a dict, a DataProto's tensors, blocks)."""
    if isinstance(obj, list):
        return [without(part, key) for part in obj]
    if isinstance(obj, SimpleNamespace) and hasattr(obj, "batch"):
        return SimpleNamespace(batch=without(obj.batch, key), non_tensor_batch=obj.non_tensor_batch)
    if isinstance(obj, SimpleNamespace):
        return SimpleNamespace(**{k: v for k, v in vars(obj).items() if k != key})
    out = type(obj)({k: v for k, v in obj.items() if k != key})
    if hasattr(obj, "metadata"):
        out.metadata = obj.metadata
    return out
