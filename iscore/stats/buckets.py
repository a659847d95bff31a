"""The mismatch by bucket of its tokens: of the rollout probability of the sampled token
(`PROB_EDGES`) and of its position (powers of two), as token sums of |d|, k3 and d."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from iscore.packed import TokenBatch, ops
from iscore.stats.histogram import (
    log2_bucket,
)

PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
"""Buckets of the rollout probability of the sampled token, exp(rollout_logprob)."""


# Token-level sums kept per probability / position bucket.
BUCKET_FIELDS = ("tokens", "abs", "k3", "d")


def _count(mask: torch.Tensor) -> int:
    if mask.device.type == "cpu":
        return int(np.count_nonzero(mask.numpy()))
    return int(torch.count_nonzero(mask))


@functools.cache
def prob_thresholds() -> tuple[float, ...]:
    """For each inner edge e of PROB_EDGES, the smallest float32 log-prob v with
    exp(float64(v)) >= e: comparing float32 log-probs with these buckets exactly as
    bucketizing their float64 exponentials would. (Cached whole: two threads analyzing
    steps at once must never see part of it.)"""
    thresholds = []
    for edge in PROB_EDGES[1:-1]:
        lo, hi = np.float32(math.log(edge) - 1e-3), np.float32(math.log(edge) + 1e-3)
        # Bisection over the float32 values between lo and hi (exp is increasing).
        while np.nextafter(lo, hi) != hi:
            grid = np.linspace(lo, hi, 64, dtype=np.float64).astype(np.float32)
            grid = np.unique(np.concatenate([[lo], grid, [hi]]))
            above = torch.exp(torch.from_numpy(grid.astype(np.float64))).numpy() >= edge
            first = int(np.argmax(above))
            lo, hi = grid[first - 1], grid[first]
        thresholds.append(float(hi))
    return tuple(thresholds)


def prob_bucket(
    rollout: torch.Tensor, masked_out: torch.Tensor | None, buf: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, np.ndarray | None]:
    """([N] bucket of exp(rollout_logprob) among PROB_EDGES (right-closed, like
    torch.bucketize(right=True)), len(PROB_EDGES) - 1 for tokens outside the loss mask;
    the count per bucket when every token is a loss token, else None)."""
    above_counts = None
    if rollout.dtype == torch.float32:
        bucket = buf("prob", torch.uint8).zero_()
        above = buf("prob_above", torch.bool)
        above_counts = [rollout.numel()]
        for threshold in prob_thresholds():
            bucket += ops.compare("ge", rollout, threshold, above)
            above_counts.append(_count(above))
    else:
        edges = torch.tensor(PROB_EDGES[1:-1], dtype=torch.float64, device=rollout.device)
        bucket = torch.bucketize(rollout.double().exp(), edges, right=True)
    if masked_out is not None:
        return bucket.masked_fill_(masked_out, len(PROB_EDGES) - 1), None
    if above_counts is None:
        return bucket, None
    # Tokens at or above each threshold, minus those at or above the next.
    return bucket, -np.diff(np.array([*above_counts, 0], dtype=np.float64))


def bucket_sums(
    index: torch.Tensor,
    fields: tuple[torch.Tensor | None, ...],
    size: int,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [size, len(fields)]: per bucket, the count (for None) or sum of each field;
    index == size (the extra bucket) is dropped. Known `counts` come first."""
    columns = [] if counts is None else [counts]
    if index.device.type == "cpu":
        idx = index.numpy().astype(np.intp)
        for f in fields:
            weights = None if f is None else f.numpy()
            columns.append(np.bincount(idx, weights=weights, minlength=size + 1)[:size])
    else:
        index = index.long()
        for f in fields:
            weights = None if f is None else f.double()
            counts = torch.bincount(index, weights=weights, minlength=size + 1)
            columns.append(counts[:size].cpu().numpy())
    return np.stack(columns, axis=1).astype(np.float64)


def position_sums(
    batch: TokenBatch,
    masked_out: torch.Tensor | None,
    fields: tuple[torch.Tensor | None, ...],
    size: int,
) -> np.ndarray:
    """float64 [size, len(fields)] per log2 bucket of pos + 1 (the last holds all beyond):
    the loss-token count (for None) or the sum of each field (zero outside the loss mask).

    Buckets change only a few times along a sequence, so the fields are summed over runs of
    one bucket (`reduceat`) and the runs then added per bucket.
    """
    if batch.device.type != "cpu":
        index = log2_bucket(batch.positions() + 1).clamp_(max=size - 1)
        if masked_out is not None:
            index = index.masked_fill(masked_out, size)
        return bucket_sums(index, fields, size)
    cu = batch.cu_seqlens.numpy()
    starts, lengths = cu[:-1], np.diff(cu)
    if batch.pos is None:
        # Positions 0..T-1: bucket b covers pos + 1 in [2^b, 2^(b+1)).
        top = max(int(lengths.max(initial=0)).bit_length(), 1)
        offsets = (1 << np.arange(top, dtype=np.int64)) - 1
        valid = offsets[None, :] < lengths[:, None]
        runs = (starts[:, None] + offsets[None, :])[valid]
        run_bucket = np.broadcast_to(np.arange(top), valid.shape)[valid]
    else:
        bucket = log2_bucket(batch.pos + 1).numpy()
        change = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
        runs = np.union1d(change, starts[lengths > 0])
        run_bucket = bucket[runs]
    run_bucket = np.minimum(run_bucket, size - 1)
    out = np.zeros((size, len(fields)))
    if not runs.size:
        return out
    for j, f in enumerate(fields):
        if f is None:
            values = (
                np.diff(np.append(runs, batch.num_tokens))
                if masked_out is None
                else np.add.reduceat(~masked_out.numpy(), runs, dtype=np.int64)
            )
        else:
            values = np.add.reduceat(f.numpy(), runs)
        out[:, j] = np.bincount(run_bucket, weights=values, minlength=size)[:size]
    return out


def bucket_rows(table: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label, (tokens, abs_sum, k3_sum, d_sum) in zip(labels, table, strict=False):
        if tokens:
            rows.append(
                {
                    "bucket": label,
                    "tokens": int(tokens),
                    "abs_diff_mean": abs_sum / tokens,
                    "k3": k3_sum / tokens,
                    "d_mean": d_sum / tokens,
                }
            )
    return rows
