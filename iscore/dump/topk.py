"""The engine's top-k columns (`TOPK_COLUMNS`, docs/distribution.md): their checks as a chunk is
read.

Each token lists k ids (`rollout_topk_ids`, the engine's k most likely), the engine's log-probs of
them (`rollout_topk_logprobs`) and the trainer's (`train_topk_logprobs`), k the same for every
token of a dump; `token_id`, the sampled id, is read beside them where the dump has it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from iscore.dump.columns import TOPK_COLUMNS, ColumnMap
from iscore.dump.schema import column_label
from iscore.errors import Problem, counted

_SHOW_ROWS = 5

SAMPLED_TOLERANCE = 1e-5
"""How far (nats) the sampled token's rollout log-prob may lie from its top-k entry: the two are
one number the engine reports twice, so they differ only by the dump's rounding (float32 keeps
about 7 digits, 1e-5 relative at the log-probs of rare tokens)."""


def topk_problems(
    file: str, per_token: dict[str, pa.Array], rows: np.ndarray, columns: ColumnMap
) -> list[Problem]:
    """Of a chunk (its `file`, `per_token` columns and each token's file row, `rows`): top-k
    lists of another length than its first token's (in any of the three columns), negative ids,
    log-probs that are not finite or above 0, and a sampled token (`token_id`) among its k ids
    whose rollout log-prob is not its entry's. Each is tested on the whole column first; the
    rows are found only where one fails."""
    if not all(name in per_token for name in TOPK_COLUMNS):
        return []
    found: list[tuple[str, np.ndarray, str]] = []
    k = None
    for name in TOPK_COLUMNS:
        n = pc.list_value_length(per_token[name]).fill_null(0).to_numpy(zero_copy_only=False)
        if n.size and k is None:
            k = int(n[0])
        if (n != k).any():
            found.append(
                (name, n != k, f"token whose list is not of {k} entries (k, as the first)")
            )
    if found or not k:
        return _problems(file, rows, columns, found)
    ids = _values(per_token, "rollout_topk_ids", k)
    if ids.min() < 0:
        found.append(("rollout_topk_ids", (ids < 0).any(axis=1), "token with a negative id"))
    for name in TOPK_COLUMNS[1:]:
        x = _values(per_token, name, k)
        if not (x.max() <= 0 and np.isfinite(x.min())):  # a NaN fails the first
            bad = ~(np.isfinite(x) & (x <= 0)).all(axis=1)
            what = "token with a NaN, infinite or positive log-prob (a log-prob is finite, <= 0)"
            found.append((name, bad, what))
    token = per_token.get("token_id")
    if token is not None and not found:
        sampled = token.to_numpy(zero_copy_only=False)[:, None] == ids
        # Each token's entry at its sampled id's place where it is among the k (else at 0).
        flat = np.arange(len(token)) * k + sampled.argmax(axis=1)
        entry = _values(per_token, "rollout_topk_logprobs", k).reshape(-1)[flat]
        rollout = per_token["rollout_logprob"].to_numpy(zero_copy_only=False)
        far = np.abs(entry.astype(np.float64) - rollout) > SAMPLED_TOLERANCE
        bad = sampled.reshape(-1)[flat] & far
        if bad.any():
            what = (
                f"token whose sampled id is among its k but whose rollout_logprob differs from "
                f"its entry by more than {SAMPLED_TOLERANCE:g} (are the ids and log-probs "
                "aligned?)"
            )
            found.append(("rollout_topk_logprobs", bad, what))
    return _problems(file, rows, columns, found)


def _values(per_token: dict[str, pa.Array], name: str, k: int) -> np.ndarray:
    """[tokens, k] numpy of a top-k column whose lists all hold k entries (a view where the
    values allow one)."""
    flat = pc.list_flatten(per_token[name])
    return flat.to_numpy(
        zero_copy_only=flat.null_count == 0 and not pa.types.is_boolean(flat.type)
    ).reshape(-1, k)


def _problems(
    file: str, rows: np.ndarray, columns: ColumnMap, found: list[tuple[str, np.ndarray, str]]
) -> list[Problem]:
    problems = []
    for name, bad, what in found:
        if bad.any():
            hits = np.flatnonzero(bad)
            shown = tuple(dict.fromkeys(int(r) for r in rows[hits[:_SHOW_ROWS]]))
            message = counted(int(hits.size), what, what.replace("token ", "tokens ", 1))
            problems.append(
                Problem(file, column_label(columns, name), message, shown, int(hits.size))
            )
    return problems
