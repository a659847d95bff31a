"""`iscore diff --html` (`iscore.present.diffs`): a page that parses, holds both arms, every
table and each verdict with its evidence, escapes every name from a dump or a config, runs no
script and writes nothing but the file asked for; the rows it shares with the CLI and the app."""

from __future__ import annotations

import dataclasses
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from iscore.cli import main
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.frameworks import resolve
from iscore.passes.diff import diff
from iscore.present import diff_figure, diff_rows, render_diff_html, step_rows

SETTING = "verl:decoupled_geo_rs_token_tis"
EVIL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def arms(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("diff_html")
    found = {}
    for regime, seed in (("dense_bf16", 1), ("fp8", 2)):
        found[regime] = folder / f"{regime}.parquet"
        config = SimConfig(regime, sequences=48, steps=2, median_len=160, seed=seed)
        write_simulated(found[regime], config)
    return found


class _Page(HTMLParser):
    """What a browser would build of the page: its elements, cells, titles and text."""

    VOID = frozenset({"meta", "br"})

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.open: list[str] = []
        self.cells: list[tuple[str, str]] = []  # (class, text) of each verdict-like cell
        self.titles: list[str] = []
        self.csp = ""
        self.text = ""
        self._cell: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag not in self.VOID:
            self.open.append(tag)
        if tag == "meta" and attrs.get("http-equiv") == "Content-Security-Policy":
            self.csp = attrs["content"]
        if tag == "td" and "title" in attrs:
            self.titles.append(attrs["title"])
            self._cell = attrs.get("class") or ""
            self.cells.append((self._cell, ""))

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-3:])
        self.open.pop()
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        self.text += data
        if self._cell is not None:
            grade, text = self.cells[-1]
            self.cells[-1] = (grade, text + data)


def _parsed(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    assert page.open == [], page.open  # every element closed, in order
    return page


def test_the_cli_writes_a_page_that_escapes_the_names_and_holds_the_verdicts(
    arms, tmp_path, capsys
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    html = out / "diff.html"
    argv = ["diff", str(arms["dense_bf16"]), str(arms["fp8"]), "--preset", SETTING, "-q"]
    argv += ["--resamples", "100", "--name", f"A={EVIL}", "--name", "B=fp8 & co"]
    cwd = Path.cwd()
    os.chdir(out)
    try:
        assert main([*argv, "--html", str(html)]) == 0
    finally:
        os.chdir(cwd)
    assert [p.name for p in out.iterdir()] == ["diff.html"]  # nothing else, no leftover
    assert f"wrote {html}" in capsys.readouterr().out
    text = html.read_text(encoding="utf-8")
    assert text.startswith("<!doctype html>")
    page = _parsed(text)
    assert "script" not in page.tags and "alert(1)" not in "".join(page.tags)
    assert EVIL not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert EVIL in page.text and "fp8 & co" in page.text  # shown as text
    assert "default-src 'none'" in page.csp and "script-src" not in page.csp
    # Both arms, their files, the tables and the per-step rows.
    for said in (str(arms["dense_bf16"]), str(arms["fp8"]), "The mismatch", SETTING, "By step"):
        assert said in page.text, said
    verdicts = {(grade, text) for grade, text in page.cells}
    assert ("bad", "worse") in verdicts and ("", "same") in verdicts
    k3 = next(t for t in page.titles if t.startswith("k3 ("))
    assert f"{EVIL} " in k3 and "fp8 & co" in k3  # the evidence names the arms, unescaped
    assert "95% interval [" in k3 and "100 resamples" in k3 and "unpaired" in k3


def test_a_hostile_setting_name_stays_text_and_pairing_is_said(arms) -> None:
    spec = dataclasses.replace(resolve(SETTING), name="</td><img src=x onerror=alert(1)>")
    same = diff(arms["fp8"], arms["fp8"], [spec], names=("a", "b"), resamples=20)
    text = render_diff_html(same)
    page = _parsed(text)
    assert "img" not in page.tags
    assert "verl:</td><img src=x onerror=alert(1)>" in page.text
    assert "paired (both hold the same sequences" in page.text
    assert "No metric is worse on the candidate." in page.text
    assert all(grade == "" for grade, _ in page.cells)  # every verdict same, uncoloured


def test_the_rows_say_what_the_cli_prints_and_why(arms) -> None:
    found = diff(arms["dense_bf16"], arms["fp8"], [SETTING], resamples=50)
    rows = diff_rows(found)
    assert [r.metric for r in rows[: len(found.metrics)]] == [m.name for m in found.metrics]
    assert {r.group for r in rows} == {"mismatch", SETTING}
    k3 = rows[0]
    m = found.metric("k3")
    assert (k3.baseline, k3.candidate, k3.change, k3.interval) == (
        m.baseline,
        m.candidate,
        m.ratio,
        m.ci,
    )
    assert k3.change_text == f"x{m.ratio:.3g}" and k3.interval_text.startswith("[")
    assert f"baseline {m.baseline:.4g}, candidate {m.candidate:.4g}" in k3.evidence
    assert "Verdict: worse." in k3.evidence and "higher is worse" in k3.evidence
    # Without a ratio (no baseline badness), the difference and its interval.
    none = next(r for r in rows if r.metric == "broken_share")
    assert none.by == "difference" and none.change_text.startswith(("+", "-"))
    assert len(step_rows(found)) == 6 * len(found.by_step)


def test_the_figure_draws_each_ratio_with_its_interval_and_evidence(arms) -> None:
    found = diff(arms["dense_bf16"], arms["fp8"], resamples=50, names=("<i>a</i>", "b"))
    (trace,) = diff_figure(found)["data"]
    ratios = [r for r in diff_rows(found) if r.by == "ratio"]
    assert trace["y"] == [r.metric for r in ratios] and trace["x"] == [r.change for r in ratios]
    k3 = ratios[0]
    assert trace["error_x"]["array"][0] == pytest.approx(k3.interval[1] - k3.change)
    assert (
        trace["hovertext"][0].startswith("k3 (&lt;e^d")
        and "&lt;i&gt;a&lt;/i&gt;" in (trace["hovertext"][0])
    )
