"""The Trends page's split of a change in Chromium: open a run of four steps, open *Why did it
change?*, read the sentence and the two figures, then split at the run's event."""

from __future__ import annotations

from pathlib import Path

import pytest

import iscore
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

SAMPLE = ROOT / "data" / "drift.parquet"


def test_the_split_between_two_steps_and_at_an_event(
    page: Page, app_url: str, screens: Path
) -> None:
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(app_url)
    _idle(page)
    page.get_by_test_id("stFileUploader").locator("input[type=file]").set_input_files(SAMPLE)
    _idle(page)
    _go(page, "Trends")
    split = page.get_by_test_id("stExpander").filter(has_text="Why did it change?")
    split.get_by_text("Why did it change?").click()
    _idle(page)
    body = split.get_by_test_id("stExpanderDetails")
    first = iscore.why(SAMPLE, 0, 3).sentence
    expect(body.get_by_test_id("stMarkdownContainer").filter(has_text=first[:40])).to_be_visible()
    expect(body.locator(".js-plotly-plot")).to_have_count(2)
    expect(body.get_by_test_id("stDataFrame")).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)
    _shoot(page, screens, "trends-why")

    choose = body.get_by_role("combobox", name="Explain")
    choose.click()
    page.get_by_role("option", name="Step 2: The mismatch began to grow").click()
    _idle(page)
    event = iscore.why(SAMPLE, 1, 2).sentence
    expect(body.get_by_test_id("stMarkdownContainer").filter(has_text=event[:40])).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)
