"""The canonical dump's columns, the frameworks' names for them, and how a file's columns map.

A dump holds one row per token (token layout) or one row per sequence with equal-length
list columns (sequence layout). Columns are found by their canonical name first, then by
the names the RL frameworks use for the same quantity (see `aliases`); an explicit
mapping overrides both.

>>> resolve_columns(["seq_id", "rollout_log_probs", "old_log_probs"], {}, "a.parquet").source
{'seq_id': 'seq_id', 'rollout_logprob': 'rollout_log_probs', 'train_logprob': 'old_log_probs'}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from functools import cache

import pyarrow as pa

from iscore import frameworks
from iscore.errors import ConfigError, DumpError, quote
from iscore.packed import META_COLUMNS

REQUIRED = ("seq_id", "rollout_logprob", "train_logprob")
"""Columns every dump must have (in sequence layout `seq_id` defaults to the row number)."""

LOGPROB_COLUMNS = ("rollout_logprob", "train_logprob", "policy_logprob", "floor_logprob")
"""Log-probability columns: finite and <= 0 in a valid dump."""

EXPERT_COLUMNS = ("rollout_experts", "train_experts")
"""Per-token lists of the expert ids each side's router picked: both or neither."""

TOPK_COLUMNS = ("rollout_topk_ids", "rollout_topk_logprobs", "train_topk_logprobs")
"""Per-token lists of k: the engine's k most likely ids and their log-probs, and the trainer's
log-probs at those ids (docs/distribution.md): all three or none, k the same for every token of
a file."""

PER_TOKEN = (
    "pos",
    "rollout_logprob",
    "train_logprob",
    "policy_logprob",
    "floor_logprob",
    "loss_mask",
    "turn",
    "train_token_id",
    *EXPERT_COLUMNS,
    *TOPK_COLUMNS,
)
"""Per-token columns the engine reads; in sequence layout they are list columns (the expert
ids, a list per token, are lists of lists there)."""

PER_SEQUENCE = ("seq_id", "step")
"""Per-sequence columns the engine reads; constant within a sequence in token layout."""

# The sequence table (`iscore.passes.sequences`): one row per sequence, the dump's columns and
# these.
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


EXTRA = ("advantage", "token_id", "group_id", "reward", "entropy", *META_COLUMNS)
"""Optional columns recognized and reported; carried through by readers that need them (the
metadata columns, `META_COLUMNS`, always: the mismatch is broken down by each)."""

COMMON_NAMES: dict[str, tuple[str, ...]] = {
    "seq_id": ("seq_id", "sequence_id", "export_sequence_idx"),
    "step": ("step", "global_step", "train_step"),
    "pos": ("pos", "position", "token_position"),
    "rollout_logprob": (
        "rollout_logprob",
        "rollout_logprobs",
        "inference_logprobs",
        "vllm_logprobs",
        "inf_logprobs",
    ),
    "train_logprob": ("train_logprob", "train_logprobs", "train_log_probs", "trainer_logprobs"),
    "policy_logprob": ("policy_logprob", "policy_logprobs", "cur_log_probs"),
    # The trainer's log-prob of the token from a second recompute (the noise floor,
    # docs/compare.md#the-noise-floor): no framework logs one, so no alias can mean it.
    "floor_logprob": ("floor_logprob",),
    "loss_mask": ("loss_mask",),
    "turn": ("turn",),
    # The id of the token the trainer scored at each position, beside `token_id` (the one the
    # engine sampled): they differ where the trainer's input was re-tokenized.
    "train_token_id": ("train_token_id", "train_token_ids"),
    "rollout_experts": ("rollout_experts",),
    "train_experts": ("train_experts",),
    "rollout_topk_ids": ("rollout_topk_ids",),
    "rollout_topk_logprobs": ("rollout_topk_logprobs",),
    "train_topk_logprobs": ("train_topk_logprobs",),
    "advantage": ("advantage", "advantages"),
    "token_id": ("token_id", "token_ids"),
    "group_id": ("group_id", "prompt_id"),
    "reward": ("reward", "rewards", "score"),
    "entropy": ("entropy", "entropies"),
    # Per sequence (docs/why.md#the-metadata-breakdown): the policy version the engine sampled
    # with, the engine instance, the trainer's rank, the host and the GPU model.
    "weight_version": ("weight_version", "policy_version", "model_version"),
    "replica": ("replica", "replica_id", "engine_id"),
    "rank": ("rank", "dp_rank", "trainer_rank"),
    "host": ("host", "hostname"),
    "device": ("device", "device_name", "gpu_name"),
}
"""Each canonical column's own name first, then the spellings that belong to no registered
framework (plurals, prime-rl's and open-instruct's exports); every framework adds the names
it writes (`Framework.columns`), so that adding one is editing its module alone."""

CANONICAL = tuple(COMMON_NAMES)


@cache
def aliases() -> dict[str, tuple[str, ...]]:
    """The names a file's column is found by, for each canonical column: `COMMON_NAMES`, then
    each framework's in registry order. A name means one column: declaring it for two is an
    error, which is why AReaL's `old_logprobs`/`logprobs` (the rollout's log-probs there, the
    trainer's elsewhere) are no alias at all and must be mapped explicitly.

    >>> aliases()["train_logprob"][:5]
    ('train_logprob', 'train_logprobs', 'train_log_probs', 'trainer_logprobs', 'old_log_probs')

    Raises:
        ConfigError: a framework declares names for a column that is not canonical, or a
            name another column already has.
    """
    table = {name: list(names) for name, names in COMMON_NAMES.items()}
    owner = {alias: name for name, names in COMMON_NAMES.items() for alias in names}
    for framework in frameworks.every():
        for canonical, names in framework.columns.items():
            if canonical not in table:
                raise ConfigError(
                    f"{framework.name}: Expected `columns` keys among {', '.join(CANONICAL)}, "
                    f"but got {quote(canonical)}"
                )
            for alias in names:
                if owner.setdefault(alias, canonical) != canonical:
                    raise ConfigError(
                        f"{framework.name}: column name {quote(alias)} is declared for "
                        f"{canonical} but is already an alias of {owner[alias]}"
                    )
                if alias not in table[canonical]:
                    table[canonical].append(alias)
    return {name: tuple(names) for name, names in table.items()}


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
        if name not in COMMON_NAMES:
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
    for canonical, names in aliases().items():
        if canonical in mapping:
            if mapping[canonical] is not None:
                found[canonical] = mapping[canonical]
            continue
        if canonical in present and canonical not in taken:
            found[canonical] = canonical
            continue
        candidates = tuple(alias for alias in names if alias in present and alias not in taken)
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
        if canonical not in COMMON_NAMES:
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
    unmapped, claimed = [], []
    for canonical in REQUIRED:
        if canonical in found or (sequence_layout and canonical == "seq_id"):
            continue
        mapped = [a for a in aliases()[canonical] if a in present and a in taken]
        if mapped:  # its column is there, but the mapping gave it to another column
            alias = mapped[0]
            claimed.append(
                f"missing required column {canonical}: the file's {quote(alias)} is mapped to "
                f"{taken[alias]} (--column {taken[alias]}={alias}); map {canonical} to another "
                f"column with --column {canonical}=NAME"
            )
        else:
            unmapped.append((canonical, f"{canonical} (tried {', '.join(aliases()[canonical])})"))
    if unmapped:
        tried = [text for _, text in unmapped]
        if len(unmapped) == 1:
            what, how = f"column {tried[0]}", f"it with --column {unmapped[0][0]}=NAME"
        else:
            what = f"columns {', '.join(tried[:-1])} and {tried[-1]}"
            how = "each with --column CANONICAL=NAME"
        raise DumpError(f"{path}: missing required {what} (columns: {', '.join(names)}). Map {how}")
    if claimed:
        raise DumpError(f"{path}: {'; '.join(claimed)}")
    return ColumnMap(found)
