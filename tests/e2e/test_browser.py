"""A user's way through the dashboard in Chromium: upload, look, compare, tune, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from iscore.replay import parse_config
from tests.e2e.conftest import CHROMIUM, ROOT

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


def _idle(page: Page) -> None:
    """Wait until the app's script run is over."""
    page.wait_for_timeout(300)
    page.wait_for_selector(
        "[data-testid='stApp'][data-test-script-state='notRunning']", timeout=60_000
    )


def _go(page: Page, title: str) -> None:
    """Switch page in the sidebar (a client-side switch: the session and its upload stay)."""
    page.get_by_test_id("stSidebarNav").get_by_role("link", name=title).click()
    expect(page.get_by_role("heading", level=1)).to_contain_text(title)
    _idle(page)


def _shoot(page: Page, folder: Path, name: str) -> None:
    """The whole page: the viewport is stretched to the main column's height first."""
    height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": 1440, "height": min(max(height + 40, 900), 8000)})
    page.wait_for_timeout(800)
    page.screenshot(path=str(folder / f"{name}.png"))
    page.set_viewport_size({"width": 1440, "height": 900})


def _metric(page: Page, label: str) -> str:
    metric = page.get_by_test_id("stMetric").filter(has_text=label)
    return metric.get_by_test_id("stMetricValue").inner_text()


def test_upload_to_export(page: Page, app_url: str, screens: Path) -> None:
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(app_url)
    _idle(page)
    expect(page.get_by_role("heading", level=1)).to_contain_text("Data")

    page.get_by_test_id("stFileUploader").locator("input[type=file]").set_input_files(SAMPLE)
    _idle(page)
    expect(page.get_by_test_id("stMetric").filter(has_text="Sequences")).to_contain_text("48")
    page.locator(".js-plotly-plot").first.wait_for()
    expect(page.get_by_test_id("stSidebar")).to_contain_text("Dump: fp8.parquet (all steps)")
    _shoot(page, screens, "1-data")

    _go(page, "Mismatch")
    expect(page.locator(".js-plotly-plot")).to_have_count(7, timeout=30_000)
    _shoot(page, screens, "2-mismatch")

    _go(page, "Compare")
    choose = page.get_by_test_id("stMultiSelect").locator("input")
    for preset in ("verl:decoupled_geo_rs", "skyrl:skyrl_token_tis", "verl:decoupled_seq_is"):
        choose.click()
        choose.fill(preset)
        page.get_by_role("option", name=preset, exact=True).click()
        page.keyboard.press("Escape")
        _idle(page)
    expect(page.get_by_test_id("stMultiSelect")).to_contain_text("verl:decoupled_seq_is")
    expect(page.locator(".js-plotly-plot")).to_have_count(6, timeout=30_000)
    _shoot(page, screens, "3-compare")

    _go(page, "Tune")
    before = _metric(page, "Tokens truncated")
    thumb = page.get_by_test_id("stSlider").get_by_role("slider").first
    thumb.focus()
    for _ in range(8):
        thumb.press("ArrowLeft")
    _idle(page)
    expect(page.get_by_test_id("stMetric").filter(has_text="Tokens truncated")).not_to_contain_text(
        before
    )
    page.get_by_role("button", name="Use this setting").click()
    _idle(page)
    expect(page.get_by_test_id("stAlert").filter(has_text="to the Compare list")).to_be_visible()
    _shoot(page, screens, "4-tune")
    page.get_by_test_id("stSelectbox").filter(has_text="Family").click()
    page.get_by_role("option", name="IcePop band").click()
    _idle(page)
    expect(page.get_by_test_id("stSlider")).to_have_count(2)
    expect(page.locator(".js-plotly-plot")).to_have_count(2)
    _shoot(page, screens, "4-tune-icepop")

    expect(page.get_by_test_id("stSidebar")).to_contain_text("Settings in Compare: 4")
    _go(page, "Export")
    expect(page.get_by_test_id("stCode")).to_contain_text("rollout_correction")
    buttons = page.get_by_test_id("stDownloadButton")
    config = buttons.filter(has_text="iscore config")
    button = config if config.count() else buttons.filter(has_text="snippet")
    with page.expect_download() as download:
        button.click()
    text = Path(download.value.path()).read_text()
    assert parse_config(yaml.safe_load(text)).name == "decoupled_geo_rs"
    _shoot(page, screens, "5-export")


def test_malformed_upload_shows_the_problem(page: Page, app_url: str, screens: Path) -> None:
    page.goto(app_url)
    _idle(page)
    page.get_by_test_id("stFileUploader").locator("input[type=file]").set_input_files(
        {"name": "broken.parquet", "mimeType": "application/octet-stream", "buffer": b"{}\n"}
    )
    _idle(page)
    expect(page.get_by_test_id("stAlert").filter(has_text="not a Parquet file")).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)
    _shoot(page, screens, "0-malformed-upload")
