"""What every figure shares: the palette, each setting's color, dash and symbol, and names
from a config or a dump made safe to show (plotly renders a subset of HTML in text)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from iscore.frameworks import Spec
    from iscore.stats import SettingSummary

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
"""One color per setting, in order, on every figure (the app uses the same). Each has a
mid luminance, so that it reads on a white and on a near-black background."""


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
"""One dash pattern per setting, by index (`dash`)."""


SYMBOLS = (
    "circle",
    "square",
    "diamond",
    "triangle-up",
    "x",
    "triangle-down",
    "cross",
    "star",
    "pentagon",
    "hourglass",
)
"""One marker per setting, by index."""


OVERLAY_MAX = 4
"""Up to this many settings share one plot; beyond, `collapse_by_length` draws a panel each."""


DATA = "#5b84b1"
"""Quantities of the dump itself (d, |d|, lengths): not a setting's color."""


ACCENT = "#b5527e"
"""A second quantity beside `DATA` (k3 beside mean |d|)."""


MIDDLE = "rgba(91, 132, 177, 0.5)"
"""The middle bar of `signed_diff_histogram` (|d| below its scale): `DATA`, lighter."""


NEUTRAL = "rgba(128, 128, 128, 0.9)"
"""Reference lines and expectations: a grey that reads on light and dark pages."""


TRAIN = "rgba(255, 140, 40, 0.55)"
"""The trainer's log-probs, wide and light under the rollout's (`sequence_figure`)."""


GRID = "rgba(128, 128, 128, 0.22)"


AXIS_LINE = "rgba(128, 128, 128, 0.6)"


Figure = dict[str, Any]


def color(i: int) -> str:
    """The color of the i-th setting."""
    return PALETTE[i % len(PALETTE)]


def _cycle(i: int) -> int:
    """The i-th setting's index into the dashes and markers: i, shifted by one more each time
    the colors start over, so that settings PALETTE apart differ in dash and marker (without
    the shift, the 6 dashes and 10 colors would repeat together every 30 settings and the
    markers with the colors). Settings 0 to 9 keep their own index."""
    return i + i // len(PALETTE)


def dash(i: int) -> str:
    """The dash pattern of the i-th setting: (color, dash) is unique for the first 60."""
    return DASHES[_cycle(i) % len(DASHES)]


def symbol(i: int) -> str:
    """The marker of the i-th setting: (color, marker) is unique for the first 100."""
    return SYMBOLS[_cycle(i) % len(SYMBOLS)]


def style(i: int, n: int) -> dict[str, Any]:
    """Line and marker of the i-th of n settings drawn on one plot: its color, dash and marker,
    and a width that shrinks with the index, so that a later setting drawn over an earlier one
    with the same values leaves the earlier one visible around it.

    >>> style(0, 3)["line"], style(2, 3)["line"]["width"]
    ({'color': '#1f77b4', 'dash': 'solid', 'width': 3.5}, 1.5)
    """
    rank = max(min(n, OVERLAY_MAX) - 1 - i, 0)  # 0 for the last (thinnest) setting
    return {
        "line": {"color": color(i), "dash": dash(i), "width": 1.5 + rank},
        "marker": {
            "color": color(i),
            "symbol": symbol(i),
            "size": 6 + 2 * rank,
            "line": {"color": color(i), "width": 1},
        },
    }


def setting_name(setting: SettingSummary | Spec) -> str:
    """How a setting (its summary, or its spec) is named in legends: `name (framework)`, or
    just `name` where the two are the same (a framework's default setting is named after it:
    not "trl (trl)").

    >>> from iscore.frameworks import presets, resolve
    >>> setting_name(presets()["trl:trl_default"]), setting_name(resolve({"framework": "trl"}))
    ('trl_default (trl)', 'trl')
    """
    if setting.name == setting.framework:
        return setting.name
    return f"{setting.name} ({setting.framework})"


def text(value: object) -> str:
    """`value` as plain text for a plotly text field (title, legend, label, hover): plotly
    renders a subset of HTML there (<b>, <a href>, <span style>), so a setting's name or a
    sequence id from an upload or a config must arrive with <, > and & as entities.

    >>> text("<b>x</b> & y")
    '&lt;b&gt;x&lt;/b&gt; &amp; y'
    """
    return html.escape(str(value), quote=False)


def legend_label(setting: SettingSummary) -> str:
    """`setting_name`, as plotly text."""
    return text(setting_name(setting))
