"""The results store: a second analysis of a run reads only what changed, and equals a fresh
one to the last digit; whatever in the store does not check out is computed again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.cli import main
from iscore.dump import Dump, StepRange
from iscore.dump.simulate import SimConfig, write_run, write_simulated
from iscore.errors import DumpError, IscoreError
from iscore.passes.analysis import analyze
from iscore.passes.results_store import (
    ATTRIBUTION,
    MISMATCH,
    Context,
    FileIdentity,
    ResultStore,
    footer_complete,
)
from iscore.stats.histogram import LogHistogram, from_keyed_state, keyed_state
from iscore.utils import footer
from iscore.utils.paths import default_folder

SETTINGS = ["verl:decoupled_geo_rs_token_tis", "skyrl:skyrl_geo_mask"]


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "run"
    config = SimConfig("moe_routing", sequences=12, steps=4, median_len=80, seed=5)
    write_run(folder, config, ranks=2)
    return folder


def _doc(data, settings=SETTINGS, store=None, **options) -> str:
    return json.dumps(
        analyze(Dump(data, **options), settings, store=store).to_dict(), sort_keys=True
    )


def _entries(store: ResultStore) -> list[Path]:
    """The files' entries (not the merges of a run's files)."""
    return sorted(p for p in store.root.rglob("*.arrow") if p.parent.name != "merged")


def _forget_merges(store: ResultStore) -> None:
    """Remove the merges of a run's files, so that the next analysis goes through the
    files' own entries."""
    shutil.rmtree(store.root / "merged", ignore_errors=True)


def test_a_second_analysis_reads_the_store_and_equals_a_fresh_one(run, tmp_path):
    fresh = _doc(run)
    store = ResultStore(tmp_path / "cache")
    assert _doc(run, store=store) == fresh
    # 4 steps x 2 ranks, one entry each, and their merge.
    assert (store.reads, store.writes) == (0, 9)
    again = ResultStore(tmp_path / "cache")
    assert _doc(run, store=again) == fresh
    assert (again.reads, again.writes) == (1, 0)  # the merge alone
    _forget_merges(again)
    files = ResultStore(tmp_path / "cache")
    assert _doc(run, store=files) == fresh
    assert (files.reads, files.writes) == (8, 1)  # each file's entry, the merge written again
    # A selection of steps is served from the files' entries (its merge is its own), and
    # equals its fresh analysis.
    steps = ResultStore(tmp_path / "cache")
    assert _doc(run, store=steps, steps=StepRange(1, 2)) == _doc(run, steps=StepRange(1, 2))
    assert (steps.reads, steps.writes) == (8, 1)
    assert len(list((steps.root / "merged").iterdir())) == 2


def test_a_merge_is_replaced_as_the_run_grows_and_rebuilt_when_damaged(tmp_path):
    folder = tmp_path / "run"
    write_run(folder, SimConfig(sequences=6, steps=4, median_len=40, seed=3))
    staged = folder.parent / "late"
    shutil.move(folder / "step_000003", staged)
    store = ResultStore(tmp_path / "cache")
    _doc(folder, store=store)
    (merge,) = (store.root / "merged").iterdir()
    shutil.move(staged, folder / "step_000003")
    grown = ResultStore(tmp_path / "cache")
    assert _doc(folder, store=grown) == _doc(folder)
    assert (grown.reads, grown.writes) == (3, 2)  # the old merge is not this run's
    assert list((store.root / "merged").iterdir()) == [merge]  # replaced, not piled up
    for damage in (b"", merge.read_bytes()[:-100], b"PAR1 not an Arrow file"):
        merge.write_bytes(damage)
        again = ResultStore(tmp_path / "cache")
        assert _doc(folder, store=again) == _doc(folder)
        assert (again.reads, again.writes) == (4, 1)


def test_only_what_changed_is_computed(run, tmp_path):
    store = ResultStore(tmp_path / "cache")
    _doc(run, store=store)
    # A new step lands: one file per rank is read, the others come from the store.
    write_run(
        tmp_path / "more",
        SimConfig("moe_routing", sequences=12, steps=5, median_len=80, seed=5),
        ranks=2,
    )
    for rank in (0, 1):
        (run / "step_000004").mkdir(exist_ok=True)
        shutil.copy(
            tmp_path / "more" / "step_000004" / f"rank_{rank:04d}.parquet", run / "step_000004"
        )
    store = ResultStore(tmp_path / "cache")
    assert _doc(run, store=store) == _doc(run)
    assert (store.reads, store.writes) == (8, 3)  # and the run's merge
    # A setting added: every file is read again for it alone, the rest kept.
    store = ResultStore(tmp_path / "cache")
    assert _doc(run, [*SETTINGS, "nemo_rl:nemo_icepop"], store) == _doc(
        run, [*SETTINGS, "nemo_rl:nemo_icepop"]
    )
    assert store.writes == 11
    store = ResultStore(tmp_path / "cache")
    assert _doc(run, SETTINGS[:1], store) == _doc(run, SETTINGS[:1])  # a subset: all stored
    assert (store.reads, store.writes) == (1, 0)
    _forget_merges(store)
    store = ResultStore(tmp_path / "cache")
    assert _doc(run, SETTINGS[:1], store) == _doc(run, SETTINGS[:1])
    assert (store.reads, store.writes) == (10, 1)


@pytest.mark.parametrize(
    "damage",
    [
        "flip a byte",
        "truncate",
        "another file's entry",
        "not Arrow",
    ],
)
def test_a_damaged_or_foreign_entry_is_ignored_and_rebuilt(run, tmp_path, damage):
    fresh = _doc(run)
    store = ResultStore(tmp_path / "cache")
    _doc(run, store=store)
    _forget_merges(store)
    entries = _entries(store)
    victim = entries[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip a byte":
        # Inside the arrays (lz4-compressed): either the checksum or the decompression fails.
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "another file's entry":
        shutil.copy(entries[1], victim)
    else:
        victim.write_bytes(b"PAR1 not an Arrow file")
    damaged = victim.read_bytes()
    again = ResultStore(tmp_path / "cache")
    assert _doc(run, store=again) == fresh
    assert again.writes == 2 and victim.read_bytes() not in (damaged, b"")  # and the merge


def test_a_state_that_does_not_make_an_accumulator_is_recomputed(run, tmp_path):
    """Arrays whose checksum holds but that `from_state` refuses (an array missing, as a
    bug or a hand could write them) are computed again."""
    store = ResultStore(tmp_path / "cache")
    fresh = _doc(run, store=store)
    for info in Dump(run).files:
        identity = FileIdentity.of(info.path)
        context = Context(tuple(sorted(info.columns.source.items())), "cpu").key
        stored = store.load(identity, context)
        for part in stored.parts:
            del part.states[MISMATCH]["noise"]
        store.save(identity, context, stored)  # with checksums of what is left
    _forget_merges(store)
    again = ResultStore(tmp_path / "cache")
    assert _doc(run, store=again) == fresh
    assert (again.reads, again.writes) == (8, 9)


def test_a_file_changed_in_place_is_read_again(run, tmp_path):
    store = ResultStore(tmp_path / "cache")
    _doc(run, store=store)
    path = run / "step_000000" / "rank_0000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path)
    again = ResultStore(tmp_path / "cache")
    assert _doc(run, store=again) == _doc(run)
    assert again.writes == 2  # its entry and the run's merge


def test_a_sequence_in_two_files_is_refused_through_the_store_too(run, tmp_path):
    shutil.copy(
        run / "step_000001" / "rank_0000.parquet", run / "step_000001" / "rank_0009.parquet"
    )
    with pytest.raises(DumpError, match="also in"):
        analyze(Dump(run), SETTINGS)
    with pytest.raises(
        DumpError, match=r"rank_0009.parquet: sequence \(step 1, seq_id .*also in .*rank_0000"
    ):
        analyze(Dump(run), SETTINGS, store=ResultStore(tmp_path / "cache"))


def test_the_store_is_left_alone_where_it_cannot_serve(run, tmp_path):
    store = ResultStore(tmp_path / "cache")
    analyze(Dump(run, where="length > 10"), SETTINGS, store=store)
    analyze(Dump(run, drop_invalid=True), SETTINGS, store=store)
    assert (store.reads, store.writes) == (0, 0) and not (tmp_path / "cache").exists()


def test_footer_complete_and_identity(run, tmp_path):
    path = next(run.rglob("*.parquet"))
    assert footer_complete(path)
    data = path.read_bytes()
    for cut in (data[:-3], data[: len(data) // 2], b"", b"PAR1"):
        partial = tmp_path / "partial.parquet"
        partial.write_bytes(cut)
        assert not footer_complete(partial) and FileIdentity.of(partial) is None
    a = FileIdentity.of(path)
    os.utime(path, ns=(a.mtime_ns + 10**9, a.mtime_ns + 10**9))
    assert FileIdentity.of(path).key != a.key


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_folder() == tmp_path / "iscore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_folder() == Path.home() / ".cache" / "iscore"


def test_the_command_keeps_its_results_in_the_users_cache_unless_told(
    run, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    argv = ["analyze", str(run), "-q", "--preset", "verl:decoupled_geo_rs"]
    assert main(argv) == 0
    assert len(_entries(ResultStore(tmp_path / "xdg" / "iscore"))) == 8
    assert "wrote 9 entries" in capsys.readouterr().err  # and the run's merge
    assert main([*argv, "--cache-dir", str(tmp_path / "mine")]) == 0
    assert len(_entries(ResultStore(tmp_path / "mine"))) == 8
    capsys.readouterr()
    assert main([*argv, "--no-cache", "--json", str(tmp_path / "a.json")]) == 0
    assert "results store" not in capsys.readouterr().err
    assert sorted(p.name for p in run.rglob("*") if p.is_file() and p.suffix != ".parquet") == []


def test_an_entry_holds_no_object_arrays(run, tmp_path):
    store = ResultStore(tmp_path / "cache")
    _doc(run, store=store)
    for path in store.root.rglob("*.arrow"):
        table = pa.ipc.open_file(pa.OSFile(str(path))).read_all()
        assert set(table["dtype"].to_pylist()) <= {"|u1", "<i4", "<i8", "<f8"}
    assert np.dtype("|u1").str == "|u1"


def test_routing_and_turns_go_through_the_store_and_an_entry_without_them_is_rebuilt(tmp_path):
    """An entry written before the attribution kept its routing and turn sums holds states
    without them: `from_state` refuses those, and they are computed again, never misread."""
    folder = tmp_path / "moe"
    config = SimConfig(
        sequences=12, steps=3, median_len=80, seed=6, experts=4, routing_differ=0.2, turns=3
    )
    write_run(folder, config)
    fresh = _doc(folder)
    assert json.loads(fresh)["attribution"]["routing"] is not None
    store = ResultStore(tmp_path / "cache")
    assert _doc(folder, store=store) == fresh
    for info in Dump(folder).files:
        identity = FileIdentity.of(info.path)
        context = Context(tuple(sorted(info.columns.source.items())), "cpu").key
        stored = store.load(identity, context)
        for part in stored.parts:
            for name in ("routing", "turns"):
                del part.states[ATTRIBUTION][name]
        store.save(identity, context, stored)
    _forget_merges(store)
    again = ResultStore(tmp_path / "cache")
    assert _doc(folder, store=again) == fresh
    assert (again.reads, again.writes) == (3, 4)


def test_a_footer_that_passed_is_not_parsed_again_through_the_store(run, tmp_path, monkeypatch):
    parsed = []
    check = footer._check
    monkeypatch.setattr(footer, "_check", lambda meta: (parsed.append(1), check(meta))[1])
    store = ResultStore(tmp_path / "cache")
    analyze(str(run), SETTINGS, store=store)
    assert len(parsed) >= 8  # each file's footer parsed (and marked) once at least
    fresh = _doc(run)
    parsed.clear()
    again = analyze(str(run), SETTINGS, store=store).to_dict()
    assert parsed == []
    assert json.dumps(again, sort_keys=True) == fresh
    # Without the store, from memory, or a footer changed: parsed.
    Dump(run)
    assert len(parsed) == 8
    path = next(run.rglob("*.parquet"))
    Dump.from_buffers([("up.parquet", path.read_bytes())])
    assert len(parsed) == 9
    # A footer that fails is never marked: refused every time.
    bad = tmp_path / "bad.parquet"
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    bad.write_bytes(data[: -8 - length] + b"\xff" * length + data[-8:])
    for _ in range(2):
        with pytest.raises(DumpError, match="unreadable Parquet footer"):
            Dump(bad, footers=store.footers)
    marks = {p.name for p in store.footers.folder.rglob("*") if p.is_file()}
    assert len(marks) == 8
    assert hashlib.sha256(bad.read_bytes()[-8 - length :]).hexdigest() not in marks


def test_a_histogram_read_back_sparse_merges_and_reads_as_the_dense_one():
    rng = np.random.default_rng(0)
    dense = [LogHistogram() for _ in range(3)]
    for hist in dense:
        hist.update(torch.from_numpy(np.exp(rng.normal(0, 3, 500))))
    sparse = [LogHistogram.from_state(h.state()) for h in dense]
    assert all(s._dense is None for s in sparse) and sparse == dense
    total_dense, total_sparse = LogHistogram(), LogHistogram()
    for d, s in zip(dense, sparse, strict=True):
        total_dense.merge(d)
        total_sparse.merge(s)
    assert total_sparse == total_dense
    np.testing.assert_array_equal(total_sparse.counts, total_dense.counts)
    for q in (0.0, 0.01, 0.5, 0.99, 1.0):
        assert sparse[0].quantile(q) == dense[0].quantile(q)
    assert sparse[1].total == dense[1].total
    # Merging into a sparse one leaves the other's arrays as they were.
    kept = sparse[2]._used_counts.copy()
    first = LogHistogram.from_state(dense[0].state())
    first.merge(sparse[2])
    first.merge(sparse[2])
    np.testing.assert_array_equal(sparse[2]._used_counts, kept)
    assert first.total == dense[0].total + 2 * dense[2].total
    # Steps read back by key from a merge of many.
    steps = {k: dense[k % 3] for k in (7, 1, 4, 2)}
    back = from_keyed_state(keyed_state(steps))
    assert back == steps


def test_interleaved_steps_are_one_part_per_step_and_give_the_sorted_numbers(tmp_path):
    """A file whose steps interleave row by row (`step = seq_id % 4`, as ranks' outputs
    concatenated give) made a part of every sequence: 7 ms and a stored entry's histograms
    each, and a noise estimate per sequence. Its steps are now gathered per chunk: one part
    per step, and the numbers of the same rows sorted by step."""
    ordered = tmp_path / "sorted.parquet"
    config = SimConfig("moe_routing", sequences=16, steps=4, median_len=60, seed=8)
    write_simulated(ordered, config)
    table = pq.read_table(ordered)
    steps = table["step"].to_numpy()
    # Row r of the interleaved file is the (r // 4)-th sequence of step r % 4.
    rows = np.stack([np.flatnonzero(steps == s) for s in range(4)], axis=1).ravel()
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(table.take(pa.array(rows)), mixed)
    assert (pq.read_table(mixed)["step"].to_numpy()[:8] == [0, 1, 2, 3] * 2).all()

    store = ResultStore(tmp_path / "cache")
    interleaved = analyze(Dump(mixed), SETTINGS, store=store)
    (info,) = Dump(mixed).files
    context = Context(tuple(sorted(info.columns.source.items())), "cpu").key
    stored = store.load(FileIdentity.of(mixed), context)
    assert sorted(p.step for p in stored.parts) == [0, 1, 2, 3]

    reference = analyze(Dump(ordered), SETTINGS, store=None)
    got, want = interleaved.mismatch, reference.mismatch
    for name in ("tokens", "sequences", "broken_sequences"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("k3", "abs_diff_mean", "chi2_token", "ratio_mean", "ess", "d_rollout_slope"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-12), name
    for a, b in zip(got.by_step, want.by_step, strict=True):
        assert a.keys() == b.keys()
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=1e-12, nan_ok=True), (b["step"], key)
    for a, b in zip(interleaved.settings, reference.settings, strict=True):
        for name in ("lr_scale", "weight_mean", "ess", "token_masked_fraction"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12), name
    assert [f.code for f in interleaved.flags] == [f.code for f in reference.flags]


def test_the_store_stays_within_its_cap_and_evicts_the_least_recently_used(run, tmp_path):
    """Nothing bounded the store (two analyses left 697 MB): past its cap, the entries used
    longest ago go, and an analysis through a store too small still equals a fresh one."""
    fresh = _doc(run)
    unbounded = ResultStore(tmp_path / "all")
    _doc(run, store=unbounded)
    sizes = sorted(size for _, size, _ in unbounded.entries())
    cap = sum(sizes) // 2
    small = ResultStore(tmp_path / "small", max_bytes=cap)
    assert _doc(run, store=small) == fresh
    assert small.evicted > 0 and small.size() <= cap + sizes[-1]
    # A read marks an entry used: what the next analysis reads again is kept.
    kept = {path.name for path, _, _ in small.entries()}
    again = ResultStore(tmp_path / "small", max_bytes=cap)
    assert _doc(run, store=again) == fresh
    assert again.reads > 0 and kept & {path.name for path, _, _ in again.entries()}


def test_cache_info_and_clear_touch_the_store_alone(run, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "cache"
    _doc(run, store=ResultStore(folder))
    (folder / "numba").mkdir()
    (folder / "numba" / "kernel.nbi").write_bytes(b"compiled")
    assert main(["cache", "info", "--cache-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"results store {folder}: " in out and "of at most 2,048.0 MB" in out
    assert main(["cache", "clear", "--cache-dir", str(folder)]) == 0
    assert "cleared" in capsys.readouterr().out
    assert ResultStore(folder).entries() == []
    assert (folder / "numba" / "kernel.nbi").read_bytes() == b"compiled"
    monkeypatch.setenv("ISCORE_CACHE_MAX_MB", "0.5")
    assert ResultStore(folder).max_bytes == 1 << 19
    monkeypatch.setenv("ISCORE_CACHE_MAX_MB", "-3")
    with pytest.raises(IscoreError, match="ISCORE_CACHE_MAX_MB"):
        ResultStore(folder)
