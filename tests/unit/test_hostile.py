"""Hostile inputs through every command that reads them: never a traceback, never a silent
wrong answer, always one short line (or, for a dump's problems, one line per problem).

Corpus size per class (see `tests/unit/hostile.py`), each run through every command that
reads it: dumps 43 x 5 commands (validate, analyze, replay, recommend, export --dump),
framework dumps 23 x 3 commands (validate, analyze, convert), configs 13 x 3 commands
(replay, analyze, export), paths 6, outputs 10, Ctrl-C 8, report 1, writer casts 4, 150
hypothesis-fuzzed tables for the reader, and 3 configs under an address-space limit. The
harness of `tests/fuzz` generates many more, through every command.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import iscore.dump
import iscore.dump.importers.nemo_rl
import iscore.utils.paths
from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.importers import read_buffers
from iscore.dump.writer import PROVENANCE_KEY, canonical_table
from iscore.errors import ConfigError, DumpError, DumpProblems, IscoreError, Problem
from iscore.frameworks.resolve import load_config_text, parse_config
from iscore.passes.validation import validate
from iscore.session.budget import parquet_tokens
from iscore.utils.output import check_output
from tests.unit import hostile

PRESET = "verl:decoupled_geo_rs"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[:2000]
    assert len(lines[0]) < 1000, lines[0][:300]
    return lines[0]


def problem_lines(text: str) -> list[str]:
    lines = text.splitlines()
    assert re.match(r"^(\S.*: )?\d+ problems?:?$", lines[0]), lines[0]
    assert lines[1:] and all(line.startswith("  - ") for line in lines[1:]), text
    return lines[1:]


# ---------------------------------------------------------------------------------- dumps

DUMP_COMMANDS = {
    "validate": lambda d, out: ["validate", str(d), "-q"],
    "analyze": lambda d, out: ["analyze", str(d), "-q", "--preset", PRESET],
    "replay": lambda d, out: ["replay", str(d), "-q", "--config", PRESET_FILE, "--out", out],
    "recommend": lambda d, out: ["recommend", str(d), "-q", "--framework", "verl"],
    "export": lambda d, out: ["export", "--config", PRESET, "--to", "skyrl", "--dump", str(d)],
}
PRESET_FILE = ""  # set by the fixture below: replay needs a config file


@pytest.fixture(autouse=True)
def _config_file(tmp_path, monkeypatch):
    path = tmp_path / "verl.yaml"
    path.write_text("framework: verl\n" + hostile.VERL)
    monkeypatch.setattr(sys.modules[__name__], "PRESET_FILE", str(path))


@pytest.mark.parametrize("command", list(DUMP_COMMANDS))
@pytest.mark.parametrize("case", list(hostile.dumps()))
def test_hostile_dump(case, command, tmp_path, capsys):
    dump = hostile.dumps()[case](tmp_path)
    out_path = tmp_path / "out.parquet"
    code, out, err = run(DUMP_COMMANDS[command](dump, str(out_path)), capsys)
    assert not out_path.exists()
    assert list(tmp_path.glob(".*")) == []  # no temporary file left behind
    if command == "validate":
        assert code == 1
        lines = problem_lines(out if out.strip() else err)
    elif code == 1:
        lines = problem_lines(err)
    else:
        assert code == 2, (code, out, err)
        lines = [one_line_error(err)]
    assert any(dump.name in line for line in lines), lines


@pytest.mark.parametrize("command", ["validate", "analyze", "convert"])
@pytest.mark.parametrize("case", list(hostile.framework_dumps()))
def test_hostile_framework_dump(case, command, tmp_path, capsys):
    """A malformed framework file is one problem naming it (exit 1), as a Parquet file's are:
    each was a traceback (RecursionError, OverflowError, numpy's inhomogeneous shape,
    MemoryError, ...) or a silent wrong value (1.5 read as 1, an imaginary part dropped)."""
    source = hostile.framework_dumps()[case](tmp_path)
    out = tmp_path / "out.parquet"
    argv = {
        "validate": ["validate", str(source), "-q"],
        "analyze": ["analyze", str(source), "-q", "--preset", PRESET],
        "convert": ["convert", str(source), "--out", str(out)],
    }[command]
    code, out_text, err = run([*argv, "--allow-pickle"], capsys)
    assert code == 1, (code, out_text, err)
    lines = problem_lines(err)
    assert len(lines) == 1 and str(source) in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_json_integers_beyond_float_are_infinite_as_1e400_is(tmp_path, capsys):
    """An integer of 400 digits was an OverflowError; JSON's 1e400 was already infinity."""
    huge = "9" * 400
    record = {**hostile._NEMO, "rewards": ["HUGE"]}
    line = json.dumps(record).replace("-0.375", f"-{huge}").replace('"HUGE"', huge)
    for i, text in enumerate([line, line.replace(f"-{huge}", "-1e400").replace(huge, "3.5e38")]):
        logs = tmp_path / str(i)
        logs.mkdir()
        (logs / "train_data_step1.jsonl").write_text(text + "\n")
        code, out, err = run(["validate", str(logs), "-q"], capsys)
        assert code == 1 and "column train_logprob: invalid log-prob: 1 infinite" in out
        assert err == ""  # no numpy "overflow encountered in cast" for the float32 reward
        code, _, _ = run(["convert", str(logs), "--out", str(logs / "c.parquet")], capsys)
        table = pq.read_table(logs / "c.parquet")
        assert code == 0 and table["train_logprob"].to_pylist() == [[-0.5, float("-inf")]]
        assert table["reward"].to_pylist() == [float("inf")]


@pytest.mark.parametrize("bounds", [[("a", 2)], [(None, 2)], [(0.5, 2)], [(-1, 2)], [(0,)], 7])
def test_skyrl_malformed_prompt_bounds_leave_group_id_out(bounds, tmp_path, capsys):
    """A string or missing bound was a ValueError or TypeError, 0.5 was read as 0 and -1 as
    the last row; group_id is optional, so the log-probs are read without it, with a note."""
    path = tmp_path / "global_step_3_training_input.pkl"
    state = hostile.skyrl_batch(metadata={"policy_prompt_boundaries": bounds})
    path.write_bytes(hostile.skyrl_pickle(state))
    out = tmp_path / "c.parquet"
    code, said, _ = run(["convert", str(path), "--out", str(out), "--allow-pickle"], capsys)
    assert code == 0 and "note: " in said and "group_id not imported" in said
    assert "group_id" not in pq.read_table(out).column_names


def _strict_json(path) -> object:
    """The file's JSON, refusing NaN and Infinity (Python writes them; JSON has neither)."""

    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_an_extreme_but_finite_logprob_is_analyzed(tmp_path, capsys):
    """-3e38 is a valid log-prob (finite, <= 0) that validate passed: analyze and recommend
    overflowed (math.exp), and a ratio of inf was written to JSON as Infinity."""
    dump = tmp_path / "x.parquet"
    rollout = [-3e38, -3e38, -1.0, -0.5, -1.0, -0.5, -2.0, -0.1]
    pq.write_table(
        pa.table(
            {"seq_id": [0] * 4 + [1] * 4, "rollout_logprob": rollout, "train_logprob": [-1.0] * 8}
        ),
        dump,
    )
    for argv in (
        ["validate", str(dump), "-q", "--json", str(tmp_path / "v.json")],
        ["analyze", str(dump), "-q", "--preset", PRESET, "--json", str(tmp_path / "a.json")],
        ["recommend", str(dump), "-q", "--framework", "verl", "--json", str(tmp_path / "r.json")],
        ["replay", str(dump), "-q", "--config", PRESET, "--out", str(tmp_path / "w.parquet")],
        ["export", "--config", PRESET, "--to", "skyrl", "--dump", str(dump)],
    ):
        code, _, err = run(argv, capsys)
        assert code == 0, err
    for name in ("v", "a", "r"):
        _strict_json(tmp_path / f"{name}.json")
    weights = pq.read_table(tmp_path / "w.parquet")["weight"].to_numpy()
    assert np.isfinite(weights).all() and (weights >= 0).all()


def test_a_problem_is_one_line_whatever_it_quotes():
    """Arrow's errors can end in a newline (an unreadable footer's thrift error did)."""
    problem = Problem("f.parquet", None, "unreadable Parquet footer: thrift: Invalid data\n\n")
    assert str(problem) == "f.parquet: unreadable Parquet footer: thrift: Invalid data"
    assert str(Problem("f", "pos", "a\n  b")) == "f, column pos: a; b"


def test_a_step_without_loss_tokens_is_analyzed(tmp_path, capsys):
    """A KeyError ('k3') in the drift flag, when the last of three steps had no loss token."""
    dump = tmp_path / "x.parquet"
    table = hostile.valid_dump()  # steps 0, 0, 1, 1
    mask = [[True] * len(r) for r in table["rollout_logprob"].to_pylist()]
    mask[3] = [False] * len(mask[3])
    table = table.set_column(0, "step", pa.array([0, 1, 1, 2])).append_column(
        "loss_mask", pa.array(mask)
    )
    pq.write_table(table, dump)
    code, _, err = run(
        ["analyze", str(dump), "-q", "--preset", PRESET, "--json", str(tmp_path / "a.json")], capsys
    )
    assert code == 0, err
    assert _strict_json(tmp_path / "a.json")["mismatch"]["k3_growth"] is None


@pytest.mark.filterwarnings("error")  # torch's "Detected pickle protocol 253" printed a line
def test_a_damaged_torch_file_of_the_legacy_format_is_refused():
    """torch.load of a cut or flipped legacy (non-zip) torch.save raised IndexError, KeyError
    or struct.error through the importer; each is a DumpError now, without torch's warnings."""
    payload = {"rollout_id": 1, "rank": 0, "rollout_data": {"response_lengths": [2]}}
    payload["rollout_data"] |= {"sample_indices": [0], "log_probs": [torch.tensor([-1.0, -0.5])]}
    payload["rollout_data"]["rollout_log_probs"] = [torch.tensor([-1.0, -0.5])]
    buffer = io.BytesIO()
    torch.save(payload, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    damaged = [data[:cut] for cut in range(1, len(data), 4)]
    damaged += [data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :] for at in range(len(data))]
    for content in damaged:
        with contextlib.suppress(DumpError):
            read_buffers([("1.pt", content)], "slime")


def test_the_token_budget_reads_every_hostile_footer(tmp_path):
    """The app counts an upload's tokens from its footer before the reader sees it: a
    column name that is not UTF-8 raised UnicodeDecodeError there."""
    for case, write in hostile.dumps().items():
        (tmp_path / case).mkdir()
        path = write(tmp_path / case)
        for file in [path] if path.is_file() else sorted(path.iterdir()):
            tokens = parquet_tokens(file.read_bytes())
            assert tokens is None or tokens >= 0, case


@pytest.mark.parametrize("kind", [pa.uint64(), pa.int8(), pa.large_string()])
def test_files_may_store_seq_id_as_any_integer_or_string_type(kind, tmp_path, capsys):
    """validate passed a folder whose files held seq_id as uint64 and int64, but loading it
    said the files disagree (exit 2), and replay raised a ValueError writing the second."""
    folder = tmp_path / "run"
    folder.mkdir()
    ids = (["a", "b"], ["c", "d"]) if kind == pa.large_string() else ([0, 1], [2, 3])
    first = hostile.valid_dump().slice(0, 2).set_column(1, "seq_id", pa.array(ids[0], kind))
    regular = pa.string() if kind == pa.large_string() else pa.int64()
    second = hostile.valid_dump().slice(2, 2).set_column(1, "seq_id", pa.array(ids[1], regular))
    pq.write_table(first, folder / "a.parquet")
    pq.write_table(second, folder / "b.parquet")
    out = tmp_path / "w.parquet"
    for argv in (
        ["validate", str(folder), "-q"],
        ["replay", str(folder), "-q", "--config", PRESET, "--out", str(out), "--chunk-tokens", "1"],
    ):
        code, _, err = run(argv, capsys)
        assert code == 0, err
    assert pq.read_table(out)["seq_id"].type == regular
    assert iscore.dump.load(folder).seq_id.to_pylist() == [*ids[0], *ids[1]]


_BUDGET = (
    "import sys; from iscore.session.budget import parquet_tokens; "
    "print(parquet_tokens(sys.argv[1]))"
)


@pytest.mark.parametrize("case", ["footer_levels_misfit", "footer_type_misfit"])
def test_a_footer_pyarrow_aborts_on_is_refused_first(case, tmp_path):
    """pyarrow killed the process (SIGABRT, "Definition level histogram size mismatch",
    "ColumnMetaData type does not match ColumnDescriptor physical type"): in the app, every
    session with it. Run in a child, which the abort would kill instead of the tests."""
    dump = str(hostile.dumps()[case](tmp_path))
    for argv in (["validate", dump, "-q"], ["analyze", dump, "-q", "--steps", "0:1"]):
        done = subprocess.run(
            [sys.executable, "-m", "iscore", *argv], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stderr[-2000:]
        assert "f.parquet: unreadable Parquet footer: " in done.stderr
    done = subprocess.run(
        [sys.executable, "-c", _BUDGET, dump], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, "None\n"), done.stderr[-2000:]


def test_float64_overflow_names_file_column_row(tmp_path, capsys):
    dump = hostile.dumps()["logprob_f64_overflow_neg"](tmp_path)
    code, out, _ = run(["validate", str(dump), "-q"], capsys)
    assert code == 1
    assert "t.parquet, column rollout_logprob: invalid log-prob: 1 infinite" in out
    assert "at row 1" in out


def test_uint64_step_names_row(tmp_path, capsys):
    dump = hostile.dumps()["step_uint64_above_int64"](tmp_path)
    code, out, _ = run(["validate", str(dump), "-q"], capsys)
    assert code == 1 and "column step: 1 value above" in out
    assert "which int64 cannot hold at row 0" in out


def test_null_inside_loss_mask_list_is_not_false(tmp_path, capsys):
    dump = hostile.dumps()["null_in_loss_mask_list"](tmp_path)
    code, out, _ = run(["validate", str(dump), "-q"], capsys)
    assert code == 1 and "column loss_mask: 1 null value inside its lists at row 0" in out


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("duplicate_column", "t.parquet, column rollout_logprob: appears more than once"),
        ("provenance_a_list", "s.parquet: metadata iscore.provenance: expected a JSON object"),
        ("provenance_source_files_a_number", "; found source_files 3"),
        ("flipped_byte_with_checksum", "CRC checksum verification failed"),
        ("policy_in_some_files", "b.parquet, column policy_logprob: missing here but present in"),
        ("experts_one_side", "s.parquet, column train_experts: present without rollout_experts"),
        ("experts_in_some_files", "b.parquet, column rollout_experts: missing here but present"),
        ("experts_negative_id", "t.parquet, column rollout_experts: 1 negative expert id at row 1"),
        ("experts_uint64_above_int64", "column rollout_experts: 1 value above"),
        ("turn_goes_back", "t.parquet, column turn: turn decreases within a sequence (1 token)"),
        (
            "experts_null_inside_inner_list",
            "column rollout_experts: 1 null value inside the lists of its lists at row 1",
        ),
    ],
)
def test_structure_problems_say_what_was_expected(case, said, tmp_path, capsys):
    """Each was a traceback (KeyError, JSONDecodeError, AttributeError) or read as valid."""
    dump = hostile.dumps()[case](tmp_path)
    code, out, err = run(["validate", str(dump), "-q"], capsys)
    assert code == 1 and said in out + err


def test_a_long_provenance_is_quoted_short(tmp_path, capsys):
    """validate printed a provenance's framework and steps whole (here 500 kB on a line)."""
    record = {"framework": "x" * 5000, "source_files": ["a"], "steps": list(range(100_000))}
    table = hostile.valid_dump()
    table = table.replace_schema_metadata({PROVENANCE_KEY: json.dumps(record).encode()})
    pq.write_table(table, tmp_path / "p.parquet")
    code, out, _ = run(["validate", str(tmp_path / "p.parquet"), "-q"], capsys)
    assert code == 0 and max(len(line) for line in out.splitlines()) < 1000


def test_validate_reads_the_per_sequence_columns_too(tmp_path, capsys):
    """A token-layout reward that differs within a sequence passed validate, while
    `sequences` (and any --where on it) refused the dump."""
    dump = tmp_path / "t.parquet"
    pq.write_table(hostile._token(reward=pa.array([1.0, 0.5, 0.0, 0.0])), dump)
    said = "t.parquet, column reward: 1 values differ from the first of their sequence"
    code, out, _ = run(["validate", str(dump), "-q"], capsys)
    assert code == 1 and said in out
    code, _, err = run(["sequences", str(dump), "--out", str(tmp_path / "s.csv")], capsys)
    assert code == 1 and said in err


def test_no_loss_token_is_a_clear_error_for_streams_and_batches(tmp_path, good_dump):
    from iscore.passes.analysis import analyze

    with pytest.raises(DumpProblems, match="no token is in the loss"):
        list(Dump(hostile.dumps()["no_loss_token"](tmp_path)).batches())
    batch = iscore.dump.load(good_dump)
    masked = dataclasses.replace(batch, loss_mask=torch.zeros_like(batch.loss_mask), _seq_index=[])
    with pytest.raises(DumpError, match="no token is in the loss"):  # was a KeyError
        analyze(masked, [PRESET])


def test_writer_casts_refuse_wrapping_truncating_complex():
    tokens = {"rollout_logprob": np.array([-1.0, -1.0]), "train_logprob": np.array([-1.0, -1.0])}
    base = {"seq_id": [1, 2], "lengths": np.array([1, 1])}
    cases = {
        "token_id 2**40 into int32": dict(
            step=3, tokens=dict(tokens, token_id=np.array([2**40, 1]))
        ),
        "fractional step": dict(step=1.5, tokens=tokens),
        "complex step": dict(step=np.array([1 + 2j, 1]), tokens=tokens),
        "uint64 step above int64": dict(step=np.array([2**63, 1], np.uint64), tokens=tokens),
    }
    for what, kwargs in cases.items():
        with pytest.raises(DumpError, match=r"Expected `(token_id|step)`"):
            canonical_table(**base, **kwargs)
            pytest.fail(what)


# -------------------------------------------------------------------------------- configs

CONFIG_COMMANDS = {
    "replay": lambda c, d, o: ["replay", str(d), "-q", "--config", str(c), "--out", o],
    "analyze": lambda c, d, o: ["analyze", str(d), "-q", "--config", str(c)],
    "export": lambda c, d, o: ["export", "--config", str(c), "--to", "skyrl"],
}


@pytest.fixture
def good_dump(tmp_path):
    path = tmp_path / "good.parquet"
    pq.write_table(hostile.valid_dump(), path)
    return path


@pytest.mark.parametrize("command", list(CONFIG_COMMANDS))
@pytest.mark.parametrize("case", list(hostile.configs()))
def test_hostile_config(case, command, tmp_path, good_dump, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(hostile.configs()[case])
    out_path = tmp_path / "out.parquet"
    code, _, err = run(CONFIG_COMMANDS[command](config, good_dump, str(out_path)), capsys)
    assert code == 2
    assert "c.yaml" in one_line_error(err)
    assert not out_path.exists()


@pytest.mark.parametrize("spelling", [".inf", "1e999", "1e400", '"inf"', '"Infinity"', "1.0e+999"])
def test_an_infinite_bound_reads_as_infinity_however_spelled(spelling):
    """A framework reads its thresholds with float(): every spelling of infinity is infinity
    (a cap that never binds, as iscore's own exports write "no cap"), accepted alike; NaN
    fails every bound check a framework makes, and an integer no float holds makes float()
    raise (it was an OverflowError traceback): both are refused, the key named."""
    text = "framework: verl\n" + hostile.VERL.replace("2.0", spelling)
    spec = parse_config(load_config_text(text))
    assert spec == parse_config(load_config_text(text.replace(spelling, ".inf")))
    assert spec.is_upper == math.inf
    for refused in (".nan", '"nan"', "1" + "0" * 400, "-1" + "0" * 400):
        with pytest.raises(ConfigError, match=r"rollout_is_threshold` to be a float > 0\.0"):
            parse_config(load_config_text(text.replace(spelling, refused)))


def test_alias_bomb_fails_at_its_first_alias(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(hostile.configs()["yaml_alias_bomb"])
    with pytest.raises(ConfigError, match=r"line 3: YAML aliases \(\*name\) are not allowed"):
        parse_config(config)


# ---------------------------------------------------------------------------------- paths


def _reference(good_dump, capsys) -> str:
    code, out, _ = run(["validate", str(good_dump), "-q"], capsys)
    assert code == 0
    return out.split("\n", 1)[1]


def test_existing_file_with_glob_characters_is_read_as_itself(tmp_path, good_dump, capsys):
    odd = tmp_path / "run[1].parquet"
    odd.write_bytes(good_dump.read_bytes())
    (tmp_path / "run1.parquet").write_bytes(b"not parquet")  # what the glob would match
    code, out, _ = run(["validate", str(odd), "-q"], capsys)
    assert code == 0 and out.split("\n", 1)[1] == _reference(good_dump, capsys)


def test_globs_and_walks_skip_symlinked_directories(tmp_path, good_dump, capsys):
    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.parquet").write_bytes(good_dump.read_bytes())
    (root / "a" / "loop").symlink_to("..")  # a cycle glob.glob would follow
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "y.parquet").write_bytes(b"junk")
    (root / "out").symlink_to(outside)
    want = [str(root / "a" / "x.parquet")]
    assert iscore.dump.resolve_files(str(root / "**" / "*.parquet")) == want
    assert iscore.dump.resolve_files(str(root)) == want
    code, out, _ = run(["validate", str(root / "**" / "*.parquet"), "-q"], capsys)
    assert code == 0 and out.split("\n", 1)[1] == _reference(good_dump, capsys)


def test_walks_stop_past_the_file_budget(tmp_path, monkeypatch, capsys):
    for i in range(30):
        (tmp_path / f"f{i}.txt").write_bytes(b"")
    monkeypatch.setattr(iscore.utils.paths, "MAX_LISTED", 20)
    code, _, err = run(["validate", str(tmp_path / "**" / "*.parquet"), "-q"], capsys)
    assert code == 2 and "stopped after looking at 20 directory entries" in one_line_error(err)


def test_walks_stop_past_the_time_budget(tmp_path, monkeypatch, capsys):
    (tmp_path / "d").mkdir()
    monkeypatch.setattr(iscore.utils.paths, "LIST_SECONDS", -1.0)
    code, _, err = run(["validate", str(tmp_path), "-q"], capsys)
    assert code == 2 and "s of listing directories" in one_line_error(err)


@pytest.mark.parametrize("path", ["missing.parquet", "no/such/*.parquet"])
def test_missing_paths(path, tmp_path, capsys):
    code, _, err = run(["validate", str(tmp_path / path), "-q"], capsys)
    assert code == 2 and one_line_error(err)


# -------------------------------------------------------------------------------- outputs


def test_output_gets_the_umask_mode(tmp_path, good_dump, capsys):
    old = os.umask(0o027)
    try:
        out = tmp_path / "w.parquet"
        code, _, _ = run(
            ["replay", str(good_dump), "-q", "--config", PRESET_FILE, "--out", str(out)], capsys
        )
    finally:
        os.umask(old)
    assert code == 0 and stat.S_IMODE(out.stat().st_mode) == 0o640


def test_output_over_a_directory_is_refused(tmp_path, good_dump, capsys):
    target = tmp_path / "adir"
    target.mkdir()
    code, _, err = run(
        ["replay", str(good_dump), "-q", "--config", PRESET_FILE, "--out", str(target)], capsys
    )
    assert code == 2 and "is a directory" in one_line_error(err)
    assert list(target.iterdir()) == []


def test_output_through_a_symlink_keeps_the_link(tmp_path, good_dump, capsys):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    code, _, _ = run(["validate", str(good_dump), "-q", "--json", str(link)], capsys)
    assert code == 0 and link.is_symlink() and json.loads(real.read_text())["ok"]


def test_output_to_a_fifo_writes_into_it(tmp_path, good_dump, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    code, _, _ = run(["validate", str(good_dump), "-q", "--json", str(fifo)], capsys)
    reader.join(10)
    assert code == 0 and stat.S_ISFIFO(fifo.stat().st_mode)
    assert json.loads(received[0])["ok"]


def test_output_to_dev_stdout_is_written_directly(tmp_path, good_dump):
    code = (
        "import sys; from iscore.cli import main; "
        f"sys.exit(main(['validate', {str(good_dump)!r}, '-q', '--json', '/dev/stdout']))"
    )
    was_link = os.path.islink("/dev/stdout")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and '"ok": true' in done.stdout
    assert os.path.islink("/dev/stdout") == was_link  # never replaced by a regular file


def test_failed_write_leaves_no_temporary(tmp_path, capsys):
    dump = hostile.dumps()["no_loss_token"](tmp_path)
    out = tmp_path / "w.parquet"
    code, _, _ = run(
        ["replay", str(dump), "-q", "--config", PRESET_FILE, "--out", str(out)], capsys
    )
    assert code == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet", "verl.yaml"]


@pytest.mark.parametrize(("command", "flag"), [("replay", "--out"), ("validate", "--json")])
def test_empty_paths_are_refused(command, flag, tmp_path, good_dump, capsys, monkeypatch):
    """An empty --out was refused as ": is a directory"; an empty --json wrote nothing."""
    monkeypatch.chdir(tmp_path)
    for args in (
        [command, str(good_dump), "-q", "--config", PRESET_FILE, flag, ""],
        [command, "", "-q", "--config", PRESET_FILE, flag, "x"],
    ):
        if command == "validate":
            args.remove("--config"), args.remove(PRESET_FILE)
        code, _, err = run(args, capsys)
        assert code == 2 and "but got an empty string" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.parquet", "verl.yaml"]
    with pytest.raises(IscoreError, match="expected a file name to write, but got an empty path"):
        check_output("")  # the Python API's writers


_COMMANDS_READING = {
    "validate": ["validate", "{dump}", "-q", "--json", "{out}.json"],
    "analyze": ["analyze", "{dump}", "-q", "--preset", PRESET, "--json", "{out}.json"],
    "replay": ["replay", "{dump}", "-q", "--config", PRESET, "--out", "{out}.parquet"],
    "recommend": ["recommend", "{dump}", "-q", "--framework", "verl", "--json", "{out}.json"],
    "export": ["export", "--config", PRESET, "--to", "skyrl", "--dump", "{dump}", "--out", "{out}"],
    "sequences": ["sequences", "{dump}", "--out", "{out}.parquet"],
}


@pytest.mark.parametrize("command", list(_COMMANDS_READING))
def test_ctrl_c_is_one_line_and_exit_130(command, tmp_path, good_dump, capsys, monkeypatch):
    """Every command printed a KeyboardInterrupt traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(Dump, "batches", interrupted)
    monkeypatch.setattr(Dump, "scan", interrupted)
    out = str(tmp_path / "w")
    argv = [a.format(dump=good_dump, out=out) for a in _COMMANDS_READING[command]]
    code, stdout, err = run(argv, capsys)
    assert (code, stdout, err) == (130, "", "interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.parquet", "verl.yaml"]


def test_ctrl_c_in_convert_leaves_no_file(tmp_path, capsys, monkeypatch):
    logs = hostile.framework_dumps()["nemo_idx_2_70"](tmp_path)
    done = []

    def interrupted(path):
        if done:
            raise KeyboardInterrupt
        done.append(path)  # the first step's records are written, then Ctrl-C
        yield 1, dict(hostile._NEMO)

    (logs / "train_data_step2.jsonl").write_text((logs / "train_data_step1.jsonl").read_text())
    monkeypatch.setattr(iscore.dump.importers.nemo_rl, "jsonl_records", interrupted)
    out = tmp_path / "c.parquet"
    code, stdout, err = run(["convert", str(logs), "--out", str(out)], capsys)
    assert (code, stdout, err) == (130, "", "interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "verl.yaml"]


def test_ctrl_c_from_the_terminal(tmp_path, good_dump):
    """SIGINT itself, delivered while replay reads: exit 130, one line, no file left (the
    child takes Ctrl-C's default back, as in `test_signal_removes_the_temporary`)."""
    code = textwrap.dedent(
        f"""
        import signal, sys, time
        from iscore.cli import main
        from iscore.dump import Dump

        signal.signal(signal.SIGINT, signal.default_int_handler)

        def waiting(*args, **kwargs):
            print("reading", file=sys.stderr, flush=True)
            time.sleep(60)
            yield

        Dump.batches = waiting
        out = {str(tmp_path / "w.parquet")!r}
        sys.exit(main(["replay", {str(good_dump)!r}, "-q", "--config", {PRESET!r}, "--out", out]))
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stderr.readline() == "reading\n"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert (child.returncode, out, err) == (130, "", "interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.parquet", "verl.yaml"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_temporary(sig, tmp_path):
    # A shell starts background jobs with SIGINT ignored, and children inherit that: the
    # child takes Ctrl-C's default back, as an interactive terminal's process has it (the
    # test failed under `pytest &`).
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        from iscore.utils.output import output_path
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with output_path({str(tmp_path / "o.json")!r}) as tmp:
            Path(tmp).write_text("partial")
            os.kill(os.getpid(), {int(sig)})
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("o.json", ".o.json"))]


# --------------------------------------------------------------------------------- report


class _Scripts(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts: list[str] = []
        self.csp = None
        self.loads: list[str] = []  # what the page fetches when opened
        self.anchors: list[str] = []  # where its links lead when clicked
        self._in = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a":
            self.anchors.append(attrs.get("href", ""))
        else:
            self.loads += [attrs[k] for k in ("src", "href") if attrs.get(k)]
        if tag == "script":
            self._in = True
            self.scripts.append("")
        if tag == "meta" and attrs.get("http-equiv") == "Content-Security-Policy":
            self.csp = attrs["content"]

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = False

    def handle_data(self, data):
        if self._in:
            self.scripts[-1] += data


def test_report_escapes_names_and_allows_only_its_scripts(tmp_path, good_dump, capsys):
    evil = "</script><script>alert(1)</script><!--\u2028"
    config = tmp_path / "evil.yaml"
    config.write_text(f"framework: verl\nname: {json.dumps(evil)}\n" + hostile.VERL)
    html = tmp_path / "r.html"
    code, _, _ = run(
        ["analyze", str(good_dump), "-q", "--config", str(config), "--html", str(html)], capsys
    )
    assert code == 0
    text = html.read_text()
    page = _Scripts()
    page.feed(text)
    assert len(page.scripts) == 2  # plotly and the figures: nothing injected
    assert "alert(1)" not in page.scripts[0] and "<script>alert" not in text
    csp = page.csp
    assert "default-src 'none'" in csp and "connect-src" not in csp
    for script in page.scripts:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert page.loads == []  # opens with no network: no element loads anything
    # The health section's sources are links; none is a script's or a name's.
    assert page.anchors and all(a.startswith("https://") for a in page.anchors)


# ------------------------------------------------------------------------------- fuzzing

_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([-1e300, -3.5e38, -1e-50, 0.0, -0.0, 1e300]),
)
_TYPES = {
    "f64": pa.float64(),
    "f32": pa.float32(),
    "i64": pa.int64(),
    "u64": pa.uint64(),
    "str": pa.string(),
    "bool": pa.bool_(),
}


@st.composite
def _dumps(draw):
    """Token-layout tables of random column types and values, nulls included."""
    n = draw(st.integers(1, 12))
    ids = sorted(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    columns = {"seq_id": pa.array(ids)}
    for name in ("rollout_logprob", "train_logprob", "loss_mask", "step", "pos"):
        if name not in ("rollout_logprob", "train_logprob") and draw(st.booleans()):
            continue
        kind = draw(st.sampled_from(list(_TYPES)))
        if kind in ("f64", "f32"):
            values = draw(st.lists(st.one_of(st.none(), _FLOATS), min_size=n, max_size=n))
        elif kind == "i64":
            values = draw(
                st.lists(
                    st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), min_size=n, max_size=n
                )
            )
        elif kind == "u64":
            values = draw(
                st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=n, max_size=n)
            )
        elif kind == "bool":
            values = draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n))
        else:
            values = draw(
                st.lists(st.one_of(st.none(), st.text(max_size=3)), min_size=n, max_size=n)
            )
        columns[name] = pa.array(values, _TYPES[kind])
    return pa.table(columns)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dumps())
def test_fuzzed_dump_is_read_faithfully_or_refused(table):
    """Either a batch whose values are the input's, as float32, or a DumpError."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    try:
        batch = Dump.from_buffers([("f.parquet", sink.getvalue().to_pybytes())]).load()
    except DumpError:
        return
    if "pos" not in table.column_names:  # file order is batch order
        for name, tensor in (("rollout_logprob", batch.rollout), ("train_logprob", batch.train)):
            expected = np.asarray(table[name].to_pylist(), np.float64).astype(np.float32)
            assert np.array_equal(tensor.numpy(), expected)
    assert batch.num_tokens == table.num_rows
    assert np.isfinite(batch.rollout.numpy()).all() and (batch.rollout.numpy() <= 0).all()
    assert batch.loss_mask.any()
    if "step" in table.column_names:
        assert set(batch.step.tolist()) <= set(table["step"].to_pylist())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dumps())
def test_fuzzed_dump_is_validated_as_it_is_loaded(table):
    """`validate` (numpy, no tensors) passes exactly the dumps that load, and summarizes what
    loading gives: the same tokens, loss tokens and mean |d|."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    files = [("f.parquet", sink.getvalue().to_pybytes())]
    try:
        report = validate(Dump.from_buffers(files))
    except DumpError:  # refused on opening: neither reads it
        return
    try:
        batch = Dump.from_buffers(files).load()
    except DumpError:
        assert not report.ok
        return
    assert report.ok, report.problems
    assert (report.tokens, report.sequences) == (batch.num_tokens, batch.num_sequences)
    d = (batch.train.double() - batch.rollout.double())[batch.loss_mask]
    assert report.loss_tokens == d.numel()
    assert report.abs_diff_mean == pytest.approx(float(d.abs().mean()), rel=1e-12)


# -------------------------------------------------------------------------------- memory

_LIMITED = """
import resource, sys
from iscore.errors import ConfigError
from iscore.frameworks.resolve import load_config_text, parse_config
# The limit counts from what the imports (torch) already mapped: 300 MB more, no further.
with open("/proc/self/status") as f:
    size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 300 * 2**20, size + 300 * 2**20))
try:
    parse_config(sys.argv[1])
except ConfigError as e:
    print("refused:", str(e)[:200])
"""


@pytest.mark.parametrize("case", ["yaml_alias_bomb", "oversized", "deep_nesting"])
def test_config_fails_cleanly_under_an_address_space_limit(case, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(hostile.configs()[case])
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused:") and "Traceback" not in done.stderr
