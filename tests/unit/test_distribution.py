"""The whole distribution (`iscore.stats.distribution`, docs/distribution.md): the engine's top-k
log-probs and the trainer's at the same ids, against a float64 reference written here from the
formulas, on distributions whose full KL is known."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.cli import main
from iscore.dump import SimConfig, read_truth, write_simulated
from iscore.errors import ConfigError, DumpError, DumpProblems
from iscore.passes import analyze
from iscore.passes.results_store import ResultStore


def _softmax_log(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))


def _vocabulary(seed: int, n: int, vocab: int = 64, k: int = 8, noise: float = 0.1,
                kept: int | None = None) -> dict:  # fmt: skip
    """n tokens of a vocabulary: the engine's and the trainer's full log-probs, a token sampled
    from the engine, its top-k. `kept`: the engine samples from its `kept` most likely ids and
    reports log-probs renormalized over them (top-k sampling, processed log-probs)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (n, vocab))
    train = _softmax_log(logits + rng.normal(0, noise, (n, vocab)))
    engine = _softmax_log(logits)
    if kept is not None:
        order = np.argsort(-engine, axis=1)
        outside = np.zeros_like(engine, dtype=bool)
        np.put_along_axis(outside, order[:, kept:], True, axis=1)
        engine = np.where(outside, -np.inf, engine)
        engine = engine - np.log(np.exp(engine).sum(axis=1, keepdims=True))
    cdf = np.exp(engine).cumsum(axis=1)
    token = np.minimum((cdf < rng.random(n)[:, None] * cdf[:, -1:]).sum(axis=1), vocab - 1)
    ids = np.argsort(-engine, axis=1, kind="stable")[:, :k]
    rows = np.arange(n)
    return {
        "engine": engine,
        "train": train,
        "token": token,
        "ids": ids,
        "rollout": engine[rows, token].astype(np.float32),
        "train_lp": train[rows, token].astype(np.float32),
        "rollout_topk": np.take_along_axis(engine, ids, 1).astype(np.float32),
        "train_topk": np.take_along_axis(train, ids, 1).astype(np.float32),
    }


def _table(v: dict, length: int = 25, steps: int = 2, token_id: bool = True) -> pa.Table:
    n = v["token"].size
    seq = np.arange(n) // length
    columns = {
        "step": seq % steps,
        "seq_id": seq,
        "rollout_logprob": v["rollout"],
        "train_logprob": v["train_lp"],
        "rollout_topk_ids": pa.array(list(v["ids"])),
        "rollout_topk_logprobs": pa.array(list(v["rollout_topk"])),
        "train_topk_logprobs": pa.array(list(v["train_topk"])),
    }
    if token_id:
        columns["token_id"] = v["token"]
    return pa.table(columns)


def _write(tmp_path, table: pa.Table, name: str = "d.parquet") -> str:
    pq.write_table(table, tmp_path / name)
    return str(tmp_path / name)


def _reference(v: dict, mask: np.ndarray | None = None) -> dict:
    """The statistics in float64 from the formulas, over the tokens of `mask`."""
    r, t = v["rollout_topk"].astype(np.float64), v["train_topk"].astype(np.float64)
    mu, pi = np.exp(r), np.exp(t)
    known = (mu * (r - t)).sum(axis=1)
    rest_mu = np.clip(1 - mu.sum(axis=1), 0, None)
    rest_pi = np.clip(1 - pi.sum(axis=1), 0, None) + 1e-6
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(rest_mu > 0, rest_mu * np.log(rest_mu / rest_pi), 0.0)
    inside = (v["ids"] == v["token"][:, None]).any(axis=1)
    d = v["train_lp"].astype(np.float64) - v["rollout"].astype(np.float64)
    estimate = known + (pi.sum(axis=1) - mu.sum(axis=1)) + np.where(inside, 0, np.expm1(d) - d)
    top1 = np.argmax(v["rollout_topk"], axis=1) == np.argmax(v["train_topk"], axis=1)
    sel = np.ones(d.size, bool) if mask is None else mask
    full = np.exp(v["engine"]) * np.nan_to_num(v["engine"] - v["train"], neginf=0.0)
    return {
        "lower": (known + tail)[sel].mean(),
        "estimate": estimate[sel].mean(),
        "top1": top1[sel].mean(),
        "rollout_mass": mu.sum(axis=1)[sel].mean(),
        "train_mass": pi.sum(axis=1)[sel].mean(),
        "exact": full.sum(axis=1)[sel].mean(),
    }


@pytest.mark.parametrize("seed", range(3))
def test_the_statistics_are_the_formulas(tmp_path, seed):
    v = _vocabulary(seed, 4000)
    table = _table(v)
    path = _write(tmp_path, table)
    d = analyze(path, store=None, max_tokens=900).mismatch
    want = _reference(v)
    got = d.distribution
    assert got["kl"]["lower"] == pytest.approx(want["lower"], rel=1e-9)
    assert got["kl"]["estimate"] == pytest.approx(want["estimate"], rel=1e-9)
    assert got["top1_agreement"] == pytest.approx(want["top1"], rel=1e-12)
    assert got["rollout_topk_mass"] == pytest.approx(want["rollout_mass"], rel=1e-12)
    assert got["train_topk_mass"] == pytest.approx(want["train_mass"], rel=1e-12)
    assert got["kl"]["lower"] <= want["exact"]
    steps = table["step"].to_numpy()
    for row in d.by_step:
        step = _reference(v, steps == row["step"])
        assert row["kl_lower"] == pytest.approx(step["lower"], rel=1e-9)
        assert row["top1_agreement"] == pytest.approx(step["top1"], rel=1e-12)


def test_k_covering_the_support_gives_the_exact_kl(tmp_path):
    v = _vocabulary(5, 3000, vocab=16, k=16)
    got = analyze(_write(tmp_path, _table(v)), store=None).mismatch.distribution["kl"]
    exact = _reference(v)["exact"]
    assert got["lower"] == pytest.approx(exact, rel=1e-3)
    assert got["estimate"] == pytest.approx(exact, rel=1e-3)


def test_eight_of_64_ids_bound_and_estimate_the_simulated_kl(tmp_path):
    # The simulator's exact KL(rollout || trainer) per position is in the truth.
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(sequences=24, steps=1, vocab=64, topk=8, seed=2,
                                    median_len=900, length_sigma=0.0))  # fmt: skip
    truth = read_truth(path)
    assert truth.tokens >= 20_000
    got = analyze(str(path), store=None).mismatch.distribution
    assert got["kl"]["lower"] <= truth.kl_rollout_train
    assert got["kl"]["estimate"] == pytest.approx(truth.kl_rollout_train, rel=0.1)
    assert 0.5 < got["top1_agreement"] <= 1


def test_without_the_sampled_id_membership_is_by_the_reported_log_prob(tmp_path):
    v = _vocabulary(1, 2000)
    with_ids = analyze(_write(tmp_path, _table(v), "a.parquet"), store=None).mismatch
    without = analyze(_write(tmp_path, _table(v, token_id=False), "b.parquet"), store=None)
    assert without.mismatch.distribution["kl"] == pytest.approx(with_ids.distribution["kl"])


def _by_sequence(token: pa.Table) -> pa.Table:
    """The same data one row per sequence: list columns, the top-k as lists of lists."""
    seq = token["seq_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    offsets = pa.array(np.r_[starts, seq.size].astype(np.int32))
    rows = {
        "step": token["step"].to_numpy()[starts],
        "seq_id": seq[starts],
        **{
            name: pa.ListArray.from_arrays(offsets, token[name].combine_chunks())
            for name in token.column_names
            if name not in ("step", "seq_id")
        },
    }
    return pa.table(rows)


def test_token_and_sequence_layouts_agree(tmp_path):
    v = _vocabulary(3, 1500)
    token = _table(v, length=30)
    path = _write(tmp_path, token, "token.parquet")
    other = _write(tmp_path, _by_sequence(token), "sequence.parquet")
    a = analyze(path, store=None).mismatch.distribution
    b = analyze(other, store=None).mismatch.distribution
    assert a == b


def test_a_renormalizing_engine_is_flagged_and_no_sample_or_regime_is(tmp_path):
    v = _vocabulary(4, 6000, kept=12)  # top-k sampling over 12 ids, 8 of them reported
    flags = analyze(_write(tmp_path, _table(v)), store=None).flags
    (flag,) = [f for f in flags if f.code == "support_normalized"]
    assert flag.kind == "semantics_bug" and "raw_logprobs" in flag.message
    honest = analyze(_write(tmp_path, _table(_vocabulary(4, 6000)), "h.parquet"), store=None)
    assert "support_normalized" not in [f.code for f in honest.flags]
    for regime in ("dense_bf16", "fp8", "moe_routing", "long_collapse", "drift"):
        path = tmp_path / f"{regime}.parquet"
        write_simulated(path, SimConfig(regime, sequences=32, steps=2, topk=4, median_len=200))
        assert "support_normalized" not in [f.code for f in analyze(str(path), store=None).flags]


def test_the_statistics_survive_the_store_and_the_workers(tmp_path):
    for rank in range(2):
        v = _vocabulary(10 + rank, 2000)
        table = _table(v).set_column(1, "seq_id", pa.array(np.arange(2000) // 25 + 1000 * rank))
        pq.write_table(table, tmp_path / f"rank{rank}.parquet", row_group_size=500)
    source = str(tmp_path / "rank*.parquet")
    alone = analyze(source, store=None).mismatch.distribution
    analyze(source, store=ResultStore(tmp_path / "store"))
    again = analyze(source, store=ResultStore(tmp_path / "store")).mismatch.distribution
    workers = analyze(source, store=None, jobs=2).mismatch.distribution
    assert again == alone
    assert workers["kl"] == pytest.approx(alone["kl"], rel=1e-12)


@pytest.mark.parametrize("layout", ["token", "sequence"])
def test_a_chunk_of_top_k_tokens_holds_fewer_and_changes_no_number(tmp_path, layout):
    """A chunk's budget counts each of a token's k entries as a quarter of a token
    (`TOPK_WEIGHT`), and the analysis is the same whatever the chunks."""
    from iscore.dump import Dump
    from iscore.dump.readers import TOPK_WEIGHT

    v = _vocabulary(4, 6000)  # k = 8: a token counts 3
    table = _table(v, length=20)
    table = table.set_column(0, "step", pa.array(np.arange(6000) // 2000))  # 3 steps in order
    table = table if layout == "token" else _by_sequence(table)
    path = str(tmp_path / "d.parquet")
    pq.write_table(table, path, row_group_size=100 if layout == "token" else 5)  # 100 tokens
    budget = 1200
    sizes = [b.num_tokens for b in Dump(path).batches(max_tokens=budget)]
    assert sum(sizes) == 6000
    # A chunk holds a third of the budget's tokens, overshot by at most one read.
    assert budget / (1 + TOPK_WEIGHT * 8) == 400
    assert max(sizes) <= 400 + 100
    assert len(sizes) >= 6000 // 500
    documents = {
        budget: analyze(path, store=None, max_tokens=budget).to_dict() for budget in (600, 100_000)
    }
    assert documents[600] == documents[100_000]


def test_masked_and_one_token_sequences(tmp_path):
    v = _vocabulary(6, 600)
    table = _table(v, length=1)  # one-token sequences
    mask = np.ones(600, bool)
    mask[:300] = False  # the first 300 sequences have no loss token
    table = table.append_column("loss_mask", pa.array(mask))
    got = analyze(_write(tmp_path, table), store=None).mismatch.distribution
    want = _reference(v, mask)
    assert got["tokens"] == 300
    assert got["kl"]["estimate"] == pytest.approx(want["estimate"], rel=1e-9)


@pytest.mark.parametrize(
    ("change", "column", "words"),
    [
        (lambda c: c | {"rollout_topk_ids": pa.array([[1, 2]] + [[1, 2, 3]] * 99)},
         "rollout_topk_ids", "not of 2 entries"),
        (lambda c: c | {"rollout_topk_ids": pa.array([[-1, 2, 3]] + [[1, 2, 3]] * 99)},
         "rollout_topk_ids", "negative id"),
        (lambda c: c | {"train_topk_logprobs": pa.array([[0.5, -1.0, -2.0]] * 100)},
         "train_topk_logprobs", "positive log-prob"),
        (lambda c: c | {"token_id": np.full(100, 1)}, "rollout_topk_logprobs", "aligned"),
    ],
)  # fmt: skip
def test_bad_top_k_columns_name_the_file_column_and_row(tmp_path, change, column, words):
    columns = {
        "seq_id": np.arange(100) // 10,
        "rollout_logprob": np.full(100, -0.5, np.float32),
        "train_logprob": np.full(100, -0.6, np.float32),
        "token_id": np.full(100, 7),
        "rollout_topk_ids": pa.array([[1, 2, 3]] * 100),
        "rollout_topk_logprobs": pa.array([[-0.1, -1.0, -2.0]] * 100, pa.list_(pa.float32())),
        "train_topk_logprobs": pa.array([[-0.2, -1.1, -2.1]] * 100, pa.list_(pa.float32())),
    }
    path = _write(tmp_path, pa.table(change(columns)))
    with pytest.raises(DumpProblems) as caught:
        analyze(path, store=None)
    problem = caught.value.problems[0]
    assert problem.file == path and problem.column.startswith(column)
    assert words in problem.message and problem.rows


def test_some_top_k_columns_without_the_others_are_refused(tmp_path):
    table = _table(_vocabulary(0, 100)).drop_columns(["train_topk_logprobs"])
    with pytest.raises(DumpProblems, match="train_topk_logprobs"):
        analyze(_write(tmp_path, table), store=None)


def test_the_writer_writes_the_columns_padded_and_ragged(tmp_path):
    v = _vocabulary(8, 6)
    ids, r, t = v["ids"].reshape(2, 3, -1), v["rollout_topk"].reshape(2, 3, -1), v["train_topk"]
    t = t.reshape(2, 3, -1)
    with iscore.DumpWriter(tmp_path / "padded.parquet") as writer:
        writer.add(step=0, rollout_logprobs=torch.tensor(v["rollout"].reshape(2, 3)),
                   train_logprobs=torch.tensor(v["train_lp"].reshape(2, 3)),
                   mask=torch.ones(2, 3, dtype=torch.bool),
                   token_ids=torch.tensor(v["token"].reshape(2, 3)),
                   rollout_topk_ids=torch.tensor(ids), rollout_topk_logprobs=torch.tensor(r),
                   train_topk_logprobs=torch.tensor(t))  # fmt: skip
    with iscore.DumpWriter(tmp_path / "ragged.parquet") as writer:
        writer.add(step=0, rollout_logprobs=list(v["rollout"].reshape(2, 3)),
                   train_logprobs=list(v["train_lp"].reshape(2, 3)),
                   token_ids=list(v["token"].reshape(2, 3)),
                   rollout_topk_ids=list(ids), rollout_topk_logprobs=list(r),
                   train_topk_logprobs=list(t))  # fmt: skip
    for name in ("padded", "ragged"):
        batch = iscore.load(tmp_path / f"{name}.parquet")
        assert batch.topk_ids.tolist() == v["ids"].tolist()
        assert batch.train_topk.numpy().tolist() == v["train_topk"].tolist()
    with pytest.raises(DumpError, match="all three or none"):
        iscore.DumpWriter(tmp_path / "x.parquet").add(
            step=0, rollout_logprobs=[v["rollout"]], train_logprobs=[v["train_lp"]],
            rollout_topk_ids=[v["ids"]],
        )  # fmt: skip


def test_simulate_writes_the_columns_only_when_asked(tmp_path):
    assert main(["simulate", str(tmp_path / "k.parquet"), "--sequences", "8", "--topk",
                 "4"]) == 0  # fmt: skip
    assert main(["simulate", str(tmp_path / "n.parquet"), "--sequences", "8"]) == 0
    with_k, plain = pq.read_table(tmp_path / "k.parquet"), pq.read_table(tmp_path / "n.parquet")
    assert {"rollout_topk_ids", "rollout_topk_logprobs", "train_topk_logprobs"} <= set(
        with_k.column_names
    )
    for name in plain.column_names:
        assert with_k[name].equals(plain[name]), name
    with pytest.raises(ConfigError, match="top-p"):
        SimConfig("offset_bug", topk=4)
    with pytest.raises(ConfigError, match="vocab"):
        SimConfig(topk=99)
