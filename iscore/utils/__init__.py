"""Plumbing that knows nothing of log-probs: object-storage URIs (`storage`), listing the files
a path names and the cache folder (`paths`), safe output files and the JSON boundary
(`output`), Parquet footers checked before pyarrow reads them (`footer`), Arrow arrays as
bytes (`arrow_ipc`), the locked-down DuckDB (`sql`) and the fan-out over a Ray cluster
(`distributed`) or this machine's cores (`workers`).

Rule: imports nothing of iscore but `iscore.errors`.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submodules=["footer", "paths", "storage"],
    submod_attrs={
        "arrow_ipc": ["from_ipc", "to_ipc"],
        "distributed": ["ENGINES", "Engine", "Ready", "check_engine", "connect", "ordered"],
        "footer": ["Passed"],
        "output": ["check_output", "json_ready", "output_path", "write_json"],
        "paths": ["default_folder", "list_files"],
        "workers": ["WORKER_ENV", "cores", "default_jobs", "ordered_here"],
        "sql": [
            "Evaluator",
            "Predicate",
            "QueryError",
            "ROW_LIMIT",
            "Result",
            "TIMEOUT_S",
            "TableSource",
            "one_line",
            "open_query",
            "query",
            "referenced",
        ],
    },
)
