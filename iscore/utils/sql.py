"""SQL over iscore's tables with DuckDB, locked down to those tables.

A connection from `connect` is in memory and sees only the Arrow tables and datasets it was
given (registered zero-copy, never round-tripped through pandas) and the views built over them.
After they are registered, external access is disabled and the configuration locked: no
`read_csv`, `read_parquet` or `glob` of other paths, no `COPY`, `ATTACH`, `EXPORT`, `INSTALL`
or `LOAD`, no httpfs, no spilling to a temporary directory. A query must moreover be one
`SELECT` whose tables are the ones offered (or its own CTEs): table functions, other names
and every other kind of statement are refused before DuckDB runs anything (docs/sql.md#safety).

`Predicate` is a `--where` expression: a boolean over the columns of one row, checked once
against the table's schema and then evaluated on any number of tables of that schema.

>>> import pyarrow as pa
>>> t = pa.table({"step": [1, 2, 3], "length": [10, 500, 7000]})
>>> query({"sequences": t}, "SELECT step FROM sequences WHERE length > 100").table.to_pydict()
{'step': [2, 3]}
>>> Predicate.compile("length > 100 AND step < 3", t.schema).mask(t).tolist()
[False, True, False]
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads

from iscore.errors import IscoreError, clip, quote

ROW_LIMIT = 10_000
"""The most rows the app shows of a query."""

TIMEOUT_S = 30.0
"""The longest the app lets a query run."""

_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "temp_directory": "",  # never spill to disk: an in-memory database writes nothing
    "memory_limit": "2GB",
    "threads": 2,
}
"""Settings fixed when a connection opens; `_lock` then disables external access."""

_ROW = "__iscore_row"
"""The row number column a predicate is evaluated with (not a column a predicate may use)."""

TableSource = pa.Table | pads.Dataset
"""What a connection can offer as a table: an Arrow table, or a dataset it scans lazily."""


class QueryError(IscoreError):
    """A query or predicate that is not valid SQL, or not allowed; the message is one line."""


def one_line(text: object) -> str:
    """DuckDB's message on one line, without its "LINE 1: ..." pointer into the SQL."""
    text = str(text).split("\nLINE ")[0]
    return clip(" ".join(line.strip() for line in text.splitlines() if line.strip()), 500)


def connect(
    tables: Mapping[str, TableSource], views: Mapping[str, str] | None = None
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection offering `tables` and `views`, then locked.

    Args:
        tables: name -> Arrow table or dataset, registered zero-copy.
        views: name -> the SELECT defining it (iscore's own text, over `tables`).

    >>> con = connect({"t": pa.table({"x": [1, 2]})})
    >>> con.execute("SELECT sum(x) FROM t").fetchone()
    (3,)
    """
    con = duckdb.connect(":memory:", config=dict(_CONFIG))
    for name, table in tables.items():
        con.register(name, table)
    for name, text in (views or {}).items():
        con.execute(f'CREATE VIEW "{name}" AS {text}')
    _lock(con)
    return con


def _lock(con: duckdb.DuckDBPyConnection) -> None:
    """Disable every way out of the registered tables, for good (DuckDB's own safety
    settings: enable_external_access cannot be turned back on, lock_configuration freezes
    the rest)."""
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _parse(con: duckdb.DuckDBPyConnection, sql: str, what: str) -> dict[str, Any]:
    """The one SELECT statement of `sql`, as DuckDB's parse tree (JSON)."""
    raw = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0]
    tree = json.loads(raw)
    if tree.get("error"):
        message = tree.get("error_message", "not valid SQL")
        if "Only SELECT" in message:
            message = "only a SELECT query may run (no COPY, ATTACH, INSTALL, SET, CREATE, ...)"
        raise QueryError(f"{what}: {one_line(message)}")
    statements = tree["statements"]
    if len(statements) != 1:
        raise QueryError(f"{what}: expected one SELECT statement, found {len(statements)}")
    return statements[0]["node"]


def _is_aggregate(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether DuckDB's catalog has an aggregate function called `name`."""
    query = (
        "SELECT count(*) FROM duckdb_functions() WHERE function_type = 'aggregate' "
        "AND function_name = lower(?)"
    )
    return con.execute(query, [name]).fetchone()[0] > 0


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every dict of a parse tree, depth first."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def tables_of(con: duckdb.DuckDBPyConnection, sql: str, allowed: set[str]) -> set[str]:
    """The tables `sql` reads, after checking that it is one SELECT over `allowed` tables
    (and its own CTEs) and calls no table function.

    Raises:
        QueryError: anything else, naming what is not allowed.
    """
    node = _parse(con, sql, "query")
    ctes = set()
    for item in _walk(node):
        for entry in item.get("cte_map", {}).get("map", []):
            ctes.add(entry["key"])
    used = set()
    offered = ", ".join(sorted(allowed))
    for item in _walk(node):
        kind = item.get("type")
        if kind == "TABLE_FUNCTION":
            call = item.get("function", {}).get("function_name", "a table function")
            raise QueryError(f"query: {call}() is not allowed; the tables are {offered}")
        if kind == "BASE_TABLE":
            name = item["table_name"]
            qualified = item.get("schema_name") or item.get("catalog_name")
            if qualified or (name not in allowed and name not in ctes):
                raise QueryError(
                    f"query: no table {quote('.'.join(item['qualified_name']['path']))}; "
                    f"the tables are {offered}"
                )
            if name not in ctes:
                used.add(name)
    return used


@dataclass(frozen=True, slots=True)
class Result:
    """A query's rows.

    Attributes:
        table: the rows, at most the limit asked for.
        truncated: whether the query had more rows than that.
    """

    table: pa.Table
    truncated: bool


@contextmanager
def _deadline(con: duckdb.DuckDBPyConnection, timeout: float | None) -> Iterator[None]:
    """Interrupt what `con` runs once `timeout` seconds have passed."""
    timer = None if timeout is None else threading.Timer(timeout, con.interrupt)
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    except duckdb.InterruptException:
        raise QueryError(f"query: stopped after {timeout:g} s (the time limit)") from None
    finally:
        if timer is not None:
            timer.cancel()


def _run_error(e: duckdb.Error) -> QueryError:
    return QueryError(f"query: {one_line(e)}")


def query(
    tables: Mapping[str, TableSource],
    sql: str,
    *,
    views: Mapping[str, str] | None = None,
    limit: int | None = None,
    timeout: float | None = None,
) -> Result:
    """Run one SELECT over `tables` (and `views`) on a fresh locked connection.

    Args:
        tables: name -> Arrow table or dataset.
        sql: the query.
        views: name -> iscore's SELECT defining it; only those the query names are created.
        limit: the most rows returned (`Result.truncated` says whether there were more).
        timeout: seconds after which the query is stopped.

    Raises:
        QueryError: the query is not valid, not allowed, fails or runs out of time; one line
            with DuckDB's message.
    """
    with open_query(tables, sql, views=views, timeout=timeout) as relation:
        try:
            if limit is None:
                return Result(relation.to_arrow_table(), False)
            table = relation.limit(limit + 1).to_arrow_table()
        except duckdb.InterruptException:
            raise
        except duckdb.Error as e:
            raise _run_error(e) from e
    return Result(table.slice(0, limit), table.num_rows > limit)


@contextmanager
def open_query(
    tables: Mapping[str, TableSource],
    sql: str,
    *,
    views: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Iterator[duckdb.DuckDBPyRelation]:
    """The checked query as a lazy DuckDB relation (stream it with `to_arrow_reader`), on a
    fresh locked connection closed when the block ends; see `query`."""
    sql = sql.strip().rstrip(";").strip()
    if not sql:
        raise QueryError("query: empty; expected a SELECT over " + ", ".join(tables))
    views = views or {}
    used = referenced(sql, set(tables) | set(views))
    con = connect(tables, {name: text for name, text in views.items() if name in used})
    try:
        with _deadline(con, timeout):
            try:
                relation = con.sql(sql)
            except duckdb.InterruptException:
                raise
            except duckdb.Error as e:
                raise _run_error(e) from e
            yield relation
    finally:
        con.close()


@dataclass(frozen=True, slots=True)
class Predicate:
    """A boolean SQL expression over the columns of one row of a table (`--where`).

    Attributes:
        text: the expression as given.
        columns: the columns it reads.
        schema: the table schema it was checked against.
    """

    text: str
    columns: frozenset[str]
    schema: pa.Schema = field(repr=False)

    @classmethod
    def compile(
        cls,
        text: str,
        schema: pa.Schema,
        *,
        hint: str = "",
        flag: str = "--where",
        unit: str = "sequence",
    ) -> Predicate:
        """Check `text` against `schema`: one boolean expression over its columns, with no
        subquery, aggregate or window function (each row is judged on its own).

        Args:
            text: the expression, e.g. `length > 4000 AND reward = 1`.
            schema: the columns it may use.
            hint: added to the message naming an unknown column.
            flag: the option the messages name (`--where`, `--alert`).
            unit: what a row is, in the messages ("sequence", "step").

        Raises:
            QueryError: one line saying what is wrong, with DuckDB's message.

        >>> Predicate.compile("k3 > 1e-3", pa.schema([("k3", pa.float64())])).columns
        frozenset({'k3'})
        """
        if not text.strip():
            raise QueryError(f"{flag}: empty; expected a boolean expression such as step > 200")
        # Where --sql answers what a predicate cannot (the sequence table's questions).
        across = " (use --sql for questions across sequences)" if flag == "--where" else ""
        grouped = (
            " (use --sql with GROUP BY for questions across sequences)" if flag == "--where" else ""
        )
        empty = schema.empty_table()
        con = connect({"sequences": empty})
        try:
            node = _parse(con, f"SELECT * FROM sequences WHERE {text}", flag)
            extra = (
                node.get("type") != "SELECT_NODE"
                or node.get("modifiers")
                or node.get("group_expressions")
                or node.get("having")
                or node.get("qualify")
                or node.get("sample")
                or node.get("cte_map", {}).get("map")
                or node.get("from_table", {}).get("table_name") != "sequences"
            )
            if extra:
                raise QueryError(f"{flag}: expected one boolean expression, but got {quote(text)}")
            columns = set()
            for item in _walk(node["where_clause"]):
                if item.get("class") in ("SUBQUERY", "WINDOW"):
                    what = "a subquery" if item["class"] == "SUBQUERY" else "a window function"
                    raise QueryError(
                        f"{flag}: {what} is not allowed; a predicate judges each {unit} "
                        f"on its own values{across}"
                    )
                if item.get("class") == "FUNCTION" and _is_aggregate(con, item["function_name"]):
                    # DuckDB's parser names count(*) count_star.
                    name = {"count_star": "count(*)"}.get(
                        item["function_name"], item["function_name"]
                    )
                    raise QueryError(
                        f"{flag}: an aggregate ({name}) is not allowed; a "
                        f"predicate judges each {unit} on its own values{grouped}"
                    )
                if item.get("class") == "COLUMN_REF":
                    columns.add(item["column_names"][-1])
            unknown = sorted(columns - set(schema.names))
            if unknown:
                raise QueryError(
                    f"{flag}: no column {', '.join(map(quote, unknown))}; the columns are "
                    f"{', '.join(schema.names)}{hint}"
                )
            try:
                kind = con.sql(f"SELECT ({text}) AS keep FROM sequences").types[0]
                con.execute(f"SELECT * FROM sequences WHERE {text}").fetchall()
            except duckdb.Error as e:
                raise QueryError(f"{flag}: {one_line(e)}") from e
            if str(kind) not in ("BOOLEAN", '"NULL"', "NULL"):
                raise QueryError(
                    f"{flag}: expected a boolean expression, but {quote(text)} is {kind}"
                )
        finally:
            con.close()
        return cls(text, frozenset(columns), schema)

    def evaluator(self) -> Evaluator:
        """An evaluator of the predicate on many tables, with its own connection (use it in
        one thread; close it, or use it as a context manager)."""
        return Evaluator(self, connect({"sequences": self.schema.empty_table()}))

    def mask(self, table: pa.Table) -> np.ndarray:
        """bool [rows]: where the predicate holds (NULL counts as false, as in WHERE)."""
        with self.evaluator() as evaluator:
            return evaluator.mask(table)


@dataclass(slots=True)
class Evaluator:
    """A `Predicate` with a connection to evaluate it on: see `Predicate.evaluator`."""

    predicate: Predicate
    con: duckdb.DuckDBPyConnection

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.con.close()

    def mask(self, table: pa.Table) -> np.ndarray:
        """bool [rows] of `table`, which holds (at least) the columns the predicate reads."""
        rows = table.append_column(_ROW, pa.array(np.arange(table.num_rows, dtype=np.int64)))
        self.con.register("sequences", rows)
        try:
            kept = self.con.execute(
                f"SELECT {_ROW} FROM sequences WHERE {self.predicate.text}"
            ).fetchnumpy()[_ROW]
        except duckdb.Error as e:
            raise QueryError(f"--where: {one_line(e)}") from e
        finally:
            self.con.unregister("sequences")
        keep = np.zeros(table.num_rows, dtype=bool)
        keep[np.asarray(kept, dtype=np.int64)] = True
        return keep


def referenced(sql: str, allowed: set[str]) -> set[str]:
    """The tables of `allowed` that query `sql` reads (see `tables_of`), on a throwaway
    connection."""
    con = connect({})
    try:
        return tables_of(con, sql, allowed)
    finally:
        con.close()
