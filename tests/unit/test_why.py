"""`iscore why` (`iscore.stats.mix`, `iscore.advice.shift`, `iscore.passes.change`): a rise made
only of a shift toward low-probability tokens is composition, one made only of per-token drift
is within; composition + within is the change exactly and every bin's numbers are the
formulas' (a float64 reference here); bins on one side only, a step without loss tokens or not
in the dump, one-token sequences, a column of the dump as a factor, and the CLI's document."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.errors import ConfigError, DumpError
from iscore.passes.change import why
from iscore.stats.mix import PROB_EDGES_FINE

LENGTHS = (16, 40, 96, 200)


def _step(
    step: int, sequences: int, low_share: float, noise: float, seed: int, **columns
) -> dict[str, np.ndarray]:
    """One step's tokens (token layout): a share `low_share` of them sampled at a probability
    of 1e-4 to 0.1, the others at 1 - p of 1e-5 to 0.1; d ~ N(0, noise (0.02 + 0.5 (1 - p))),
    so that a bin's mismatch depends on p alone, the same at every step for the same
    `noise`. `columns`: per-sequence columns (a value a sequence)."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice(LENGTHS, sequences)
    n = int(lengths.sum())
    low = rng.random(n) < low_share
    p = np.where(low, 10 ** rng.uniform(-4, -1, n), 1 - 10 ** rng.uniform(-5, -1, n))
    rollout = np.log(p).astype(np.float32)
    sigma = noise * (0.02 + 0.5 * (1 - p))
    train = np.minimum(rollout + rng.normal(0, 1, n) * sigma, 0).astype(np.float32)
    table = {
        "step": np.full(n, step),
        "seq_id": np.repeat(np.arange(sequences) + 1000 * step, lengths),
        "pos": np.concatenate([np.arange(k) for k in lengths]),
        "rollout_logprob": rollout,
        "train_logprob": train,
        "loss_mask": np.ones(n, dtype=bool),
    }
    for name, values in columns.items():
        table[name] = np.repeat(values, lengths)
    return table


def _write(path: Path, *steps: dict[str, np.ndarray]) -> Path:
    tables = [pa.table(s) for s in steps]
    pq.write_table(pa.concat_tables(tables), path, row_group_size=max(len(t) for t in tables))
    return path


def _write_sequences(path: Path, *steps: dict[str, np.ndarray], lists: tuple[str, ...]) -> Path:
    """The steps in sequence layout: a row a sequence, the per-token columns `lists` as lists,
    the others one value a sequence (any scalar column is then carried as a column)."""
    rows = []
    for s in steps:
        cuts = np.flatnonzero(np.diff(s["seq_id"])) + 1
        starts = np.concatenate([[0], cuts])
        rows.append(
            pa.table(
                {k: pa.array(np.split(v, cuts)) if k in lists else v[starts] for k, v in s.items()}
            )
        )
    pq.write_table(pa.concat_tables(rows), path)
    return path


@pytest.fixture(scope="module")
def composition(tmp_path_factory) -> Path:
    """Step 1 has 6x the low-probability tokens of step 0, at the same noise."""
    path = tmp_path_factory.mktemp("why") / "composition.parquet"
    return _write(path, _step(0, 300, 0.05, 1.0, 1), _step(1, 300, 0.3, 1.0, 2))


@pytest.fixture(scope="module")
def drift(tmp_path_factory) -> Path:
    """Step 1 has the mix of step 0 and twice its noise."""
    path = tmp_path_factory.mktemp("why") / "drift.parquet"
    return _write(path, _step(0, 300, 0.1, 1.0, 3), _step(1, 300, 0.1, 2.0, 4))


@pytest.mark.parametrize("metric", ["k3", "abs_diff_mean", "chi2_token", "token_mult_prob_error"])
def test_a_shift_toward_low_probability_tokens_is_composition(composition, metric):
    w = why(composition, 0, 1, metric=metric)
    assert w.change > 0
    assert w.best.factor == "prob"
    assert w.composition >= 0.7, (metric, w.composition)
    assert w.factor("prob").moved.where.startswith("below")
    assert "composition by rollout probability" in w.sentence


@pytest.mark.parametrize("metric", ["k3", "abs_diff_mean", "chi2_token", "token_mult_prob_error"])
def test_per_token_drift_is_within(drift, metric):
    w = why(drift, 0, 1, metric=metric)
    assert w.change > 0
    assert w.composition <= 0.3, (metric, w.composition)
    assert "is within the bins" in w.sentence


def test_the_simulated_engine_drifting_is_within(tmp_path):
    """The simulator's trainer noise growing 3x a step from step 1, at the same token mix."""
    path = tmp_path / "grow.parquet"
    write_simulated(
        path, SimConfig(sequences=64, steps=3, median_len=200, grow_from=1, growth=3.0, seed=1)
    )
    w = why(path, 0, 2)
    assert w.value > 10 * w.baseline
    assert w.composition <= 0.3


def _reference(path: Path, steps: tuple[int, int], factor: str) -> dict[str, np.ndarray]:
    """float64 per-bin shares, means and terms of k3 from the formulas, for one factor."""
    t = pq.read_table(path).to_pandas()
    t = t[t["step"].isin(steps) & t["loss_mask"]]
    d = t["train_logprob"].to_numpy(np.float64) - t["rollout_logprob"].to_numpy(np.float64)
    term = np.expm1(d) - d
    if factor == "prob":
        key = np.searchsorted(np.log(PROB_EDGES_FINE), t["rollout_logprob"].to_numpy(), "right")
    elif factor == "position":
        key = np.floor(np.log2(t["pos"].to_numpy() + 1)).astype(int)
    else:
        lengths = t.groupby(["step", "seq_id"])["pos"].transform("size").to_numpy()
        key = np.floor(np.log2(lengths)).astype(int)
    bins = np.unique(key)
    w, m = np.zeros((2, bins.size)), np.full((2, bins.size), np.nan)
    for s, step in enumerate(steps):
        here = t["step"].to_numpy() == step
        for i, b in enumerate(bins):
            inside = here & (key == b)
            w[s, i] = inside.sum() / here.sum()
            if inside.any():
                m[s, i] = term[inside].mean()
    filled = np.where(np.isnan(m), m[::-1], m)
    return {
        "share": w,
        "value": m,
        "composition": (w[1] - w[0]) * (filled[0] + filled[1]) / 2,
        "within": (filled[1] - filled[0]) * (w[0] + w[1]) / 2,
    }


@pytest.mark.parametrize("factor", ["prob", "length", "position"])
def test_the_split_is_exact_and_each_bin_is_the_formulas(composition, factor):
    w = why(composition, 0, 1)
    shift = w.factor(factor)
    assert abs(shift.composition + shift.within - w.change) <= 1e-12 * max(1.0, w.value)
    ref = _reference(composition, (0, 1), factor)
    for i, b in enumerate(shift.bins):
        assert b.share == pytest.approx(tuple(ref["share"][:, i]), rel=1e-12, abs=1e-15)
        for s in (0, 1):
            if math.isnan(ref["value"][s, i]):
                assert b.value[s] is None
            else:
                assert b.value[s] == pytest.approx(ref["value"][s, i], rel=1e-9)
        assert b.composition == pytest.approx(ref["composition"][i], rel=1e-9, abs=1e-18)
        assert b.within == pytest.approx(ref["within"][i], rel=1e-9, abs=1e-18)


def test_the_values_are_the_analysis_own(composition):
    w = why(composition, 0, 1, metric="k3")
    steps = {r["step"]: r["k3"] for r in iscore.analyze(composition).mismatch.by_step}
    assert w.baseline == pytest.approx(steps[0], rel=1e-12)
    assert w.value == pytest.approx(steps[1], rel=1e-12)


def test_a_dump_a_path_and_a_loaded_batch_give_the_same_split(composition):
    by_path = why(composition, 0, 1).to_dict()
    assert why(Dump(composition), 0, 1).to_dict() == by_path
    loaded = why(iscore.load(composition), 0, 1).to_dict()
    assert loaded["change"] == pytest.approx(by_path["change"], rel=1e-12)
    assert loaded["composition"] == pytest.approx(by_path["composition"], rel=1e-9)


def test_a_bin_present_at_one_step_only_is_all_composition(tmp_path):
    """Step 0 has no token below 0.1; at step 1 those bins hold 20%: they have no value at
    step 0 (None), no within term, and their composition is w1 m1."""
    path = _write(tmp_path / "new.parquet", _step(0, 100, 0.0, 1.0, 5), _step(1, 100, 0.2, 1.0, 6))
    w = why(path, 0, 1)
    new = [b for b in w.factor("prob").bins if b.tokens[0] == 0]
    assert new
    for b in new:
        assert b.value[0] is None and b.within == 0.0
        assert b.composition == pytest.approx(b.share[1] * b.value[1], rel=1e-12)
    shift = w.factor("prob")
    assert abs(shift.composition + shift.within - w.change) <= 1e-12
    assert "appear" in w.sentence


def test_one_token_sequences(tmp_path):
    steps = []
    for step, noise in ((0, 1.0), (1, 3.0)):
        t = _step(step, 400, 0.1, noise, step)
        first = np.concatenate([[True], t["seq_id"][1:] != t["seq_id"][:-1]])
        steps.append({k: v[first] for k, v in t.items()})
    w = why(_write(tmp_path / "one.parquet", *steps), 0, 1)
    assert [len(w.factor(f).bins) for f in ("length", "position")] == [1, 1]
    for shift in w.by:
        assert abs(shift.composition + shift.within - w.change) <= 1e-12
    assert w.factor("length").composition == pytest.approx(0.0, abs=1e-15)


def test_a_step_without_loss_tokens_or_not_in_the_dump_is_refused(tmp_path):
    masked = _step(1, 10, 0.1, 1.0, 8)
    masked["loss_mask"][:] = False
    path = _write(tmp_path / "masked.parquet", _step(0, 10, 0.1, 1.0, 7), masked)
    with pytest.raises(DumpError, match="step 1 has no loss tokens"):
        why(path, 0, 1)
    with pytest.raises(DumpError, match=r"step 5 is not in the dump; it has steps 0-1"):
        why(path, 0, 5)
    with pytest.raises(DumpError, match=r"step 5 is not in the dump; it has step 0$"):
        why(iscore.load(path, steps=iscore.StepRange(0, 0)), 5, 0)


def test_unknown_metrics_and_factors_name_the_choices(composition):
    with pytest.raises(ConfigError, match=r"one of k1, k2, k3.*but got 'js'"):
        why(composition, 0, 1, metric="js")
    with pytest.raises(ConfigError, match="one of prob, length, position, but got 'turn'"):
        why(composition, 0, 1, by=["turn"])
    with pytest.raises(ConfigError, match="two different steps"):
        why(composition, 1, 1)


def test_a_column_of_the_dump_and_the_turn_are_factors(tmp_path):
    """Replica 1 scores every token with 4x the noise; step 1 has 70% of its sequences from
    it, step 0 10%: the change is the replicas' mix, the split by replica says so."""
    rng = np.random.default_rng(9)
    steps = []
    for step, share in ((0, 0.1), (1, 0.7)):
        parts = []
        for replica, noise in ((0, 1.0), (1, 4.0)):
            count = round(200 * (share if replica else 1 - share))
            seed = int(rng.integers(1 << 30))
            part = _step(step, count, 0.1, noise, seed, replica=np.full(count, replica))
            part["seq_id"] = part["seq_id"] + 10_000 * replica
            parts.append(part)
        table = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        table["turn"] = np.minimum(table["pos"] // 50, 3)
        table["reward"] = np.full(len(table["pos"]), 1.0, dtype=np.float32)
        steps.append(table)
    lists = ("pos", "rollout_logprob", "train_logprob", "loss_mask", "turn")
    path = _write_sequences(tmp_path / "replicas.parquet", *steps, lists=lists)
    w = why(path, 0, 1, by=["replica", "prob", "turn"])
    assert [s.factor for s in w.by] == ["replica", "prob", "turn"]
    assert w.best.factor == "replica" and w.composition > 0.9
    assert w.factor("replica").moved.where == "with replica = 1"
    # The same tokens in token layout (a row a token, the replica on each) split the same.
    tokens = why(_write(tmp_path / "replicas_tokens.parquet", *steps), 0, 1, by=["replica"])
    assert tokens.by[0].composition == pytest.approx(w.by[0].composition, rel=1e-9)
    assert [b.tokens for b in tokens.by[0].bins] == [b.tokens for b in w.by[0].bins]
    assert [s.factor for s in why(path, 0, 1).by] == ["prob", "length", "position", "turn"]
    with pytest.raises(ConfigError, match=r"integers, strings or booleans.*'reward' is double"):
        why(path, 0, 1, by=["reward"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_bins_are_the_same_on_every_device(composition, device):
    here = why(composition, 0, 1, device="cpu")
    there = why(composition, 0, 1, device=device)
    for a, b in zip(here.by, there.by, strict=True):
        assert [x.tokens for x in a.bins] == [x.tokens for x in b.bins]
        assert a.composition == pytest.approx(b.composition, rel=1e-9)
    assert torch.device(device).type in ("cpu", "cuda")


def test_the_command_writes_the_document(composition, tmp_path, capsys):
    out = tmp_path / "why.json"
    assert main(["why", str(composition), "--from", "0", "--to", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "composition by rollout probability" in printed and "by response length" in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == "iscore.why"
    for key in ("metric", "from", "to", "baseline", "value", "change", "composition", "within"):
        assert key in doc
    assert (doc["from"], doc["to"], doc["metric"]) == (0, 1, "k3")
    assert doc["change"] == pytest.approx(doc["value"] - doc["baseline"])
    assert doc["composition"] == max(f["composition"] for f in doc["by"])
    assert doc["within"] == pytest.approx(1 - doc["composition"])
    for f in doc["by"]:
        assert set(f) >= {"factor", "composition", "within", "bins"}
        assert f["composition"] + f["within"] == pytest.approx(1.0, abs=1e-9)
        assert sum(b["composition"] + b["within"] for b in f["bins"]) == pytest.approx(1.0)


def test_the_command_names_what_it_refuses(composition, capsys):
    base = ["why", str(composition), "--from", "0", "--to"]
    assert main([*base, "1", "--metric", "nope"]) == 2
    assert "one of k1, k2, k3" in capsys.readouterr().err
    assert main([*base, "7"]) == 2
    assert "step 7 is not in the dump; it has steps 0-1" in capsys.readouterr().err
    assert main([*base, "1", "--by", "prob,nope"]) == 2
    assert "but got 'nope'" in capsys.readouterr().err
    assert main([*base, "1", "--steps", "0:1"]) == 2
    assert "--steps does not apply" in capsys.readouterr().err
