"""Every decision, made once and carried as data: the mismatch flags (`flags`), where the
mismatch comes from (`attribution`), the health verdict (`health`) against published reference
values (`reference`), the targets a setting is held to and each statistic's grade
(`targets`), the recommendation of a setting (`recommendation`, over the thresholds placed on
the data, `thresholds`, its candidates, `candidates`, the objective they are ranked by,
`objective`, and the words, `explain`), threshold tuning (`tuning`), export between frameworks
(`conversion`), a run's trend and its events (`trend`) and the verdicts on two dumps compared
(`comparison`), the bars a dump is gated by (`gates`), and a metric's change between two steps
split into composition and within (`shift`); three bug signatures among the flags
(`signatures`).

Rule: reads statistics and dumps from the floors below (`iscore.stats`, `iscore.dump` and
down); never streams a dump through settings into statistics (`iscore.passes` does).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["tuning"],
    submod_attrs={
        "attribution": ["Attribution", "Finding", "attribute"],
        "candidates": ["RULE_SYMBOLS"],
        "comparison": [
            "DISTRIBUTION_METRICS",
            "METRICS",
            "MISMATCH_METRICS",
            "SETTING_METRICS",
            "VERDICTS",
            "Metric",
            "Verdict",
            "verdict",
        ],
        "conversion": ["Syntax", "export", "snippet", "to_file_text"],
        "gates": [
            "GATED",
            "TABLES",
            "Bound",
            "Check",
            "Table",
            "gated_values",
            "judge",
            "parse_bound",
            "read_table",
        ],
        "flags": ["FLAG_KINDS", "Flag", "NO_SEMANTICS_BUG", "find_flags", "flags_of"],
        "health": ["Floor", "Health", "assess", "assess_values", "floor_of", "whole_distribution"],
        "metadata": ["Standout", "metadata_flags", "standouts"],
        "recommendation": ["Recommendation", "recommend"],
        "signatures": ["signature_flags"],
        "reference": ["point_dict", "points"],
        "shift": [
            "BinShift",
            "FactorShift",
            "Moved",
            "best_factor",
            "share_of",
            "shift_share",
            "split_sentence",
        ],
        "targets": ["Targets"],
        "trend": ["EVENT_KINDS", "Event", "GrowingTrend", "Trend", "default_alert"],
        "tuning": [
            "FAMILIES",
            "TuneResult",
            "Tuner",
            "family_of",
            "family_spec",
            "frameworks_for",
            "grid",
            "query",
        ],
    },
)
