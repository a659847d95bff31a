"""Per-setting statistics against a float64 reference; analyze streaming; JSON and HTML outputs."""

from __future__ import annotations

import html
import itertools
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from iscore import Dump, load
from iscore.advice.targets import Targets
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.errors import ConfigError
from iscore.frameworks.base import Aggregation
from iscore.frameworks.resolve import parse_config, presets, resolve
from iscore.packed import kernels
from iscore.passes.analysis import analyze
from iscore.passes.document import SCHEMA_VERSION
from iscore.present.report import render_html
from iscore.present.tables import SUMMARY_COLUMNS
from iscore.stats.setting import SettingStats, _per_sequence, aggregation_of
from tests.unit.frameworks.conftest import edge_batch, make_batch
from tests.unit.test_mismatch import assert_same

SPECS = [
    "verl:decoupled_token_is",
    "verl:decoupled_seq_is",
    "verl:decoupled_geo_rs",
    "verl:decoupled_token_icepop",
    "trl:trl_default",
    "openrlhf:openrlhf_tis",
    "skyrl:skyrl_geo_mask",
    "nemo_rl:nemo_gspo_is",
    "slime:slime_mis_example",
]
BATCH_NORMALIZED = {
    "framework": "verl",
    "algorithm": {
        "rollout_correction": {
            "rollout_is": "token",
            "rollout_is_threshold": 1.5,
            "rollout_is_batch_normalize": True,
        }
    },
}


def reference(batch, result, aggregation: Aggregation) -> dict[str, float]:
    """The statistics from their definitions (iscore/stats/setting.py docstring), per sequence."""
    cu = batch.cu_seqlens.tolist()
    m_all = batch.loss_mask.numpy()
    w_all = result.weight.double().numpy()
    raw_all = result.raw.double().numpy()
    pre_all = w_all if result.pre_norm is None else result.pre_norm.double().numpy()
    keep_all = result.keep.numpy()
    weighted = bool(np.any(pre_all[keep_all & m_all] != 1.0))
    per_seq, w_tokens, high, low, rejected = [], [], 0, 0, 0
    for a, b in itertools.pairwise(cu):
        m = m_all[a:b]
        if not m.any():
            continue
        w, raw, pre, keep = w_all[a:b][m], raw_all[a:b][m], pre_all[a:b][m], keep_all[a:b][m]
        per_seq.append((w.sum(), m.sum(), keep.sum(), (w > 0).sum()))
        w_tokens.append(w)
        if weighted:
            active = keep & (pre > 0)
            high += (active & (pre < raw * (1 - 1e-6))).sum()
            low += (active & (pre > raw * (1 + 1e-6))).sum()
        rejected += (~keep).sum()
    w = np.concatenate(w_tokens)
    sums = np.array(per_seq, dtype=np.float64)
    n = w.size
    if aggregation.mode == "seq-mean-token-mean":
        lr = np.mean(sums[:, 0] / sums[:, 1])
    elif aggregation.shrinks:
        lr = w.sum() / sums[:, 2].sum()
    else:
        lr = w.sum() / n
    return {
        "weight_mean": w.mean(),
        "weight_mean_seq": np.mean(sums[:, 0] / sums[:, 1]),
        "ess": w.sum() ** 2 / (n * (w**2).sum()),
        "truncated_high_fraction": high / n,
        "truncated_low_fraction": low / n,
        "token_masked_fraction": (w == 0).mean(),
        "token_rejected_fraction": rejected / n,
        "seq_masked_fraction": np.mean(sums[:, 3] == 0),
        "lr_scale": lr,
        "tokens": n,
        "sequences": len(per_seq),
    }


@pytest.fixture(params=["numba", "reference"])
def both_paths(request, monkeypatch):
    """The compiled kernels from the first token, then the numpy/torch reference."""
    if request.param == "numba" and not kernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv(kernels.ENV, request.param)


@pytest.mark.parametrize("setting", [*SPECS, BATCH_NORMALIZED])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.usefixtures("both_paths")
def test_statistics_match_float64_reference(setting, seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 3, *rng.lognormal(5, 1, 25).astype(int).clip(1, 3000).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=[0.05, 0.3][seed])
    spec = resolve(setting)
    result = spec.replay(batch)
    stats = SettingStats(spec)
    stats.update(batch, result)
    got = stats.compute().to_dict()
    for key, value in reference(batch, result, stats.aggregation).items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    applied = result.weight.double().numpy()[batch.loss_mask.numpy()]
    for q in (0.01, 0.1, 0.5, 0.9, 0.99):
        exact = float(np.quantile(applied, q, method="inverted_cdf"))
        estimate = got["weight_quantiles"][f"p{q * 100:g}"]
        assert estimate == pytest.approx(exact, rel=0.025, abs=1e-300), q
    assert got["weight_min"] == applied.min() and got["weight_max"] == pytest.approx(applied.max())


@pytest.mark.usefixtures("both_paths")
def test_edge_batch_counts_fully_masked_and_zero_weight_sequences():
    batch = edge_batch()
    spec = resolve("trl:trl_default")  # sequence product masked above 3
    stats = SettingStats(spec)
    result = spec.replay(batch)
    stats.update(batch, result)
    got = stats.compute().to_dict()
    ref = reference(batch, result, stats.aggregation)
    assert got["sequences"] == batch.num_sequences - 1 == ref["sequences"]
    assert got["seq_masked_fraction"] == pytest.approx(ref["seq_masked_fraction"])
    assert got["seq_masked_fraction"] > 0  # the S = 100 sequence (ratio inf) is masked


def test_aggregation_follows_each_framework():
    assert aggregation_of(resolve("verl:decoupled_geo_rs")) == Aggregation("token-mean", True)
    assert aggregation_of(resolve("verl:bypass_pg_geo_rs")) == Aggregation("token-mean", False)
    assert aggregation_of(resolve("nemo_rl:nemo_gspo_is")).mode == "seq-mean-token-mean"
    assert aggregation_of(resolve("slime:slime_tis")).mode == "seq-mean-token-mean"
    per_token = resolve({"framework": "slime", "args": "--use-tis --calculate-per-token-loss"})
    assert aggregation_of(per_token).mode == "token-mean"
    assert aggregation_of(resolve({"framework": "trl", "loss_type": "grpo"})).mode == (
        "seq-mean-token-mean"
    )


def test_lr_scale_of_geo_mask_renormalizes_surviving_tokens_in_verl_only():
    batch = make_batch([50] * 20, seed=4, sigma=0.3)
    verl = analyze(batch, ["verl:decoupled_geo_rs"]).settings[0]
    assert verl.token_masked_fraction > 0.2
    assert verl.lr_scale == pytest.approx(1.0)  # kept tokens, kept denominator
    bypass = analyze(batch, ["verl:bypass_pg_geo_rs"]).settings[0]
    assert bypass.lr_scale == pytest.approx(1 - bypass.token_masked_fraction)


def test_presets_and_resolution(tmp_path):
    assert "verl:decoupled_geo_rs" in presets() and len(presets()) > 30
    assert resolve("decoupled_geo_rs") is presets()["verl:decoupled_geo_rs"]
    with pytest.raises(ConfigError, match="neither a config file nor a preset; see `iscore pre"):
        resolve("nope")
    # A near miss is named; a framework's prefix lists that framework's presets only.
    with pytest.raises(ConfigError, match=r"\(did you mean 'verl:decoupled_geo_rs'\?\)") as e:
        resolve("verl:decoupled_geo")
    assert "verl's presets: verl:bypass_pg_geo_rs," in str(e.value) and "slime:" not in str(e.value)
    path = tmp_path / "c.yaml"
    path.write_text("framework: trl\nvllm_importance_sampling_mode: token_truncate\n")
    assert resolve(str(path)).mode == "token_truncate"


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "d.parquet"
    write_simulated(path, SimConfig(regime="drift", sequences=24, steps=4, median_len=200))
    return path


def test_analyze_streamed_equals_whole(simulated):
    settings = [*SPECS, BATCH_NORMALIZED]
    whole = analyze(load(simulated), settings).to_dict()
    streamed = analyze(Dump(simulated), settings, max_tokens=500).to_dict()
    assert whole["source"].pop("dropped") is None  # a loaded batch: what was dropped is unknown
    assert streamed["source"].pop("dropped") == {"sequences": 0, "tokens": 0, "invalid_values": {}}
    for doc in (whole, streamed):
        doc["source"].pop("files")
    assert_same(streamed, whole)


def test_json_document(simulated, tmp_path):
    result = analyze(simulated, ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"])
    path = tmp_path / "a.json"
    result.write_json(path)
    doc = json.loads(path.read_text())  # strict JSON: no NaN
    assert doc["schema_version"] == SCHEMA_VERSION
    for key in (
        "k1",
        "k2",
        "k3",
        "k3_reverse",
        "chi2_token",
        "chi2_seq",
        "abs_diff_mean",
        "abs_diff_max",
        "token_mult_prob_error",
    ):
        assert isinstance(doc["mismatch"][key], float), key
    for setting in doc["settings"]:
        for key in (
            "name",
            "framework",
            "weight_mean",
            "ess",
            "truncated_high_fraction",
            "truncated_low_fraction",
            "token_masked_fraction",
            "seq_masked_fraction",
            "lr_scale",
            "by_length",
            "by_step",
        ):
            assert key in setting, key
        assert [row["step"] for row in setting["by_step"]] == [0, 1, 2, 3]
    assert doc["mismatch"]["names"]["k3"][0] == "verl rollout_corr/k3_kl"
    frames = result.frames()
    assert list(frames["settings"]["setting"]) == ["decoupled_seq_is", "skyrl_geo_mask"]
    assert len(frames["settings_by_step"]) == 8


def test_html_report_is_self_contained(simulated):
    result = analyze(simulated, ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"])
    page = render_html(result)
    for key in (
        "weights",
        "raw",
        "collapse",
        "mask_by_length",
        "lr_scale",
        "signed_diff",
        "abs_diff",
        "by_prob",
        "by_pos",
        "by_length",
        "by_step",
    ):
        assert f"id='fig-{key}'" in page and f"Plotly.newPlot('fig-{key}'" in page, key
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", page)  # nothing to fetch
    assert "drift" in page  # the drift regime's flag is shown


def test_html_report_holds_the_configs_and_the_worst_sequences(simulated):
    hostile = replace(resolve("verl:decoupled_geo_rs"), name="</pre><script>alert(1)</script>")
    result = analyze(simulated, [hostile, "skyrl:skyrl_geo_mask"])
    page = render_html(result)
    configs = re.findall(r"<pre>(.*?)</pre>", page, flags=re.S)
    assert len(configs) == 2
    # Each block reads back (unescaped) as the setting it names.
    for text, setting in zip(configs, result.settings, strict=True):
        spec = parse_config(yaml.safe_load(html.unescape(text)))
        assert (spec.framework, spec.name) == (setting.framework, setting.name)
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    worst = result.mismatch.worst_sequences
    assert worst and "Worst sequences" in page
    first = re.search(r"Worst sequences.*?<tr><td>(.*?)</td><td>(.*?)</td>", page, flags=re.S)
    assert (first[1], first[2]) == (str(worst[0]["step"]), str(worst[0]["seq_id"]))


def test_html_report_grades_the_settings_against_the_targets(simulated):
    result = analyze(simulated, ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"])

    def grades(page: str, row: int) -> dict[str, str]:
        table = re.search(r"<h2>Settings</h2>(.*?)</table>", page, flags=re.S)[1]
        cells = re.findall(r"<tr><td>.*?</td><td>.*?</td>(.*?)</tr>", table, flags=re.S)[row]
        marks = re.findall(r"<td(?: class='(\w+)')?>", cells)
        return {key: mark for (key, _, _), mark in zip(SUMMARY_COLUMNS, marks, strict=True)}

    page = render_html(result)
    for row, setting in enumerate(result.settings):
        expected = {k: Targets().grade(k, setting.value(k)) or "" for k, _, _ in SUMMARY_COLUMNS}
        assert grades(page, row) == expected
    assert grades(page, 0)["lr_scale"] in ("fair", "bad")  # product weights collapse
    assert grades(page, 1)["lr_scale"] == "good"
    # The app's Export passes the session's targets.
    lenient = Targets(lr_scale=(0.001, 1.25))
    assert grades(render_html(result, lenient), 0)["lr_scale"] == "good"
    assert " · 1 step · " in render_html(analyze(make_batch([3, 4]), []))


@pytest.mark.parametrize(
    ("lengths", "values", "constant"),
    [
        ([2, 3, 1], [1, 1, 2, 2, 2, 3], True),
        ([2, 3, 1], [1, 1, 1, 1, 1, 1], True),  # the same value across sequences too
        ([2, 0, 3, 0, 1], [1, 1, 2, 2, 2, 3], True),  # empty sequences
        ([6], [4, 4, 4, 4, 4, 4], True),
        ([2, 3, 1], [1, 1, 2, 0, 2, 3], False),  # a masked token inside a sequence
        ([2, 3, 1], [1, 2, 2, 2, 2, 3], False),  # a change one token after a start
        ([6], [4, 4, 4, 4, 4, 5], False),
        ([1, 1, 1], [1, float("nan"), 3], False),  # NaN equals nothing
        ([3], [float("nan")] * 3, False),
        ([1, 1, 1, 1], [1, 2, 3, 4], True),  # one-token sequences: always constant
    ],
)
def test_per_sequence_finds_constant_values_as_a_repeat_would(lengths, values, constant):
    batch = make_batch(lengths)
    x = torch.tensor(values, dtype=torch.float64)
    found = _per_sequence(x, batch)
    nonempty = [n for n in lengths if n]
    starts = np.cumsum([0, *lengths])[:-1][np.array(lengths) > 0]
    reference = np.array_equal(np.repeat(np.asarray(values)[starts], nonempty), values)
    assert (found is not None) == constant == reference
    if constant:
        assert found[0].tolist() == np.asarray(values)[starts].tolist()
        assert found[1].tolist() == nonempty
