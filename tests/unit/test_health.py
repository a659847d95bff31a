"""The health verdict (`iscore.advice.health`) and the published reference values it cites
(`iscore.advice.reference`), checked on simulated dumps whose source of mismatch is known, with
seeds no bundled sample uses."""

from __future__ import annotations

import pytest

from iscore.advice.health import Check
from iscore.advice.reference import bands, place, points
from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.frameworks.base import Citation, HealthBand, ReferencePoint
from iscore.passes.analysis import analyze
from iscore.passes.validation import validate
from iscore.present.report import render_html
from iscore.stats.catalogue import BANDS, METRIC_NAMES

SOURCE = Citation("a test", "https://example.org")


def _health(tmp_path, **config):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(**config))
    return analyze(path).health


def test_every_band_and_reference_point_cites_a_source():
    assert bands() and points()
    for _, band in bands():
        assert band.statistic in METRIC_NAMES and band.meaning and band.logged_as
        assert band.source.url.startswith("https://")
    for p in points():
        assert p.statistic in METRIC_NAMES and p.setting and p.model and p.logged_as
        assert p.source.url.startswith("https://")
    with pytest.raises(ValueError, match="https link"):
        Citation("no link", "example.org")


def test_the_mismatch_page_column_is_written_from_the_typed_bands():
    framework, band = bands()[0]
    assert f"{framework} {band.logged_as}: {band.describe()}" in BANDS[band.statistic]


@pytest.mark.parametrize(
    ("regime", "seed"), [("dense_bf16", 31), ("dense_bf16", 32), ("long_collapse", 33)]
)
def test_benign_noise_is_normal(tmp_path, regime, seed):
    health = _health(tmp_path, regime=regime, sequences=64, seed=seed, steps=2)
    assert health.verdict == "normal", health.reasons
    assert [s.verdict for s in health.by_step] == ["normal", "normal"]
    assert all(c.within for c in health.checks)


@pytest.mark.parametrize("seed", [34, 35])
def test_fp8_like_noise_is_not_normal(tmp_path, seed):
    health = _health(tmp_path, regime="fp8", sequences=48, seed=seed)
    assert health.verdict == "elevated"
    outside = {c.band.statistic for c in health.outside}
    assert {"k3", "token_mult_prob_error"} <= outside


def test_a_stale_replica_is_broken_in_the_steps_it_scores(tmp_path):
    health = _health(tmp_path, sequences=64, seed=36, broken_share=0.05, steps=2)
    assert health.verdict == "broken" and health.flags == ("broken_sequences",)
    assert [s.verdict for s in health.by_step] == ["broken", "broken"]
    assert "broken sequences" in health.by_step[0].reasons[0]


@pytest.mark.parametrize("regime", ["offset_bug", "temperature_bug"])
def test_a_semantics_bug_is_broken_in_every_step(tmp_path, regime):
    health = _health(tmp_path, regime=regime, sequences=48, seed=37, steps=2)
    assert health.verdict == "broken" and health.flags
    assert {s.verdict for s in health.by_step} == {"broken"}


def test_drift_is_judged_step_by_step(tmp_path):
    health = _health(tmp_path, regime="drift", sequences=48, seed=38, steps=5)
    verdicts = [s.verdict for s in health.by_step]
    assert verdicts[0] == "normal" and verdicts[-1] == "elevated", verdicts
    assert verdicts == sorted(verdicts, key=["normal", "elevated"].index)


def test_a_band_includes_its_limits_and_a_missing_value_is_unjudged():
    band = HealthBand("k3", None, 1e-3, "gen_kl_error", "investigate", SOURCE)
    assert band.contains(1e-3) and not band.contains(1.1e-3)
    assert Check("x", band, None).within is None and Check("x", band, 2e-3).within is False
    with pytest.raises(ValueError, match="at least one limit"):
        HealthBand("k3", None, None, "x", "x", SOURCE)


def test_a_dump_is_placed_between_the_published_points():
    low = ReferencePoint("bf16", "m", "bf16", "k3", 1e-4, "kl", SOURCE)
    high = ReferencePoint("fp8", "m", "fp8", "k3", 0.06, "kl", SOURCE)
    between = place("k3", 0.05, (low, high))
    assert (between.below, between.above) == (low, high)
    assert between.describe().startswith("your k3 (0.05) sits between bf16 of m")
    assert place("k3", 1e-5, (low, high)).describe().startswith("your k3 (1e-05) is below")
    assert place("k3", 1.0, (low, high)).above is None
    assert place("k3", 0.06, (low, high)).below == high  # a published value is at or below
    assert place("chi2_seq", 1.0, (low, high)) is None and place("k3", None) is None


def test_the_analysis_document_holds_the_verdict(tmp_path):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(regime="fp8", sequences=16, seed=39))
    document = analyze(path).to_dict()["health"]
    assert document["verdict"] == "elevated" and document["by_step"][0]["verdict"] == "elevated"
    assert {b["statistic"] for b in document["bands"]} == {b.statistic for _, b in bands()}
    assert document["reference"] and all(r["text"] for r in document["reference"])


def test_the_report_opens_with_the_verdict_its_sources_and_the_sources_of_mismatch(tmp_path):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(regime="moe_routing", sequences=32, steps=2, seed=40))
    analysis = analyze(path)
    page = render_html(analysis)
    verdict = analysis.to_dict()["health"]["verdict"]
    assert page.index(f"<div class='verdict {verdict}'>") < page.index("<h2>")
    for _, band in bands():
        assert f"<a href='{band.source.url}'>" in page
    assert "sits between" in page or "every published point" in page
    assert "Where the mismatch comes from" in page and "MoE routing flips" in page
    assert page.count("<td class='") >= 2  # a verdict per step


@pytest.mark.parametrize(
    "config",
    [
        {"regime": "dense_bf16"},
        {"regime": "fp8"},
        {"regime": "dense_bf16", "broken_share": 0.05},
        {"regime": "offset_bug"},
    ],
    ids=["bf16", "fp8", "stale-replica", "top-p"],
)
def test_validate_summarizes_the_same_verdict_without_torch(tmp_path, config):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(sequences=48, seed=41, **config))
    report = validate(Dump(path), max_tokens=20_000)  # several chunks
    health = analyze(path).health
    assert report.health["verdict"] == health.verdict
    if health.verdict == "broken":  # validate tests broken sequences and the ratio alone
        codes = report.health["summary"].removeprefix("broken: ").split(", ")
        assert codes and set(codes) <= set(health.flags)
    else:
        assert report.health["summary"] == health.summary()
    assert f"  health      {report.health['summary']}" in report.render()


def test_analyze_prints_the_verdict_and_the_sources(tmp_path, capsys):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(regime="moe_routing", sequences=48, seed=42))
    assert main(["analyze", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "  health: elevated: NeMo-RL " in out and "gen_kl_error" in out
    assert "  from routing: " in out and "To do: On an MoE model" in out
