"""The trend of a run: its per-step table and the events found in it, on simulated runs whose
scheduled change (`iscore simulate --grow-from / --broken-from`) is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, read_truth, write_run, write_simulated
from iscore.frameworks.resolve import resolve
from iscore.passes.analysis import analyze
from iscore.passes.replay import replay
from iscore.stats.mismatch import MismatchStats
from iscore.stats.setting import SettingStats

SETTINGS = ["skyrl:skyrl_geo_mask", "verl:decoupled_token_is"]


def _run(tmp_path_factory, ranks: int = 1, **config) -> tuple:
    folder = tmp_path_factory.mktemp("run") / "run"
    write_run(folder, SimConfig(sequences=48, median_len=200, **config), ranks=ranks)
    return folder, analyze(folder, SETTINGS)


def _events(analysis) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in analysis.trend.events if e.kind != "setting_degrades"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_growth_is_found_within_three_steps_of_where_it_began(tmp_path_factory, seed):
    folder, a = _run(tmp_path_factory, steps=20, seed=seed, grow_from=12)
    grow_from = read_truth(next(folder.rglob("*.parquet"))).config.grow_from
    (growth,) = _events(a)
    assert growth[0] == "growth" and grow_from <= growth[1] <= grow_from + 3
    # The drift flag is the same rise, from the same step.
    (drift,) = [f for f in a.flags if f.code == "drift"]
    assert f"rises from step {growth[1]} on" in drift.message


@pytest.mark.parametrize(("seed", "regime", "ranks"), [(4, "dense_bf16", 1), (5, "fp8", 2)])
def test_broken_sequences_are_found_at_the_step_they_appear(tmp_path_factory, seed, regime, ranks):
    _, a = _run(
        tmp_path_factory,
        ranks,
        steps=14,
        seed=seed,
        regime=regime,
        broken_from=10,
        broken_share=0.06,
    )
    assert _events(a) == [("broken_sequences", 10)]  # and not taken for growth
    counts = [row["broken_sequences"] for row in a.trend.rows]
    assert counts[:10] == [0] * 10 and min(counts[10:]) >= 1


@pytest.mark.parametrize(("seed", "regime"), [(6, "dense_bf16"), (7, "moe_routing"), (8, "fp8")])
def test_a_flat_run_has_no_event(tmp_path_factory, seed, regime):
    _, a = _run(tmp_path_factory, steps=16, seed=seed, regime=regime)
    assert a.trend.events == ()
    assert not [f for f in a.flags if f.code == "drift"]


def test_an_offset_is_found_at_its_first_step(tmp_path_factory):
    _, a = _run(tmp_path_factory, steps=4, seed=9, regime="offset_bug")
    assert _events(a) == [("offset", 0)]
    assert "<e^d> = 0.97" in a.trend.events[0].evidence


def test_a_setting_that_stops_meeting_the_targets_is_named_from_that_step(tmp_path_factory):
    """A geometric mask that keeps every sequence on the early steps drops most of them
    once the mismatch grows; token TIS stays within the targets."""
    _, a = _run(tmp_path_factory, steps=20, seed=10, grow_from=12)
    (event,) = [e for e in a.trend.events if e.kind == "setting_degrades"]
    assert event.setting == "skyrl_geo_mask" and 12 <= event.step <= 15
    assert event.metric.startswith("skyrl_geo_mask_")
    masked = [row["skyrl_geo_mask_seq_masked_fraction"] for row in a.trend.rows]
    assert max(masked[:12]) <= 0.05 and min(masked[event.step :]) > 0.05


def test_the_trend_table_joins_the_by_step_tables(tmp_path_factory):
    _, a = _run(tmp_path_factory, steps=5, seed=11)
    table = a.trend.table()
    assert table.column_names == a.trend.columns
    assert table["step"].to_pylist() == a.source["steps"]
    assert table["k3"].to_pylist() == [row["k3"] for row in a.mismatch.by_step]
    lr = [row["lr_scale"] for row in a.settings[1].by_step]
    assert table["decoupled_token_is_lr_scale"].to_pylist() == lr
    doc = a.to_dict()["trend"]
    assert doc["columns"] == a.trend.columns and len(doc["steps"]) == 5
    assert doc["settings"][0] == {"name": "skyrl_geo_mask", "prefix": "skyrl_geo_mask"}


def test_an_analysis_streamed_in_chunks_equals_the_whole_exactly(tmp_path):
    """Each step is analyzed on its own, so where the chunks end changes nothing, not even
    the last digit (the JSON, byte for byte)."""
    path = tmp_path / "d.parquet"
    write_simulated(path, SimConfig("moe_routing", sequences=24, steps=5, median_len=150, seed=12))
    whole = analyze(path, SETTINGS, max_tokens=10**9).to_dict()
    streamed = analyze(path, SETTINGS, max_tokens=3000).to_dict()
    assert json.dumps(streamed, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_accumulator_states_round_trip(tmp_path):
    path = tmp_path / "d.parquet"
    write_simulated(path, SimConfig("fp8", sequences=16, steps=3, median_len=100, seed=13))
    spec = resolve("verl:decoupled_geo_rs_token_tis")
    mismatch, setting = MismatchStats(), SettingStats(spec)
    for batch in Dump(path).batches(whole_steps=True):
        mismatch.update(batch)
        setting.update(batch, replay(batch, spec))
    back = MismatchStats.from_state(mismatch.state())
    assert json.dumps(back.compute().to_dict(), default=str) == json.dumps(
        mismatch.compute().to_dict(), default=str
    )
    again = SettingStats.from_state(spec, setting.state())
    assert json.dumps(again.compute().to_dict(), default=str) == json.dumps(
        setting.compute().to_dict(), default=str
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("seq"),
        lambda s: s.update({"seq": s["seq"][:, :-1]}),
        lambda s: s.update({"seq": s["seq"][:-1]}),
        lambda s: s.update({"step": s["step"].astype(np.float64)}),
        lambda s: s.update({"seq_id": s["seq_id"][:-7]}),
        lambda s: s.update({"neg_hist.bins": s["neg_hist.bins"] + [[10**6], [0]]}),
        lambda s: s.update({"neg_hist.bins": s["neg_hist.bins"] * [[1], [-1]]}),
        lambda s: s.update({"neg_hist.scalars": s["neg_hist.scalars"] + 0.5}),
        lambda s: s.update({"worst.values": s["worst.values"][:3]}),
        lambda s: s.update({"noise": s["noise"][:, :3]}),
        lambda s: s.update({"step_hist.scalars": np.repeat(s["step_hist.scalars"][:1], 2, 0)}),
        lambda s: s.update({"joint.cells": s["joint.cells"][:, [0, 0]]}),
    ],
)
def test_a_damaged_state_is_refused(damage):
    stats = MismatchStats()
    stats.update(Dump("data/drift.parquet").load())
    state = stats.state()
    damage(state)
    with pytest.raises(ValueError):
        MismatchStats.from_state(state)


def test_the_report_shows_the_trend_and_its_events(tmp_path_factory):
    from iscore.present.figures import trend_figure
    from iscore.present.report import render_html

    _, a = _run(tmp_path_factory, steps=14, seed=14, broken_from=9, broken_share=0.06)
    figure = trend_figure(a.trend)
    marks = [s["label"]["text"] for s in figure["layout"]["shapes"] if s["type"] == "line"]
    assert marks[:2] == ["median of the first 4 steps", "the early band's edge"]
    # At step 9, where the geometric mask drops them, beyond its 5% of sequences.
    assert marks[2:] == ["broken sequences, setting degrades"]
    assert [s["x0"] for s in figure["layout"]["shapes"][2:]] == [9]
    assert figure["data"][1]["x"] == list(range(9, 14))  # steps with broken sequences
    page = render_html(a)
    assert "<b>Broken sequences appeared</b> from step 9: " in page
    assert "id='fig-trend'" in page
    flat = analyze("data/fp8.parquet", SETTINGS[:1])
    assert "No event: the mismatch stays within" not in render_html(flat)  # one step: no trend


def test_one_setting_twice_gets_two_sets_of_columns():
    """Analyzing a preset beside itself with other thresholds (as the bench does) must work:
    the trend numbers the repeat's columns where the sequence table refuses them."""
    a = analyze("data/drift.parquet", ["verl:decoupled_geo_rs"] * 3)
    prefix = "verl_decoupled_geo_rs"  # named with its framework, as two of one name are
    assert a.trend.settings == (prefix, f"{prefix}_2", f"{prefix}_3")
    assert f"{prefix}_3_lr_scale" in a.trend.table().column_names


def test_the_apps_analysis_joins_the_settings_into_its_trend():
    """The app computes the mismatch once and each setting on its own: its analysis (what the
    report exported from it shows) must still carry the settings' per-step columns."""
    from iscore.frameworks.resolve import resolve
    from iscore.session.workspace import open_path

    ws = open_path("data/drift.parquet")
    spec = resolve("skyrl:skyrl_geo_mask")
    trend = ws.analysis([spec]).trend
    assert trend.settings == ("skyrl_geo_mask",)
    direct = analyze("data/drift.parquet", [spec]).trend
    assert trend.table().equals(direct.table())


def test_a_loaded_batch_judged_step_by_step_finds_what_the_analysis_reports(tmp_path_factory):
    """`noise.outside_by_step` (for a batch in memory, as the recommendation has it) and the
    streamed analysis' `by_step[].broken_sequences` are one test."""
    from iscore import load
    from iscore.packed import ops
    from iscore.stats.noise import outside_by_step

    folder, a = _run(tmp_path_factory, steps=8, seed=15, broken_from=5, broken_share=0.06)
    batch = load(folder)
    d = ops.log_ratio(batch).numpy()
    T = batch.lengths.numpy()
    signs = [np.add.reduceat(x, batch.cu_seqlens.numpy()[:-1]) for x in (d > 0, d < 0)]
    rollout = batch.rollout.double().numpy()
    broken = outside_by_step(d, rollout, T, *signs, batch.step.numpy())
    per_step = np.bincount(batch.step.numpy()[broken], minlength=8).tolist()
    assert per_step == [row["broken_sequences"] for row in a.mismatch.by_step]
    assert per_step[:5] == [0] * 5 and min(per_step[5:]) >= 1


def _followed(masked: list[float], k3: list[float]):
    """A trend built a step at a time from `by_step` rows: one IcePop setting masking
    `masked` of 10,000 tokens a step, the mismatch's k3 `k3`."""
    from iscore.advice.targets import Targets
    from iscore.advice.trend import GrowingTrend

    spec = resolve("verl:decoupled_token_is")
    trend = GrowingTrend([spec], [spec.name], Targets())
    for step, (m, k) in enumerate(zip(masked, k3, strict=True)):
        mismatch = {"tokens": 10_000, "sequences": 50, "healthy_k3": k, "broken_sequences": 0}
        setting = {"tokens": 10_000, "token_masked_fraction": m, "seq_masked_fraction": 0.0}
        trend.set(step, mismatch, [setting | {"lr_scale": 1.0, "ess": 1.0}])
    return trend.trend()


@pytest.mark.parametrize("seed", [16, 17])
def test_a_band_whose_mask_rate_stays_while_k3_rises_is_called_inert(seed):
    rng = np.random.default_rng(seed)
    k3 = [1e-4 * (1 + 0.1 * rng.random()) for _ in range(12)] + [1e-4 * 2**t for t in range(2, 8)]
    flat = [0.01 + 0.0005 * rng.standard_normal() for _ in k3]
    events = _followed(flat, k3).events
    growth = next(e for e in events if e.kind == "growth")
    (inert,) = [e for e in events if e.kind == "band_inert"]
    assert inert.step == growth.step == 12 and inert.setting == "decoupled_token_is"
    assert inert.metric == "decoupled_token_is_token_masked_fraction"
    assert "steps 15-17" in inert.evidence and "its band does not follow" in inert.evidence
    # A band whose mask rate rises with k3, or a setting that masks nothing, is not inert.
    following = flat[:12] + [0.01 * 2**t for t in range(1, 7)]
    for masked in (following, [0.0] * len(k3)):
        assert not [e for e in _followed(masked, k3).events if e.kind == "band_inert"]
    # Nor is a band that stays while k3 rises and falls back.
    back = k3[:15] + k3[:3]
    assert not [e for e in _followed(flat, back).events if e.kind == "band_inert"]


def test_the_default_alert_is_the_earlier_of_growth_and_lasting_broken_sequences():
    from iscore.advice.trend import default_alert

    k3 = [1e-4] * 12 + [1e-3] * 6
    trend = _followed([0.0] * 18, k3)
    assert default_alert(trend).what == "growth of k3" and default_alert(trend).step == 12
    assert default_alert(_followed([0.0] * 12, [1e-4] * 12)) is None
