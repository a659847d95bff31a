"""What writing a dump from a training loop costs it: `DumpWriter.add_batch` against a step
that moves the same tensors (TRL's GRPO loss inputs and loss)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from iscore.bench.base import Measured, Run, best, row
from iscore.dump import DumpWriter
from iscore.frameworks import trl

STEP_TOKENS = 1_000_000
"""Tokens of the step the writer is timed in (fewer on a smaller bench dump)."""


def writer(run: Run) -> Measured:
    """`DumpWriter.add_batch` per step, against a step that moves the same tensors: TRL's GRPO
    loss inputs ([B, T] padded, half full) and, as the step, TRL's clipped loss with its
    importance-sampling ratio over them, forward and backward. The writer's per-rank layout
    holds the loop only while it takes references; its background thread converts and writes
    (timed too, as a single-file write)."""
    run.say("timing the dump writer inside a training step")
    tokens, steps = min(run.tokens, STEP_TOKENS), max(run.repeats, 3)
    rng = np.random.default_rng(0)
    count = 512
    width = max(2 * tokens // count, 2)
    lengths = torch.from_numpy(rng.integers(1, width + 1, count))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rollout = -torch.from_numpy(rng.exponential(0.7, (count, width)).astype(np.float32))
    inputs = {
        "sampling_per_token_logps": rollout,
        "old_per_token_logps": rollout + 0.01 * torch.randn(count, width),
        "completion_mask": mask.long(),
        "completion_ids": torch.randint(0, 150_000, (count, width)),
        "advantages": torch.randn(count),
    }

    def step() -> None:
        new = inputs["old_per_token_logps"].clone().requires_grad_()
        ratio = torch.exp(new - inputs["old_per_token_logps"])
        adv = inputs["advantages"][:, None]
        per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        sampling = inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]
        per_token = per_token * sampling.exp().clamp(max=3.0)
        mask_f = inputs["completion_mask"].float()
        ((per_token * mask_f).sum() / mask_f.sum()).backward()

    step_s = best(steps, step)
    blocked = []
    with tempfile.TemporaryDirectory(prefix="iscore-bench-writer-") as folder:
        per_rank = DumpWriter(folder, framework=trl.NAME, rank=0)
        for i in range(steps):
            start = time.perf_counter()
            per_rank.add_batch(inputs, step=i)
            blocked.append(time.perf_counter() - start)
        per_rank.close()

        def write_one() -> None:
            with DumpWriter(Path(folder) / "one.parquet", framework=trl.NAME) as single:
                single.add_batch(inputs, step=0)

        background_s = best(2, write_one)
    written = int(mask.sum())
    add_s = float(np.median(blocked))
    return Measured(
        rows=(
            row("writer: a step's loss over the same tensors", step_s, written),
            row("writer: add_batch, time the step waits", add_s, written, "writer_vs_step"),
            row("writer: background conversion and write", background_s, written),
        ),
        entries={
            "writer": {
                "tokens": written,
                "step_s": step_s,
                "add_batch_s": add_s,
                "background_s": background_s,
            }
        },
    )
