"""`iscore gate` (`iscore.advice.gates`, `iscore/cli/gate.py`): bounds exactly hit pass, a NaN
never does; the shipped tables are cited; a user's table is checked key by key; the command
exits 0 / 1 / 2 as documented, and its JUnit report parses, a test case per check."""

from __future__ import annotations

import json
import math
from pathlib import Path
from xml.etree import ElementTree

import pytest

from iscore.advice.gates import GATED, TABLES, Bound, judge, parse_bound, read_table
from iscore.cli import main
from iscore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FP8 = str(ROOT / "data" / "fp8.parquet")
BF16 = str(ROOT / "data" / "dense_bf16.parquet")


@pytest.mark.parametrize(
    ("low", "high", "value", "passed"),
    [
        (None, 0.015, 0.015, True),  # a bound exactly hit passes
        (None, 0.015, 0.0150001, False),
        (0.3, None, 0.3, True),
        (0.3, None, 0.2999, False),
        (0.5, 2.0, 2.0, True),
        (0.5, 2.0, math.nan, False),  # a metric the dump cannot give is within no bar
    ],
)
def test_a_bound_holds_its_limits_included(low, high, value, passed):
    (check,) = judge({"k3": value}, [Bound("k3", low, high)], "t")
    assert check.passed is passed and check.table == "t"
    assert judge({}, [Bound("ess", 0.3, None)])[0].passed is False


def test_every_shipped_bar_is_cited_and_names_a_gated_metric():
    assert {"prime-rl-ci", "slime-ci", "vime-ci", "nemo-rl-ci", "health"} <= TABLES.keys()
    for table in TABLES.values():
        assert table.bounds, table.name
        for bound in table.bounds:
            assert bound.metric in GATED and bound.source.url.startswith("https://")
    assert [b.describe() for b in TABLES["prime-rl-ci"].bounds] == ["k3 <= 0.015"]
    assert [b.describe() for b in TABLES["nemo-rl-ci"].bounds] == ["token_mult_prob_error <= 1.05"]
    assert [b.describe() for b in TABLES["slime-ci"].bounds] == ["abs_diff_mean <= 0.1"]


@pytest.mark.parametrize(
    ("text", "flag", "message"),
    [
        ("k3", "--max", "Expected --max to be METRIC=VALUE, but got 'k3'"),
        ("k3=big", "--max", "Expected --max k3 to be a finite number, but got 'big'"),
        ("k3=inf", "--min", "to be a finite number"),
        ("kl=0.1", "--max", "expected a metric among k1, k2, k3"),
    ],
)
def test_a_bound_from_the_command_line_is_checked(text, flag, message):
    with pytest.raises(ConfigError, match=message):
        parse_bound(text, flag)
    assert parse_bound("ess=0.5", "--min") == Bound("ess", 0.5, None)


def test_a_users_table_is_read_and_checked_key_by_key(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text(
        "name: ours\nbounds:\n  - {metric: k3, max: 0.002}\n"
        "  - {metric: ess, min: 0.9, source: {name: our wiki, url: 'https://example.org/x'}}\n"
    )
    table = read_table(good)
    assert table.name == "ours" and [b.describe() for b in table.bounds] == [
        "k3 <= 0.002",
        "ess >= 0.9",
    ]
    for text, said in (
        ("[1, 2]", "expected a mapping with a non-empty list `bounds`"),
        ("bounds: [{max: 1}]", "bounds[0]: expected a mapping with a `metric`"),
        ("bounds: [{metric: k3}]", "bounds[0]: expected `max`, `min` or both"),
        ("bounds: [{metric: k3, max: nope}]", "bounds[0].max to be a finite number"),
        ("bounds: [{metric: k3, max: 1, source: {name: x, url: 'http://x'}}]", "https url"),
        ("bounds: [: :", "cannot read the gate table"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
            read_table(bad)


def test_the_command_fails_on_a_bar_and_writes_junit_and_json(tmp_path, capsys):
    junit, doc = tmp_path / "gate.xml", tmp_path / "gate.json"
    argv = ["gate", FP8, "--table", "prime-rl-ci", "--max", "k3=0.1", "-q"]
    assert main([*argv, "--junit", str(junit), "--json", str(doc)]) == 1
    suite = ElementTree.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "2" and suite.get("failures") == "1"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["k3 <= 0.1", "k3 <= 0.015"]
    (failure,) = cases[1].findall("failure")
    assert "expected k3 <= 0.015" in failure.get("message")
    assert "prime-rl PR #3543" in failure.text and "fp8.parquet" in failure.text
    checks = json.loads(doc.read_text())
    assert checks["schema"] == "iscore.gate" and checks["passed"] is False
    assert [c["passed"] for c in checks["checks"]] == [True, False]
    assert "1 of 2 checks pass" in capsys.readouterr().out
    assert main(["gate", BF16, "--table", "prime-rl-ci", "--table", "nemo-rl-ci", "-q"]) == 0


def test_against_a_baseline_fails_where_diff_says_worse(capsys):
    assert main(["gate", FP8, "--against", BF16, "--max", "k3=1", "-q"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  k3 not worse than {BF16}" in out
    assert main(["gate", BF16, "--against", BF16, "-q"]) == 0


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main(["gate", BF16, "-q"]) == 2
    assert "nothing to check: give --max, --min, --table or --against" in capsys.readouterr().err
    assert main(["gate", BF16, "--table", "no-such-table", "-q"]) == 2
    err = capsys.readouterr().err
    assert "Expected --table to be one of vime-ci" in err and "prime-rl-ci" in err
    assert main(["gate", "--max", "k3=1"]) == 2
    assert main(["gate", "--list-tables"]) == 0
    listed = capsys.readouterr().out
    assert "prime-rl-ci (v1)" in listed and "https://github.com/THUDM/slime/pull/1968" in listed


def test_what_a_users_table_says_is_escaped_in_the_report(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text(
        "name: '<b>x</b>'\nbounds: [{metric: k3, max: 0.0001, note: '<script>alert(1)</script>'}]\n"
    )
    junit = tmp_path / "j.xml"
    assert main(["gate", BF16, "--table", str(table), "--junit", str(junit), "-q"]) == 1
    text = junit.read_text()
    assert "<script>" not in text and "<b>" not in text
    assert ElementTree.parse(junit).getroot().find("testcase").get("classname") == "<b>x</b>"
