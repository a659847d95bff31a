"""Tests of `iscore.dump.simulate`: columns, exact ground truth, magnitudes, seeds and files."""

from __future__ import annotations

import functools
import json
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from iscore.dump.simulate import (
    METADATA_KEY,
    REGIMES,
    SEQUENCE_SCHEMA,
    STEP_METADATA_KEY,
    TOKEN_SCHEMA,
    SimConfig,
    SimTruth,
    _margins,
    _normals,
    _sample_positions,
    read_truth,
    simulate,
    write_simulated,
)
from iscore.errors import ConfigError, DumpError, IscoreError

Z = 4.0
"""Width of the confidence bounds, in standard errors (seeds are fixed, so no flakes)."""

MAGNITUDES = {
    "dense_bf16": {"mean_abs": (0.005, 0.015), "k3": (1e-4, 1e-3)},
    "fp8": {"mean_abs": (0.1, 0.3), "k3": (0.01, 0.06)},
}
"""Ranges the module docstring documents (reference/ecosystem.md section 2)."""

LIST_COLUMNS = ("rollout_logprob", "train_logprob", "loss_mask", "token_id")


def _log_ratio(batch: pa.RecordBatch) -> np.ndarray:
    """float64 [N] d = train - rollout over a batch's tokens."""
    train = pc.list_flatten(batch["train_logprob"]).to_numpy().astype(np.float64)
    return train - pc.list_flatten(batch["rollout_logprob"]).to_numpy()


@functools.cache
def _sample(regime: str) -> tuple[np.ndarray, dict]:
    """About 200k tokens of one regime in one step: d and the step's truth."""
    (batch,) = simulate(SimConfig(regime, sequences=128, median_len=1000, seed=3))
    return _log_ratio(batch), json.loads(batch.schema.metadata[STEP_METADATA_KEY])


@pytest.mark.parametrize("regime", list(REGIMES))
def test_every_regime_yields_valid_columns(regime):
    config = SimConfig(regime, sequences=20, steps=2, min_len=8, median_len=64, max_len=256)
    batches = list(simulate(config))
    assert len(batches) == config.steps
    groups_per_step = 3  # ceil(20 / 8)
    seq_ids = []
    for step, batch in enumerate(batches):
        assert batch.schema.equals(SEQUENCE_SCHEMA)
        assert batch.num_rows == config.sequences
        assert pc.all(pc.equal(batch["step"], step)).as_py()
        lengths = pc.list_value_length(batch["rollout_logprob"]).to_numpy()
        for name in LIST_COLUMNS:
            np.testing.assert_array_equal(pc.list_value_length(batch[name]).to_numpy(), lengths)
        assert lengths.min() >= config.min_len and lengths.max() <= config.max_len
        for name in ("rollout_logprob", "train_logprob"):
            values = pc.list_flatten(batch[name]).to_numpy()
            assert values.dtype == np.float32
            assert np.isfinite(values).all() and (values <= 0).all()
        tokens = pc.list_flatten(batch["token_id"]).to_numpy()
        assert tokens.min() >= 0 and tokens.max() < config.vocab
        assert pc.all(pc.list_flatten(batch["loss_mask"])).as_py()
        within = np.arange(config.sequences) // config.group_size
        expected_group = step * groups_per_step + within
        np.testing.assert_array_equal(batch["group_id"].to_numpy(), expected_group)
        advantage = batch["advantage"].to_numpy()
        assert np.isfinite(advantage).all()
        # GRPO advantages are centred within each prompt group.
        group_means = np.bincount(within, advantage)
        np.testing.assert_allclose(group_means, 0.0, atol=1e-5)
        assert set(np.unique(batch["reward"].to_numpy())) <= {0.0, 1.0}
        truth = json.loads(batch.schema.metadata[STEP_METADATA_KEY])
        assert truth["step"] == step and truth["tokens"] == lengths.sum()
        seq_ids.extend(batch["seq_id"].to_pylist())
    assert sorted(seq_ids) == list(range(config.steps * config.sequences))


@pytest.mark.parametrize("regime", list(REGIMES))
def test_expected_ratio_matches_truth(regime):
    """E_rollout[exp(d)] is 1 for unbiased regimes and the kept mass (< 1) for offset_bug."""
    d, truth = _sample(regime)
    ratio = np.exp(d)
    bound = Z * ratio.std() / math.sqrt(ratio.size)
    assert abs(ratio.mean() - truth["expected_ratio"]) <= bound
    if REGIMES[regime].unbiased:
        assert truth["expected_ratio"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert ratio.mean() + bound < 1.0
        assert truth["expected_ratio"] < 0.99


@pytest.mark.parametrize("regime", list(REGIMES))
def test_k1_matches_exact_kl(regime):
    d, truth = _sample(regime)
    bound = Z * d.std() / math.sqrt(d.size)
    assert abs(-d.mean() - truth["kl_rollout_train"]) <= bound


@pytest.mark.parametrize("regime", list(MAGNITUDES))
def test_documented_magnitudes(regime):
    d, truth = _sample(regime)
    ranges = MAGNITUDES[regime]
    lo, hi = ranges["mean_abs"]
    assert lo <= np.abs(d).mean() <= hi
    lo, hi = ranges["k3"]
    assert lo <= np.mean(np.expm1(d) - d) <= hi
    assert lo <= truth["kl_rollout_train"] <= hi


def test_regimes_have_their_signatures():
    def kl(regime):
        return _sample(regime)[1]["kl_rollout_train"]

    assert kl("moe_routing") > 2 * kl("dense_bf16")
    assert kl("temperature_bug") > 20 * kl("dense_bf16")
    # The trainer has mass outside the rollout's nucleus: KL(train || rollout) is infinite.
    assert _sample("offset_bug")[1]["kl_train_rollout"] is None
    assert _sample("dense_bf16")[1]["kl_train_rollout"] > 0


def test_truth_round_trips_through_strict_json(tmp_path):
    truth = write_simulated(tmp_path / "x.parquet", SimConfig("offset_bug", sequences=8, steps=2))
    assert math.isinf(truth.kl_train_rollout)
    text = json.dumps(truth.to_dict(), allow_nan=False)
    assert SimTruth.from_dict(json.loads(text)) == truth
    assert truth.tokens == sum(s.tokens for s in truth.steps)
    assert truth.sequences == 16


def test_drift_grows_geometrically():
    truth = [
        json.loads(b.schema.metadata[STEP_METADATA_KEY])
        for b in simulate(SimConfig("drift", sequences=32, steps=3, median_len=500))
    ]
    sigmas = [t["sigma"] for t in truth]
    assert sigmas == pytest.approx([0.07, 0.105, 0.1575])
    kls = [t["kl_rollout_train"] for t in truth]
    assert kls[0] < kls[1] < kls[2]


def test_long_collapse_product_weights_collapse():
    config = SimConfig("long_collapse", sequences=48)
    assert config.median_len == 4000
    batch = next(simulate(config))
    truth = json.loads(batch.schema.metadata[STEP_METADATA_KEY])
    assert 5e-4 <= truth["kl_rollout_train"] <= 1e-3
    d = _log_ratio(batch)
    lengths = pc.list_value_length(batch["train_logprob"]).to_numpy()
    log_weight = np.add.reduceat(d, np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    assert np.median(np.exp(log_weight)) < 0.2


def test_explicit_median_len_overrides_the_regime():
    assert SimConfig("long_collapse", median_len=300).median_len == 300
    assert SimConfig("dense_bf16").median_len == 600


def _reference(regime: str, vocab: int, noise: np.ndarray) -> dict[str, np.ndarray]:
    """Per position in float64, replaying the draws in the order `_sample_positions` makes
    them (generator seed 2): the sampled token and the rollout's and trainer's log-probs of
    every candidate (a plain softmax, the rollout's truncated to its nucleus)."""
    n = noise.size
    rng = np.random.default_rng(2)
    z = _normals(rng, vocab, n)
    z[0] += _margins(rng, n)
    eps = _normals(rng, vocab, n) * noise
    uniform = rng.random(n, dtype=np.float32)
    z, trainer = z.astype(np.float64), z.astype(np.float64) + eps

    log_mu = _log_softmax(z / REGIMES[regime].temperature)
    top_p = REGIMES[regime].top_p
    if top_p < 1:
        order = np.argsort(-log_mu, axis=0)
        ranked = np.take_along_axis(np.exp(log_mu), order, axis=0)
        above = np.cumsum(ranked, axis=0) - ranked
        inside = np.zeros_like(log_mu, dtype=bool)
        np.put_along_axis(inside, order, above < top_p, axis=0)
        log_mu = np.where(inside, log_mu, -np.inf)
        log_mu -= np.log(np.exp(log_mu).sum(axis=0))
    cdf = np.cumsum(np.exp(log_mu), axis=0)
    token = np.count_nonzero(cdf <= uniform * cdf[-1], axis=0)
    return {"token": token, "log_mu": log_mu, "trainer": trainer}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=0)
    return shifted - np.log(np.exp(shifted).sum(axis=0))


def _noise(n: int) -> np.ndarray:
    return np.random.default_rng(1).lognormal(-1.5, 1.0, n).clip(0.01, 4.0).astype(np.float32)


@pytest.mark.parametrize(("regime", "vocab"), [(r, 16) for r in REGIMES] + [("offset_bug", 5)])
def test_positions_match_float64_reference(regime, vocab):
    """Per-position truth and log-probs against a plain float64 softmax of the same draws."""
    n = 4000
    noise = _noise(n)
    got = _sample_positions(np.random.default_rng(2), noise, REGIMES[regime], vocab)
    ref = _reference(regime, vocab, noise)
    token, log_mu = ref["token"], ref["log_mu"]
    log_pi = _log_softmax(ref["trainer"])
    mu, pi = np.exp(log_mu), np.exp(log_pi)
    support = mu > 0
    with np.errstate(invalid="ignore"):  # 0 * -inf outside the nucleus, masked out
        kl_forward = np.where(support, mu * (log_mu - log_pi), 0.0).sum(axis=0)
        kl_reverse = np.where(support, pi * (log_pi - log_mu), np.inf).sum(axis=0)
    ratio = np.where(support, pi, 0.0).sum(axis=0)

    np.testing.assert_array_equal(got.token_id, token)
    cols = np.arange(n)
    # Logit noise up to ~20 nats leaves a few float32 ulps of that size in the log-probs.
    np.testing.assert_allclose(got.rollout, log_mu[token, cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.train, log_pi[token, cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.kl_forward, kl_forward, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(got.kl_reverse, kl_reverse, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(got.ratio, ratio, rtol=1e-5)
    assert got.policy is None and got.kl_policy is None


@pytest.mark.parametrize("regime", ["dense_bf16", "fp8", "offset_bug"])
@pytest.mark.parametrize("sigma", [1e-3, 0.1, 1.0])
def test_policy_matches_float64_reference(regime, sigma):
    """The current policy's log-prob of the sampled token and KL(trainer || policy) against a
    float64 softmax of the trainer's logits plus the policy noise; the rest is unchanged."""
    n, vocab = 4000, 16
    noise = _noise(n)
    g = _normals(np.random.default_rng(5), vocab, n) * np.float32(sigma)
    got = _sample_positions(np.random.default_rng(2), noise, REGIMES[regime], vocab, g)
    without = _sample_positions(np.random.default_rng(2), noise, REGIMES[regime], vocab)
    ref = _reference(regime, vocab, noise)
    log_pi = _log_softmax(ref["trainer"])
    log_q = _log_softmax(ref["trainer"] + g.astype(np.float64))
    kl = (np.exp(log_pi) * (log_pi - log_q)).sum(axis=0)

    cols = np.arange(n)
    np.testing.assert_array_equal(got.token_id, without.token_id)
    np.testing.assert_array_equal(got.train, without.train)
    np.testing.assert_allclose(got.policy, log_q[ref["token"], cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.kl_policy, kl, rtol=1e-4, atol=1e-9)


def test_same_seed_same_output_other_seed_differs():
    config = SimConfig("moe_routing", sequences=16, steps=2, median_len=100)
    first = pa.Table.from_batches(list(simulate(config)))
    again = pa.Table.from_batches(list(simulate(config)))
    other = pa.Table.from_batches(
        list(simulate(SimConfig("moe_routing", sequences=16, steps=2, median_len=100, seed=1)))
    )
    assert first.equals(again)
    assert not first.equals(other)


def test_token_and_sequence_files_hold_the_same_values(tmp_path):
    config = SimConfig("offset_bug", sequences=24, steps=3, median_len=80)
    truth = write_simulated(tmp_path / "seq.parquet", config)
    assert write_simulated(tmp_path / "tok.parquet", config, layout="token") == truth

    for name in ("seq.parquet", "tok.parquet"):
        file = pq.ParquetFile(tmp_path / name)
        assert file.num_row_groups == config.steps
        for step in range(config.steps):
            steps = file.read_row_group(step, columns=["step"])["step"]
            assert pc.all(pc.equal(steps, step)).as_py()
        stored = json.loads(file.metadata.metadata[METADATA_KEY])
        assert stored == json.loads(json.dumps(truth.to_dict()))
        assert read_truth(tmp_path / name) == truth

    seq = pq.read_table(tmp_path / "seq.parquet")
    tok = pq.read_table(tmp_path / "tok.parquet")
    assert tok.schema.equals(TOKEN_SCHEMA)
    # Parquet renames list items to "element"; names and value types are what matter.
    assert seq.schema.names == SEQUENCE_SCHEMA.names
    for field, expected in zip(seq.schema, SEQUENCE_SCHEMA, strict=True):
        if pa.types.is_list(expected.type):
            assert field.type.value_type == expected.type.value_type
        else:
            assert field.type == expected.type
    assert tok.num_rows == truth.tokens
    lengths = pc.list_value_length(seq["rollout_logprob"]).to_numpy()
    for name in LIST_COLUMNS:
        np.testing.assert_array_equal(
            pc.list_flatten(seq[name]).to_numpy(), tok[name].to_numpy(), err_msg=name
        )
    for name in ("step", "seq_id", "group_id", "advantage", "reward"):
        np.testing.assert_array_equal(
            np.repeat(seq[name].to_numpy(), lengths), tok[name].to_numpy(), err_msg=name
        )
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    np.testing.assert_array_equal(tok["pos"].to_numpy(), np.arange(tok.num_rows) - starts)


def test_read_truth_needs_simulation_metadata(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), path)
    with pytest.raises(DumpError, match=r"iscore\.simulate"):
        read_truth(path)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DumpError, match="cannot read"):
        read_truth(tmp_path / "junk.parquet")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequences": 0}, "Expected argument `sequences` to be an int >= 1, but got 0"),
        ({"sequences": 2.5}, "Expected argument `sequences` to be an int >= 1, but got 2.5"),
        ({"sequences": True}, "Expected argument `sequences` to be an int >= 1, but got True"),
        ({"steps": 0}, "Expected argument `steps` to be an int >= 1, but got 0"),
        ({"seed": -1}, "Expected argument `seed` to be an int >= 0, but got -1"),
        ({"min_len": 0}, "Expected argument `min_len` to be an int >= 1, but got 0"),
        ({"max_len": 8}, "Expected argument `max_len` to be an int >= min_len=16, but got 8"),
        (
            {"median_len": 8},
            "Expected argument `median_len` to be an int >= min_len=16, but got 8",
        ),
        (
            {"median_len": 20000},
            "Expected argument `median_len` to be an int <= max_len=16384, but got 20000",
        ),
        (
            {"regime": "long_collapse", "max_len": 1000},
            "Expected argument `median_len` to be an int <= max_len=1000, but got 4000",
        ),
        ({"vocab": 1}, "Expected argument `vocab` to be an int >= 2, but got 1"),
        ({"group_size": 0}, "Expected argument `group_size` to be an int >= 1, but got 0"),
        (
            {"length_sigma": -0.5},
            "Expected argument `length_sigma` to be a float in [0, 4], but got -0.5",
        ),
        ({"regime": "bf16"}, "Expected argument `regime` to be one of 'dense_bf16', 'fp8'"),
        (
            {"policy_sigma": -0.1},
            "Expected argument `policy_sigma` to be a float in [0, 2], but got -0.1",
        ),
        (
            {"policy_sigma": True},
            "Expected argument `policy_sigma` to be a float in [0, 2], but got True",
        ),
        (
            {"policy_growth": 0.1},
            "Expected argument `policy_growth` to be a float in [0.5, 4], but got 0.1",
        ),
        ({"experts": -1}, "Expected argument `experts` to be an int >= 0, but got -1"),
        ({"experts": 64}, "Expected argument `experts` to be an int < 64"),
        ({"turns": 1.5}, "Expected argument `turns` to be an int >= 0, but got 1.5"),
        (
            {"routing_differ": 1.5},
            "Expected argument `routing_differ` to be a float in [0, 1], but got 1.5",
        ),
        (
            {"routing_scale": 0.5},
            "Expected argument `routing_scale` to be a float in [1, 30], but got 0.5",
        ),
        ({"turn_scale": True}, "Expected argument `turn_scale` to be a float in [1, 30]"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SimConfig(**kwargs)


def test_bad_layout_raises(tmp_path):
    with pytest.raises(ConfigError, match="Expected argument `layout` to be 'sequence' or"):
        write_simulated(tmp_path / "x.parquet", SimConfig(sequences=2), layout="rows")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nodir/s.parquet", "nodir/s.parquet: no such directory"),
        ("adir", "adir: is a directory; expected a file name to write"),
        ("s.csv", "s.csv: expected a .parquet file name, but got '.csv'"),
    ],
)
def test_bad_output_paths_are_refused_and_nothing_is_left(name, message, tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(IscoreError, match=re.escape(message)):
        write_simulated(tmp_path / name, SimConfig(sequences=2))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir"]


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("iscore.dump.simulate._token_batch", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        write_simulated(tmp_path / "s.parquet", SimConfig(sequences=2), layout="token")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_a_policy_adds_its_column_and_changes_nothing_else(tmp_path, layout):
    config = SimConfig("moe_routing", sequences=24, steps=2, seed=4)
    plain = write_simulated(tmp_path / "plain.parquet", config, layout=layout)
    with_policy = SimConfig("moe_routing", sequences=24, steps=2, seed=4, policy_sigma=0.2)
    truth = write_simulated(tmp_path / "policy.parquet", with_policy, layout=layout)
    a, b = pq.read_table(tmp_path / "plain.parquet"), pq.read_table(tmp_path / "policy.parquet")
    names = a.column_names
    train = names.index("train_logprob")
    assert b.column_names == [*names[: train + 1], "policy_logprob", *names[train + 1 :]]
    assert b.schema.field("policy_logprob").type == a.schema.field("train_logprob").type
    assert all(a[name].equals(b[name]) for name in names)
    assert [s.kl_train_policy for s in plain.steps] == [None, None]
    assert plain.kl_train_policy is None and truth.kl_train_policy > 0
    assert read_truth(tmp_path / "policy.parquet") == truth

    # k3 of log(train / policy) over the sampled tokens estimates KL(trainer || policy): the
    # tokens are drawn from the rollout, within bf16 noise of the trainer.
    flat = pc.list_flatten if layout == "sequence" else (lambda column: column)
    policy = flat(b["policy_logprob"]).to_numpy().astype(np.float64)
    log_ratio = flat(b["train_logprob"]).to_numpy() - policy
    k3 = np.expm1(-log_ratio) + log_ratio
    assert (policy <= 0).all()
    assert abs(k3.mean() - truth.kl_train_policy) < Z * k3.std() / math.sqrt(k3.size)


def test_a_run_folder_holds_one_file_per_step_and_rank_with_its_truth(tmp_path, capsys):
    from iscore.cli import main

    run = tmp_path / "run"
    argv = ["simulate", str(run), "--steps", "3", "--sequences", "5", "--median-len", "20"]
    assert main([*argv, "--ranks", "2", "--grow-from", "1", "--broken-from", "2"]) == 0
    files = sorted(p.relative_to(run).as_posix() for p in run.rglob("*.parquet"))
    assert files == [f"step_{s:06d}/rank_{r:04d}.parquet" for s in range(3) for r in range(2)]
    truths = [read_truth(run / f) for f in files]
    assert [t.steps[0].step for t in truths] == [0, 0, 1, 1, 2, 2]
    assert {(t.config.grow_from, t.config.broken_from, t.config.broken_share) for t in truths} == {
        (1, 2, 0.04)
    }
    assert [t.steps[0].broken for t in truths[::2]] == [0, 0, 1]
    assert [t.steps[0].sigma / truths[0].steps[0].sigma for t in truths[::2]] == [1.0, 1.5, 2.25]
    # Two ranks hold the step's five sequences between them.
    assert sum(pq.read_metadata(run / f).num_rows for f in files[:2]) == 5
    capsys.readouterr()
    assert main(argv) == 2  # never into an existing folder
    assert "is a directory; expected a file name to write, or" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "one.parquet"), "--ranks", "2"]) == 2
    assert "--ranks is an option of a run folder" in capsys.readouterr().err


def test_a_growing_policy_lags_more_each_step_and_leaves_the_rest_unchanged(tmp_path):
    config = {"regime": "dense_bf16", "sequences": 16, "steps": 3, "seed": 8, "policy_sigma": 0.1}
    steady = write_simulated(tmp_path / "steady.parquet", SimConfig(**config))
    growing = write_simulated(tmp_path / "growing.parquet", SimConfig(**config, policy_growth=2))
    a, b = pq.read_table(tmp_path / "steady.parquet"), pq.read_table(tmp_path / "growing.parquet")
    assert all(a[n].equals(b[n]) for n in a.column_names if n != "policy_logprob")
    assert steady.steps[0].kl_train_policy == growing.steps[0].kl_train_policy
    lag = [s.kl_train_policy for s in growing.steps]
    assert lag[1] > 3 * lag[0] and lag[2] > 3 * lag[1]  # KL ~ sigma^2: x4 per step
    assert read_truth(tmp_path / "growing.parquet") == growing
    # Unset, the field is not written: dumps simulated before it existed keep their bytes.
    assert "policy_growth" not in steady.to_dict()["config"]


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_expert_ids_and_turns_add_their_columns_and_their_noise_only_where_said(tmp_path, layout):
    base = {"sequences": 24, "seed": 9, "median_len": 200}
    plain_config = SimConfig(**base)
    plain = write_simulated(tmp_path / "plain.parquet", plain_config, layout=layout)
    benign = SimConfig(**base, experts=6, routing_differ=0.25, turns=3)
    truth = write_simulated(tmp_path / "benign.parquet", benign, layout=layout)
    noisy = SimConfig(
        **base, experts=6, routing_differ=0.25, routing_scale=9.0, turns=3, turn_scale=9.0
    )
    write_simulated(tmp_path / "noisy.parquet", noisy, layout=layout)
    a, b, c = (pq.read_table(tmp_path / f"{n}.parquet") for n in ("plain", "benign", "noisy"))
    added = ["turn", "rollout_experts", "train_experts"]
    assert b.column_names == [*a.column_names, *added] == c.column_names
    # A disagreement or a seam that carries no extra noise changes no other column.
    assert all(a[name].equals(b[name]) for name in a.column_names)
    assert read_truth(tmp_path / "benign.parquet") == truth and plain.tokens == truth.tokens
    assert {"experts", "turns"} <= set(truth.to_dict()["config"])
    assert "experts" not in plain.to_dict()["config"]

    def per_token(table, name):
        column = table[name].combine_chunks()
        return pc.list_flatten(column) if layout == "sequence" else column

    rollout = per_token(b, "rollout_experts").to_pylist()
    train = per_token(b, "train_experts").to_pylist()
    assert all(len(set(ids)) == 6 and min(ids) >= 0 and max(ids) < 64 for ids in rollout)
    differ = np.array([set(x) != set(y) for x, y in zip(rollout, train, strict=True)])
    assert all(len(set(x) - set(y)) <= 1 for x, y in zip(rollout, train, strict=True))
    assert abs(differ.mean() - 0.25) < Z * math.sqrt(0.25 * 0.75 / differ.size)
    # Turns: each sequence cut into 3 of equal length; the first 4 tokens of turns 1 and 2
    # are the seams.
    turn = per_token(b, "turn").to_numpy()
    lengths = (
        pc.list_value_length(b["rollout_logprob"].combine_chunks()).to_numpy()
        if layout == "sequence"
        else np.bincount(b["seq_id"].to_numpy() - b["seq_id"].to_numpy().min())
    )
    pos = np.concatenate([np.arange(n) for n in lengths])
    length = np.repeat(lengths, lengths)
    assert (turn == pos * 3 // length).all()
    first = np.r_[True, turn[1:] != turn[:-1]] | (pos == 0)
    run_start = np.maximum.accumulate(np.where(first, np.arange(turn.size), 0))
    seam = (turn > 0) & (np.arange(turn.size) - run_start < 4)
    # With noise on them, only the seams' and the disagreeing tokens' train log-probs move.
    moved = per_token(c, "train_logprob").to_numpy() != per_token(b, "train_logprob").to_numpy()
    assert moved.any() and not (moved & ~(seam | differ)).any()
    assert per_token(c, "rollout_logprob").equals(per_token(b, "rollout_logprob"))
