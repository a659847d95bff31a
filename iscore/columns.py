"""The canonical dump's columns, the frameworks' names for them, and how a file's columns map.

A dump holds one row per token (token layout) or one row per sequence with equal-length
list columns (sequence layout). Columns are found by their canonical name first, then by
the names the RL frameworks use for the same quantity (see `ALIASES`); an explicit
mapping overrides both.

>>> resolve_columns(["seq_id", "rollout_log_probs", "old_log_probs"], {}, "a.parquet").source
{'seq_id': 'seq_id', 'rollout_logprob': 'rollout_log_probs', 'train_logprob': 'old_log_probs'}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from difflib import get_close_matches

import pyarrow as pa

from iscore.errors import DumpError, quote

REQUIRED = ("seq_id", "rollout_logprob", "train_logprob")
"""Columns every dump must have (in sequence layout `seq_id` defaults to the row number)."""

LOGPROB_COLUMNS = ("rollout_logprob", "train_logprob", "policy_logprob")
"""Log-probability columns: finite and <= 0 in a valid dump."""

PER_TOKEN = ("pos", "rollout_logprob", "train_logprob", "policy_logprob", "loss_mask")
"""Per-token columns the engine reads; in sequence layout they are list columns."""

PER_SEQUENCE = ("seq_id", "step")
"""Per-sequence columns the engine reads; constant within a sequence in token layout."""

# The sequence table (`iscore.sequences`): one row per sequence, the dump's columns and these.
COUNTS = ("length", "loss_tokens")
"""Computed integer columns: tokens, and loss tokens, of each sequence."""

MISMATCH = {
    "d_mean": "S / T: the mean of d = train_logprob - rollout_logprob over the loss tokens",
    "abs_diff_mean": "mean |d|",
    "abs_diff_max": "max |d|",
    "k1": "-S / T: k1 estimate of KL(rollout || train), per sequence",
    "k3": "mean of e^d - 1 - d",
    "d_sum": "S: the sum of d (the log of the sequence-level ratio)",
    "geo_ratio": "e^(S / T): the geometric-mean ratio",
}
"""Computed mismatch columns (float64, over loss tokens; null without loss tokens)."""

COMPUTED = (*COUNTS, *MISMATCH)
"""Every column computed from the log-probs; the dump's own columns are renamed `dump_NAME`
where their name is one of these."""


def dump_schema(seq_id: pa.DataType, extras: pa.Schema) -> pa.Schema:
    """The columns of the sequence table that come from the dump (all but the per-setting
    ones): `step`, `seq_id` of type `seq_id`, the `extras`, then `COMPUTED`."""
    return pa.schema(
        [
            ("step", pa.int64()),
            ("seq_id", seq_id),
            *extras,
            *((name, pa.int64()) for name in COUNTS),
            *((name, pa.float64()) for name in MISMATCH),
        ]
    )


EXTRA = ("advantage", "token_id", "group_id", "reward", "entropy")
"""Optional columns recognized and reported; carried through by readers that need them."""

# Names each framework writes for the same quantity (docs/corrections.md#frameworks).
# Deliberately absent: AReaL's `old_logprobs`/`logprobs`, which hold the
# *rollout* (behaviour) log-probs there but the trainer's elsewhere; a name that means
# opposite things in two frameworks must be mapped explicitly.
ALIASES: dict[str, tuple[str, ...]] = {
    "seq_id": ("seq_id", "sequence_id", "sample_index", "export_sequence_idx", "uid"),
    "step": ("step", "global_step", "rollout_id", "train_step"),
    "pos": ("pos", "position", "token_position"),
    "rollout_logprob": (
        "rollout_logprob",
        "rollout_logprobs",
        "rollout_log_probs",
        "generation_logprobs",
        "inference_logprobs",
        "sampling_per_token_logps",
        "vllm_logprobs",
        "inf_logprobs",
    ),
    "train_logprob": (
        "train_logprob",
        "train_logprobs",
        "train_log_probs",
        "prev_logprobs",
        "old_log_probs",
        "old_per_token_logps",
        "trainer_logprobs",
        "log_probs",
        "action_log_probs",
        "prox_logp",
    ),
    "policy_logprob": (
        "policy_logprob",
        "policy_logprobs",
        "curr_logprobs",
        "cur_log_probs",
    ),
    "loss_mask": (
        "loss_mask",
        "loss_masks",
        "response_mask",
        "token_loss_mask",
        "completion_mask",
    ),
    "advantage": ("advantage", "advantages"),
    "token_id": ("token_id", "token_ids"),
    "group_id": ("group_id", "group_index", "prompt_id"),
    "reward": ("reward", "rewards", "score"),
    "entropy": ("entropy", "entropies"),
}

CANONICAL = tuple(ALIASES)


@dataclass(frozen=True, slots=True)
class ColumnMap:
    """Which source column of a file feeds each canonical column.

    Attributes:
        source: canonical name -> the file's column name, for every column found.
    """

    source: dict[str, str]

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def describe(self) -> str:
        """One line per column, `canonical <- source` where the names differ."""
        return ", ".join(
            name if src == name else f"{name} <- {src}" for name, src in self.source.items()
        )


def parse_mapping(items: Sequence[str]) -> dict[str, str | None]:
    """Parse CLI `CANONICAL=SOURCE` pairs into an explicit column mapping; `CANONICAL=` (no
    source) leaves an optional column out.

    >>> parse_mapping(["train_logprob=lp_trainer", "loss_mask="])
    {'train_logprob': 'lp_trainer', 'loss_mask': None}

    Raises:
        DumpError: an item is not of that form, or names no canonical column.
    """
    mapping: dict[str, str | None] = {}
    for item in items:
        name, sep, source = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise DumpError(
                f"Expected a column mapping CANONICAL=SOURCE (or CANONICAL= to leave an optional "
                f"column out), but got {quote(item)}"
            )
        if name not in ALIASES:
            close = get_close_matches(name, CANONICAL, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DumpError(
                f"Unknown canonical column {quote(name)} in --column {quote(item)}{hint}; "
                f"expected one of {', '.join(CANONICAL)}"
            )
        if not source and name in ("rollout_logprob", "train_logprob"):
            raise DumpError(f"--column {quote(item)}: {name} is required and cannot be left out")
        mapping[name] = source or None
    return mapping


def match_columns(
    names: Sequence[str], mapping: Mapping[str, str | None] | None = None
) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """What `resolve_columns` finds, without raising: for choosing a mapping.

    Returns:
        found: canonical name -> the file's column, for every column found without doubt;
        ambiguous: canonical name -> the file's columns that could each be it.

    >>> match_columns(["lp_rollout", "train_logprobs", "log_probs"], {})
    ({}, {'train_logprob': ('train_logprobs', 'log_probs')})
    >>> match_columns(["a", "b", "loss_mask"], {"rollout_logprob": "a", "loss_mask": None})
    ({'rollout_logprob': 'a'}, {})
    """
    mapping = mapping or {}
    present = set(names)
    taken = {source for source in mapping.values() if source is not None}
    found: dict[str, str] = {}
    ambiguous: dict[str, tuple[str, ...]] = {}
    for canonical, aliases in ALIASES.items():
        if canonical in mapping:
            if mapping[canonical] is not None:
                found[canonical] = mapping[canonical]
            continue
        if canonical in present and canonical not in taken:
            found[canonical] = canonical
            continue
        candidates = tuple(alias for alias in aliases if alias in present and alias not in taken)
        if len(candidates) > 1:
            ambiguous[canonical] = candidates
        elif candidates:
            found[canonical] = candidates[0]
    return found, ambiguous


def resolve_columns(
    names: Sequence[str],
    mapping: Mapping[str, str | None],
    path: str,
    *,
    sequence_layout: bool = False,
) -> ColumnMap:
    """Map a file's column names onto the canonical columns.

    Args:
        names: the file's column names.
        mapping: explicit canonical -> source names; these win over aliases. None leaves an
            optional column out even where an alias would find it.
        path: the file, for error messages.
        sequence_layout: whether `seq_id` may be absent (it defaults to the row number).

    Raises:
        DumpError: a required column is missing (the message lists the names tried), an
            explicit mapping names an unknown canonical column or a column the file lacks,
            or leaves out a log-prob column, or two aliases of one column are both present.
    """
    present = set(names)
    for canonical, source in mapping.items():
        if canonical not in ALIASES:
            raise DumpError(
                f"Unknown canonical column {quote(canonical)} in the column mapping; "
                f"expected one of {', '.join(CANONICAL)}"
            )
        if source is None:
            if canonical in ("rollout_logprob", "train_logprob"):
                raise DumpError(f"the column mapping leaves out {canonical}, which is required")
            continue
        if source not in present:
            raise DumpError(
                f"{path}: the column mapping says {canonical} <- {quote(source)}, but the file "
                "has no "
                f"column {quote(source)} (columns: {', '.join(names)})"
            )
    found, ambiguous = match_columns(names, mapping)
    if ambiguous:
        canonical, candidates = next(iter(ambiguous.items()))
        raise DumpError(
            f"{path}: columns {', '.join(map(repr, candidates))} could each be {canonical}; "
            f"say which with --column {canonical}=NAME"
        )
    taken = {source: name for name, source in mapping.items() if source is not None}
    for canonical in REQUIRED:
        if canonical not in found and not (sequence_layout and canonical == "seq_id"):
            claimed = [a for a in ALIASES[canonical] if a in present and a in taken]
            if claimed:  # its column is there, but the mapping gave it to another column
                alias = claimed[0]
                raise DumpError(
                    f"{path}: missing required column {canonical}: the file's {quote(alias)} "
                    f"is mapped to {taken[alias]} (--column {taken[alias]}={alias}); "
                    f"map {canonical} to another column with --column {canonical}=NAME"
                )
            raise DumpError(
                f"{path}: missing required column {canonical}; tried "
                f"{', '.join(ALIASES[canonical])} (columns: {', '.join(names)}). "
                f"Map it with --column {canonical}=NAME"
            )
    return ColumnMap(found)
