"""A self-contained HTML report of an analysis: plotly.js inlined, opens with no network.

Everything the report shows from a dump or a config (file names, setting names, notes) is
escaped, and a Content-Security-Policy allows only the report's own two scripts (by their
SHA-256) and no network at all: a setting named `</script><script>...` stays text.

>>> write_html(analysis, "report.html")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import hashlib
import html
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iscore.advice import (
    EVENT_KINDS,
    FLAG_KINDS,
    NO_SEMANTICS_BUG,
    Flag,
    Targets,
    flags_of,
    to_file_text,
)
from iscore.errors import IscoreError
from iscore.frameworks import parse_config
from iscore.passes import Analysis
from iscore.present.figures import all_figures, color, setting_name
from iscore.present.tables import (
    METADATA_COLUMNS,
    SUMMARY_COLUMNS,
    metadata_cell,
    metadata_tables,
)
from iscore.stats import SettingSummary
from iscore.utils import output_path

_MISMATCH_ROWS = (
    "k1",
    "k3",
    "k3_reverse",
    "abs_diff_mean",
    "abs_diff_max",
    "token_mult_prob_error",
    "chi2_token",
    "chi2_seq",
    "js",
    "log_ppl_diff",
    "ppl_ratio",
    "ratio_mean",
)
_SECTIONS = (
    ("Settings side by side", ("weights", "raw", "collapse", "mask_by_length", "lr_scale")),
    ("Mismatch", ("signed_diff", "abs_diff", "by_prob", "by_pos", "by_length", "by_step")),
    ("The run, step by step", ("trend",)),
)


def plotly_js() -> str:
    """plotly.js from the installed plotly package (read as a file: iscore never imports it)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise IscoreError("HTML reports need the plotly package: pip install plotly")
    return (Path(spec.submodule_search_locations[0]) / "package_data" / "plotly.min.js").read_text()


def render_html(analysis: Analysis, targets: Targets | None = None) -> str:
    """The report as one HTML string; the settings table is graded against `targets`
    (default: `Targets()`, those of `iscore recommend`)."""
    figures = all_figures(analysis)
    doc = analysis.to_dict()
    sections = [
        _header(doc),
        _health(doc),
        _flags(analysis.flags),
        _summary_table(analysis.settings, doc["settings"], targets or Targets()),
        _configs(analysis.settings),
        _mismatch_table(doc),
        _metadata_tables(doc),
        _worst_table(doc),
    ]
    parts = [section for section in sections if section]  # a section that has nothing: no line
    scripts = []
    for title, keys in _SECTIONS:
        present = [k for k in keys if k in figures]
        if not present:
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if "trend" in keys:
            parts.append(_events(doc))
        parts.append("<div class='grid'>")
        for key in present:
            parts.append(f"<div class='fig' id='fig-{key}'></div>")
            spec = script_json(figures[key])
            scripts.append(
                f"Plotly.newPlot('fig-{key}', ...(s => [s.data, s.layout])({spec}), "
                "{displaylogo: false, responsive: true});"
            )
        parts.append("</div>")
    plotly = plotly_js()
    figures_js = "\n" + "\n".join(scripts) + "\n" + _FOLLOW_THEME
    return _PAGE.format(
        csp=content_policy((plotly, figures_js)),
        style=STYLE,
        plotly=plotly,
        body="\n".join(parts),
        scripts=figures_js,
    )


def content_policy(scripts: Sequence[str] = ()) -> str:
    """A report's Content-Security-Policy, escaped for its `<meta>` element: nothing loaded
    from anywhere, and no script run but the inline `scripts` (allowed by their SHA-256).

    >>> content_policy().split("; ")[:2]
    ["default-src 'none'", "style-src 'unsafe-inline'"]
    """
    allowed = [f"script-src {' '.join(_sha256(s) for s in scripts)}"] if scripts else []
    policy = "; ".join(
        (
            "default-src 'none'",  # no fetch, image, font or frame from anywhere
            *allowed,
            "style-src 'unsafe-inline'",  # the report's <style> and plotly's inline styles
            "img-src data:",  # plotly's modebar icons and downloads
            "base-uri 'none'",
            "form-action 'none'",
        )
    )
    return html.escape(policy, quote=False)


def script_json(value: Any) -> str:
    """`value` as JSON that is safe inside an HTML `<script>` element.

    `<`, `>` and `&` are written as \\u escapes so that no `</script>` or `<!--` in a name
    can end the element or change how it is parsed; `json.dumps` already writes every
    non-ASCII character (U+2028 and U+2029 among them) as an escape.

    >>> script_json({"name": "</script><!--\u2028"})
    '{"name": "\\\\u003c/script\\\\u003e\\\\u003c!--\\\\u2028"}'
    """
    text = json.dumps(value, allow_nan=False, default=_none, ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _sha256(script: str) -> str:
    """A CSP source allowing exactly the inline script with this text."""
    digest = hashlib.sha256(script.encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def write_html(analysis: Analysis, path: str | Path, targets: Targets | None = None) -> None:
    """Write the report to `path` (`targets`: as `render_html`)."""
    text = render_html(analysis, targets)
    with output_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def _none(value: Any) -> None:
    return None


def _header(doc: dict[str, Any]) -> str:
    src = doc["source"]
    files = ", ".join(html.escape(Path(f).name) for f in src["files"]) or "in-memory batch"
    if src.get("where"):
        files += f" · only sequences where <code>{html.escape(src['where'])}</code>"
    steps = len(src["steps"])
    return (
        f"<h1>iscore report</h1><p class='meta'>{files} · {steps} step{'s' * (steps != 1)} · "
        f"{src['sequences']:,} sequences · {src['loss_tokens']:,} loss tokens · "
        f"iscore {doc['iscore_version']} · schema v{doc['schema_version']}</p>"
    )


def _link(source: dict[str, str]) -> str:
    return f"<a href='{html.escape(source['url'])}'>{html.escape(source['name'])}</a>"


def _health(doc: dict[str, Any]) -> str:
    """The verdict (`iscore.advice.health`), the published bands it was judged against with their
    sources, where the dump sits among published measurements, the verdict of each step, and
    where the mismatch comes from (`iscore.stats.attribution`)."""
    health = doc["health"]
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in health["reasons"])
    parts = [
        f"<div class='verdict {health['verdict']}'><b>{html.escape(health['headline'])}</b>"
        + (f"<ul>{reasons}</ul>" if reasons else "")
        + "</div>"
    ]
    if "floor" in health:
        parts.append(f"<p class='floor'>{html.escape(health['floor']['sentence'])}</p>")
    whole = doc["mismatch"].get("distribution")
    if whole:
        kl = whole["kl"]
        parts.append(
            "<p class='distribution'>The whole distribution (top-k log-probs): KL "
            f"{_fmt(kl['estimate'], '{:.3g}')} (at least {_fmt(kl['lower'], '{:.3g}')}), "
            f"top-1 agreement {_fmt(whole['top1_agreement'], '{:.1%}')}.</p>"
        )
    rows = "".join(
        f"<tr><td>{html.escape(b['statistic'])}</td><td>{_fmt(b['value'], '{:.4g}')}</td>"
        f"<td>{html.escape(b['healthy'])}</td>"
        f"<td>{'-' if b['within'] is None else 'yes' if b['within'] else '<b>no</b>'}</td>"
        f"<td>{html.escape(b['framework'])} {html.escape(b['logged_as'])}</td>"
        f"<td>{_link(b['source'])}</td></tr>"
        for b in health["bands"]
    )
    parts.append(
        "<details><summary>The published bands it was judged against</summary><table><tr>"
        "<th>statistic</th><th>value</th><th>healthy</th><th>within</th><th>published as</th>"
        f"<th>source</th></tr>{rows}</table></details>"
    )
    placed = "".join(f"<li>{html.escape(p['text'])}</li>" for p in health.get("reference", []))
    if placed:
        parts.append(f"<p>Among published measurements:</p><ul>{placed}</ul>")
    steps = health["by_step"]
    if len(steps) > 1:
        cells = "".join(
            f"<td class='{_GRADE[s['verdict']]}'>{s['step']}: {s['verdict']}</td>" for s in steps
        )
        parts.append(f"<table class='steps'><tr>{cells}</tr></table>")
    findings = doc.get("attribution", {}).get("findings", [])
    if findings:
        items = "".join(
            f"<li><b>{html.escape(f['title'])}</b>: {html.escape(f['summary'])} "
            f"<i>{html.escape(f['action'])}</i></li>"
            for f in findings
        )
        parts.append(f"<h2>Where the mismatch comes from</h2><ul>{items}</ul>")
    return "".join(parts)


_GRADE = {"normal": "good", "elevated": "fair", "broken": "bad"}
"""Each verdict in the colours of the settings table's grades."""


def _flags(flags: Sequence[Flag]) -> str:
    parts = []
    if not flags_of(flags, "semantics_bug"):
        parts.append(f"<p class='ok'>{html.escape(NO_SEMANTICS_BUG)}</p>")
    for kind, title in FLAG_KINDS.items():
        items = "".join(
            f"<li><b>{html.escape(f.code)}</b>: {html.escape(f.message)}</li>"
            for f in flags_of(flags, kind)
        )
        if items:
            parts.append(
                f"<div class='flags {kind}'><b>{html.escape(title)}:</b><ul>{items}</ul></div>"
            )
    return "".join(parts)


def _events(doc: dict[str, Any]) -> str:
    """When the run changed (`trend.events`, docs/runs.md), grouped by kind, each with its
    step and evidence."""
    events = doc["trend"]["events"]
    if not events:
        return (
            "<p class='ok'>No event: the mismatch stays within its early steps' band, no "
            "step has broken sequences or an offset, and no setting stops meeting the "
            "targets.</p>"
        )
    items = "".join(
        f"<li><b>{html.escape(title)}</b> from step {e['step']}: {html.escape(e['evidence'])}</li>"
        for kind, title in EVENT_KINDS.items()
        for e in events
        if e["kind"] == kind
    )
    return f"<div class='flags events'><b>Events:</b><ul>{items}</ul></div>"


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _summary_table(
    settings: Sequence[SettingSummary], values: list[dict[str, Any]], targets: Targets
) -> str:
    """The settings table: each setting's numbers as the document holds them (`values`: null
    for a number that is not finite), graded against `targets`."""
    if not settings:
        return ""
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in SUMMARY_COLUMNS)
    rows = []
    for i, (s, v) in enumerate(zip(settings, values, strict=True)):
        cells = []
        for key, _, pattern in SUMMARY_COLUMNS:
            value = v.get(key)
            grade = targets.grade(key, value)
            mark = f" class='{grade}'" if grade else ""
            cells.append(f"<td{mark}>{_fmt(value, pattern)}</td>")
        name = html.escape(setting_name(s))
        upstream = html.escape(s.upstream)
        rows.append(
            f"<tr><td><span class='dot' style='background:{color(i)}'></span>{name}"
            f"<br><span class='note'>{upstream}</span></td>"
            f"<td>{html.escape(s.aggregation)}</td>{''.join(cells)}</tr>"
        )
    lo, hi = targets.lr_scale
    stricter = (
        f" (stricter than the {targets.min_ess:.0%} a recommendation must reach)"
        if targets.min_ess < 0.8
        else ""
    )
    return (
        "<h2>Settings</h2><table><tr><th>setting</th><th>loss aggregation</th>"
        f"{head}</tr>{''.join(rows)}</table><p class='note'>Green: good for training, amber: "
        f"fair, red: bad, from the targets of <code>iscore recommend</code>: LR scale in "
        f"[{lo:g}, {hi:g}], ESS at least {max(targets.min_ess, 0.8):.0%}{stricter}, mean "
        "weight in "
        f"[0.9, 1.1], at most {100 * targets.max_token_drop:.3g}% of tokens and "
        f"{100 * targets.max_seq_drop:.3g}% of sequences masked and 1% truncated (amber: "
        "within half to twice the LR bounds, ESS from 30%, mean weight in [0.5, 2], up to 5x "
        "the shares). LR scale: the corrected gradient's size relative to the uncorrected one "
        "under the framework's loss aggregation.</p>"
    )


def _configs(settings: Sequence[SettingSummary]) -> str:
    """Each setting as the config file that replays it (the framework's own keys, with
    `framework:` and `name:`), escaped."""
    if not settings:
        return ""
    blocks = "".join(
        f"<details><summary><span class='dot' style='background:{color(i)}'></span>"
        f"{html.escape(setting_name(s))}</summary>"
        f"<pre>{html.escape(to_file_text(parse_config(s.config)))}</pre></details>"
        for i, s in enumerate(settings)
    )
    return f"<h2>The settings' configs</h2>{blocks}"


_WORST_COLUMNS = (
    ("step", "step", "{}"),
    ("seq_id", "seq_id", "{}"),
    ("tokens", "loss tokens", "{:,}"),
    ("k3_sum", "summed k3", "{:.4g}"),
    ("log_ratio_sum", "S = sum of d", "{:.4g}"),
    ("abs_diff_mean", "mean |d|", "{:.4g}"),
    ("abs_diff_max", "max |d|", "{:.4g}"),
)


def _worst_table(doc: dict[str, Any]) -> str:
    """The sequences with the largest summed k3: where to look first."""
    worst = doc["mismatch"].get("worst_sequences") or []
    if not worst:
        return ""
    head = "".join(f"<th>{label}</th>" for _, label, _ in _WORST_COLUMNS)
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(_fmt(w.get(key), pattern))}</td>"
            for key, _, pattern in _WORST_COLUMNS
        )
        + "</tr>"
        for w in worst
    )
    return f"<h2>Worst sequences (largest summed k3)</h2><table><tr>{head}</tr>{rows}</table>"


def _metadata_tables(doc: dict[str, Any]) -> str:
    """The mismatch by each metadata column the dump has (`mismatch.by_replica`, ...); every
    value escaped: they come from the dump."""
    parts = []
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in METADATA_COLUMNS)
    for column, rows, left in metadata_tables(doc["mismatch"]):
        body = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(metadata_cell(row, key, pattern))}</td>"
                for key, _, pattern in METADATA_COLUMNS
            )
            + "</tr>"
            for row in rows
        )
        more = f"<p class='note'>{left:,} more values in the JSON document.</p>" if left else ""
        parts.append(f"<h3>By {html.escape(column)}</h3><table><tr>{head}</tr>{body}</table>{more}")
    return "<h2>The mismatch by metadata</h2>" + "".join(parts) if parts else ""


def _mismatch_table(doc: dict[str, Any]) -> str:
    m = doc["mismatch"]
    rows = "".join(
        f"<tr><td>{key}</td><td>{_fmt(m.get(key), '{:.4g}')}</td>"
        f"<td>{html.escape(m['definitions'].get(key, ''))}</td>"
        f"<td>{html.escape('; '.join(m['names'].get(key, [])))}</td></tr>"
        for key in _MISMATCH_ROWS
    )
    return (
        "<h2>Mismatch statistics</h2><table><tr><th>statistic</th><th>value</th>"
        f"<th>definition</th><th>logged by the frameworks as</th></tr>{rows}</table>"
    )


_FOLLOW_THEME = """
const dark = matchMedia('(prefers-color-scheme: dark)');
function paint() {
  const ink = dark.matches ? '#e6e6e6' : '#222222';
  for (const fig of document.querySelectorAll('.fig')) Plotly.relayout(fig, {'font.color': ink});
}
paint();
dark.addEventListener('change', paint);
"""
"""The figures' text in the page's ink: their backgrounds are transparent, so they follow the
reader's light or dark system theme with the page, and switch with it."""

STYLE = """\
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
h1 { margin-bottom: 4px; } .meta, .note { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
td.good { background: #dcf1de; } td.fair { background: #f8ecd0; }
td.bad { background: #fddcda; }
.dot { display: inline-block; width: 10px; height: 10px; border-radius: 5px; margin-right: 6px; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(760px, 1fr)); gap: 12px; }
.flags { background: #fff4e5; border: 1px solid #f0b45c; padding: 8px 12px; }
.ok { color: #2a7a2a; }
.verdict { padding: 8px 12px; margin: 8px 0; border: 1px solid; }
.verdict.normal { background: #dcf1de; border-color: #7cc287; }
.verdict.elevated { background: #f8ecd0; border-color: #f0b45c; }
.verdict.broken { background: #fddcda; border-color: #e0807a; }
pre { background: #f6f6f4; padding: 8px 12px; font-size: 12px; overflow-x: auto; }
summary { cursor: pointer; margin: 4px 0; }
:root { color-scheme: light dark; }
@media (prefers-color-scheme: dark) {
  body { background: #0e1117; color: #e6e6e6; }
  .meta, .note { color: #a8a8a8; }
  td, th { border-color: #3a3d44; }
  td.good { background: #1e3d25; } td.fair { background: #4a3b16; }
  td.bad { background: #4d2626; }
  .flags { background: #3b2b12; border-color: #8a6420; }
  .ok { color: #6fcf6f; }
  .verdict.normal { background: #1e3d25; } .verdict.elevated { background: #4a3b16; }
  .verdict.broken { background: #4d2626; }
  pre { background: #1b1e24; }
}
"""
"""The reports' style sheet (`render_html`, and the diff's page in `iscore.present.diffs`): a
light page, dark where the reader's system is."""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>iscore report</title>
<style>
{style}</style>
<script>{plotly}</script></head>
<body>
{body}
<script>{scripts}</script>
</body></html>
"""
