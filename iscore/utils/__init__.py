"""Plumbing that knows nothing of log-probs: object-storage URIs (`storage`), listing the
files a path names (`paths`), safe output files and the JSON boundary (`output`), Parquet
footers checked before pyarrow reads them (`footer`), the locked-down DuckDB (`sql`) and the fan-out
over a Ray cluster (`distributed`).

Rule: imports nothing of iscore but `iscore.errors`.
"""
