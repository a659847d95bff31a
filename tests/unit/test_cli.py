"""The `iscore` command line: exit codes, messages, outputs, and nothing written elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from iscore.cli import main
from iscore.frameworks.resolve import parse_config
from tests.conftest import make_sequences, write


@pytest.fixture
def dump(tmp_path):
    s = make_sequences([5, 1, 40, 7], steps=[0, 0, 1, 1])
    return write(s.sequence_table({"train_logprob": "old_log_probs"}), tmp_path / "d.parquet")


def test_validate_summary(dump, capsys, tmp_path):
    assert main(["validate", str(dump), "-q", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "d.parquet: OK" in out
    assert "sequences   4" in out and "tokens      53" in out
    assert "train_logprob <- old_log_probs" in out
    assert "min 1" in out and "max 40" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["steps"] == [0, 1] and report["tokens"] == 53
    assert report["columns"]["train_logprob"] == ["old_log_probs"]


def test_validate_lists_problems_and_fails(tmp_path, capsys):
    table = pa.table(
        {
            "seq_id": [1, 1, 2, 3],
            "rollout_logprob": np.float32([-1, np.nan, -1, -1]),
            "train_logprob": np.float32([-1, -1, 0.5, -1]),
        }
    )
    path = write(table, tmp_path / "bad.parquet")
    assert main(["validate", str(path), "-q"]) == 1
    out = capsys.readouterr().out
    assert "bad.parquet: 2 problems" in out
    assert "column rollout_logprob: invalid log-prob: 1 NaN or null value at row 1" in out
    assert "column train_logprob: invalid log-prob: 1 positive" in out
    assert main(["validate", str(path), "-q", "--drop-invalid"]) == 0
    assert "dropped     2 sequences (3 tokens)" in capsys.readouterr().out


def test_validate_reports_every_bad_file(tmp_path, capsys):
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 but cut")
    assert main(["validate", str(tmp_path), "-q"]) == 1
    err = capsys.readouterr().err
    assert "2 problems" in err and "empty file" in err and "truncated Parquet file" in err


def test_step_filter_and_mapping(dump, capsys):
    assert main(["validate", str(dump), "-q", "--steps", "1"]) == 0
    assert "sequences   2" in capsys.readouterr().out
    swap = [
        "--column",
        "train_logprob=rollout_logprob",
        "--column",
        "rollout_logprob=old_log_probs",
    ]
    assert main(["validate", str(dump), "-q", *swap]) == 0
    assert "rollout_logprob <- old_log_probs, train_logprob <- rollout_logprob" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["validate", "nope.parquet"], "error: nope.parquet: no such file or directory"),
        (["validate", "x.parquet", "--column", "oops"], "Expected a column mapping"),
        (
            ["validate", "x.parquet", "--column", "trainlogprob=lp"],
            "Unknown canonical column 'trainlogprob' in --column 'trainlogprob=lp' (did you "
            "mean train_logprob?)",
        ),
        (
            ["validate", "x.parquet", "--column", "rollout_logprob="],
            "rollout_logprob is required and cannot be left out",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_optional_column_is_left_out_with_an_empty_source(dump, capsys):
    assert main(["validate", str(dump), "-q"]) == 0
    assert "loss_mask" in capsys.readouterr().out.split("columns")[1].splitlines()[0]
    assert main(["validate", str(dump), "-q", "--column", "loss_mask="]) == 0
    assert "loss_mask" not in capsys.readouterr().out.split("columns")[1].splitlines()[0]


def test_bad_step_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate", "x.parquet", "--steps", "a:b"])
    assert info.value.code == 2
    assert "Expected a step range like 5, 3:7, 3: or :7, but got 'a:b'" in capsys.readouterr().err


def test_no_traceback_from_the_console_script(tmp_path):
    (tmp_path / "x.parquet").write_text("not parquet")
    result = subprocess.run(
        [sys.executable, "-m", "iscore.cli", "validate", str(tmp_path / "x.parquet")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "not a Parquet file" in result.stderr


VERL_GEO = """\
framework: verl
name: geo
algorithm:
  rollout_correction:
    rollout_is: token
    rollout_is_threshold: 2.0
    rollout_rs: seq_mean_k1
    rollout_rs_threshold: "0.999_1.001"
"""


def test_replay_writes_one_row_per_token(dump, tmp_path, capsys):
    import pyarrow.parquet as pq

    from iscore import load
    from iscore.passes.replay import replay

    config = tmp_path / "geo.yaml"
    config.write_text(VERL_GEO)
    out = tmp_path / "w.parquet"
    assert main(["replay", str(dump), "--config", str(config), "--out", str(out), "-q"]) == 0
    table = pq.read_table(out)
    assert table.column_names == ["seq_id", "pos", "step", "weight", "keep"]
    batch = load(dump)
    expected = replay(batch, config)
    assert table.num_rows == batch.num_tokens
    assert table["weight"].to_numpy().tolist() == expected.weight.tolist()
    assert table["keep"].to_numpy().tolist() == expected.keep.tolist()
    assert table["pos"].to_pylist()[:6] == [0, 1, 2, 3, 4, 0]
    assert "53 tokens replayed with geo (verl)" in capsys.readouterr().out


def test_replay_writes_nothing_on_failure(tmp_path, capsys):
    table = pa.table(
        {
            "seq_id": np.repeat(np.arange(4), 3),
            "rollout_logprob": np.float32([-1] * 11 + [np.nan]),
            "train_logprob": np.float32([-1] * 12),
        }
    )
    path = write(table, tmp_path / "bad.parquet")
    config = tmp_path / "geo.yaml"
    config.write_text(VERL_GEO)
    out = tmp_path / "out" / "w.parquet"
    out.parent.mkdir()
    argv = ["replay", str(path), "--config", str(config), "--out", str(out), "-q"]
    assert main([*argv, "--chunk-tokens", "3"]) == 1
    assert "1 NaN or null value at row 11" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []  # no partial or temporary file left behind
    config.write_text("framework: verl\nalgorithm: {rollout_correction: {rollout_is: tokn}}\n")
    assert main(argv) == 2
    assert "rollout_is" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []


def test_recommend_prints_ranking_and_snippet(tmp_path, capsys):
    from iscore.dump.simulate import SimConfig, write_simulated

    path = tmp_path / "long.parquet"
    write_simulated(path, SimConfig(regime="long_collapse", sequences=24, seed=2))
    out = tmp_path / "rec.json"
    argv = ["recommend", str(path), "--framework", "skyrl", "-q", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert " 1. ok " in text and "Product (sequence-level) weights collapse" in text
    assert "off_policy_correction:" in text
    ranking = json.loads(out.read_text())
    assert ranking["framework"] == "skyrl" and ranking["candidates"][0]["passes"]
    assert main([*argv, "--lr-scale", "1.2:2"]) == 2
    assert "Expected --lr-scale to be a range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--max-token-drop", "2"])
    assert refused.value.code == 2
    assert "argument --max-token-drop: expected a fraction in [0, 1] or a percentage, e.g. " in (
        said := capsys.readouterr().err
    )
    assert "(for 2 percent write 2% or 0.02)" in said


def test_a_share_of_one_is_not_taken_for_one_percent(tmp_path, capsys):
    """`--max-token-drop 1` was read as 100% without a word: a percentage is written 1%, and
    a bare 1 (which does mean 100%) is warned about."""
    argv = ["recommend", "data/fp8.parquet", "--framework", "verl", "-q", "--json"]
    assert main([*argv, str(tmp_path / "a.json"), "--max-token-drop", "1%"]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["targets"]["max_token_drop"] == 0.01
    assert "warning" not in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "b.json"), "--max-token-drop", "1"]) == 0
    assert capsys.readouterr().err.startswith(
        "warning: --max-token-drop 1 lets every one be dropped (100%); for one percent write "
        "0.01 or 1%"
    )


def nemo_logs(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for step in (1, 2):
        lines = [
            json.dumps(
                {
                    "token_loss_mask": [[0, 0, 1, 1]],
                    "generation_logprobs": [[0.0, 0.0, -0.5, -0.25]],
                    "prev_logprobs": [[0.0, 0.0, -0.5, -0.375]],
                    "idx": i,
                }
            )
            for i in range(3)
        ]
        (logs / f"train_data_step{step}.jsonl").write_text("\n".join(lines) + "\n")
    return logs


def test_convert_and_direct_loading_of_framework_dumps(tmp_path, capsys):
    logs = nemo_logs(tmp_path)
    out = tmp_path / "run.parquet"
    assert main(["convert", str(logs), "--out", str(out)]) == 0
    assert "12 tokens in 6 sequences, 2 steps, from 2 nemo_rl file(s)" in capsys.readouterr().out
    assert main(["validate", str(out), "-q"]) == 0
    converted = capsys.readouterr().out
    assert "imported    from nemo_rl: 2 file(s), steps [1, 2]" in converted
    assert "layout      sequence, 1 file" in converted
    assert main(["validate", str(logs), "-q"]) == 0  # read directly, format detected
    direct = capsys.readouterr().out
    assert "(nemo_rl): OK" in direct and "tokens      12" in direct
    assert "layout      sequence, converted on reading (see imported)" in direct


def test_pickles_are_refused_without_the_flag(tmp_path, capsys):
    (tmp_path / "global_step_1_training_input.pkl").write_bytes(b"\x80\x04K\x01.")
    assert main(["validate", str(tmp_path / "global_step_1_training_input.pkl"), "-q"]) == 2
    assert "--allow-pickle" in capsys.readouterr().err


def test_export_prints_snippet_and_writes_a_replayable_file(tmp_path, capsys, dump):
    from iscore import load
    from iscore.frameworks.resolve import parse_config
    from iscore.passes.replay import replay

    assert main(["export", "--config", "verl:decoupled_token_icepop", "--to", "nemo_rl"]) == 0
    captured = capsys.readouterr()
    assert "truncated_importance_sampling_type: icepop" in captured.out
    assert captured.out.startswith("# exact: decoupled_token_icepop (verl) -> nemo_rl")
    out = tmp_path / "nemo.yaml"
    argv = ["export", "--config", "verl:decoupled_token_icepop", "--to", "nemo_rl"]
    assert main([*argv, "--out", str(out), "--dump", str(dump)]) == 0
    err = capsys.readouterr().err
    assert "# source: mean w" in err and "# target: mean w" in err
    batch = load(dump)
    exported = replay(batch, parse_config(out))
    original = replay(
        batch, parse_config({"framework": "verl", "preset": "decoupled_token_icepop"})
    )
    assert exported.weight.tolist() == original.weight.tolist()
    assert exported.keep.tolist() == original.keep.tolist()


@pytest.mark.parametrize("command", ["analyze", "replay", "recommend", "validate"])
def test_a_dump_with_every_sequence_dropped_says_so(command, tmp_path, capsys):
    table = pa.table({"seq_id": [1, 1], "rollout_logprob": np.float32([-1, np.nan])})
    path = write(
        table.append_column("train_logprob", pa.array(np.float32([-1, -1]))),
        tmp_path / "nan.parquet",
    )
    extra = {
        "replay": ["--config", "verl:disabled", "--out", str(tmp_path / "w.parquet")],
        "recommend": ["--framework", "verl"],
    }.get(command, [])
    assert main([command, str(path), "-q", "--drop-invalid", *extra]) in (1, 2)
    said = capsys.readouterr()
    assert f"{path}: its only sequence was dropped as invalid" in said.out + said.err
    assert not (tmp_path / "w.parquet").exists()


@pytest.mark.parametrize("empty", ["tokens", "loss"])
def test_a_run_read_file_by_file_names_the_dumps_empty_sequences(empty, tmp_path, capsys):
    """analyze reads a dump file by file through the results store, where one file without
    a loss token is no problem of the dump's; a dump where none has one is refused as
    validate refuses it (exit 1, the problem named), not as a selection with no sequence."""
    values = [] if empty == "tokens" else [-1.0, -2.0]
    table = pa.table(
        {
            "seq_id": [0],
            "rollout_logprob": pa.array([values], pa.list_(pa.float32())),
            "train_logprob": pa.array([values], pa.list_(pa.float32())),
            "loss_mask": pa.array([[False] * len(values)], pa.list_(pa.bool_())),
        }
    )
    path = write(table, tmp_path / "empty.parquet")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    expected = {
        "tokens": "all 1 sequences are empty (0 tokens)",
        "loss": "no token is in the loss: loss_mask is false for all 2 tokens",
    }[empty]
    for command in (["validate", str(path)], ["analyze", str(path), "-q", *cache]):
        assert main(command) == 1, command
        said = capsys.readouterr()
        assert expected in said.out + said.err, command


def test_a_warning_is_one_line(dump, tmp_path, capsys):
    config = tmp_path / "cap.yaml"
    config.write_text("framework: trl\nvllm_importance_sampling_cap: 2.0\n")
    assert main(["analyze", str(dump), "-q", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "warning: `vllm_importance_sampling_cap` is deprecated in TRL" in err
    assert "FutureWarning" not in err and ".py:" not in err


def test_export_of_an_older_verl_generation_is_labelled_with_it(capsys):
    argv = ["export", "--config", "verl:decoupled_geo_rs", "--to", "verl", "--generation", "gen0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-> verl in its gen0 config keys" in out and "as of" not in out


def test_an_inexact_export_keeps_its_notes_on_stdout_and_exact_refuses_it(tmp_path, capsys):
    """`export --to trl` of a setting TRL cannot express printed a config that turns the
    correction off, with the notes on stderr only: a redirect lost them. They are comments
    above the snippet now, and --exact refuses (exit 1, nothing written)."""
    argv = ["export", "--config", "skyrl:skyrl_tldr_stack", "--to", "trl"]
    assert main(argv) == 0
    said = capsys.readouterr()
    lines = said.out.splitlines()
    assert lines[0] == (
        "# not exact: skyrl_tldr_stack (skyrl) -> trl (as of huggingface/trl@f2cd5771 (2026-07-24))"
    )
    assert "# note: Left out: the geometric sequence mask" in said.out
    assert lines[-1].startswith("vllm_importance_sampling_clip_max") and said.err == ""
    out = tmp_path / "trl.yaml"
    assert main([*argv, "--exact", "--out", str(out)]) == 1
    said = capsys.readouterr()
    assert said.out == "" and not out.exists() and not list(tmp_path.iterdir())
    assert said.err.splitlines()[-1] == (
        "error: --exact: trl cannot express skyrl_tldr_stack (skyrl) exactly; the notes above "
        "say what differs"
    )
    assert (
        main(["export", "--config", "verl:decoupled_token_icepop", "--to", "nemo_rl", "--exact"])
        == 0
    )


def test_a_newline_in_a_setting_name_cannot_end_the_export_comment(tmp_path, capsys):
    config = tmp_path / "evil.yaml"
    config.write_text('framework: trl\nname: "x\\nvllm_importance_sampling_mode: token_mask"\n')
    assert main(["export", "--config", str(config), "--to", "skyrl"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("# not exact: x\\nvllm_importance_sampling_mode: token_mask (trl)")


def test_bench_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "20000", "--no-memory", "-q", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "analyze, streamed (8 settings)" in text and "padded [B, max_len] torch" in text
    assert "agreement padded" in text and "agreement pandas" in text
    assert json.loads(out.read_text())["dump"]["tokens"] > 0


def test_setting_names_reach_the_terminal_with_control_characters_escaped(dump, capsys, tmp_path):
    config = tmp_path / "evil.yaml"
    config.write_text('framework: trl\nname: "evil\\x1b[2J\\x07name"\n')
    assert main(["analyze", str(dump), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2J\\x07name (trl)" in out


def test_replay_takes_a_preset_name(dump, tmp_path, capsys):
    import pyarrow.parquet as pq

    from iscore import load
    from iscore.frameworks.resolve import resolve

    out = tmp_path / "w.parquet"
    argv = ["replay", str(dump), "--config", "verl:decoupled_geo_rs", "--out", str(out), "-q"]
    assert main(argv) == 0
    assert "replayed with decoupled_geo_rs (verl)" in capsys.readouterr().out
    expected = resolve("verl:decoupled_geo_rs").replay(load(dump))
    assert pq.read_table(out)["weight"].to_numpy().tolist() == expected.weight.tolist()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "nodir/s.parquet"], "nodir/s.parquet: no such directory"),
        (["simulate", "adir"], "adir: is a directory; expected a file name to write"),
        (["simulate", "s1.csv"], "s1.csv: expected a .parquet file name, but got '.csv'"),
        (
            ["replay", "DUMP", "--config", "verl:disabled", "--out", "w.csv", "-q"],
            "w.csv: expected a .parquet file name, but got '.csv'",
        ),
        (
            ["analyze", "DUMP", "-q", "--json", "same.out", "--html", "./same.out"],
            "--json and --html both name ./same.out; give each output a file of its own",
        ),
        (
            ["analyze", "DUMP", "-q", "--json", "a.json", "--sequences", "a.json"],
            "--json and --sequences both name a.json",
        ),
        (
            ["bench", "--dump", "b.json", "--json", "b.json", "-q"],
            "--dump and --json both name b.json",
        ),
        (
            ["export", "--config", "verl:disabled", "--to", "skyrl", "--where", "step > 1"],
            "--where is an option of --dump; give --dump DUMP with it",
        ),
        (
            ["export", "--config", "verl:disabled", "--to", "skyrl", "--chunk-tokens", "9"],
            "--chunk-tokens is an option of --dump; give --dump DUMP with it",
        ),
    ],
)
def test_bad_outputs_and_misplaced_options_are_refused(
    argv, message, dump, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    before = sorted(tmp_path.iterdir())
    assert main([str(dump) if a == "DUMP" else a for a in argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}")
    assert sorted(tmp_path.iterdir()) == before


def test_convert_names_its_own_format_flag(dump, tmp_path, capsys):
    assert main(["convert", str(dump), "--out", str(tmp_path / "r.parquet")]) == 2
    assert capsys.readouterr().err.rstrip().endswith("name the format (--from; fmt= in Python)")
    assert main(["validate", str(tmp_path / "nothing*.jsonl"), "-q"]) == 2
    assert "(--from)" not in capsys.readouterr().err


def test_export_reads_its_dump_with_the_dump_options(dump, capsys):
    argv = ["export", "--config", "verl:decoupled_geo_rs", "--to", "skyrl", "--dump", str(dump)]
    measured = {}
    for extra in ([], ["--steps", "1", "-q"], ["--where", "step = 1", "-q"]):
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        measured[" ".join(extra)] = [line for line in out.splitlines() if "mean w" in line]
    assert measured["--steps 1 -q"] == measured["--where step = 1 -q"] != measured[""]


def test_settings_keep_the_command_line_order(dump, tmp_path, capsys):
    config = tmp_path / "geo.yaml"
    config.write_text(VERL_GEO)
    argv = ["--preset", "trl:trl_token_tis", "--config", str(config), "--preset", "verl:disabled"]
    out = tmp_path / "a.json"
    assert main(["analyze", str(dump), "-q", *argv, "--json", str(out)]) == 0
    names = [s["name"] for s in json.loads(out.read_text())["settings"]]
    assert names == ["trl_token_tis", "geo", "disabled"]
    table = tmp_path / "s.csv"
    assert main(["sequences", str(dump), "-q", *argv, "--out", str(table)]) == 0
    header = table.read_text().splitlines()[0].replace('"', "").split(",")
    weights = [name for name in header if name.endswith("_weight")]
    assert weights == ["trl_token_tis_weight", "geo_weight", "disabled_weight"]


@pytest.mark.parametrize("command", ["analyze", "sequences", "replay"])
@pytest.mark.parametrize("preset", ["verl:bypass_ppo_clip", "skyrl:skyrl_rollout_is"])
def test_a_setting_that_cannot_replay_the_dump_is_named(command, preset, dump, tmp_path, capsys):
    argv = [command, str(dump), "-q"]
    if command == "replay":
        argv += ["--config", preset, "--out", str(tmp_path / "w.parquet")]
    else:
        argv += ["--preset", "verl:disabled", "--preset", preset]
        argv += ["--out", str(tmp_path / "w.csv")] if command == "sequences" else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {preset}: ") and "`policy_logprob` column" in err
    assert not (tmp_path / "w.parquet").exists() and not (tmp_path / "w.csv").exists()


@pytest.mark.parametrize("value", ["0", "-5"])
def test_chunk_tokens_must_be_positive(value, dump, capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate", str(dump), "--chunk-tokens", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --chunk-tokens: expected a positive integer, but got '{value}'" in err


def test_version_is_the_installed_one(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"iscore {version('iscore')}\n"


def _fresh(code: str) -> str:
    """The last line `code` prints in a fresh Python process."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


_LOADED = (
    "print(sorted(m for m, probe in (('torch', 'torch._C'), ('plotly', 'plotly'), "
    "('streamlit', 'streamlit')) if probe in sys.modules))\n"
)


def test_commands_that_compute_nothing_load_no_torch(dump):
    """`iscore --help`, a command's help, a mistyped option, `presets` and `validate` answer
    without loading torch, plotly or streamlit (seconds of start-up)."""
    argvs = [
        ["--help"],
        ["analyze", "--help"],
        ["analyze", "--nope", "x"],
        ["presets"],
        ["validate", str(dump)],
    ]
    code = (
        "import sys\n"
        "from iscore.cli import main\n"
        f"for argv in {argvs!r}:\n"
        "    try:\n"
        "        assert main(argv) == 0, argv\n"
        "    except SystemExit:\n"
        "        pass\n" + _LOADED
    )
    assert _fresh(code) == "[]"


def test_torch_loads_on_first_use_and_gives_the_same_results(dump, tmp_path, capsys):
    """A command that computes, in a fresh process where torch was deferred, writes what it
    writes where torch was imported first (as in this test process)."""
    args = ["analyze", str(dump), "--config", "verl:decoupled_geo_rs", "--quiet"]
    assert main([*args, "--json", str(tmp_path / "here.json")]) == 0
    code = (
        "import sys\n"
        "from iscore.cli import main\n"
        f"assert main({[*args, '--json', str(tmp_path / 'fresh.json')]!r}) == 0\n" + _LOADED
    )
    assert _fresh(code) == "['torch']"
    here, fresh = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("here", "fresh"))
    assert fresh == here


def test_a_deferred_module_runs_on_first_use_and_a_failed_load_is_retried(tmp_path, monkeypatch):
    from iscore.cli import _defer_import

    (tmp_path / "iscore_probe_ok.py").write_text("import sys\nsys.ran = True\nvalue = 42\n")
    (tmp_path / "iscore_probe_bad.py").write_text("raise ImportError('broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("iscore_probe_ok", "iscore_probe_bad"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        _defer_import(name)
    monkeypatch.delattr(sys, "ran", raising=False)
    import iscore_probe_ok  # binds the module without running it

    assert not hasattr(sys, "ran")
    assert iscore_probe_ok.value == 42 and sys.ran
    assert type(iscore_probe_ok) is type(sys)  # a plain module from then on
    import iscore_probe_bad

    with pytest.raises(ImportError, match="broken install"):
        iscore_probe_bad.anything  # noqa: B018
    assert "iscore_probe_bad" not in sys.modules
    monkeypatch.delitem(sys.modules, "iscore_probe_ok")


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        ("replay", ["--config", "verl:disabled", "--out", "{dump}"]),
        ("sequences", ["--out", "{link}"]),
        ("analyze", ["--sequences", "{dump}"]),
        ("analyze", ["--json", "{dump}"]),
        ("validate", ["--json", "{dump}"]),
        ("recommend", ["--framework", "verl", "--json", "{dump}"]),
        ("export", ["--config", "verl:disabled", "--to", "slime", "--out", "{dump}"]),
    ],
)
def test_no_output_is_written_onto_the_dump_it_reads(command, extra, dump, tmp_path, capsys):
    """Writing the output onto the input (itself, or through a link) destroyed the dump."""
    (tmp_path / "link.parquet").symlink_to(dump)
    before = dump.read_bytes()
    names = {"dump": str(dump), "link": str(tmp_path / "link.parquet")}
    argv = [a.format(**names) for a in extra]
    if command == "export":
        argv += ["--dump", str(dump)]
    else:
        argv.insert(0, str(dump))
    assert main([command, *argv, "-q"]) == 2
    said = capsys.readouterr()
    assert "is an input being read; write the output to another file" in said.err
    assert dump.read_bytes() == before


def test_export_out_is_not_written_onto_its_config(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("framework: trl\nvllm_importance_sampling_correction: true\n")
    before = config.read_text()
    argv = ["export", "--config", str(config), "--to", "verl", "--out", str(config)]
    assert main(argv) == 2
    assert "is an input being read" in capsys.readouterr().err
    assert config.read_text() == before


def test_an_output_in_a_missing_folder_is_refused_before_the_work(dump, capsys):
    argv = ["recommend", str(dump), "-q", "--framework", "verl", "--json", "/nonexistent/r.json"]
    assert main(argv) == 2
    said = capsys.readouterr()
    assert said.out == ""  # refused before recommending, not after printing it all
    assert "no such directory /nonexistent; create it first" in said.err


@pytest.mark.parametrize("command", ["analyze", "replay", "recommend", "sequences"])
def test_drop_invalid_says_what_it_left_out(command, tmp_path, capsys):
    table = pa.table(
        {
            "seq_id": [1, 1, 2, 2, 2],
            "rollout_logprob": np.float32([-1, -2, -1, -1, -1]),
            "train_logprob": np.float32([-1, -2, 0.5, -1, -1]),  # 0.5: not a log-prob
        }
    )
    path = write(table, tmp_path / "pos.parquet")
    extra = {
        "analyze": ["--json", str(tmp_path / "a.json")],
        "replay": ["--config", "verl:disabled", "--out", str(tmp_path / "w.parquet")],
        "recommend": ["--framework", "verl"],
        "sequences": ["--out", str(tmp_path / "s.parquet")],
    }[command]
    assert main([command, str(path), "-q", "--drop-invalid", *extra]) == 0
    err = capsys.readouterr().err
    note = "note: --drop-invalid left out 1 sequence (3 tokens) with invalid log-probs"
    assert note in err and "train_logprob: 1 value)" in err
    if command == "analyze":
        dropped = json.loads((tmp_path / "a.json").read_text())["source"]["dropped"]
        assert dropped == {"sequences": 1, "tokens": 3, "invalid_values": {"train_logprob": 1}}


def test_replay_counts_the_kept_tokens_with_weight_zero(dump, tmp_path, capsys):
    out = tmp_path / "w.parquet"
    argv = ["replay", str(dump), "-q", "--config", "verl:decoupled_token_icepop", "--out", str(out)]
    assert main(argv) == 0
    rows = pq.read_table(out).to_pydict()
    zero = sum(k and w == 0 for k, w in zip(rows["keep"], rows["weight"], strict=True))
    kept = sum(rows["keep"])
    assert f"{kept:,} kept in the loss, {zero:,} of them with weight 0" in capsys.readouterr().out


def test_export_out_keeps_what_the_translation_lost(tmp_path, capsys):
    out = tmp_path / "skyrl.yaml"
    argv = ["export", "--config", "verl:decoupled_k3_rs", "--to", "skyrl", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert text.startswith("# not exact: decoupled_k3_rs (verl) -> skyrl")
    assert "# note: Left out: the KL-estimator mask" in text
    assert parse_config(out).framework == "skyrl"  # the comments do not stop it replaying


def test_python_m_iscore_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "iscore", "--version"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("iscore ")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--sequences", "0"], "Expected --sequences to be an int >= 1, but got 0"),
        (["--median-len", "0"], "Expected --median-len to be an int >= --min-len 16"),
    ],
)
def test_simulate_errors_name_its_flags(flags, expected, tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "s.parquet"), *flags]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "s.parquet").exists()


def test_recommend_prints_the_default_beside_the_best(capsys):
    argv = ["recommend", "data/fp8.parquet", "--framework", "verl", "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\nbest: token TIS, cap 1.5\n" in out
    assert "\ndefault: verl's default, decoupled_token_is (ranked " in out
    assert main([*argv[:-1], "--config", "verl:decoupled_token_is"]) == 0
    assert "default: your setting, decoupled_token_is" in capsys.readouterr().out
    assert main([*argv, "--config", "skyrl:skyrl_token_tis"]) == 2
    assert "--config is a skyrl setting; --framework verl ranks verl settings" in (
        capsys.readouterr().err
    )
