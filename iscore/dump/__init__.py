"""Read canonical logprob dumps (Parquet) into `TokenBatch`es, whole or streamed: `Dump` and
`load` (`facade`), over the files (`files`), their columns (`schema`), the row-group readers
(`readers`) and the Arrow-to-torch conversion (`tensors`); `values` holds the types they
share."""

from iscore.budget import DEFAULT_CHUNK_TOKENS
from iscore.dump.facade import Data, Dump, Piece, check_unique, load, load_data, open_data
from iscore.dump.files import Source, is_framework_dump, resolve_files
from iscore.dump.values import DropReport, DumpFile, Extra, StepRange
from iscore.errors import DumpProblems, Problem

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "Data",
    "DropReport",
    "Dump",
    "DumpFile",
    "DumpProblems",
    "Extra",
    "Piece",
    "Problem",
    "Source",
    "StepRange",
    "check_unique",
    "is_framework_dump",
    "load",
    "load_data",
    "open_data",
    "resolve_files",
]
