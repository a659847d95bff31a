"""Mismatch diagnostics against a float64 numpy reference, streaming, and bug signatures."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from iscore import Dump, TokenBatch
from iscore.advice.flags import find_flags, flags_of
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.stats.buckets import PROB_EDGES
from iscore.stats.mismatch import MismatchStats
from tests.conftest import DEVICES
from tests.unit.frameworks.conftest import edge_batch, make_batch, sequences


def reference(batch) -> dict[str, float]:
    """The statistics written from their definitions, one sequence at a time."""
    tokens, seq = [], []
    for r, t, _, m in sequences(batch):
        d = (t - r)[m]
        if not d.size:
            continue
        tokens.append((r[m], t[m], d))
        S, T = d.sum(), d.size
        seq.append((S, T, t[m].mean(), r[m].mean()))
    r = np.concatenate([x[0] for x in tokens])
    t = np.concatenate([x[1] for x in tokens])
    d = np.concatenate([x[2] for x in tokens])
    mid = np.log(0.5 * np.exp(t) + 0.5 * np.exp(r))
    a, b = t - mid, r - mid
    S = np.array([s[0] for s in seq])
    T = np.array([s[1] for s in seq])
    G = S / T
    return {
        "k1": float(np.mean(-d)),
        "k2": float(np.mean(d**2 / 2)),
        "k3": float(np.mean(np.expm1(d) - d)),
        "k3_reverse": float(np.mean(np.expm1(-d) + d)),
        "chi2_token": float(np.mean(np.exp(2 * np.clip(d, -20, 20))) - 1),
        "chi2_seq": float(np.mean(np.exp(2 * np.clip(S, -20, 20))) - 1),
        "abs_diff_mean": float(np.mean(np.abs(d))),
        "abs_diff_max": float(np.max(np.abs(d))),
        "token_mult_prob_error": float(np.mean(np.exp(np.abs(d)))),
        "js": float(np.mean(0.5 * (np.expm1(a) - a) + 0.5 * (np.expm1(b) - b))),
        "log_ppl_diff": float(np.mean(-G)),
        "log_ppl_abs_diff": float(np.mean(np.abs(G))),
        "ppl_ratio": float(np.mean(np.exp(-G))),
        "training_ppl": float(np.mean([math.exp(-s[2]) for s in seq])),
        "rollout_ppl": float(np.mean([math.exp(-s[3]) for s in seq])),
        "ratio_mean": float(np.mean(np.exp(d))),
        "tokens": int(d.size),
        "sequences": len(seq),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_match_float64_reference(seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, *rng.lognormal(4, 1, 30).astype(int).clip(1, 2000).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=[0.01, 0.1, 0.5][seed])
    stats = MismatchStats()
    stats.update(batch)
    got = stats.compute().to_dict()
    for key, value in reference(batch).items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_edge_cases_fully_masked_and_overflow():
    batch = edge_batch()
    stats = MismatchStats()
    stats.update(batch)
    got = stats.compute().to_dict()
    ref = reference(batch)
    for key in ("k1", "k3", "chi2_seq", "abs_diff_max", "sequences", "tokens"):
        assert got[key] == pytest.approx(ref[key], rel=1e-9), key
    # d = +-30: the ratio is clamped at e^20 before squaring (e^40), not its square at e^20.
    assert got["chi2_token"] == pytest.approx(ref["chi2_token"], rel=1e-6)
    assert got["sequences"] == batch.num_sequences - 1  # the fully masked one has no tokens
    assert got["abs_diff_max"] == 30.0  # the masked-out d = 30 token does not count


def test_per_step_and_buckets():
    batch = make_batch([5, 7, 300, 2, 40], seed=3, sigma=0.2)
    batch = dataclasses.replace(batch, step=torch.tensor([0, 0, 1, 1, 1]), _seq_index=[])
    stats = MismatchStats()
    stats.update(batch)
    got = stats.compute().to_dict()
    cut = int(batch.cu_seqlens[2])
    first = TokenBatch(  # the first two sequences: step 0
        rollout=batch.rollout[:cut],
        train=batch.train[:cut],
        cu_seqlens=batch.cu_seqlens[:3],
        loss_mask=batch.loss_mask[:cut],
    )
    assert got["by_step"][0]["step"] == 0
    assert got["by_step"][0]["k3"] == pytest.approx(reference(first)["k3"], rel=1e-9)
    # Token buckets add up to the whole, and each holds the right tokens.
    m = batch.loss_mask
    p = batch.rollout.double()[m].exp().numpy()
    d = (batch.train.double() - batch.rollout.double())[m].numpy()
    assert sum(row["tokens"] for row in got["by_prob"]) == m.sum()
    for row in got["by_prob"]:
        lo, hi = (float(x) for x in row["bucket"].split("-"))
        inside = (p >= lo) & ((p < hi) if hi < 1 else (p <= hi))
        if lo == PROB_EDGES[0]:
            inside = p < hi
        assert row["tokens"] == inside.sum()
        assert row["abs_diff_mean"] == pytest.approx(np.abs(d[inside]).mean(), rel=1e-9)
    assert sum(row["tokens"] for row in got["by_pos"]) == m.sum()
    assert sum(row["sequences"] for row in got["by_length"]) == 5


def test_worst_tokens_and_sequences():
    batch = edge_batch()
    stats = MismatchStats()
    stats.update(batch)
    got = stats.compute().to_dict()
    assert [abs(t["d"]) for t in got["worst_tokens"][:2]] == [30.0, 30.0]
    assert got["worst_sequences"][0]["k3_sum"] >= got["worst_sequences"][1]["k3_sum"]


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_equals_whole(tmp_path, device):
    path = tmp_path / "d.parquet"
    write_simulated(path, SimConfig(regime="moe_routing", sequences=40, steps=3, median_len=300))
    dump = Dump(path)
    whole = MismatchStats()
    whole.update(dump.load(device))
    streamed = MismatchStats()
    for i, chunk in enumerate(Dump(path).batches(max_tokens=3000)):
        part = MismatchStats()
        part.update(chunk.to(device))
        if i % 2:
            streamed.merge(part)  # merging accumulators and updating one are the same
        else:
            streamed.update(chunk.to(device))
    assert_same(streamed.compute(), whole.compute())


def assert_same(got, expected, where="result"):
    """Equal structure and integers; floats equal up to float64 summation order (1e-12)."""
    if hasattr(expected, "to_dict"):  # a typed summary: its document
        assert_same(got.to_dict(), expected.to_dict(), where)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(expected, bool):
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15, nan_ok=True), where
    else:
        assert got == expected, where


def _flags(stats: MismatchStats) -> tuple:
    """The flags of an accumulator's diagnostics, as an analysis finds them."""
    s = stats.sequences()
    broken = stats.broken(s)
    return find_flags(stats.compute(s, broken), s, broken, stats.regression, stats.signs)


@pytest.mark.parametrize(
    ("regime", "expected"),
    [
        ("dense_bf16", set()),
        ("fp8", set()),
        ("long_collapse", set()),
        ("offset_bug", {"ratio_mean_bias", "constant_offset"}),
        ("temperature_bug", {"logprob_dependent_offset"}),
        ("drift", {"drift"}),
    ],
)
def test_bug_signatures_on_simulated_regimes(tmp_path, regime, expected):
    path = tmp_path / f"{regime}.parquet"
    write_simulated(path, SimConfig(regime=regime, sequences=48, steps=4, seed=21))
    stats = MismatchStats()
    for chunk in Dump(path).batches():
        stats.update(chunk)
    flags = _flags(stats)
    codes = {flag.code for flag in flags if flag.kind != "heavy_tail"}
    assert expected <= codes
    if not expected:
        assert codes == set()


def test_each_flag_carries_its_kind_and_a_heavy_tail_is_one(tmp_path):
    """The kind (semantics bug, drift, heavy tail) is decided with the flag, once: the pages
    and the report read it (the Mismatch page held the heavy-tail rule, and Compare, Mismatch
    and the report disagreed on whether drift is a semantics bug)."""
    results = {}
    for name in ("fp8", "dense_bf16", "drift", "offset_bug"):
        stats = MismatchStats()
        for chunk in Dump(f"data/{name}.parquet").batches():
            stats.update(chunk)
        results[name] = {"flags": _flags(stats)}
    kinds = {n: {(f.code, f.kind) for f in r["flags"]} for n, r in results.items()}
    assert kinds["fp8"] == {("heavy_tail", "heavy_tail")}  # max |d| 15.1, p99.9 3.85
    assert kinds["dense_bf16"] == set()  # max |d| 0.79
    assert ("drift", "drift") in kinds["drift"]
    assert {("ratio_mean_bias", "semantics_bug"), ("constant_offset", "semantics_bug")} <= kinds[
        "offset_bug"
    ]
    heavy = flags_of(results["fp8"]["flags"], "heavy_tail")[0].message
    assert heavy.startswith("the largest |d| is 15.1 nats") and "within 3.85" in heavy
    assert flags_of(results["drift"]["flags"], "semantics_bug") == []


@pytest.mark.parametrize("length", [256, 1024, 4096])
def test_collapse_matches_independent_token_expectation(tmp_path, length):
    """Sequence ratios e^S of fixed-length sequences sit where S ~ N(mu T, var T) puts them.

    The simulator's tokens are independent, so the measured median / p10 / p90 of S must
    match the normal ones within sampling error (4 standard errors of a quantile).
    """
    path = tmp_path / "c.parquet"
    config = SimConfig(
        regime="long_collapse",
        sequences=400,
        min_len=length,
        max_len=length,
        median_len=length,
        seed=length,
    )
    write_simulated(path, config)
    stats = MismatchStats()
    for chunk in Dump(path).batches():
        stats.update(chunk)
    result = stats.compute().to_dict()
    (row,) = result["by_length"]
    n, sd = row["sequences"], math.sqrt(result["d_var"] * length)
    for q, key in ((0.5, "median"), (0.1, "p10"), (0.9, "p90")):
        z = {0.5: 0.0, 0.1: -1.2815515655446004, 0.9: 1.2815515655446004}[q]
        density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        stderr = math.sqrt(q * (1 - q) / n) / density * sd  # of the q-quantile of S
        measured = math.log(row[f"seq_ratio_{key}"])
        expected = math.log(row[f"expected_seq_ratio_{key}"])
        assert abs(measured - expected) < 4 * stderr, (key, measured, expected, stderr)
    # and the product weights do collapse: the median is e^(mu T) < 1, ever smaller with T
    assert row["expected_seq_ratio_median"] == pytest.approx(math.exp(result["d_mean"] * length))


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_k3_growth_is_last_over_first_step_and_null_below_three_steps(tmp_path, steps):
    path = tmp_path / "drift.parquet"
    write_simulated(path, SimConfig(regime="drift", sequences=12 * steps, steps=steps, seed=3))
    stats = MismatchStats()
    for chunk in Dump(path).batches(whole_steps=True):
        stats.update(chunk)
    result = stats.compute().to_dict()
    if steps < 3:
        assert result["k3_growth"] is None
    else:
        by_step = result["by_step"]
        assert result["k3_growth"] == by_step[-1]["k3"] / by_step[0]["k3"] > 1.0
