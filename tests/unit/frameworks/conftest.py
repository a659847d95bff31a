"""Batches for the framework replay tests: fresh random data plus hand-made edge cases.

The references in these tests are written from the formulas in float64 numpy, one sequence
at a time, independent of `iscore.packed.ops`; `sequences(batch)` hands them the per-sequence
slices.
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from iscore.packed.batch import TokenBatch


def make_batch(
    lengths: list[int],
    *,
    seed: int = 0,
    sigma: float = 0.05,
    masked_fraction: float = 0.1,
    policy: bool = True,
    advantages: bool = True,
) -> TokenBatch:
    """Random log-probs (rollout peaked with a low-probability tail), d ~ N(0, sigma); each
    sequence's advantage (the batch's `extra`) N(0, 1), a fifth of them exactly 0."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    rollout = -rng.exponential(0.6, n)
    train = np.minimum(rollout + rng.normal(0.0, sigma, n), 0.0)
    pol = np.minimum(train + rng.normal(0.0, sigma, n), 0.0)
    mask = rng.random(n) >= masked_fraction
    advantage = np.where(rng.random(len(lengths)) < 0.2, 0.0, rng.normal(size=len(lengths)))
    return TokenBatch(
        rollout=torch.tensor(rollout, dtype=torch.float32),
        train=torch.tensor(train, dtype=torch.float32),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        loss_mask=torch.tensor(mask),
        policy=torch.tensor(pol, dtype=torch.float32) if policy else None,
        extra=pa.table({"advantage": advantage}) if advantages else None,
    )


def edge_batch() -> TokenBatch:
    """Hand-made edge cases, one per sequence:

    0. one token, d = 0 exactly (every ratio bound of 1.0 hit exactly)
    1. one token, d = +30 (extreme outlier above)
    2. one token, d = -30 (extreme outlier below)
    3. fully masked sequence (loss_mask all false), 4 tokens
    4. 200 tokens of d = +0.5: S = 100 > 88.72 (float32 exp overflow), G = 0.5
    5. 300 tokens of d = -0.5: S = -150 (float32 exp underflow to 0)
    6. 8 tokens, d = 0 exactly except one masked-out token with d = +30
    7. 5 tokens with mixed d = [0, ln 2 (float32), -ln 2 (float32), 0.1, -0.1]

    Advantages (the batch's `extra`), by sequence: 1, 1, -1, 1, -1, 0, 0, -0.5.
    """
    seqs: list[tuple[list[float], list[float], list[bool]]] = []

    def add(rollout, d, mask=None):
        rollout = np.asarray(rollout, dtype=np.float32)
        train = (rollout.astype(np.float64) + np.asarray(d)).astype(np.float32)
        seqs.append((rollout, train, np.ones(len(rollout), bool) if mask is None else mask))

    add([-0.5], [0.0])
    add([-31.0], [30.0])
    add([-0.5], [-30.0])
    add([-1.0, -2.0, -0.1, -0.3], [0.1, -0.1, 0.05, 0.0], np.zeros(4, bool))
    add(np.full(200, -3.0), np.full(200, 0.5))
    add(np.full(300, -0.2), np.full(300, -0.5))
    mask = np.ones(8, bool)
    mask[3] = False
    add(np.full(8, -40.0), [0, 0, 0, 30, 0, 0, 0, 0], mask)
    ln2 = float(np.float32(np.log(2.0)))
    add([-2.0, -2.0, -2.0, -2.0, -2.0], [0.0, ln2, -ln2, 0.1, -0.1])
    lengths = [len(s[0]) for s in seqs]
    rollout = np.concatenate([s[0] for s in seqs])
    train = np.concatenate([s[1] for s in seqs])
    return TokenBatch(
        rollout=torch.from_numpy(rollout),
        train=torch.from_numpy(train),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        loss_mask=torch.from_numpy(np.concatenate([s[2] for s in seqs])),
        policy=torch.from_numpy(train.copy()),
        extra=pa.table({"advantage": [1.0, 1.0, -1.0, 1.0, -1.0, 0.0, 0.0, -0.5]}),
    )


def sequences(batch: TokenBatch):
    """Per sequence: float64 numpy (rollout, train, policy, mask), for references."""
    cu = batch.cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        policy = None if batch.policy is None else batch.policy[a:b].double().numpy()
        yield (
            batch.rollout[a:b].double().numpy(),
            batch.train[a:b].double().numpy(),
            policy,
            batch.loss_mask[a:b].numpy(),
        )


def binary_kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KPop's B(P || Q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)) in float64, from the
    probabilities as verl #6800 and prime-rl #3283 clamp them: e^l of the float32 log-prob in
    float32, clamped into [1e-6, 1 - 1e-6] in float32 (so a log-prob near 0, whose e^l rounds
    to 1, gives p = float32(1 - 1e-6) = 1 - 1.013e-6). Both frameworks compute B itself in
    float32, whose rounding (here up to ~5e-5, 1e-6 at the 99th percentile, and negative for
    nearly equal p and q) can carry a token across phi: the tests' thresholds (>= 1e-3) are
    ones these batches never bring within it."""
    eps, top = np.float32(1e-6), np.float32(1.0 - 1e-6)
    p, q = (
        np.clip(np.exp(x.astype(np.float32)), eps, top).astype(np.float64) for x in (log_p, log_q)
    )
    return p * np.log(p / q) + (1.0 - p) * np.log((1.0 - p) / (1.0 - q))


SEEDS = (0, 1, 2)
"""The seeds of `random_batch_of`: sigma 0.02, 0.1 and 0.4."""


def random_batch_of(seed: int) -> TokenBatch:
    """Fresh random data: long-tailed lengths incl. 1-token sequences; one of `SEEDS`."""
    rng = np.random.default_rng(100 + seed)
    lengths = [1, 1, 2, *rng.lognormal(4.0, 1.2, 40).astype(int).clip(1, 3000).tolist()]
    return make_batch(lengths, seed=seed, sigma=[0.02, 0.1, 0.4][seed])


@pytest.fixture(params=SEEDS)
def random_batch(request) -> TokenBatch:
    return random_batch_of(request.param)


@pytest.fixture
def edges() -> TokenBatch:
    return edge_batch()
