"""The verdict at the top of the Data and Mismatch pages, the published measurements the dump
is placed among, and where its mismatch comes from."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app.conftest import DATA, new_app, no_exception, open_path, plain


@pytest.mark.parametrize(
    ("sample", "box", "headline"),
    [
        ("dense_bf16.parquet", "success", "Normal"),
        ("fp8.parquet", "warning", "Elevated"),
        ("offset_bug.parquet", "error", "Broken"),
    ],
)
def test_the_data_page_shows_the_verdict_once_a_dump_is_loaded(sample, box, headline):
    at = open_path(new_app(), DATA / sample)
    no_exception(at)
    first = getattr(at, box)[0].value
    assert plain(first).startswith(f"**{headline}"), first
    bands = next(e for e in at.expander if e.label.startswith("The published bands"))
    table = bands.dataframe[0].value
    assert set(table.columns) >= {"statistic", "value", "healthy", "within", "source", "link"}
    assert table["link"].str.startswith("https://").all()


def test_the_mismatch_page_places_the_dump_and_names_its_sources(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/mismatch.py").run()
    no_exception(at)
    assert plain(at.warning[0].value).startswith("**Elevated")
    text = " ".join(plain(m.value) for m in at.markdown)
    assert "your k3 (0.04985) sits between" in text  # fp8: between published bf16 and FP8
    assert "Engine numerics on low-probability tokens" in text
    measurements = next(e for e in at.expander if e.label == "The published measurements")
    assert measurements.dataframe[0].value["link"].str.startswith("https://").all()
