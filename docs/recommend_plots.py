"""Draw docs/img/recommend-<regime>.svg: each sequence's e^G against its length, the sequences
`iscore recommend` calls broken, and the e^G band it places for a geometric mask, on simulated
dumps of each regime; and print docs/recommend.md's table of each framework's pick on the same
dumps.

Run from the repository root: `python docs/recommend_plots.py` (plain SVG, no plotting library).
"""

from __future__ import annotations

import math
import tempfile
from html import escape
from pathlib import Path

import numpy as np

from iscore import TokenBatch, load, recommend
from iscore.advice import Recommendation
from iscore.dump import SimConfig, write_simulated
from iscore.frameworks import NAMES
from iscore.packed import ops
from iscore.stats import broken_sequences

W, H, PAD = 640, 360, 56
REGIMES = {
    "benign": ("dense_bf16", {"sequences": 96, "median_len": 300}, 11),
    "broken": ("dense_bf16", {"sequences": 100, "median_len": 300, "broken_share": 0.04}, 21),
    "long": ("long_collapse", {"sequences": 64}, 3),
    "offset": ("offset_bug", {"sequences": 64, "median_len": 300}, 31),
    "drift": ("drift", {"sequences": 24, "steps": 6, "median_len": 200}, 32),
}


def _tag(name: str, text: str = "", **attributes: object) -> str:
    attrs = " ".join(f'{k.rstrip("_").replace("_", "-")}="{v}"' for k, v in attributes.items())
    return f"<{name} {attrs}>{escape(text)}</{name}>" if text else f"<{name} {attrs}/>"


def _svg(title: str, lengths: np.ndarray, ratio: np.ndarray, broken: np.ndarray, band, pick: str):
    x = np.log10(np.maximum(lengths, 1))
    lo, hi = min(ratio.min(), band[0]), max(ratio.max(), band[1])
    margin = 0.1 * (hi - lo or 1.0)
    lo, hi = lo - margin, hi + margin
    x_max = max(float(x.max()), 1.0) * 1.05

    def px(v: float) -> float:
        return PAD + v / x_max * (W - 2 * PAD)

    def py(v: float) -> float:
        return H - PAD - (v - lo) / (hi - lo) * (H - 2 * PAD)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        _tag("rect", width="100%", height="100%", fill="white"),
        _tag("text", title, x=PAD, y=22, font_size=14),
        _tag("text", f"pick for verl: {pick}", x=PAD, y=40, fill="#555"),
        _tag(
            "rect",
            x=PAD,
            y=f"{py(band[1]):.1f}",
            width=W - 2 * PAD,
            height=f"{py(band[0]) - py(band[1]):.1f}",
            fill="#2ca02c",
            opacity=0.15,
        ),
        _tag(
            "text",
            f"kept: e^G in [{band[0]:g}, {band[1]:g}]",
            x=PAD + 4,
            y=f"{py(band[1]) - 4:.1f}",
            fill="#2ca02c",
        ),
        _tag("line", x1=PAD, y1=H - PAD, x2=W - PAD, y2=H - PAD, stroke="#333"),
        _tag("line", x1=PAD, y1=PAD, x2=PAD, y2=H - PAD, stroke="#333"),
        _tag(
            "text", "sequence length (tokens, log scale)", x=W / 2, y=H - 18, text_anchor="middle"
        ),
        _tag("text", "e^G", x=PAD - 6, y=PAD - 8, text_anchor="end"),
    ]
    for decade in range(math.floor(x_max) + 1):
        parts.append(_tag("text", f"1e{decade}", x=f"{px(decade):.1f}", y=H - PAD + 16,
                          text_anchor="middle"))  # fmt: skip
    for v in (lo + margin, (lo + hi) / 2, hi - margin):
        parts.append(_tag("text", f"{v:.4g}", x=PAD - 6, y=f"{py(v):.1f}", text_anchor="end"))
    for xi, yi, b in zip(x, ratio, broken, strict=True):
        parts.append(_tag("circle", cx=f"{px(xi):.1f}", cy=f"{py(yi):.1f}", r=3,
                          fill="#d62728" if b else "#1f77b4", opacity=0.7))  # fmt: skip
    return "\n".join([*parts, "</svg>"])


def _geometric(batch: TokenBatch) -> tuple[np.ndarray, np.ndarray]:
    """Loss tokens and e^G per sequence."""
    m = batch.loss_mask
    T = ops.segment_count(batch, m).double()
    S = ops.segment_sum(ops.log_ratio(batch).double(), batch, m)
    return T.numpy(), np.exp((S / T.clamp(min=1)).numpy())


def _cell(rec: Recommendation) -> str:
    """A framework's pick on one dump, for the table."""
    best, s = rec.best, rec.best.stats
    name = f"keep default ({best.spec.name})" if best.kind == "default" else best.kind
    cap = "" if best.kind == "default" else f" {rec.thresholds['token_cap']:g}"
    text = (
        f"{name}{cap if 'token_tis' in best.kind else ''}{'' if best.passes else ' (misses)'}: "
        f"objective {s['objective']:.4f}, tok {s['token_masked_fraction']:.2%}, "
        f"seq {s['seq_masked_fraction']:.1%}, LR {s['lr_scale']:.3f}, ESS {s['ess']:.0%}"
    )
    if rec.thresholds["broken_sequences"]:
        text += (
            f", broken kept {s['broken_gradient_kept']:.0%}, "
            f"healthy seqs dropped {s['healthy_seq_dropped']:.1%}"
        )
    return text


def main() -> None:
    out = Path(__file__).parent / "img"
    out.mkdir(exist_ok=True)
    cells: dict[str, list[str]] = {framework: [] for framework in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (regime, config, seed) in REGIMES.items():
            path = Path(tmp) / f"{name}.parquet"
            write_simulated(path, SimConfig(regime=regime, seed=seed, **config))
            batch = load(path)
            rec = recommend(batch, "verl")
            lengths, ratio = _geometric(batch)
            broken = broken_sequences(batch)
            has = lengths > 0
            title = f"{name}: {int(broken.sum())} broken of {int(has.sum())} sequences"
            band = rec.thresholds["geometric_band"]
            svg = _svg(title, lengths[has], ratio[has], broken[has], band, rec.best.kind)
            (out / f"recommend-{name}.svg").write_text(svg)
            print(f"wrote docs/img/recommend-{name}.svg")
            for framework in NAMES:
                cells[framework].append(_cell(recommend(batch, framework)))
    print("\n| framework | " + " | ".join(REGIMES) + " |")
    print("|---" * (len(REGIMES) + 1) + "|")
    for framework, row in cells.items():
        print(f"| {framework} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
