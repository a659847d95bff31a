"""The locked-down DuckDB connection, checked queries and `--where` predicates
(iscore/utils/sql.py): results against numpy, and every way out of the offered tables refused, by
iscore's check and by DuckDB's own lock."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from iscore.utils.sql import Predicate, QueryError, connect, query, referenced

RNG = np.random.default_rng(7)
N = 500
TABLE = pa.table(
    {
        "step": RNG.integers(0, 5, N),
        "seq_id": np.arange(N),
        "length": RNG.integers(1, 9000, N),
        "k3": RNG.exponential(1e-3, N),
        "reward": pa.array(RNG.integers(0, 2, N).astype(float), mask=RNG.random(N) < 0.1),
    }
)


def test_query_results_match_numpy() -> None:
    got = query(
        {"sequences": TABLE},
        "SELECT step, count(*) AS n, avg(k3) AS k3 FROM sequences WHERE length > 4000 "
        "GROUP BY step ORDER BY step",
    ).table.to_pydict()
    step, length, k3 = (TABLE[c].to_numpy() for c in ("step", "length", "k3"))
    long = length > 4000
    steps = np.unique(step[long])
    assert got["step"] == steps.tolist()
    assert got["n"] == [int((long & (step == s)).sum()) for s in steps]
    expected = [float(np.mean(k3[long & (step == s)])) for s in steps]
    np.testing.assert_allclose(got["k3"], expected, rtol=1e-12)


def test_row_limit_keeps_order_and_says_truncated() -> None:
    sql = "SELECT seq_id FROM sequences ORDER BY k3 DESC"
    order = np.argsort(-TABLE["k3"].to_numpy(), kind="stable")
    result = query({"sequences": TABLE}, sql, limit=10)
    assert result.truncated
    assert result.table["seq_id"].to_pylist() == order[:10].tolist()
    assert not query({"sequences": TABLE}, sql, limit=N).truncated


def test_ctes_and_views_are_allowed() -> None:
    sql = "WITH big AS (SELECT * FROM sequences WHERE length > 100) SELECT count(*) FROM big"
    expected = int((TABLE["length"].to_numpy() > 100).sum())
    assert query({"sequences": TABLE}, sql).table.column(0).to_pylist() == [expected]
    views = {"long": "SELECT * FROM sequences WHERE length > 4000"}
    got = query({"sequences": TABLE}, "SELECT count(*) FROM long", views=views)
    assert got.table.column(0).to_pylist() == [int((TABLE["length"].to_numpy() > 4000).sum())]


def test_a_slow_query_is_stopped_at_the_time_limit() -> None:
    sql = (
        "SELECT count(*) FROM sequences a, sequences b, sequences c, sequences d "
        "WHERE a.k3 + b.k3 + c.k3 + d.k3 > 1"
    )
    with pytest.raises(QueryError, match=r"stopped after 0.5 s"):
        query({"sequences": TABLE}, sql, timeout=0.5)


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELECT * FROM read_csv('{file}')", "read_csv() is not allowed"),
        ("SELECT * FROM read_parquet('{file}')", "read_parquet() is not allowed"),
        ("SELECT * FROM read_text('{file}')", "read_text() is not allowed"),
        ("SELECT * FROM glob('/etc/*')", "glob() is not allowed"),
        ("SELECT * FROM '{file}'", "no table"),
        ("SELECT * FROM duckdb_settings()", "duckdb_settings() is not allowed"),
        ("SELECT * FROM memory.main.sequences", "no table 'memory.main.sequences'"),
        ("SELECT * FROM other", "no table 'other'; the tables are sequences"),
        ("COPY sequences TO '{out}'", "only a SELECT query may run"),
        ("COPY (SELECT 1) TO '{out}' (FORMAT csv)", "only a SELECT query may run"),
        ("ATTACH '{out}' AS x", "only a SELECT query may run"),
        ("EXPORT DATABASE '{dir}'", "only a SELECT query may run"),
        ("INSTALL httpfs", "only a SELECT query may run"),
        ("LOAD httpfs", "only a SELECT query may run"),
        ("SET enable_external_access = true", "only a SELECT query may run"),
        ("CREATE TABLE x AS SELECT 1", "only a SELECT query may run"),
        ("SELECT 1; COPY sequences TO '{out}'", "only a SELECT query may run"),
        ("SELECT 1; SELECT 2", "expected one SELECT statement, found 2"),
        ("SELEC 1", "syntax error"),
        ("", "empty"),
    ],
)
def test_only_a_select_over_the_offered_tables_runs(tmp_path, sql, message) -> None:
    secret = tmp_path / "secret.parquet"
    pq.write_table(TABLE, secret)
    out = tmp_path / "out.csv"
    text = sql.format(file=secret, out=out, dir=tmp_path / "export")
    with pytest.raises(QueryError) as caught:
        query({"sequences": TABLE}, text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.parquet"]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('{file}')",
        "SELECT * FROM read_parquet('{secret}')",
        "SELECT * FROM '{secret}'",
        "COPY sequences TO '{out}'",
        "ATTACH '{out}' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SELECT * FROM read_parquet('https://example.invalid/x.parquet')",
    ],
)
def test_the_connection_itself_refuses_files_and_extensions(tmp_path, sql) -> None:
    # Below iscore's own check: DuckDB's external access is off and its configuration locked.
    secret = tmp_path / "secret.parquet"
    pq.write_table(TABLE, secret)
    (tmp_path / "a.csv").write_text("x\n1\n")
    con = connect({"sequences": TABLE})
    text = sql.format(file=tmp_path / "a.csv", secret=secret, out=tmp_path / "out.csv")
    with pytest.raises(duckdb.Error, match="disabled"):
        con.execute(text).fetchall()
    assert not (tmp_path / "out.csv").exists()


def test_the_lock_cannot_be_undone() -> None:
    con = connect({"sequences": TABLE})
    for setting in (
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "SET autoinstall_known_extensions = true",
        "SET temp_directory = '/tmp/x'",
    ):
        with pytest.raises(duckdb.Error, match=r"locked|Cannot change"):
            con.execute(setting)
    settings = dict(
        con.execute(
            "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
            "'lock_configuration', 'autoload_known_extensions', 'temp_directory')"
        ).fetchall()
    )
    assert settings == {
        "enable_external_access": "false",
        "lock_configuration": "true",
        "autoload_known_extensions": "false",
        "temp_directory": "",
    }
    assert con.execute("SELECT count(*) FROM sequences").fetchone() == (N,)


def test_referenced_tables() -> None:
    allowed = {"sequences", "tokens"}
    assert referenced("SELECT * FROM sequences", allowed) == {"sequences"}
    sql = "WITH t AS (SELECT * FROM tokens) SELECT * FROM t JOIN sequences USING (seq_id)"
    assert referenced(sql, allowed) == {"sequences", "tokens"}
    sql = "SELECT * FROM sequences WHERE seq_id IN (SELECT seq_id FROM tokens WHERE d > 1)"
    assert referenced(sql, allowed) == {"sequences", "tokens"}


def reference_mask(text: str) -> np.ndarray:
    """The rows where each predicate of `test_predicate_mask` holds, from numpy."""
    step, length, k3 = (TABLE[c].to_numpy() for c in ("step", "length", "k3"))
    reward = TABLE["reward"].to_numpy(zero_copy_only=False)  # NaN where null
    return {
        "length > 4000": length > 4000,
        "step >= 2 AND k3 < 1e-3": (step >= 2) & (k3 < 1e-3),
        "reward = 1": reward == 1,  # null is not 1
        "NOT (reward = 1)": reward == 0,  # NOT null is null: false
        "reward IS NULL OR length BETWEEN 10 AND 20": np.isnan(reward)
        | ((length >= 10) & (length <= 20)),
        "seq_id IN (3, 5, 400)": np.isin(np.arange(N), [3, 5, 400]),
        "sqrt(k3) > 0.05 AND length % 2 = 0": (np.sqrt(k3) > 0.05) & (length % 2 == 0),
    }[text]


@pytest.mark.parametrize(
    "text",
    [
        "length > 4000",
        "step >= 2 AND k3 < 1e-3",
        "reward = 1",
        "NOT (reward = 1)",
        "reward IS NULL OR length BETWEEN 10 AND 20",
        "seq_id IN (3, 5, 400)",
        "sqrt(k3) > 0.05 AND length % 2 = 0",
    ],
)
def test_predicate_mask(text) -> None:
    predicate = Predicate.compile(text, TABLE.schema)
    expected = reference_mask(text)
    assert expected.any() and not expected.all()
    np.testing.assert_array_equal(predicate.mask(TABLE), expected)
    # Judged on any table with the columns it reads, chunk by chunk.
    with predicate.evaluator() as evaluator:
        parts = [evaluator.mask(TABLE.slice(a, 100)) for a in range(0, N, 100)]
    np.testing.assert_array_equal(np.concatenate(parts), expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lenght > 3", "no column 'lenght'; the columns are step, seq_id, length, k3, reward"),
        ("length", "expected a boolean expression, but 'length' is BIGINT"),
        ("sum(length) > 3", "an aggregate (sum) is not allowed; a predicate judges each sequence"),
        ("AVG(k3) > 0", "an aggregate (avg) is not allowed"),
        ("abs(k3) > 0 AND max(length) > 1", "an aggregate (max) is not allowed"),
        ("k3 > (SELECT avg(k3) FROM sequences)", "a subquery is not allowed"),
        ("seq_id IN (SELECT seq_id FROM tokens)", "a subquery is not allowed"),
        ("row_number() OVER () < 10", "a window function is not allowed"),
        ("true) FROM sequences UNION SELECT (1", "syntax error"),
        ("true UNION SELECT * FROM sequences", "expected one boolean expression"),
        ("length > 1 LIMIT 1", "expected one boolean expression"),
        ("length > 1 GROUP BY step", "expected one boolean expression"),
        ("length > 1 ORDER BY k3", "expected one boolean expression"),
        ("1 = 1; COPY sequences TO 'x.csv'", "only a SELECT query may run"),
        ("length > 'abc'", "Could not convert string 'abc'"),
        ("  ", "empty"),
    ],
)
def test_predicate_errors_are_one_line(text, message) -> None:
    with pytest.raises(QueryError) as caught:
        Predicate.compile(text, TABLE.schema).mask(TABLE)
    assert message in str(caught.value)
    assert str(caught.value).startswith("--where: ")
    assert "\n" not in str(caught.value)
    assert "__iscore_row" not in str(caught.value)


def test_predicate_reads_only_its_columns() -> None:
    predicate = Predicate.compile("length > 4000 AND sequences.step = 2", TABLE.schema)
    assert predicate.columns == {"length", "step"}
    narrow = TABLE.select(["step", "length"])
    expected = (TABLE["length"].to_numpy() > 4000) & (TABLE["step"].to_numpy() == 2)
    np.testing.assert_array_equal(predicate.mask(narrow), expected)
