"""The bug signatures (`iscore.stats.signatures`, `iscore.advice.signatures`): each fires on a
dump that has it (a simulated dump edited as the bug would have written it) and only there,
never on a sample of data/ or a simulated regime; its sums are the same streamed in chunks,
through the results store and through worker processes as in one process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.advice import signature_flags
from iscore.dump import Dump
from iscore.dump.simulate import REGIMES, SimConfig, write_run, write_simulated
from iscore.packed import TokenBatch
from iscore.passes.analysis import analyze
from iscore.passes.results_store import ResultStore
from iscore.stats import SignatureStats

ROOT = Path(__file__).resolve().parents[2]
MINE = ("shifted_by_one", "zero_rollout_logprob", "position_jump")

Edit = Callable[..., tuple[np.ndarray, np.ndarray]]


def _edit(path: Path, edit: Edit) -> Path:
    """Rewrite the dump at `path` (sequence layout) in place with `edit(rollout, train, pos,
    offsets)` -> (rollout, train), flat per-token arrays."""
    table = pq.read_table(path)
    columns = {k: table.column(k).combine_chunks() for k in ("rollout_logprob", "train_logprob")}
    offsets = columns["rollout_logprob"].offsets.to_numpy()
    flat = [c.values.to_numpy(zero_copy_only=False).copy() for c in columns.values()]
    pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], np.diff(offsets))
    for name, values in zip(columns, edit(*flat, pos, offsets), strict=True):
        values = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
        table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path)
    return path


def shifted(rollout, train, pos, offsets, by=1):
    """The trainer's array read `by` tokens off within each sequence (its ends kept)."""
    out = train.copy()
    if by > 0:
        out[:-by] = train[by:]
        keep = offsets[1:] - 1
    else:
        out[-by:] = train[:by]
        keep = offsets[:-1]
    out[keep] = train[keep]
    return rollout, out


def zeroed(rollout, train, pos, offsets):
    """Turns 1 and 3 of four (tool output) with a dummy rollout log-prob of 0."""
    length = np.repeat(np.diff(offsets), np.diff(offsets))
    observation = (pos * 4 // length) % 2 == 1
    return np.where(observation, np.float32(0.0), rollout), train


def jumped(rollout, train, pos, offsets, at=96, factor=3.0):
    """d multiplied by `factor` from position `at` on (capped at log-prob 0)."""
    d = train.astype(np.float64) - rollout
    out = np.where(pos >= at, np.minimum(rollout + factor * d, 0.0), train)
    return rollout, out.astype(np.float32)


BUGS = {"shifted_by_one": shifted, "zero_rollout_logprob": zeroed, "position_jump": jumped}


def _codes(analysis) -> list[str]:
    return [f.code for f in analysis.flags if f.code in MINE]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("signatures")
    out = {}
    for regime in ("dense_bf16", "fp8"):
        config = SimConfig(regime, sequences=64, steps=2, seed=11)
        for code, edit in BUGS.items():
            path = folder / f"{regime}_{code}.parquet"
            write_simulated(path, config)
            out[f"{regime}_{code}"] = _edit(path, edit)
    return out


@pytest.mark.parametrize("regime", ["dense_bf16", "fp8"])
@pytest.mark.parametrize("code", MINE)
def test_each_signature_fires_on_its_dump_alone(dumps, regime, code):
    analysis = analyze(dumps[f"{regime}_{code}"], device="cpu", jobs=1)
    assert _codes(analysis) == [code]
    (flag,) = [f for f in analysis.flags if f.code == code]
    assert flag.kind == "semantics_bug"
    assert {
        "shifted_by_one": "rollout_logprob[t + 1]",
        "zero_rollout_logprob": "Mask observation tokens out of the loss or record the engine's",
        "position_jump": "abruptly at position 96",
    }[code] in flag.message


def test_a_shift_the_other_way_is_named(tmp_path):
    path = tmp_path / "behind.parquet"
    write_simulated(path, SimConfig("dense_bf16", sequences=32, seed=3))
    _edit(path, lambda *a: shifted(*a, by=-1))
    (flag,) = [f for f in analyze(path, device="cpu", jobs=1).flags if f.code in MINE]
    assert "rollout_logprob[t - 1]" in flag.message and "behind" in flag.message


def test_a_smooth_trend_along_the_position_is_no_jump(tmp_path):
    """|d| growing linearly with the position (3x by position 512) steps by less than 2x
    between any two windows: no position is named."""
    path = tmp_path / "trend.parquet"
    write_simulated(path, SimConfig("dense_bf16", sequences=64, steps=2, seed=5))

    def trend(rollout, train, pos, offsets):
        d = train.astype(np.float64) - rollout
        return rollout, np.minimum(rollout + (1 + pos / 256) * d, 0.0).astype(np.float32)

    _edit(path, trend)
    analysis = analyze(path, device="cpu", jobs=1)
    assert _codes(analysis) == []
    scan = analysis.mismatch.signatures.positions
    at = scan.position.index(256)
    assert 1.15 < scan.abs_mean[1][at] / scan.abs_mean[0][at] < 2.0  # the trend is there


def test_the_share_of_dummy_zeros_is_stated(dumps):
    analysis = analyze(dumps["dense_bf16_zero_rollout_logprob"], device="cpu", jobs=1)
    found = analysis.mismatch.signatures
    share = sum(found.zero_rollout[:3]) / found.loss_tokens
    (flag,) = [f for f in analysis.flags if f.code == "zero_rollout_logprob"]
    assert flag.message.startswith(f"{share:.1%} of the loss tokens")


@pytest.mark.parametrize("sample", sorted((ROOT / "data").glob("*.parquet")), ids=lambda p: p.stem)
def test_no_sample_has_a_signature(sample):
    assert _codes(analyze(sample, device="cpu", jobs=1)) == []


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_no_simulated_regime_has_a_signature(regime, tmp_path):
    # Two seeds, the second with turns whose seams are noisier and broken sequences.
    sequences = 16 if regime == "long_collapse" else 96
    for seed, extra in ((0, {}), (1, {"turns": 4, "turn_scale": 3.0, "broken_share": 0.05})):
        path = tmp_path / f"{seed}.parquet"
        write_simulated(path, SimConfig(regime, sequences=sequences, steps=2, seed=seed, **extra))
        assert _codes(analyze(path, device="cpu", jobs=1)) == [], (regime, seed)


@pytest.fixture(scope="module", params=MINE)
def run(request, tmp_path_factory) -> tuple[str, Path]:
    """A run of 3 steps x 2 ranks with one signature in every file."""
    folder = tmp_path_factory.mktemp("signature_run") / "run"
    write_run(folder, SimConfig("dense_bf16", sequences=48, steps=3, seed=2), ranks=2)
    for path in sorted(folder.rglob("*.parquet")):
        _edit(path, BUGS[request.param])
    return request.param, folder


def _doc(code, source, **options) -> str:
    analysis = analyze(source, max_tokens=20_000, device="cpu", **options)
    assert _codes(analysis) == [code]
    return json.dumps(analysis.to_dict(), sort_keys=True)


def test_streamed_stored_and_in_workers_as_in_one_process(run, tmp_path):
    code, folder = run
    whole = SignatureStats()
    for batch in Dump(folder).batches(max_tokens=10**9):
        whole.update(batch)
    chunks = SignatureStats()
    for batch in Dump(folder).batches(max_tokens=5_000):
        part = SignatureStats()
        part.update(batch)
        chunks.merge(SignatureStats.from_state(part.state()))
    assert chunks.compute() == whole.compute()
    fresh = _doc(code, folder, jobs=1)
    store = ResultStore(tmp_path / "cache")
    assert _doc(code, folder, jobs=1, store=store) == fresh
    again = ResultStore(tmp_path / "cache")
    assert _doc(code, folder, jobs=1, store=again) == fresh
    assert again.reads and not again.writes
    assert _doc(code, folder, jobs=2) == fresh


def test_a_state_of_another_shape_is_refused():
    stats = SignatureStats()
    lp = torch.tensor([-0.1, -2.0, -0.5, -1.0])
    stats.update(TokenBatch(rollout=lp, train=lp, cu_seqlens=torch.tensor([0, 1, 4])))
    state = stats.state()
    assert SignatureStats.from_state(state).compute() == stats.compute()
    with pytest.raises(ValueError, match="by_position"):
        SignatureStats.from_state(state | {"by_position": state["by_position"][:-1]})


def test_no_summary_no_flag_and_too_few_pairs_none():
    assert signature_flags(None) == []
    stats = SignatureStats()
    lp = torch.tensor([-0.1, -2.0, -0.5, -1.0])
    stats.update(TokenBatch(rollout=lp, train=lp.roll(-1), cu_seqlens=torch.tensor([0, 4])))
    assert signature_flags(stats.compute()) == []  # 3 pairs: too few to say
