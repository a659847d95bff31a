"""`iscore.session.workspace` (in-memory dumps, workspaces) and the Tune families of
`iscore.advice.tuning` as each framework's own setting: the engine side of the app."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import iscore
import iscore.dump.facade
import iscore.dump.readers
from iscore.advice.recommendation import recommend
from iscore.advice.tuning import (
    FAMILIES,
    Tuner,
    family_spec,
    frameworks_for,
    grid,
    nearest,
    query,
    sweep,
)
from iscore.dump import Dump, StepRange
from iscore.errors import ConfigError, DumpError, DumpProblems
from iscore.frameworks.resolve import presets
from iscore.passes.analysis import analyze
from iscore.session.workspace import (
    Workspace,
    digest,
    open_path,
    open_uploads,
    select_steps,
    sequence_tokens,
    summarize,
)
from iscore.stats.setting import quick_stats
from tests.app.conftest import DATA


def _bytes(path) -> bytes:
    return (DATA / path).read_bytes()


def test_a_dump_in_memory_reads_like_the_file() -> None:
    batch = Dump.from_buffers([("drift.parquet", _bytes("drift.parquet"))]).load()
    assert batch.equal(iscore.load(DATA / "drift.parquet"))
    steps = Dump.from_buffers([("d", _bytes("drift.parquet"))], steps=StepRange(2, 3)).load()
    assert steps.step.unique().tolist() == [2, 3]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "broken.parquet: empty file (0 bytes)"),
        (b"PK\x03\x04rest", "not a Parquet file (looks like a zip archive"),
        (b"PAR1" + b"\x00" * 20, "truncated Parquet file (24 bytes, no footer)"),
    ],
)
def test_broken_uploads_are_named_problems(data: bytes, message: str) -> None:
    with pytest.raises(DumpProblems) as error:
        Dump.from_buffers([("broken.parquet", data), ("fp8.parquet", _bytes("fp8.parquet"))])
    assert len(error.value.problems) == 1
    assert message in str(error.value.problems[0])


def test_missing_columns_are_problems_of_the_upload() -> None:
    table = pq.read_table(DATA / "fp8.parquet").drop_columns(["train_logprob"])
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    with pytest.raises(DumpProblems) as error:
        Dump.from_buffers([("no_train.parquet", buffer.getvalue())])
    assert "no_train.parquet" in str(error.value) and "train_logprob" in str(error.value)


def test_digest_is_of_the_contents() -> None:
    data = _bytes("fp8.parquet")
    assert digest([("a", data)]) == digest([("b", data)]) != digest([("a", data + b"x")])


def test_select_steps_keeps_whole_sequences() -> None:
    batch = iscore.load(DATA / "drift.parquet")
    part = select_steps(batch, StepRange(1, 2))
    keep = ((batch.step >= 1) & (batch.step <= 2)).numpy()
    assert part.num_sequences == int(keep.sum())
    assert part.seq_id.to_pylist() == [
        i for i, k in zip(batch.seq_id.to_pylist(), keep, strict=True) if k
    ]
    assert torch.equal(part.lengths, batch.lengths[torch.from_numpy(keep)])
    assert part.num_tokens == int(part.lengths.sum())
    assert select_steps(batch, StepRange()) is batch


def test_workspace_memoizes_and_matches_analyze() -> None:
    ws = open_uploads([("drift.parquet", _bytes("drift.parquet"))])
    spec = presets()["verl:decoupled_geo_rs"]
    steps = StepRange(1, 2)
    result = ws.analysis([spec], steps)
    reference = analyze(select_steps(ws.full, steps), [spec])
    assert result.settings == reference.settings
    assert result.mismatch.k3 == reference.mismatch.k3
    assert ws.setting(spec, steps) is result.settings[0]
    assert ws.mismatch(StepRange(0, 3)) is ws.mismatch()  # every step is "all steps"
    assert ws.tuner(steps) is ws.tuner(steps)
    assert ws.source.files == ("drift.parquet",) and ws.steps == [0, 1, 2, 3]


@pytest.mark.parametrize("sample", ["fp8.parquet", "long_collapse.parquet", "off_policy.parquet"])
def test_settings_added_one_by_one_equal_each_analyzed_alone(sample: str) -> None:
    """The workspace keeps d, e^d and the sequence sums between settings (and the tuner):
    every setting added after others gives exactly what analyzing it alone gives."""
    ws = open_uploads([(sample, _bytes(sample))])
    for spec in filter(lambda s: _replays(s, ws.full), presets().values()):
        assert ws.setting(spec) == analyze(ws.full, [spec]).settings[0], spec.name
    fresh = Tuner(ws.full)
    for family in FAMILIES:
        values = [v[len(v) // 3] for v in grid(fresh, family).values()]
        assert query(ws.tuner(), family, values) == query(fresh, family, values), family


def _replays(spec, batch) -> bool:
    """Whether `spec` applies to `batch` (not: it needs a policy column the batch lacks)."""
    try:
        spec.replay(batch)
    except ConfigError:
        return False
    return True


def test_the_data_page_and_recommend_give_one_p90_length() -> None:
    """The length quantiles are rounded as the recommendation's text rounds them (drift's p90
    is 2165.6: 2,166 on both pages, not 2,165 on one)."""
    batch = iscore.load(DATA / "drift.parquet")
    p90 = summarize(batch)["length"]["p90"]
    regime = next(r for r in recommend(batch, "verl").regimes if "your p90 length" in r)
    assert f"at {p90:,} tokens (your p90 length)" in regime


def test_the_analysis_json_says_what_drop_invalid_left_out() -> None:
    table = pq.read_table(DATA / "fp8.parquet")
    rollout = table["rollout_logprob"].to_pylist()
    rollout[3][0] = 0.5  # not a log-prob
    bad = table.set_column(
        table.schema.get_field_index("rollout_logprob"),
        "rollout_logprob",
        pa.array(rollout, pa.list_(pa.float32())),
    )
    sink = io.BytesIO()
    pq.write_table(bad, sink)
    ws = open_uploads([("bad.parquet", sink.getvalue())], drop_invalid=True)
    dropped = ws.analysis([]).to_dict()["source"]["dropped"]
    assert dropped == {
        "sequences": 1,
        "tokens": len(rollout[3]),
        "invalid_values": {"rollout_logprob": 1},
    }


def test_sequence_tokens_by_step_and_id() -> None:
    batch = iscore.load(DATA / "dense_bf16.parquet")
    i = 7
    step, seq_id = int(batch.step[i]), batch.seq_id[i].as_py()
    tokens = sequence_tokens(batch, step, seq_id)
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    np.testing.assert_array_equal(tokens["train"], batch.train[a:b].numpy())
    np.testing.assert_allclose(tokens["d"], tokens["train"] - tokens["rollout"].astype(float))
    assert tokens["pos"].tolist() == list(range(b - a))
    with pytest.raises(iscore.DumpError, match="no sequence"):
        sequence_tokens(batch, step + 100, seq_id)


@pytest.fixture(scope="module")
def fp8() -> tuple[iscore.TokenBatch, Tuner]:
    # With its per-sequence columns: prime-rl's DPPO sides by the advantage.
    batch = iscore.Dump(DATA / "fp8.parquet", extras=True).load()
    return batch, Tuner(batch)


@pytest.mark.parametrize(
    ("family", "framework"),
    [(f, fw) for f in FAMILIES for fw in frameworks_for(f)],
)
def test_a_tuned_setting_replays_as_the_tuner_says(fp8, family: str, framework: str) -> None:
    # What Tune reads out for a framework's setting is what Compare (a replay) shows for it,
    # LR scale under that framework's loss aggregation included.
    batch, tuner = fp8
    values = [
        nearest(grid(tuner, family)[b], d)
        for b, d in zip(FAMILIES[family].bounds, FAMILIES[family].defaults, strict=True)
    ]
    spec = family_spec(family, values, framework)
    assert spec.framework == framework
    tuned = query(tuner, family, values, framework)
    replayed = quick_stats(batch, spec)
    assert replayed.weight_mean == pytest.approx(tuned.weight_mean, rel=1e-4)
    assert replayed.lr_scale == pytest.approx(tuned.lr_scale, rel=1e-4)
    assert replayed.ess == pytest.approx(tuned.ess, rel=1e-4)
    # TRL's and ROLL's float32 e^S underflows to 0: a weight the tuner's float64 keeps.
    if not (framework in ("trl", "roll") and family == "seq_tis"):
        masked = replayed.token_masked_fraction
        assert masked == pytest.approx(tuned.token_masked_fraction, abs=1e-6)


def test_grids_cover_the_data_and_the_defaults(fp8) -> None:
    # Slider positions are the data's quantiles: all but the few leading to 1 and past the
    # extreme (6 each), the default and the included setting lie inside the data's range.
    _, tuner = fp8
    for key, family in FAMILIES.items():
        values = grid(tuner, key, include=[[0.123456] * len(family.bounds)])
        for i, (bound, default) in enumerate(zip(family.bounds, family.defaults, strict=True)):
            xs = values[bound]
            assert default in xs and 0.123456 in xs
            assert xs == sorted(xs) and len(set(xs)) == len(xs)
            ends = (0.25, 0.0) if bound == "lower" else (0.75, 1.0)
            q = tuner.quantiles(family.statistic_of(i), ends)
            lo, hi = sorted(q.values())
            if bound == "upper":
                lo = max(lo, 1.0)
                assert all(x > 1 for x in xs if x != 0.123456)
            if bound == "lower":
                hi = min(hi, 1.0)
                assert all(x < 1 for x in xs)
            inside = [x for x in xs if lo * 0.999 <= x <= hi * 1.001]
            assert len(xs) - len(inside) <= 14, (key, bound, xs)
            assert xs[0] <= lo and xs[-1] >= hi


def test_grid_values_carry_no_float_noise(fp8) -> None:
    _, tuner = fp8
    for key in FAMILIES:
        for xs in grid(tuner, key).values():
            assert all(x == float(f"{x:.10g}") for x in xs), xs


def test_sweep_is_the_query_at_each_point(fp8) -> None:
    _, tuner = fp8
    xs = [0.5, 0.8, 0.95]
    curve = sweep(tuner, "icepop", [0.9, 5.0], 0, xs)
    assert curve == [tuner.icepop(x, 5.0) for x in xs]


def test_a_framework_without_the_family_says_which_have_it() -> None:
    with pytest.raises(ConfigError, match=r"fireworks has no k3 sequence mask; .*: verl"):
        family_spec("k3_mask", [0.01], "fireworks")


def test_open_path_names_the_dump() -> None:
    ws = open_path(str(DATA / "fp8.parquet"))
    assert isinstance(ws, Workspace)
    assert ws.source.name == "fp8.parquet" and ws.source.layout == "sequence"
    assert dict(ws.source.columns)["train_logprob"] == "train_logprob"


def test_opening_reports_the_share_read(monkeypatch) -> None:
    monkeypatch.setattr(iscore.dump.readers, "READ_TOKENS", 4096)  # chunks of about 10k tokens
    monkeypatch.setattr(iscore.dump.facade, "DEFAULT_CHUNK_TOKENS", 10_000)
    for opened in (
        lambda progress: open_path(str(DATA / "fp8.parquet"), progress=progress),
        lambda progress: open_uploads([("fp8.parquet", _bytes("fp8.parquet"))], progress=progress),
    ):
        shares = []
        ws = opened(shares.append)
        assert len(shares) > 2 and shares == sorted(shares) and shares[-1] == 1.0
        assert ws.full.num_tokens == iscore.load(DATA / "fp8.parquet").num_tokens


def _parquet(table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def test_a_mapping_picks_the_columns_and_reports_the_unused() -> None:
    table = pq.read_table(DATA / "fp8.parquet")
    offsets = table["train_logprob"].combine_chunks().offsets
    half = pc.multiply(table["train_logprob"].combine_chunks().flatten(), 0.5)
    mask = np.arange(len(half)) % 2 == 0
    extra = table.set_column(
        table.schema.get_field_index("loss_mask"),
        "loss_mask",
        pa.ListArray.from_arrays(offsets, pa.array(mask)),
    ).append_column("train_bf16_logprob", pa.ListArray.from_arrays(offsets, half))
    files = [("run.parquet", _parquet(extra))]
    plain = open_uploads(files)
    assert plain.source.unused == ("train_bf16_logprob",)
    mapped = open_uploads(files, columns={"train_logprob": "train_bf16_logprob"})
    assert mapped.source.unused == ("train_logprob",)
    assert torch.equal(mapped.full.train, plain.full.train * 0.5)
    assert torch.equal(mapped.full.rollout, plain.full.rollout)
    # None leaves an optional column out, even where its name would find it.
    no_mask = open_uploads(files, columns={"loss_mask": None})
    assert "loss_mask" not in dict(no_mask.source.columns)
    assert bool(no_mask.full.loss_mask.all()) and not bool(plain.full.loss_mask.all())
    with pytest.raises(DumpError, match="leaves out train_logprob, which is required"):
        open_uploads(files, columns={"train_logprob": None})


def test_uploads_of_a_framework_dump_are_imported_in_memory() -> None:
    line = {
        "token_loss_mask": [[0, 1, 1]],
        "generation_logprobs": [[0.0, -0.5, -0.25]],
        "prev_logprobs": [[0.0, -0.5, -0.375]],
    }
    data = json.dumps(line).encode()
    ws = open_uploads([("train_data_step4.jsonl", data)])
    assert ws.source.name == "train_data_step4.jsonl (nemo_rl)"
    assert ws.steps == [4] and ws.full.train.tolist() == [-0.5, -0.375]
    assert ws.source.provenance == ("imported from nemo_rl: train_data_step4.jsonl (steps 4)",)
    # A Parquet dump beside it: one dump of both (the same sequence layout).
    both = open_uploads([("fp8.parquet", _bytes("fp8.parquet")), ("train_data_step4.jsonl", data)])
    assert both.steps == [0, 4] and both.source.files[1] == "train_data_step4.jsonl (nemo_rl)"


def test_uploads_are_bounded_before_and_after_they_are_imported() -> None:
    line = {  # 6 bytes a token: the least JSON can take
        "token_loss_mask": [[1] * 100],
        "generation_logprobs": [[0] * 100],
        "prev_logprobs": [[0] * 100],
    }
    data = json.dumps(line, separators=(",", ":")).encode()
    files = [("train_data_step1.jsonl", data)]
    with pytest.raises(DumpError, match=r"bytes of framework dumps \(train_data_step1.jsonl\)"):
        open_uploads(files, max_tokens=50)  # before reading: over 8 bytes a token
    with pytest.raises(DumpError, match="the upload holds 100 tokens, more than the 90"):
        open_uploads(files, max_tokens=90)  # once read
    assert open_uploads(files, max_tokens=100).full.num_tokens == 100


def test_pickled_files_only_when_allowed(tmp_path) -> None:
    from tests.unit.importers.conftest import make_seqs
    from tests.unit.importers.test_slime import write_v2

    path = write_v2(tmp_path, 3, make_seqs([4, 2]))
    files = [("3.pt", path.read_bytes())]
    for refused in (lambda: open_uploads(files), lambda: open_path(str(path))):
        with pytest.raises(DumpError, match=r"3\.pt: a pickled file; .* allow_pickle=True"):
            refused()
    assert open_uploads(files, allow_pickle=True).source.name == "3.pt (slime)"
    assert open_path(str(path), allow_pickle=True).full.num_sequences == 2
