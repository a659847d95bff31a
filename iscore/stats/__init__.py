"""The streaming accumulators: the mismatch diagnostics (`mismatch`, over its per-token terms,
`token_terms`, its buckets, `buckets`, and its worst sequences and tokens, `worst`), what one
setting does to a dump (`setting`), what the attribution needs (`attribution`), the noise of a
step (`noise`), mergeable histograms (`histogram`), intervals by resampling sequences
(`bootstrap`), the token mix of two steps with a metric in each of its bins (`mix`) and the
sums three bug signatures are judged on (`signatures`). Each has `update` (a chunk), `merge`,
`state` / `from_state` (what a results store keeps) and `compute` (`mix`, read in one pass,
only `update` and `compute`). The statistics by name
(`catalogue`) and the columns each setting gets in a table (`columns`) are here too.

Rule: never reads a file and never decides; imports `iscore.frameworks`, `iscore.packed` and
`iscore.utils` below it, never its sibling `iscore.dump`.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["noise"],
    submod_attrs={
        "bootstrap": [
            "LEVEL",
            "RESAMPLES",
            "SEED",
            "Interval",
            "counts",
            "mismatch_sum_columns",
            "mismatch_from_sums",
            "percentile_interval",
            "resample_rows",
            "setting_from_sums",
            "setting_sum_columns",
        ],
        "attribution": [
            "AttributionNumbers",
            "AttributionStats",
            "CLIP",
            "SPAN_RATIO",
            "TURN_TOKENS",
            "WINDOW",
        ],
        "catalogue": ["BANDS", "DEFINITIONS", "METRIC_NAMES"],
        "columns": ["SETTING_STATISTICS", "setting_columns"],
        "histogram": ["BINS_PER_DECADE", "LOG10_RANGE"],
        "metadata": ["MetadataStats", "MetadataSummary", "TokenIds"],
        "mix": [
            "FactorTable",
            "MixStats",
            "ORDERED",
            "PROB_EDGES_FINE",
            "SHIFT_METRICS",
            "bins_by_value",
        ],
        "mismatch": [
            "MismatchStats",
            "MismatchSummary",
            "broken_sequences",
            "floor_scalars",
            "mismatch_scalars",
            "retention",
            "RETENTION_BANDS",
        ],
        "noise": [
            "BIN_SAMPLE",
            "BROKEN_WORDS",
            "Baseline",
            "FAR",
            "MAD_SD",
            "Noise",
            "SCALE_EDGES",
            "SPREAD_FLOOR",
            "SUSTAIN_STEPS",
            "early_steps",
            "first_rise",
            "outside",
            "ratio_bias",
        ],
        "setting": [
            "BROKEN_KEPT",
            "SettingNumbers",
            "SettingStats",
            "SettingSummary",
            "TRUNCATION_TOLERANCE",
            "aggregation_of",
            "quick_stats",
            "setting_scalars",
        ],
        "signatures": ["PositionScan", "SignatureStats", "SignatureSummary", "ZERO_TRAIN_EDGES"],
        "worst": ["TOP_K"],
    },
)
