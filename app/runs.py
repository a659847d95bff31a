"""What the pages draw of the session's runs (`session.runs`): each run's mismatch analysis
and trend for the overlays, each setting's analysis on each run for Compare, and the diff of
two runs for the Runs page, computed on the runs' loaded batches (`iscore.diff` takes them as
they are) and kept for the session.

Every run is looked at whole: the step selection and the slice are the loaded dump's.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import streamlit as st
from session import compute, run_workspaces

from iscore.advice import Trend
from iscore.frameworks import Spec
from iscore.passes import Analysis, Diff, diff
from iscore.session import Workspace

OVERLAID = 2
"""Runs from which the pages overlay them."""

_DIFFS_KEPT = 4
"""Diffs a session keeps (each is small: a few hundred numbers)."""


def overlaid() -> dict[str, Workspace] | None:
    """The runs' workspaces by name, where there are enough to overlay (else None)."""
    if len(st.session_state.get("runs", [])) < OVERLAID:
        return None
    found = run_workspaces()
    return found if len(found) >= OVERLAID else None


def analyses(runs: dict[str, Workspace]) -> dict[str, Analysis]:
    """Each run's mismatch diagnostics, by name (memoized with its workspace)."""
    return {name: compute(f"Analyzing the run {name}…", ws.mismatch) for name, ws in runs.items()}


def trends(runs: dict[str, Workspace]) -> dict[str, Trend]:
    """Each run's mismatch step by step, by name."""
    return {name: a.trend for name, a in analyses(runs).items()}


def settings(runs: dict[str, Workspace], specs: Sequence[Spec]) -> dict[str, Analysis]:
    """Each run's analysis with `specs`, by name: Compare's settings x runs."""
    return {
        name: compute(f"Replaying the settings on the run {name}…", ws.analysis, specs)
        for name, ws in runs.items()
    }


def diff_of(
    runs: dict[str, Workspace], baseline: str, candidate: str, specs: Sequence[Spec]
) -> Diff:
    """`iscore.diff` of run `candidate` against run `baseline` through `specs`, on their
    loaded batches; kept for the session while both workspaces live (held by weak references,
    so that a diff never keeps a dump in memory past its cache)."""
    base, cand = runs[baseline], runs[candidate]
    kept: OrderedDict = st.session_state.setdefault("_diffs", OrderedDict())
    key = (id(base), id(cand), baseline, candidate, tuple(specs))
    found = kept.get(key)
    if found is not None and found[0]() is base and found[1]() is cand:
        kept.move_to_end(key)
        return found[2]
    result = compute(
        f"Comparing {candidate} with {baseline}…",
        lambda: diff(base.full, cand.full, list(specs), names=(baseline, candidate)),
    )
    # Handed batches, the diff knows no files: each arm's are its run's.
    base_arm, cand_arm = result.arms
    arms = (
        replace(base_arm, source=base.source.files),
        replace(cand_arm, source=cand.source.files),
    )
    result = replace(result, arms=arms)
    kept[key] = (weakref.ref(base), weakref.ref(cand), result)
    while len(kept) > _DIFFS_KEPT:
        kept.popitem(last=False)
    return result
