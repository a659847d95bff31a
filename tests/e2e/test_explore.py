"""Explore in Chromium: run an example query, click a result row to open its sequence, apply a
slice and see it on every page."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import CHROMIUM, ROOT
from tests.e2e.test_browser import _go, _idle, _shoot

pytest.importorskip(
    "pytest_playwright", reason="needs pytest-playwright (it runs /usr/bin/chromium; never "
    "`playwright install`)",
)  # fmt: skip
from playwright.sync_api import Page, expect

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
    ),
]

SAMPLE = ROOT / "data" / "fp8.parquet"


def _data_page(page: Page) -> None:
    """Back to the Data page (the default page: its address is the app's own)."""
    page.get_by_test_id("stSidebarNav").get_by_role("link", name="Data").click()
    _idle(page)


def test_query_open_a_sequence_and_slice(page: Page, app_url: str, screens: Path) -> None:
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(app_url)
    _idle(page)
    page.get_by_test_id("stFileUploader").locator("input[type=file]").set_input_files(SAMPLE)
    _idle(page)
    _go(page, "Explore")
    expect(page.get_by_test_id("stCaptionContainer").filter(has_text="48 rows")).to_be_visible()

    # An example query is one click away; its result is a table.
    page.get_by_test_id("stButtonGroup").get_by_text("k3 by step").click()
    _idle(page)
    expect(page.get_by_test_id("stTextArea").locator("textarea")).to_contain_text("GROUP BY step")
    expect(page.get_by_test_id("stCaptionContainer").filter(has_text="1 row")).to_be_visible()

    # Back to the worst sequences; clicking a row opens its curves.
    page.get_by_test_id("stButtonGroup").get_by_text("worst sequences").click()
    _idle(page)
    grid = page.get_by_test_id("stDataFrame")
    expect(grid).to_be_visible()
    box = grid.bounding_box()
    assert box is not None
    # The row-selection column is the grid's first, left of the data; row 1 is under the header.
    page.mouse.click(box["x"] + 15, box["y"] + 35 + 17)
    _idle(page)
    heading = page.get_by_role("heading", name="Sequence 26 of step 0")  # largest summed k3
    expect(heading).to_be_visible(timeout=30_000)
    # One figure: the log-probs, d, and the weight curve of each of the session's settings (the
    # framework's default and the recommended one), each a legend entry.
    expect(page.locator(".js-plotly-plot")).to_have_count(1, timeout=30_000)
    legend = page.locator(".js-plotly-plot .legendtext")
    expect(legend.filter(has_text="d = train - rollout")).to_have_count(1)
    expect(legend.filter(has_text="recommended_")).to_have_count(1)
    expect(legend).to_have_count(5)
    expect(page.get_by_test_id("stException")).to_have_count(0)
    _shoot(page, screens, "explore-sequence")

    # Apply a slice: every page then shows it, and counts only its sequences.
    page.get_by_test_id("stButtonGroup").get_by_text("long responses").click()
    _idle(page)
    page.get_by_role("textbox", name="Only the sequences where").fill("length > 1500")
    page.get_by_role("button", name="Apply as slice").click()
    _idle(page)
    sidebar = page.get_by_test_id("stSidebar")
    expect(sidebar).to_contain_text("Slice: only sequences where length > 1500")
    _data_page(page)
    sequences = page.get_by_test_id("stMetric").filter(has_text="Sequences")
    expect(sequences).not_to_contain_text("48")
    expect(sidebar).to_contain_text("Slice: only sequences where length > 1500")
    _go(page, "Mismatch")
    expect(page.get_by_test_id("stException")).to_have_count(0)
    sidebar.get_by_role("button", name="Clear the slice").click()
    _idle(page)
    expect(sidebar).not_to_contain_text("Slice:")
    _data_page(page)
    expect(sequences).to_contain_text("48")
