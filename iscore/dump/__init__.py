"""The dump format and every way in and out: `Dump` and `load` read canonical Parquet into
`TokenBatch`es, whole or streamed (`facade`), over its files (`files`), their columns
(`columns`, `schema`), the row-group readers (`readers`) and the Arrow-to-torch conversion
(`tensors`), with the values they share (`values`); `--where` selects sequences chunk by chunk
(`where`); a file's columns are previewed for mapping them (`preview`); `DumpWriter` writes the
format from a training loop (`writer`), in a run's per-step files (`stepfiles`); the
frameworks' own dumps are converted (`importers`); `simulate` writes dumps of known truth.

Rule: imports `iscore.frameworks`, `iscore.packed` and `iscore.utils` below it, never its
sibling `iscore.stats`; computes no statistic.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["importers"],
    submod_attrs={
        "columns": ["TOPK_COLUMNS", "dump_schema", "parse_mapping"],
        "facade": ["Data", "Dump", "Piece", "check_unique", "load", "load_data", "open_data"],
        "files": ["Location", "is_framework_dump", "resolve_files"],
        "importers": ["FORMATS", "PICKLED", "SUFFIXES", "convert"],
        "preview": ["Preview", "ROWS", "preview_parquet", "preview_table"],
        "simulate": [
            "BROKEN_FROM_SHARE",
            "REGIMES",
            "SimConfig",
            "read_truth",
            "write_run",
            "write_simulated",
        ],
        "stepfiles": ["describe_runs"],
        "values": ["DEFAULT_CHUNK_TOKENS", "DropReport", "DumpFile", "Extra", "StepRange"],
        "where": ["Where", "sequence_rows"],
        "writer": ["DumpWriter", "PROVENANCE_KEY", "is_tensor"],
    },
)
