"""Where the mismatch comes from (`iscore.stats.attribution`): each source alone, simulated with
seeds no bundled sample uses, is named, and no other is."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import iscore
from iscore.advice import attribution as advice_attribution
from iscore.advice.attribution import attribute
from iscore.dump.simulate import SimConfig, read_truth, write_simulated
from iscore.packed.batch import TokenBatch
from iscore.passes.analysis import analyze
from iscore.stats import MismatchSummary, attribution
from iscore.stats.attribution import (
    SPAN_RATIO,
    TURN_TOKENS,
    AttributionStats,
    _span_ratios,
    turn_boundary,
)
from tests.conftest import DEVICES


def _attribution(tmp_path, **config):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(**{"sequences": 64, **config}))
    return analyze(path).attribution.to_dict(), path


def _kinds(attribution):
    return [f["kind"] for f in attribution["findings"]]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"regime": "dense_bf16", "seed": 61}, ["numerics"]),
        ({"regime": "fp8", "seed": 62}, ["numerics"]),
        ({"regime": "moe_routing", "seed": 63}, ["routing", "numerics"]),
        ({"regime": "offset_bug", "seed": 64}, ["nucleus"]),
        ({"regime": "temperature_bug", "seed": 65}, ["temperature"]),
        ({"regime": "dense_bf16", "seed": 66, "broken_share": 0.05}, ["broken", "numerics"]),
        ({"regime": "drift", "seed": 67, "steps": 4, "sequences": 32}, ["drift", "numerics"]),
    ],
    ids=["bf16", "fp8", "routing", "top-p", "temperature", "stale-replica", "drift"],
)
def test_each_source_alone_is_named(tmp_path, config, expected):
    attribution, _ = _attribution(tmp_path, **config)
    assert _kinds(attribution) == expected
    for finding in attribution["findings"]:
        assert finding["evidence"] and finding["summary"] and finding["action"]


def test_the_temperature_finding_says_which_side_is_sharper(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="temperature_bug", seed=68, sequences=32)
    (finding,) = attribution["findings"]
    # The rollout samples at 0.7, the trainer at 1: d falls as the rollout's log-prob rises.
    assert finding["evidence"]["correlation"] < -0.3 and finding["evidence"]["slope"] < 0
    assert "sharper" in finding["summary"]


def test_the_nucleus_finding_estimates_the_kept_mass(tmp_path):
    attribution, path = _attribution(tmp_path, regime="offset_bug", seed=69, sequences=32)
    (finding,) = attribution["findings"]
    truth = read_truth(path).expected_ratio  # the trainer's mass on the nucleus
    assert finding["evidence"]["ratio_mean"] == pytest.approx(truth, abs=0.003)


def test_staleness_that_grows_with_the_lag_is_named_and_split_per_step(tmp_path):
    config = {"regime": "dense_bf16", "seed": 70, "steps": 4, "sequences": 32}
    attribution, path = _attribution(tmp_path, policy_sigma=0.1, policy_growth=2.0, **config)
    assert _kinds(attribution)[0] == "staleness"
    truth = read_truth(path)
    rows = attribution["by_step"]
    for row, step in zip(rows, truth.steps, strict=True):
        assert row["lag_k3"] == pytest.approx(step.kl_train_policy, rel=0.25)
        assert row["engine_k3"] == pytest.approx(step.kl_rollout_train, rel=0.5)
    lag = [r["lag_k3"] for r in rows]
    assert lag == sorted(lag) and lag[-1] > 20 * lag[0]
    evidence = attribution["findings"][0]["evidence"]
    assert evidence["lag_growth"] > 20 and evidence["engine_growth"] < 2


def test_a_small_steady_lag_leaves_the_engine_named(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="fp8", seed=71, policy_sigma=0.1)
    assert "engine" in _kinds(attribution) and "staleness" not in _kinds(attribution)
    (row,) = attribution["by_step"]
    assert row["lag_share"] < 0.5


def test_without_a_policy_there_is_no_split(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="dense_bf16", seed=72, sequences=16)
    assert attribution["by_step"][0]["lag_k3"] is None
    assert not {"staleness", "engine"} & set(_kinds(attribution))


def test_a_span_of_large_d_is_found_and_a_lone_outlier_is_not():
    rng = np.random.default_rng(0)
    noise = np.abs(rng.normal(0.0, 0.01, 600))
    span = noise.copy()
    span[200:260] *= 15  # a routing flip over 60 tokens
    lone = noise.copy()
    lone[300] = 20.0  # one far-off token
    T = np.array([600, 600, 600])
    ratios = _span_ratios(np.concatenate([noise, span, lone]), T, np.zeros(3, np.int64))
    assert ratios[0] < SPAN_RATIO < ratios[1] and ratios[2] < SPAN_RATIO


@pytest.mark.parametrize("seed", range(3))
def test_span_ratios_match_their_definition(seed):
    """Each sequence's largest mean of WINDOW consecutive |d| (all of them when shorter), each
    clipped at CLIP times its step's mean, over that mean: written out window by window, on
    empty, one-token, WINDOW - 1, WINDOW and WINDOW + 1 token sequences, several steps, one
    of them without mismatch (ratio 0)."""
    rng = np.random.default_rng(seed)
    W = attribution.WINDOW
    T = np.concatenate([[0, 1, W - 1, W, W + 1, 0], rng.integers(0, 300, 200), [W, 0]])
    steps = np.sort(rng.integers(0, 3, T.size))
    absd = np.abs(rng.standard_t(2, int(T.sum()))) * 0.01
    token_step = np.repeat(steps, T)
    absd[token_step == 2] = 0.0
    starts = np.cumsum(T) - T
    expected = np.zeros(T.size)
    for i in np.flatnonzero(T):
        mean = absd[token_step == steps[i]].mean()
        if mean > 0:
            x = np.minimum(absd[starts[i] : starts[i] + T[i]], attribution.CLIP * mean)
            w = min(T[i], W)
            expected[i] = max(x[j : j + w].mean() for j in range(T[i] - w + 1)) / mean
    np.testing.assert_allclose(_span_ratios(absd, T, steps), expected, rtol=1e-9, atol=0)


def test_streamed_in_steps_equals_read_whole(tmp_path):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(regime="moe_routing", sequences=24, steps=3, seed=73))
    batch = iscore.load(path)
    steps = [batch.select(batch.step == s) for s in range(3)]
    # Equal up to float64 summation order (a cumulative sum per chunk or over the whole).
    streamed, whole_read = analyze(steps).attribution, analyze(batch).attribution
    streamed, whole_read = streamed.to_dict(), whole_read.to_dict()
    assert _kinds(streamed) == _kinds(whole_read) == ["routing", "numerics"]
    assert streamed["by_step"] == whole_read["by_step"]
    merged = AttributionStats()
    for chunk in steps:
        part = AttributionStats()
        part.update(chunk)
        merged.merge(part)
    whole = AttributionStats()
    whole.update(batch)
    np.testing.assert_allclose(np.concatenate(merged.span), np.concatenate(whole.span), rtol=1e-12)


# ------------------------------------------------------------- routing agreement and turns


@pytest.mark.parametrize("layout", ["sequence", "token"])
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"seed": 81, "experts": 8, "routing_differ": 0.1, "routing_scale": 8.0}, "routing"),
        ({"seed": 82, "experts": 2, "routing_differ": 0.03, "routing_scale": 10.0}, "routing"),
        ({"seed": 83, "experts": 8, "routing_differ": 0.1}, None),
        ({"seed": 84, "regime": "fp8", "experts": 4, "routing_differ": 0.5}, None),
        ({"seed": 85, "turns": 4, "turn_scale": 8.0}, "retokenization"),
        ({"seed": 86, "turns": 6, "turn_scale": 5.0, "regime": "fp8"}, "retokenization"),
        ({"seed": 87, "turns": 4}, None),
        ({"seed": 88, "turns": 1, "turn_scale": 8.0}, None),  # one turn: no boundary
        ({"seed": 89, "regime": "fp8", "turns": 5}, None),
    ],
    ids=[
        "routing",
        "routing-rare",
        "benign-disagreement",
        "fp8-disagreement",
        "turns",
        "fp8-turns",
        "benign-turns",
        "one-turn",
        "fp8-benign-turns",
    ],
)
def test_the_source_is_named_exactly_when_present(tmp_path, layout, config, expected):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(**{"sequences": 64, **config}), layout=layout)
    attribution = analyze(path).attribution.to_dict()
    kinds = _kinds(attribution)
    assert ("routing" in kinds) == (expected == "routing")
    assert ("retokenization" in kinds) == (expected == "retokenization")
    assert ("routing" in kinds) is (attribution["routing"] is not None and expected == "routing")
    if expected is not None:
        (finding,) = [f for f in attribution["findings"] if f["kind"] == expected]
        assert finding["summary"] and finding["action"]
    if expected == "routing":
        finding = attribution["findings"][0]
        assert finding["title"] == "Tokens routed to other experts carry the mismatch"
        assert "R3" in finding["action"] and "routing replay" in finding["action"]
        evidence = finding["evidence"]
        assert evidence["differ_share"] == pytest.approx(config["routing_differ"], rel=0.2)
        assert evidence["k3_ratio"] > 10 and evidence["k3_share_differ"] > 0.3
    if expected == "retokenization":
        finding = attribution["findings"][0]
        assert "re-tokenizing" in finding["action"] and "mask" in finding["action"]
        assert finding["evidence"]["boundary_width"] == TURN_TOKENS


def test_spans_without_the_expert_ids_behind_them_say_so(tmp_path):
    """moe_routing's spans are routing-like noise, but the expert ids (drawn apart from them)
    do not follow it: the span finding stays, with what the ids say beside it."""
    path = tmp_path / "sim.parquet"
    config = SimConfig("moe_routing", sequences=64, seed=90, experts=8, routing_differ=0.1)
    write_simulated(path, config)
    attribution = analyze(path).attribution.to_dict()
    (finding,) = [f for f in attribution["findings"] if f["kind"] == "routing"]
    assert finding["title"] == "Spans of large |d|: MoE routing flips"
    assert finding["evidence"]["agreement"] == attribution["routing"]
    assert "do not tie the mismatch to routing" in finding["summary"]


def _reference(batch, group) -> dict:
    """The conditional statistics from their definitions, in float64 with plain Python."""
    d = (batch.train.double() - batch.rollout.double()).tolist()
    mask = batch.loss_mask.tolist()
    parts = {True: [], False: []}
    for x, m, g in zip(d, mask, group, strict=True):
        if m:
            parts[bool(g)].append(x)
    inside, rest = parts[True], parts[False]

    def k3(xs):
        return math.fsum(math.expm1(x) - x for x in xs) / len(xs) if xs else None

    def absd(xs):
        return math.fsum(abs(x) for x in xs) / len(xs) if xs else None

    def var(xs):
        return math.fsum(x * x for x in xs) / len(xs) - absd(xs) ** 2

    z = None
    if len(inside) > 1 and len(rest) > 1:
        se = math.sqrt(var(inside) / len(inside) + var(rest) / len(rest))
        z = (absd(inside) - absd(rest)) / se if se else None
    total = math.fsum(math.expm1(x) - x for x in inside + rest)
    return {
        "tokens": len(inside) + len(rest),
        "share": len(inside) / (len(inside) + len(rest)),
        "k3_in": k3(inside),
        "k3_out": k3(rest),
        "abs_in": absd(inside),
        "abs_out": absd(rest),
        "ratio": k3(inside) / k3(rest) if inside and rest and k3(rest) else None,
        "k3_share": math.fsum(math.expm1(x) - x for x in inside) / total if total else None,
        "z": z,
    }


def _boundary_reference(turn, lengths, mask) -> list[bool]:
    """The first TURN_TOKENS loss tokens of each turn after a sequence's first, token by token."""
    out, start = [], 0
    for n in lengths:
        seen, current, first = 0, None, True
        for i in range(start, start + n):
            if current is not None and turn[i] != current:
                seen, first = 0, False
            current = turn[i]
            on = not first and mask[i] and seen < TURN_TOKENS
            seen += bool(mask[i])
            out.append(on)
        start += n
    return out


def _batch(lengths, seed, *, agree_share=0.7, masked=()):
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    rollout = -rng.exponential(1.0, n)
    train = np.minimum(rollout + rng.standard_t(3, n) * 0.05, 0.0)
    mask = rng.random(n) > 0.2
    starts = np.cumsum(lengths) - lengths
    for i in masked:
        mask[starts[i] : starts[i] + lengths[i]] = False
    turn = np.concatenate([np.sort(rng.integers(0, 4, k)) for k in lengths]).astype(np.int64)
    return TokenBatch(
        rollout=torch.tensor(rollout, dtype=torch.float32),
        train=torch.tensor(train, dtype=torch.float32),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
        loss_mask=torch.tensor(mask),
        turn=torch.tensor(turn),
        routing_agrees=torch.tensor(rng.random(n) < agree_share),
    )


def _check(stats, ref, inside, outside):
    assert stats["tokens"] == ref["tokens"]
    assert stats[f"{inside}_share"] == pytest.approx(ref["share"], rel=1e-12)
    for key, want in (
        (f"k3_{inside}", ref["k3_in"]),
        (f"k3_{outside}", ref["k3_out"]),
        (f"abs_diff_mean_{inside}", ref["abs_in"]),
        (f"abs_diff_mean_{outside}", ref["abs_out"]),
        ("k3_ratio", ref["ratio"]),
        (f"k3_share_{inside}", ref["k3_share"]),
        ("z", ref["z"]),
    ):
        if want is None:
            assert stats[key] is None, key
        else:
            assert stats[key] == pytest.approx(want, rel=1e-9), key


@pytest.mark.parametrize(
    ("lengths", "options"),
    [
        ([40, 1, 17, 300, 2, 1, 90], {}),
        ([1] * 50, {}),  # one-token sequences: one turn each, no boundary
        ([60, 30, 45], {"masked": (1,)}),  # a sequence wholly outside the loss
        ([80, 80], {"agree_share": 1.0}),  # every token's routing agrees
        ([80, 80], {"agree_share": 0.0}),  # none does
    ],
    ids=["mixed", "one-token", "masked-sequence", "all-agree", "none-agree"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_conditional_statistics_equal_a_float64_reference(lengths, options, device):
    batch = _batch(lengths, seed=len(lengths), **options)
    stats = AttributionStats()
    stats.update(batch.to(device))
    summary = {"step": [0] * len(lengths), "seq_id": batch.seq_id}
    mismatch = MismatchSummary(
        tokens=0, sequences=len(lengths), by_step=[{"step": 0, "k3": 0.0}], by_length=[],
        by_prob=[], by_pos=[], abs_diff_quantiles={}, abs_diff_hist={}, signed_diff_hist={},
        joint_hist={}, worst_sequences=[], worst_tokens=[],
    )  # fmt: skip
    numbers = stats.compute(mismatch, summary, np.zeros(len(lengths), bool))
    result = attribute(numbers, mismatch, ())
    boundary = _boundary_reference(batch.turn.tolist(), lengths, batch.loss_mask.tolist())
    assert (
        turn_boundary(batch.turn.numpy(), np.array(lengths), batch.loss_mask.numpy()).tolist()
        == boundary
    )
    _check(result.turns, _reference(batch, boundary), "boundary", "rest")
    differ = (~batch.routing_agrees).tolist()
    _check(result.routing, _reference(batch, differ), "differ", "agree")
    if lengths == [1] * 50:
        assert result.turns["boundary_tokens"] == 0 and result.turns["k3_boundary"] is None
    share = options.get("agree_share")
    if share is not None:
        assert result.routing["differ_share"] == 1.0 - share
        assert result.routing["k3_ratio"] is None and result.routing["z"] is None
    assert not {"routing", "retokenization"} & set(result.kinds)
    (row,) = result.by_step
    assert row["routing_differ_share"] == result.routing["differ_share"]
    assert row["turn_k3_ratio"] == result.turns["k3_ratio"]


def test_a_finding_needs_the_ratio_the_z_and_the_tokens():
    """The thresholds, each alone failing: the sums of `_GROUP` (tokens, k3, |d|, d^2) of
    the rest, then of the group."""
    rest = [10_000.0, 10.0, 100.0, 2.0]  # k3 1e-3, |d| 0.01 with sd ~0.01

    def judged(group):
        return advice_attribution._carries(
            attribution.conditional(np.array(rest + group), "differ", "agree"), "differ", "agree"
        )

    assert judged([1_000.0, 3.0, 30.0, 1.2])  # k3 3x, |d| 0.03: z ~ 20
    assert not judged([1_000.0, 1.9, 30.0, 1.2])  # k3 1.9x
    assert not judged([1_000.0, 3.0, 10.5, 10.0])  # |d| barely above, noisy: z < 3
    assert not judged([99.0, 0.3, 3.0, 0.12])  # fewer than CONDITIONAL_TOKENS


def test_routing_and_turn_sums_merge_and_round_trip_the_state():
    batch = _batch([30, 5, 70, 12, 44], seed=3)
    parts = [batch.slice(0, 2), batch.slice(2, 5)]
    merged = AttributionStats()
    for part in parts:
        stats = AttributionStats()
        stats.update(part)
        merged.merge(AttributionStats.from_state(stats.state()))
    whole = AttributionStats()
    whole.update(batch)
    for name in ("routing", "turns"):
        np.testing.assert_allclose(getattr(merged, name)[0], getattr(whole, name)[0], rtol=1e-12)
    # A state written before these sums existed is refused (a results store computes it again).
    old = {k: v for k, v in whole.state().items() if k not in ("routing", "turns")}
    with pytest.raises(ValueError, match="routing"):
        AttributionStats.from_state(old)
    # Without the columns, there is nothing to condition on.
    plain = AttributionStats()
    plain.update(dataclasses.replace(batch, turn=None, routing_agrees=None, _seq_index=[]))
    assert plain.state()["routing"].shape == (0, 9) and not plain.turns


def test_the_command_and_the_report_carry_the_findings(tmp_path, capsys):
    from iscore.cli import main

    path, page, doc = (tmp_path / n for n in ("moe.parquet", "a.html", "a.json"))
    sources = "--experts 4 --routing-differ 0.1 --routing-scale 8 --turns 3 --turn-scale 8"
    code = main(["simulate", str(path), "--sequences", "48", "--seed", "92", *sources.split()])
    assert code == 0
    assert main(["analyze", str(path), "-q", "--html", str(page), "--json", str(doc)]) == 0
    out = capsys.readouterr().out
    assert "from routing: " in out and "from retokenization: " in out
    html = page.read_text()
    assert "Tokens routed to other experts carry the mismatch" in html
    assert "Turn boundaries: a re-tokenized transcript" in html
    attribution = json.loads(doc.read_text())["attribution"]
    assert attribution["routing"]["differ_share"] > 0 and attribution["turns"]["tokens"] > 0
