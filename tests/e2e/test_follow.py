"""`iscore app DIR --follow` in Chromium: a run's step files land while its Trends page is open,
and the page shows each new step without a reload; a file still being written is skipped until
it is whole; a click on a step opens its worst sequences on Explore."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from iscore.dump.simulate import SimConfig, write_run
from tests.e2e.conftest import CHROMIUM, serving
from tests.e2e.test_browser import _idle, _metric, _shoot

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

INTERVAL_S = 1
WAIT_MS = 30_000
"""A generous wait for what must show within the poll interval (and a script run)."""


def _name(step: int) -> Path:
    return Path(f"step_{step:06d}") / "rank_0000.parquet"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """(the finished run the steps come from, the followed folder holding its first step,
    the URL of `iscore app FOLDER --follow --interval 1`), its results store in a temporary
    folder."""
    root = tmp_path_factory.mktemp("follow")
    source = root / "source"
    config = SimConfig("dense_bf16", sequences=12, steps=4, median_len=60, seed=7, grow_from=2)
    write_run(source, config)
    folder = root / "run"
    (folder / _name(0)).parent.mkdir(parents=True)
    shutil.copy(source / _name(0), folder / _name(0))
    arguments = ["iscore", "app", str(folder), "--follow", "--interval", str(INTERVAL_S)]
    env = {"XDG_CACHE_HOME": str(root / "cache")}
    with serving(arguments, root / "server.log", env) as url:
        yield source, folder, url


def _land(source: Path, folder: Path, step: int) -> None:
    """Step `step`'s file, written as a training loop's writer does: whole under a temporary
    name, then renamed."""
    target = folder / _name(step)
    target.parent.mkdir(exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    shutil.copy(source / _name(step), temporary)
    os.replace(temporary, target)


K3_CHART = "[class*=st-key-trends_k3_] .js-plotly-plot"
"""The k3 chart (its key, `trends_k3_<clicks>`): the page's first plot outside the collapsed
"Why did it change?" expander, whose figures come before it."""


def _steps_drawn(page: Page) -> list[int]:
    """The steps of the k3 chart's values, as the browser holds them."""
    return page.evaluate(
        f"() => Array.from(document.querySelector('{K3_CHART}').data[0].x).map(Number)"
    )


def test_new_steps_appear_on_the_open_trends_page_without_a_reload(
    page: Page, run: tuple[Path, Path, str], screens: Path
) -> None:
    source, folder, url = run
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(url)
    _idle(page)
    nav = page.get_by_test_id("stSidebarNav")
    sidebar = page.get_by_test_id("stSidebar")
    expect(page.get_by_test_id("stMetric").filter(has_text="Training steps")).to_contain_text("1")
    expect(sidebar).to_contain_text("Following its new step files (every 1 s)")
    expect(nav.get_by_role("link", name="Trends")).to_have_count(0)  # one step: no trends

    # A second step lands: the Data page's look at the folder reruns the app, and Trends is
    # listed, right after Data.
    _land(source, folder, 1)
    expect(nav.get_by_role("link", name="Trends")).to_be_visible(timeout=WAIT_MS)
    links = nav.get_by_role("link").all_inner_texts()  # each the icon's name, then the title
    assert [text.split()[-1] for text in links[:3]] == ["Data", "Trends", "Recommend"]
    nav.get_by_role("link", name="Trends").click()
    page.wait_for_url("**/trends")
    _idle(page)
    expect(page.get_by_test_id("stMetric").filter(has_text="Latest step")).to_contain_text("1")
    page.locator(K3_CHART).wait_for()
    assert _steps_drawn(page) == [0, 1]
    page.evaluate("() => { window.stillTheSamePage = true; }")  # gone with a reload

    # A file still being written, under its final name: skipped while it is not whole.
    partial = folder / _name(2)
    partial.parent.mkdir()
    partial.write_bytes((source / _name(2)).read_bytes()[:-64])
    page.wait_for_timeout(4 * INTERVAL_S * 1000)  # several looks at the folder
    assert _metric(page, "Steps") == "2"
    expect(page.get_by_test_id("stException")).to_have_count(0)
    expect(page.get_by_test_id("stAlertContentError")).to_have_count(0)

    # Whole now: the page shows step 2 within the poll interval, without a reload.
    _land(source, folder, 2)
    expect(page.get_by_test_id("stMetric").filter(has_text="Latest step")).to_contain_text(
        "2", timeout=WAIT_MS
    )
    assert _metric(page, "Steps") == "3"
    page.wait_for_function(
        f"() => Array.from(document.querySelector('{K3_CHART}').data[0].x).length === 3",
        timeout=WAIT_MS,
    )
    assert _steps_drawn(page) == [0, 1, 2]
    assert page.evaluate("() => window.stillTheSamePage === true")
    _shoot(page, screens, "trends-followed")

    # A click on step 1's point opens its worst sequences on Explore.
    point = page.locator(K3_CHART).locator(".scatterlayer .trace").first
    point.locator("path.point").nth(1).click(force=True)
    page.wait_for_url("**/explore", timeout=WAIT_MS)
    _idle(page)
    expect(page.get_by_test_id("stTextArea").locator("textarea")).to_contain_text(
        "WHERE step = 1 ORDER BY k3_sum DESC"
    )
    expect(page.get_by_test_id("stCaptionContainer").filter(has_text="12 rows")).to_be_visible()
