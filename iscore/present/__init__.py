"""Results into things people read, computing nothing new: figures as plotly JSON specs
(`figures`), the HTML report (`report`), a diff's rows and its HTML page (`diffs`),
TensorBoard scalars (`scalars`) and the specs of the tables every surface draws (`tables`).

Rule: imports the floors below it, never its sibling `iscore.session`; no streamlit, and
plotly only as its JSON format.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["figures"],
    submod_attrs={
        "diffs": [
            "GRADES",
            "MISMATCH",
            "DiffRow",
            "diff_figure",
            "diff_rows",
            "render_diff_html",
            "step_rows",
            "write_diff_html",
        ],
        "figures": ["color", "setting_name"],
        "report": ["render_html", "write_html"],
        "scalars": ["ScalarWriter"],
        "tables": ["METADATA_COLUMNS", "SUMMARY_COLUMNS", "metadata_cell", "metadata_tables"],
    },
)
