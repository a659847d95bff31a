"""`iscore diff` (`iscore.passes.diff`, `iscore.stats.bootstrap`, `iscore.advice.comparison`):
FP8-like noise against bf16-like is `worse` (and the other way round `better`) with an interval
past 1; twins of one regime are `same` at about the rate the intervals promise; the arms'
values are the analysis' own; the bootstrap is the formula's (a float64 reference here); the
verdicts read each metric's direction; the CLI gates on `--fail-on worse`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.advice.comparison import METRICS, MISMATCH_METRICS, SETTING_METRICS, Metric, verdict
from iscore.cli import main
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.errors import ConfigError
from iscore.passes.analysis import analyze
from iscore.passes.diff import diff
from iscore.stats.bootstrap import percentile_interval, resample_rows

SETTING = "verl:decoupled_geo_rs_token_tis"
TOKEN_MEANS = (
    "k3", "abs_diff_mean", "chi2_token", "token_mult_prob_error", "ratio_mean", "far_share",
)  # fmt: skip
"""The metrics compared per step, and so with a trend."""


def _dump(folder: Path, regime: str, seed: int, steps: int = 2, sequences: int = 48) -> Path:
    path = folder / f"{regime}_{seed}.parquet"
    if not path.exists():
        write_simulated(
            path, SimConfig(regime, sequences=sequences, steps=steps, median_len=160, seed=seed)
        )
    return path


@pytest.fixture(scope="module")
def arms(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("diff")
    return {"dense_bf16": _dump(folder, "dense_bf16", 1), "fp8": _dump(folder, "fp8", 2)}


def test_fp8_against_bf16_is_worse_and_the_other_way_round_better(arms):
    worse = diff(arms["dense_bf16"], arms["fp8"], resamples=300)
    better = diff(arms["fp8"], arms["dense_bf16"], resamples=300)
    assert not worse.paired
    for name in ("k3", "abs_diff_mean"):
        assert worse.metric(name).verdict == "worse" and worse.metric(name).ci[0] > 1
        assert better.metric(name).verdict == "better" and better.metric(name).ci[1] < 1


def test_twins_of_one_regime_are_the_same_at_the_promised_rate(tmp_path):
    """40 pairs of dumps of one regime, new seeds: each metric's false alarms (a verdict other
    than same) at most 6 of 40, where a 95% interval promises 2 (P(X >= 7) < 0.5% then)."""
    alarms = dict.fromkeys((m.name for m in MISMATCH_METRICS), 0)
    for seed in range(40):
        a = _dump(tmp_path, "dense_bf16", 100 + 2 * seed, steps=1, sequences=64)
        b = _dump(tmp_path, "dense_bf16", 101 + 2 * seed, steps=1, sequences=64)
        for m in diff(a, b, resamples=200, seed=seed).metrics:
            alarms[m.name] += m.verdict != "same"
    assert max(alarms.values()) <= 6, alarms


def test_the_arms_values_are_the_analysis_own(arms):
    found = diff(arms["dense_bf16"], arms["fp8"], [SETTING], resamples=50)
    for side, path in (("baseline", arms["dense_bf16"]), ("candidate", arms["fp8"])):
        analysis = analyze(path, [SETTING])
        for m in found.metrics:
            if hasattr(analysis.mismatch, m.name):
                assert getattr(m, side) == getattr(analysis.mismatch, m.name), (side, m.name)
        (setting,) = found.settings
        for m in setting.metrics:
            assert getattr(m, side) == getattr(analysis.settings[0], m.name), (side, m.name)
        steps = {row["step"]: row for row in analysis.mismatch.by_step}
        for row in found.by_step:
            for m in row["metrics"]:
                if m.name in steps[row["step"]]:
                    expected = steps[row["step"]][m.name]
                    assert getattr(m, side) == pytest.approx(expected, rel=1e-12), m.name
    assert found.arms[1].tokens == analyze(arms["fp8"]).mismatch.tokens


def _reference_draws(path: Path, resamples: int, seed: int) -> tuple[float, np.ndarray]:
    """abs_diff_mean (sum |d| / sum T, in float64) and its value on each resample: each
    step's sequences drawn from its own, uniformly with replacement, one uniform a place."""
    table = pq.read_table(path)
    lengths = np.array([len(x) for x in table["rollout_logprob"].to_pylist()])
    d = np.abs(
        np.concatenate(table["train_logprob"].to_pylist()).astype(np.float64)
        - np.concatenate(table["rollout_logprob"].to_pylist())
    )
    sums = np.add.reduceat(d, np.r_[0, np.cumsum(lengths)[:-1]])
    step = table["step"].to_numpy()
    order = np.argsort(step, kind="stable")
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        u = rng.random(step.size)
        rows = np.empty(step.size, np.int64)
        for s in np.unique(step):
            at = np.flatnonzero(step[order] == s)
            rows[at] = order[at][np.floor(u[at] * at.size).astype(np.int64)]
        draws.append(sums[rows].sum() / lengths[rows].sum())
    return sums.sum() / lengths.sum(), np.array(draws)


def test_the_bootstrap_is_the_formulas(arms):
    """Unpaired, the baseline is resampled with `seed` and the candidate with `seed + 1`; the
    interval is the 2.5% and 97.5% quantiles of their ratio."""
    base, base_draws = _reference_draws(arms["dense_bf16"], 100, seed=7)
    cand, cand_draws = _reference_draws(arms["fp8"], 100, seed=8)
    found = diff(arms["dense_bf16"], arms["fp8"], resamples=100, seed=7).metric("abs_diff_mean")
    assert found.baseline == pytest.approx(base, rel=1e-6)
    assert found.candidate == pytest.approx(cand, rel=1e-6)
    lo, hi = np.quantile(cand_draws / base_draws, [0.025, 0.975])
    assert found.ci == pytest.approx((lo, hi), rel=1e-6)


def test_resamples_keep_each_steps_count_and_draw_only_its_own():
    step = np.array([3, 1, 3, 3, 1, 2])
    for row in resample_rows(step, 50, seed=3):
        assert sorted(step[row].tolist()) == sorted(step.tolist())
    first = [r.tolist() for r in resample_rows(step, 5, seed=3)]
    assert first == [r.tolist() for r in resample_rows(step, 5, seed=3)]
    assert first != [r.tolist() for r in resample_rows(step, 5, seed=4)]


def test_a_percentile_interval_needs_half_its_draws_finite():
    assert percentile_interval(2.0, np.array([1.0, 3.0, np.nan])).lo == pytest.approx(1.05)
    nan = percentile_interval(2.0, np.array([1.0, np.nan, np.inf, np.nan]))
    assert math.isnan(nan.lo) and math.isnan(nan.hi) and nan.value == 2.0


@pytest.mark.parametrize(
    ("bad", "ratio_ci", "difference_ci", "expected"),
    [
        ("higher", (1.01, 1.2), None, "worse"),
        ("higher", (0.5, 0.99), None, "better"),
        ("higher", (0.9, 1.1), None, "same"),
        ("higher", (1.0, 1.0), None, "same"),  # an end exactly at 1 holds 1
        ("lower", (1.01, 1.2), None, "better"),
        ("lower", (0.5, 0.99), None, "worse"),
        ("away_from_1", (1.5, 3.0), None, "worse"),
        ("higher", (math.nan, math.nan), (0.01, 0.02), "worse"),  # no ratio: the difference
        ("lower", (math.nan, math.nan), (0.01, 0.02), "better"),
        ("higher", (math.nan, math.nan), (-0.01, 0.02), "same"),
        ("higher", (math.nan, math.nan), None, "same"),
    ],
)
def test_each_verdict_reads_its_metrics_direction(bad, ratio_ci, difference_ci, expected):
    assert verdict(Metric("m", bad, ""), ratio_ci, difference_ci) == expected


def test_distance_from_one_is_compared_where_one_is_ideal():
    assert METRICS["ratio_mean"].badness(0.98) == pytest.approx(0.02)
    assert METRICS["k3"].badness(0.02) == 0.02
    assert {m.name for m in SETTING_METRICS} >= {"lr_scale", "ess", "token_masked_fraction"}


def test_the_same_rollouts_scored_twice_are_compared_paired(arms, tmp_path):
    table = pq.read_table(arms["dense_bf16"])
    noisier = [
        np.minimum(np.asarray(t) + 0.05 * np.random.default_rng(k).standard_normal(len(t)), 0)
        for k, t in enumerate(table["train_logprob"].to_pylist())
    ]
    column = table.schema.get_field_index("train_logprob")
    rescored = tmp_path / "rescored.parquet"
    field = table.schema.field("train_logprob")
    pq.write_table(table.set_column(column, field, pa.array(noisier, field.type)), rescored)
    found = diff(arms["dense_bf16"], rescored, resamples=200)
    assert found.paired and found.metric("k3").verdict == "worse"
    alone = diff(arms["dense_bf16"], arms["dense_bf16"], resamples=50)
    assert alone.paired and all(m.ci == (1.0, 1.0) for m in alone.metrics if m.ratio)
    assert all(m.verdict == "same" for m in alone.metrics)


def test_the_same_seed_gives_the_same_intervals(arms):
    one = diff(arms["dense_bf16"], arms["fp8"], resamples=100, seed=5)
    two = diff(arms["dense_bf16"], arms["fp8"], resamples=100, seed=5)
    other = diff(arms["dense_bf16"], arms["fp8"], resamples=100, seed=6)
    assert one.to_dict() == two.to_dict()
    assert one.metric("k3").ci != other.metric("k3").ci
    with pytest.raises(ConfigError, match="`resamples` to be an int >= 2"):
        diff(arms["dense_bf16"], arms["fp8"], resamples=1)


def test_the_cli_writes_the_document_and_gates_on_worse(arms, tmp_path, capsys):
    out = tmp_path / "d.json"
    argv = ["diff", str(arms["dense_bf16"]), str(arms["fp8"]), "--preset", SETTING, "-q"]
    assert main([*argv, "--json", str(out), "--name", "A=bf16", "--name", "B=fp8"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "iscore.diff" and [a["name"] for a in doc["arms"]] == ["bf16", "fp8"]
    assert {"name", "baseline", "candidate", "ratio", "ci", "verdict"} <= doc["metrics"][0].keys()
    assert doc["settings"][0]["setting"] == SETTING and doc["paired"] is False
    assert main([*argv, "--fail-on", "worse", "--resamples", "100"]) == 1
    said = capsys.readouterr().out
    assert "k3: " in said and "failed: worse on k3" in said
    same = ["diff", str(arms["fp8"]), str(arms["fp8"]), "-q", "--fail-on", "worse"]
    assert main([*same, "--resamples", "50"]) == 0
    assert main(["diff", str(arms["fp8"]), str(arms["fp8"]), "--name", "C=x", "-q"]) == 2
    assert "Expected --name to be A=LABEL or B=LABEL, but got C=x" in capsys.readouterr().err


def test_the_sum_forms_equal_the_statistics_own_functions(arms):
    """Each resample's metrics come from sums over the sequences it draws
    (`iscore.stats.bootstrap`); on the dump and on a resample they equal what
    `mismatch_scalars` and `setting_scalars` compute, under every framework's aggregation."""
    from iscore.bench import SETTINGS
    from iscore.passes.analysis import accumulate
    from iscore.passes.diff import _Numbers
    from iscore.stats.bootstrap import counts

    done = accumulate(arms["fp8"], list(SETTINGS), device=torch.device("cpu"))
    numbers = _Numbers.of(done, "x")
    modes = {(agg.mode, agg.shrinks) for agg in numbers.aggregations}
    assert len(modes) >= 2, modes
    steps = sorted(set(numbers.steps.tolist()))
    names, matrix = numbers.sum_columns(steps)
    row = next(resample_rows(numbers.steps, 1, seed=11))
    for drawn in (None, row):
        c = np.ones((1, matrix.shape[0])) if drawn is None else counts([drawn], matrix.shape[0])
        sums = dict(zip(names, (c @ matrix).T, strict=True))
        fast = numbers.from_sums(sums, steps)
        slow = numbers.values(numbers.resampled(drawn))
        slow |= {
            ("step", k): v for k, v in numbers.by_step(numbers.resampled(drawn), steps).items()
        }
        assert slow.keys() <= fast.keys()
        for key, value in slow.items():
            if math.isnan(value):
                assert math.isnan(fast[key][0]), key
            else:
                assert fast[key][0] == pytest.approx(value, rel=1e-9, abs=1e-15), key


def test_twins_of_several_steps_show_no_trend_at_the_promised_rate(tmp_path):
    """30 pairs of 4-step dumps of one regime: each metric's ratio is rising or falling over the
    steps (its slope's interval excludes 0) at most 6 of 30 times, where 95% promises 1.5."""
    alarms = dict.fromkeys((m.name for m in MISMATCH_METRICS if m.name in TOKEN_MEANS), 0)
    for seed in range(30):
        a = _dump(tmp_path, "dense_bf16", 300 + 2 * seed, steps=4, sequences=32)
        b = _dump(tmp_path, "dense_bf16", 301 + 2 * seed, steps=4, sequences=32)
        for t in diff(a, b, resamples=200, seed=seed).trend:
            alarms[t.name] += t.direction != "flat"
    assert max(alarms.values()) <= 6, alarms


def test_a_growing_mismatch_is_a_rising_trend_of_the_least_squares_slope(tmp_path):
    base = tmp_path / "base.parquet"
    grown = tmp_path / "grown.parquet"
    write_simulated(base, SimConfig(sequences=48, steps=5, median_len=160, seed=7))
    write_simulated(
        grown, SimConfig(sequences=48, steps=5, median_len=160, seed=8, grow_from=1, growth=1.4)
    )
    found = diff(base, grown, resamples=300)
    assert len(found.trend) == len(TOKEN_MEANS)
    k3 = next(t for t in found.trend if t.name == "k3")
    assert k3.direction == "rising" and k3.ci[0] > 0 and k3.steps == 5
    # The slope is the float64 least-squares fit of log(ratio) on the step.
    steps = [row["step"] for row in found.by_step]
    ratios = [next(m.ratio for m in row["metrics"] if m.name == "k3") for row in found.by_step]
    assert k3.slope == pytest.approx(np.polyfit(steps, np.log(ratios), 1)[0], rel=1e-9)
    doc = found.to_dict()["trend"]
    assert {t["name"] for t in doc} == set(TOKEN_MEANS) and doc[0]["direction"] in (
        "rising", "falling", "flat"
    )  # fmt: skip


def test_two_steps_have_no_trend(arms):
    assert diff(arms["dense_bf16"], arms["fp8"], resamples=50).trend == ()
