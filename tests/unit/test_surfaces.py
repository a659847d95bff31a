"""One way in: every public function and CLI command takes data as a path, a glob, a `Dump` or
a `TokenBatch`, and a setting as a preset name, a config path, a mapping or a spec (one or a
list), through `iscore.dump.open_data` and `iscore.frameworks.resolve.resolve`; the same bad input
gets the same error everywhere.

Before: `iscore.recommend(path, ...)` and `iscore.replay(path, ...)` raised `AttributeError:
'str' object has no attribute 'loss_mask'`, `iscore.export` refused a preset string, and
`iscore.analyze(path, "verl:...")` read the string as a list of one-character settings.
"""

from __future__ import annotations

import pytest

import iscore
from iscore.advice.conversion import to_file_text
from iscore.advice.tuning import Tuner
from iscore.cli import main
from iscore.errors import ConfigError, DumpError, IscoreError
from iscore.frameworks.resolve import resolve
from iscore.passes.sequences import sequence_table
from iscore.passes.validation import validate

FP8 = "data/fp8.parquet"
PRESET = "verl:decoupled_geo_rs"

DATA_FUNCTIONS = {
    "load": lambda data: iscore.load(data),
    "replay": lambda data: iscore.replay(data, PRESET),
    "analyze": lambda data: iscore.analyze(data, PRESET),
    "recommend": lambda data: iscore.recommend(data, "verl"),
    "export": lambda data: iscore.export(PRESET, "skyrl", batch=data),
    "sequence_table": lambda data: sequence_table(data, PRESET),
    "Tuner": lambda data: Tuner(data),
    "validate": lambda data: validate(data),
}

SETTING_FUNCTIONS = {
    "replay": lambda setting: iscore.replay(FP8, setting),
    "analyze": lambda setting: iscore.analyze(FP8, setting),
    "export": lambda setting: iscore.export(setting, "skyrl"),
    "sequence_table": lambda setting: sequence_table(FP8, setting),
}


def _message(call) -> str:
    with pytest.raises(IscoreError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("form", ["path", "glob", "Dump", "TokenBatch", "list"])
@pytest.mark.parametrize("name", list(DATA_FUNCTIONS))
def test_every_function_takes_every_form_of_data(name, form):
    if name == "validate" and form == "TokenBatch":
        pytest.skip("a loaded batch has no files left to validate (its own test below)")
    data = {
        "path": FP8,
        "glob": "data/fp8.parq*",
        "Dump": iscore.Dump(FP8),
        "TokenBatch": iscore.load(FP8),
        "list": [FP8],
    }[form]
    assert DATA_FUNCTIONS[name](data) is not None


@pytest.mark.parametrize("name", list(SETTING_FUNCTIONS))
def test_every_function_takes_every_form_of_setting(name, tmp_path):
    spec = resolve(PRESET)
    config = tmp_path / "geo.yaml"
    config.write_text(to_file_text(spec))
    forms = [PRESET, str(config), config, spec, spec.to_config()]
    if name in ("analyze", "sequence_table"):  # several settings at once
        forms.append([PRESET, "trl:trl_default"])
    for setting in forms:
        assert SETTING_FUNCTIONS[name](setting) is not None


def test_a_string_is_one_setting_not_a_list_of_characters():
    analysis = iscore.analyze(FP8, PRESET)
    assert [s.name for s in analysis.settings] == ["decoupled_geo_rs"]


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("data/missing.parquet", "data/missing.parquet: no such file or directory"),
        (3, "Expected data to be a path, a directory or a glob (or a list of them), a Dump or "
         "a TokenBatch, but got int"),
        ([], "but got an empty list"),
        ([FP8, 3], "but got a list of int, str"),
    ],
)  # fmt: skip
def test_bad_data_gets_one_error_from_every_function(bad, expected):
    messages = {name: _message(lambda f=f: f(bad)) for name, f in DATA_FUNCTIONS.items()}
    assert len(set(messages.values())) == 1, messages
    assert expected in next(iter(messages.values()))


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("verl:nope", "'verl:nope' is neither a config file nor a preset"),
        (3, "Expected a setting: a preset name, a config file's path, a config mapping or a "
         "spec, but got int"),
        ({"framework": "verI"}, "(did you mean 'verl'?)"),
    ],
)  # fmt: skip
def test_a_bad_setting_gets_one_error_from_every_function(bad, expected):
    messages = {name: _message(lambda f=f: f(bad)) for name, f in SETTING_FUNCTIONS.items()}
    assert len(set(messages.values())) == 1, messages
    assert expected in next(iter(messages.values()))


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "data/missing.parquet"],
        ["analyze", "data/missing.parquet", "--preset", PRESET],
        ["replay", "data/missing.parquet", "--config", PRESET, "--out", "{tmp}/w.parquet"],
        ["recommend", "data/missing.parquet", "--framework", "verl"],
        ["sequences", "data/missing.parquet"],
        ["export", "--config", PRESET, "--to", "skyrl", "--dump", "data/missing.parquet"],
    ],
)
def test_the_cli_says_what_the_functions_say(argv, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "-q"]) != 0
    python = _message(lambda: iscore.load("data/missing.parquet"))
    assert f"error: {python}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", FP8, "--preset", "verl:nope"],
        ["replay", FP8, "--config", "verl:nope", "--out", "{tmp}/w.parquet"],
        ["sequences", FP8, "--preset", "verl:nope"],
        ["export", "--config", "verl:nope", "--to", "skyrl"],
    ],
)
def test_the_cli_names_a_bad_setting_as_the_functions_do(argv, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) != 0
    python = _message(lambda: iscore.replay(FP8, "verl:nope"))
    assert f"error: {python}" in capsys.readouterr().err


def test_validate_refuses_a_loaded_batch_with_a_reason():
    with pytest.raises(DumpError, match="a loaded TokenBatch: its values were checked"):
        validate(iscore.load(FP8))


def test_resolve_refuses_what_is_no_setting():
    with pytest.raises(ConfigError, match="but got NoneType"):
        iscore.replay(FP8, None)
