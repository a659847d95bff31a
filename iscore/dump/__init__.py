"""Read canonical logprob dumps (Parquet) into `TokenBatch`es, whole or streamed: `Dump` and
`load` (`facade`), over the files (`files`), their columns (`schema`), the row-group readers
(`readers`) and the Arrow-to-torch conversion (`tensors`); `values` holds the types they
share."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "facade": ["Data", "Dump", "Piece", "check_unique", "load", "load_data", "open_data"],
        "files": ["Location", "is_framework_dump", "resolve_files"],
        "values": ["DEFAULT_CHUNK_TOKENS", "DropReport", "DumpFile", "Extra", "StepRange"],
    },
)
