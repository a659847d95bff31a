"""The only place a dump streams through settings into statistics: `analyze` (`analysis`, into
the document of `document`, part by part: `parts` here, `stored` through the results store,
`tasks` on a Ray cluster or worker processes, `streaming` reading ahead), one setting replayed
(`replay`), the sequence table (`sequences`), `validate` (`validation`), a run followed as it
grows (`follow`), two dumps compared (`diff`), a metric's change between two steps split
into composition and within (`change`) and the results store that keeps what a pass
computed (`results_store`).

Rule: imports every floor below it; nothing here is shown to people (`iscore.present`) or
held for a front end (`iscore.session`).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "analysis": ["Accumulated", "accumulate", "analyze", "parts"],
        "change": ["Why", "why"],
        "diff": ["Diff", "MetricDiff", "diff"],
        "document": ["Analysis"],
        "follow": ["Alert", "Follower", "ready_files"],
        "replay": ["replay", "write_replay"],
        "results_store": ["ResultStore"],
        "sequences": [
            "SequenceTable",
            "TABLES",
            "batch_schema",
            "catalog",
            "read_schema",
            "sequence_table",
            "write_rows",
        ],
        "validation": ["validate"],
    },
)
