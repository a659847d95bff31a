"""The fast paths of the hot loop equal their plain definitions.

Histograms bin in float32 and re-bin near edges in float64; sequence reductions run as numpy
`reduceat` on CPU; `ops.shared` hands the same tensors to every setting of a chunk;
`ops.reused_buffers` reuses scratch buffers; `ops.median` and `ops.quantiles` are numpy's
from one sort. Each is checked against the direct float64 / torch formulation it replaces,
including empty sequences, masks and in-place modification.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.errors import DumpProblems
from iscore.packed import kernels, ops
from iscore.packed.batch import TokenBatch
from iscore.passes.analysis import analyze
from iscore.stats.histogram import (
    BINS_PER_DECADE,
    LOG10_RANGE,
    Histogram2D,
    LogHistogram,
    bin_values,
)
from tests.unit.test_mismatch import assert_same


def exact_histogram(values: torch.Tensor) -> LogHistogram:
    """`LogHistogram`'s definition, every value binned in float64."""
    x = values.double().flatten()
    h = LogHistogram()
    nan = torch.isnan(x)
    finite = torch.isfinite(x)
    h.nan = int(nan.sum())
    if finite.any():
        h.min, h.max = float(x[finite].min()), float(x[finite].max())
    h.zeros = int((x == 0).sum())
    positive = x[(x > 0) & ~nan]
    if positive.numel():
        h.min_positive = float(positive.min())
    logs = torch.log10(positive)
    lo, hi = LOG10_RANGE
    h.underflow, h.overflow = int((logs < lo).sum()), int((logs >= hi).sum())
    inside = logs[(logs >= lo) & (logs < hi)]
    index = ((inside - lo) * BINS_PER_DECADE).long().clamp_(max=h.counts.size - 1)
    h.counts = torch.bincount(index, minlength=h.counts.size).numpy()
    return h


def same_histogram(a: LogHistogram, b: LogHistogram) -> None:
    assert np.array_equal(a.counts, b.counts)
    for name in ("zeros", "underflow", "overflow", "nan", "min", "max", "min_positive"):
        assert getattr(a, name) == getattr(b, name), name


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every bin edge and its float neighbours, in `dtype`."""
    edges = LogHistogram.edges()
    if dtype == torch.float32:
        edges = edges.astype(np.float32)
    near = [edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf)]
    return torch.from_numpy(np.concatenate(near))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make",
    [
        edge_values,
        lambda dt: torch.exp(torch.randn(50_000, dtype=torch.float64) * 4).to(dt),
        lambda dt: torch.exp(torch.randn(50_000, dtype=torch.float64) * 1e-4).to(dt),  # ~1
        lambda dt: torch.tensor([0.0, 1e-40, 1e-13, 1e-12, 1.0, 1e8, 1e9, 1e30]).to(dt),
        lambda dt: torch.where(torch.rand(9_000) < 0.3, 0.0, torch.rand(9_000) * 3).to(dt),
        lambda dt: torch.tensor([0.0, -0.0, 0.0]).to(dt),
        lambda dt: torch.tensor([1.0, float("nan"), float("inf"), -2.0, 0.0]).to(dt),
        lambda dt: torch.full((100,), 2.5).to(dt),
    ],
)
def test_log_histogram_equals_float64_binning(dtype, make):
    torch.manual_seed(0)
    values = make(dtype)
    got = LogHistogram()
    got.update(values)
    same_histogram(got, exact_histogram(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["numba", "reference"])
def test_values_counted_bin_as_their_repeats(dtype, path, monkeypatch):
    """`bin_values(values, counts)` (a sequence's weight once, counted T times) equals the
    float64 binning of every value repeated: edges and their neighbours, zeros, values
    counted 0 times (left out), extremes."""
    if path == "numba" and not kernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv(kernels.ENV, path)
    rng = np.random.default_rng(1)
    values = torch.cat([edge_values(dtype), torch.tensor([0.0, 0.0, 1e-40, 1e9], dtype=dtype)])
    counts = rng.integers(0, 5, values.numel())
    counts[-4:] = [3, 0, 2, 1]
    got = LogHistogram()
    got.add(bin_values(values, counts))
    same_histogram(got, exact_histogram(torch.from_numpy(np.repeat(values.numpy(), counts))))


@pytest.mark.parametrize(
    "derive",
    [
        lambda raw: raw.clamp(max=2.0),  # truncation changes a few values
        lambda raw: torch.where(torch.arange(raw.numel()) == 7, raw * 3.0, raw),  # one value
        lambda raw: raw.clone(),  # none
        lambda raw: torch.where((raw > 0.8) & (raw < 1.25), raw, 0.0),  # IcePop zeroes some
        lambda raw: torch.where(raw > 1.1, 1.0, 0.0),  # a mask: two values
        lambda raw: raw * 1.0001,  # everything changes
        lambda raw: torch.where(torch.arange(raw.numel()) % 2 == 0, raw, 0.0),  # half of them
        lambda raw: raw.double(),  # another dtype, the same values
    ],
)
@pytest.mark.parametrize("path", ["numba", "reference"])
def test_binning_like_earlier_values_equals_binning_afresh(derive, path, monkeypatch):
    if path == "numba" and not kernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv(kernels.ENV, path)
    raw = torch.exp(torch.randn(80_000) * 0.3)
    weights = derive(raw)
    got = LogHistogram()
    got.add(bin_values(weights, like=bin_values(raw), keep_index=False))
    same_histogram(got, exact_histogram(weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogram_2d_equals_float64_binning(dtype):
    x = (torch.rand(50_000, dtype=torch.float64) * -25).to(dtype)
    y = (x.double() + torch.randn(50_000, dtype=torch.float64) * 0.3).to(dtype)
    x[:81] = torch.linspace(-20, 0, 81).to(dtype)
    x[81:90] = torch.tensor([-1e-30, 1e-30, 0.0, -30, 5, -19.99999, -20.000001, -0.25, -0.0])
    h = Histogram2D(-20.0, 0.0, 80)
    h.update(x, y)

    def index(v):
        return ((v.double() + 20.0) * 4.0).floor().clamp_(0, 79).long()

    expected = torch.bincount(index(x) * 80 + index(y), minlength=6400).reshape(80, 80)
    assert np.array_equal(h.counts, expected.numpy())


def ragged_batch(seed: int = 0) -> TokenBatch:
    """Sequences of lengths 0..300 (empty ones included) with a partial loss mask."""
    rng = np.random.default_rng(seed)
    lengths = [0, 3, 0, 0, 1, *rng.integers(0, 300, 30).tolist(), 0]
    n = sum(lengths)
    rollout = -rng.exponential(0.5, n)
    return TokenBatch(
        rollout=torch.tensor(rollout, dtype=torch.float32),
        train=torch.tensor(rollout + rng.normal(0, 0.2, n), dtype=torch.float32),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
        loss_mask=torch.tensor(rng.random(n) > 0.2),
    )


def scatter_sum(x, batch, mask=None):
    values = x.double() if mask is None else torch.where(mask, x.double(), 0.0)
    out = torch.zeros(batch.num_sequences, dtype=torch.float64)
    return out.index_add_(0, batch.seq_index, values)


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_segment_reductions_equal_scatters(host, monkeypatch):
    if not host:
        monkeypatch.setattr(ops, "_on_host", lambda *_: False)
    batch = ragged_batch()
    m = batch.loss_mask
    d = batch.train.double() - batch.rollout.double()
    every = torch.ones_like(m)
    for x in (d, batch.train, m, d > 0, torch.arange(batch.num_tokens)):
        for mask in (None, m, every):
            expected = scatter_sum(x, batch, mask)
            assert torch.allclose(ops.segment_sum(x, batch, mask), expected, rtol=1e-12)
    assert torch.equal(ops.segment_count(batch, m), scatter_sum(m, batch))
    expected_max = torch.full((batch.num_sequences,), -torch.inf, dtype=torch.float64)
    expected_max.scatter_reduce_(0, batch.seq_index, torch.where(m, d, -torch.inf), "amax")
    assert torch.equal(ops.segment_max(d, batch, m), expected_max)
    assert torch.equal(ops.segment_all(d > -0.5, batch), scatter_sum(~(d > -0.5), batch) == 0)
    values = torch.arange(batch.num_sequences, dtype=torch.float32)
    assert torch.equal(ops.broadcast(values, batch), values[batch.seq_index])
    assert torch.equal(ops.broadcast(values > 3, batch), (values > 3)[batch.seq_index])


@pytest.mark.parametrize("selected", [None, "some", "none"])
def test_groups_equal_one_boolean_selection_per_key(selected):
    rng = np.random.default_rng(2)
    keys = rng.integers(-3, 5, 500)
    s = {"a": rng.random(500), "b": rng.integers(0, 9, 500)}
    sel = {None: None, "some": rng.random(500) < 0.6, "none": np.zeros(500, bool)}[selected]
    pick = np.ones(500, bool) if sel is None else sel
    got = list(ops.groups(s, keys, sel))
    assert [int(k) for k, _ in got] == np.unique(keys[pick]).tolist()
    for key, group in got:
        for name, values in s.items():
            assert np.array_equal(group[name], values[pick & (keys == key)])


@pytest.mark.parametrize("fraction", [0.0, 1e-3, 0.3, 0.999, 1.0])
def test_segment_counts(fraction):
    batch = ragged_batch(1)
    mask = torch.rand(batch.num_tokens) < fraction
    expected = scatter_sum(mask, batch).numpy()
    assert np.array_equal(ops.segment_counts(mask.numpy(), batch), expected)


@pytest.mark.parametrize("kind", ["normal", "zeros of both signs", "not finite", "extremes"])
def test_median_and_quantiles_are_numpys_byte_for_byte(kind):
    rng = np.random.default_rng(len(kind))
    pools = {
        "zeros of both signs": [-0.0, 0.0, 1.0, -1.0],
        "not finite": [np.inf, -np.inf, 1.0, np.nan, -0.0, 2.5],
        "extremes": [1.7e308, -1.7e308, 1e-320, 3.0, 5e-324],
    }
    levels = [(0.1, 0.9), (0.5,), (0.0, 1.0), (0.25, 0.75, 0.99)]
    for i in range(2000):
        n = int(rng.integers(1, 40))
        x = rng.normal(size=n) if kind == "normal" else rng.choice(pools[kind], n)
        qs = levels[i % len(levels)]
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf, as numpy's
            expected = np.array([np.median(x), *np.quantile(x, list(qs))])
            got = np.array([ops.median(x), *ops.quantiles(x, qs)])
        nan = np.isnan(expected)
        assert (np.isnan(got) == nan).all(), x
        assert got[~nan].tobytes() == expected[~nan].tobytes(), x


def test_shared_results_are_computed_once_and_recomputed_when_modified():
    batch = ragged_batch(2)
    plain = ops.log_ratio(batch)
    with ops.shared(batch):
        d = ops.log_ratio(batch)
        assert ops.log_ratio(batch) is d and torch.equal(d, plain)
        rho = ops.exp(d)
        assert ops.exp(d) is rho and ops.exp(d, bound=None) is not rho
        sums = ops.segment_sum(d, batch, batch.loss_mask)
        assert ops.segment_sum(d, batch, batch.loss_mask) is sums
        d.mul_(2.0)  # a caller modifying a shared tensor invalidates what was derived from it
        assert ops.log_ratio(batch) is not d and torch.equal(ops.log_ratio(batch), plain)
        fresh = ops.log_ratio(batch)
        assert torch.equal(ops.segment_sum(fresh, batch, batch.loss_mask), sums)
        other = ragged_batch(3)
        assert ops.log_ratio(other) is not ops.log_ratio(other)  # only the shared batch
        assert ops.memo(batch) is not None and ops.memo(other) is None
    assert ops.log_ratio(batch) is not ops.log_ratio(batch)


def test_scratch_buffers_are_reused_only_inside_reused_buffers():
    def scratch(name: str, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return ops.scratch(name, n, dtype, "cpu")

    first, second = scratch("x", 10), scratch("x", 10)  # outside: fresh tensors
    assert first.data_ptr() != second.data_ptr()
    with ops.reused_buffers():
        a = scratch("x", 100)
        b = scratch("x", 60)
        assert a.data_ptr() == b.data_ptr() and b.shape == (60,)
        c = scratch("x", 200)  # grown
        assert c.shape == (200,) and scratch("y", 10, torch.bool).dtype == torch.bool


def test_streamed_analysis_equals_the_analysis_of_resident_chunks(tmp_path):
    path = tmp_path / "d.parquet"
    write_simulated(path, SimConfig("moe_routing", sequences=24, steps=3), layout="token")
    settings = ["verl:decoupled_geo_rs_token_tis", "slime:slime_mis_example", "trl:trl_default"]
    streamed = analyze(path, settings, max_tokens=20_000, device="cpu")
    chunks = list(Dump(path).batches(max_tokens=20_000, whole_steps=True))
    resident = analyze(chunks, settings, device="cpu")
    assert_same(resident.mismatch, streamed.mismatch)
    assert_same(resident.settings, streamed.settings)


def test_a_bad_chunk_read_ahead_raises_in_the_caller(tmp_path):
    path = tmp_path / "bad.parquet"
    good = {"step": [0, 0], "seq_id": [1, 1], "rollout_logprob": [-0.1, -0.2]}
    bad = {"step": [1, 1], "seq_id": [2, 2], "rollout_logprob": [-0.1, float("nan")]}
    with pq.ParquetWriter(path, pa.table({**good, "train_logprob": [-0.1, -0.1]}).schema) as w:
        for part in (good, bad):
            w.write_table(pa.table({**part, "train_logprob": [-0.1, -0.1]}))
    with pytest.raises(DumpProblems, match="NaN"):
        analyze(path, ["trl:trl_default"], max_tokens=1, device="cpu")


def test_float64_log_probs_are_never_overwritten():
    """`log_ratio` subtracted the rollout in place from `train.double()`, which is `train`
    itself when it is float64 already: a batch built in Python from float64 tensors had its
    train log-probs replaced by d, and every later d was off by the rollout (a batch of 256
    short sequences had 30 of them called broken before `recommend` and 1 inside it)."""
    rng = np.random.default_rng(0)
    rollout = torch.from_numpy(np.log(rng.uniform(0.01, 1.0, 400)))
    train = rollout + torch.from_numpy(rng.normal(0.0, 0.05, 400)).clamp(max=0.0)
    batch = TokenBatch(rollout=rollout, train=train, cu_seqlens=torch.arange(0, 401, 20))
    kept = train.clone()
    expected = (train - rollout).numpy().copy()
    for _ in range(2):
        np.testing.assert_array_equal(ops.log_ratio(batch).numpy(), expected)
        with ops.shared(batch):
            np.testing.assert_array_equal(ops.log_ratio(batch).numpy(), expected)
    assert torch.equal(batch.train, kept)


def _every_field(lengths: list[int], seed: int = 0) -> TokenBatch:
    """A batch with every optional per-token and per-sequence field, for gathers."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    return TokenBatch(
        rollout=torch.tensor(-rng.random(n), dtype=torch.float32),
        train=torch.tensor(-rng.random(n), dtype=torch.float32),
        cu_seqlens=cu,
        loss_mask=torch.tensor(rng.random(n) < 0.8),
        policy=torch.tensor(-rng.random(n), dtype=torch.float32),
        step=torch.tensor(rng.integers(0, 3, len(lengths))),
        seq_id=pa.array([f"s{i}" for i in range(len(lengths))]),
        pos=torch.tensor(np.concatenate([rng.permutation(k) for k in lengths]), dtype=torch.int64),
        extra=pa.table({"reward": rng.random(len(lengths))}),
        turn=torch.tensor(np.concatenate([np.sort(rng.integers(0, 3, k)) for k in lengths])),
        routing_agrees=torch.tensor(rng.random(n) < 0.5),
    )


@pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [40, 0, 2]])
def test_take_equals_the_slices_of_its_sequences_in_order(lengths):
    """`take` gathers every field at once; the reference is one slice per sequence."""
    batch = _every_field(lengths, seed=len(lengths))
    order = torch.tensor(np.random.default_rng(1).permutation(len(lengths)))
    got = batch.take(order)
    parts = [batch.slice(int(i), int(i) + 1) for i in order]
    for name in ("rollout", "train", "loss_mask", "policy", "pos", "turn", "routing_agrees"):
        assert torch.equal(getattr(got, name), torch.cat([getattr(p, name) for p in parts])), name
    assert got.lengths.tolist() == [lengths[i] for i in order.tolist()]
    assert got.step.tolist() == batch.step[order].tolist()
    assert got.seq_id.to_pylist() == [f"s{i}" for i in order.tolist()]
    assert got.extra["reward"].to_pylist() == [batch.extra["reward"][i].as_py() for i in order]


def test_interleaved_steps_are_gathered_as_one_selection_per_step():
    from iscore.passes.parts import step_runs

    batch = _every_field([2, 3, 1, 4, 2, 5, 1, 3, 2], seed=3)
    batch = dataclasses.replace(batch, step=torch.tensor([2, 0, 2, 1, 0, 2, 1, 0, 2]))
    runs = list(step_runs(batch))
    assert [step for step, _ in runs] == [2, 0, 1]  # in the order of their first rows
    for step, run in runs:
        expected = batch.select(batch.step == step)
        assert run.equal(expected) and run.seq_id.equals(expected.seq_id), step
