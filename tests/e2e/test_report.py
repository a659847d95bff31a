"""The HTML report in Chromium: opened from disk with the network cut, in light and dark.

Each figure is read back from plotly's own layout (what it actually drew), not from the spec
iscore handed it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from playwright.sync_api import Page

from iscore.cli import main
from tests.e2e.conftest import ROOT

# The k3 axes: a trend figure's second y-axis is a hidden one, for its events' markers.
_MISMATCH_AXES = """() => [...document.querySelectorAll('.fig')]
  .filter(el => el.layout.yaxis2 && el.layout.yaxis2.visible !== false)
  .map(el => ({
    title: el.layout.title.text,
    range: el._fullLayout.yaxis2.range,
    ticks: el._fullLayout.yaxis2._vals.map(v => [v.x, v.text]),
    k3: el.data.find(t => t.yaxis === 'y2').y.filter(v => v !== null),
  }))"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    args = ["analyze", str(ROOT / "data" / "drift.parquet"), "-q", "--html", str(path)]
    assert main([*args, "--preset", "verl:decoupled_geo_rs"]) == 0
    return path


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_report_opens_offline_in_the_readers_theme(
    page: Page, report: Path, scheme: str, screens: Path
) -> None:
    asked: list[str] = []
    page.route("**/*", lambda route: (asked.append(route.request.url), route.continue_()))
    page.emulate_media(color_scheme=scheme)
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(report.as_uri())
    page.wait_for_function("document.querySelectorAll('.fig .main-svg').length > 0")
    assert asked == [report.as_uri()], "the report fetched something besides itself"

    ink, ground = page.evaluate(
        "[getComputedStyle(document.body).color, getComputedStyle(document.body).backgroundColor]"
    )
    figure_ink = page.evaluate("document.querySelector('.fig')._fullLayout.font.color")
    light_text = _luminance(ink) > 0.5
    assert light_text == (scheme == "dark")
    assert (_luminance(figure_ink) > 0.5) == light_text, "figure text in the page's ink"
    if scheme == "dark":
        assert _luminance(ground) < 0.1
    page.screenshot(path=str(screens / f"report-{scheme}.png"), full_page=True)


def test_every_k3_axis_holds_its_points_on_round_ticks(page: Page, report: Path) -> None:
    page.goto(report.as_uri())
    page.wait_for_function("document.querySelectorAll('.fig .main-svg').length > 0")
    axes = page.evaluate(_MISMATCH_AXES)
    assert {a["title"].split(" by ")[0] for a in axes} == {"Mismatch"} and len(axes) == 4
    for axis in axes:
        low, high = axis["range"]
        assert low == 0 and max(axis["k3"]) <= high, axis["title"]
        # Round steps (one significant digit), labelled without float noise.
        values = [x for x, _ in axis["ticks"]]
        step = values[1] - values[0]
        assert math.isclose(step, float(f"{step:.0e}"), rel_tol=1e-9), axis
        for x, text in axis["ticks"]:
            assert float(text) == pytest.approx(x, abs=step / 100) and len(text) <= 6, axis


def _luminance(css: str) -> float:
    """Relative brightness in [0, 1] of a CSS `rgb(r, g, b)` or `#rrggbb` color."""
    if css.startswith("#"):
        rgb = [int(css[i : i + 2], 16) for i in (1, 3, 5)]
    else:
        rgb = [float(v) for v in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
    r, g, b = (v / 255 for v in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b
