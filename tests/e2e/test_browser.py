"""A user's way through the dashboard in Chromium: upload, look, compare, tune, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from iscore.frameworks.resolve import parse_config
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
    page.wait_for_url(f"**/{title.lower()}")
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


PAGES = ("Recommend", "Compare", "Tune", "Mismatch", "Export")


def _upload(page: Page, app_url: str) -> None:
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(app_url)
    _idle(page)
    expect(page.get_by_role("heading", level=1)).to_contain_text("Data")
    page.get_by_test_id("stFileUploader").locator("input[type=file]").set_input_files(SAMPLE)
    _idle(page)
    expect(page.get_by_test_id("stMetric").filter(has_text="Sequences")).to_contain_text("48")
    page.locator(".js-plotly-plot").first.wait_for()
    expect(page.get_by_test_id("stSidebar")).to_contain_text("Dump: fp8.parquet (all steps)")


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_page_shows_content_on_first_open(
    page: Page, app_url: str, screens: Path, scheme: str
) -> None:
    # The app follows the system's theme, and asks nothing of any other host: every request
    # the page makes goes to the app itself (or stays inside the browser).
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.emulate_media(color_scheme=scheme)
    _upload(page, app_url)
    background = page.evaluate(
        "() => getComputedStyle(document.querySelector('[data-testid=stApp]')).backgroundColor"
    )
    level = sum(int(c) for c in background.strip("rgba()").split(",")[:3]) / 3
    assert (level < 80) if scheme == "dark" else (level > 200), background
    _shoot(page, screens, f"{scheme}-1-data")
    for n, title in enumerate(PAGES, 2):
        _go(page, title)
        # Visible ones: the bands' and the measurements' tables open collapsed.
        shown = page.locator(
            ".js-plotly-plot, [data-testid=stDataFrame], [data-testid=stCode] >> visible=true"
        )
        expect(shown.first).to_be_visible(timeout=30_000)
        expect(page.get_by_test_id("stException")).to_have_count(0)
        _shoot(page, screens, f"{scheme}-{n}-{title.lower()}")
    outside = [u for u in requests if not u.startswith((app_url, "data:", "blob:"))]
    assert not outside, outside


def test_recommend_then_export(page: Page, app_url: str, screens: Path) -> None:
    _upload(page, app_url)
    _go(page, "Recommend")
    expect(page.get_by_test_id("stDataFrame")).to_be_visible()
    _idle(page)
    choose = page.get_by_role("combobox", name="Setting", exact=True)
    choose.click()
    choose.fill("geometric sequence mask")
    page.keyboard.press("Enter")
    _idle(page)
    snippet = page.get_by_test_id("stCode").inner_text()
    page.get_by_role("button", name="Use this setting").click()
    _idle(page)
    expect(page.get_by_test_id("stAlert").filter(has_text="recommended_geo_mask")).to_be_visible()
    expect(page.get_by_test_id("stSidebar")).to_contain_text("Settings in Compare: 3")

    _go(page, "Export")
    chosen = page.get_by_role("combobox", name="Setting (from the Compare list)")
    expect(chosen).to_have_value("verl:recommended_geo_mask")
    expect(page.get_by_test_id("stCode")).to_have_text(snippet)
    config = yaml.safe_load(snippet)
    assert parse_config({"framework": "verl", **config}).rs is not None

    _go(page, "Tune")
    before = _metric(page, "Sequences masked")
    thumb = page.get_by_test_id("stSlider").get_by_role("slider").first
    # Six presses in a burst, each starting a rerun while the last one runs: none is lost (a
    # rerun that wrote the widget's value back would set the thumb back to where it began).
    start = int(thumb.input_value())  # an <input type=range>: its value is a slider position
    thumb.focus()
    for _ in range(6):
        thumb.press("ArrowRight")
    page.wait_for_timeout(1000)
    _idle(page)
    expect(thumb).to_have_value(str(start + 6))
    masked = page.get_by_test_id("stMetric").filter(has_text="Sequences masked")
    expect(masked).not_to_contain_text(before, timeout=30_000)
    _shoot(page, screens, "tune-moved")


def test_export_downloads_the_report_and_the_json(page: Page, app_url: str) -> None:
    """The downloads are computed when clicked, outside the script run (the HTML report read
    session state there, failed, and nothing arrived)."""
    _upload(page, app_url)
    _go(page, "Export")
    for label, check in (
        ("HTML report", lambda text: text.startswith("<!doctype html>") and "Settings" in text),
        ("Analysis JSON", lambda text: '"schema": "iscore.analysis"' in text),
    ):
        with page.expect_download(timeout=60_000) as info:
            page.get_by_role("button", name=label).click()
        text = Path(info.value.path()).read_text()
        assert check(text), label


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


def _open_sample(page: Page, name: str) -> None:
    page.get_by_role("tab", name="Sample data").click()
    page.get_by_test_id("stSelectbox").filter(has_text="Sample").click()
    page.get_by_role("option", name=name, exact=True).click()
    page.get_by_role("button", name="Open sample").click()
    _idle(page)


def test_a_new_dump_shows_its_own_step_range(page: Page, app_url: str) -> None:
    """The browser keeps a widget's value while its key lives: the step slider of a new dump
    must not come back with the previous dump's range."""
    page.goto(app_url)
    _idle(page)
    _open_sample(page, "drift")  # steps 0-3
    thumb = page.get_by_test_id("stSlider").get_by_role("slider").first
    thumb.focus()
    thumb.press("ArrowRight")
    _idle(page)
    expect(page.get_by_test_id("stMetric").filter(has_text="Training steps")).to_contain_text("3")

    _open_sample(page, "dense_bf16")  # steps 0-1
    thumbs = page.get_by_test_id("stSlider").get_by_role("slider")
    expect(thumbs.first).to_have_attribute("aria-valuetext", "0")
    expect(thumbs.last).to_have_attribute("aria-valuetext", "1")
    # Any other widget sends every widget's value back: the slider's must be the new one.
    page.get_by_text("Drop sequences with invalid log-probs").click()
    _idle(page)
    assert _metric(page, "Training steps") == "2"
    expect(thumbs.first).to_have_attribute("aria-valuetext", "0")


def _add_run(page: Page, name: str) -> None:
    page.get_by_role("textbox", name="Name of the loaded dump as a run").fill(name)
    page.get_by_role("button", name="Add as a run").click()
    _idle(page)
    expect(
        page.get_by_test_id("stAlert").filter(has_text=f"Kept as the run {name}.")
    ).to_be_visible()


def test_two_samples_as_runs_overlaid_and_compared(page: Page, app_url: str, screens: Path) -> None:
    """Two samples kept as runs: Mismatch overlays them (a legend entry a run), and Runs shows
    the verdict table (fp8 against bf16: k3 worse) and downloads the diff as a page."""
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(app_url)
    _idle(page)
    for sample, name in (("dense_bf16", "bf16"), ("fp8", "fp8")):
        _open_sample(page, sample)
        _add_run(page, name)
    expect(page.get_by_test_id("stSidebar")).to_contain_text("Runs: bf16, fp8")

    _go(page, "Mismatch")
    expect(page.get_by_role("heading", name="The runs, overlaid")).to_be_visible()
    overlay = page.locator(".js-plotly-plot").filter(has_text="each run").first
    expect(overlay.locator(".legendtext")).to_have_text(["bf16", "fp8"])
    expect(page.get_by_test_id("stException")).to_have_count(0)
    _shoot(page, screens, "runs-1-mismatch")

    _go(page, "Runs")
    table = page.get_by_test_id("stDataFrame").first
    expect(table).to_be_visible()
    expect(table).to_contain_text("worse")  # the grid draws on a canvas: its text is for a11y
    expect(page.get_by_test_id("stAlert").filter(has_text="Worse on the candidate")).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)
    _shoot(page, screens, "runs-2-runs")
    with page.expect_download(timeout=60_000) as info:
        page.get_by_role("button", name="Diff HTML").click()
    text = Path(info.value.path()).read_text()
    assert text.startswith("<!doctype html>") and "worse" in text and "<script" not in text
