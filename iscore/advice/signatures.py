"""Three bug signatures that look like mismatch and are not (docs/why.md#bug-signatures), each
decided here from the sums `iscore.stats.signatures` gathers and returned as flags of kind
`semantics_bug`: the trainer's log-probs one position off the rollout's (`shifted_by_one`),
a dummy rollout log-prob of 0 on tokens inside the loss (`zero_rollout_logprob`), and the
mismatch changing abruptly at one position (`position_jump`).

The thresholds are set far from what every sample of `data/` and every simulated regime gives
(tests/unit/test_signatures.py), and well inside what the bugs give.
"""

from __future__ import annotations

import math

import numpy as np

from iscore.advice.flags import Flag
from iscore.stats import ZERO_TRAIN_EDGES, SignatureSummary

SHIFT_CORRELATION = 0.5
"""The least correlation of train_logprob[t] with rollout_logprob[t + 1] (or [t - 1]) for
`shifted_by_one`. Both sides score the same tokens, so aligned they correlate at 0.95 (fp8)
to 1.0 (bf16) on the samples, while neighbouring tokens' log-probs are nearly independent
(|r| < 0.01 on the samples): a shift swaps the two."""

SHIFT_MARGIN = 0.2
"""How far the shifted correlation must exceed the aligned one: real text's neighbouring
log-probs correlate somewhat, and a trainer that is merely noisy lowers the aligned
correlation without raising a shifted one."""

SHIFT_PAIRS = 100
"""The least pairs of neighbouring loss tokens for `shifted_by_one`."""

ZERO_TRAIN = math.log(0.5)
"""A loss token with a rollout log-prob of exactly 0 counts for `zero_rollout_logprob` where
the trainer gives it a probability below 1/2 (a bin edge of `ZERO_TRAIN_EDGES`): an engine that
reports probability 1 for a token the trainer finds a coin flip or worse has not scored it.
Peaked tokens whose probability rounds to 1 in float32 (1.2% of the samples' loss tokens) stay above
0.9 on both sides; a top-p engine that reports 0 for a token alone in its nucleus (the
`offset_bug` sample: 0.13% of the tokens) leaves the trainer's above 1/2."""

ZERO_SHARE = 0.01
"""The least share of the loss tokens with a dummy rollout log-prob for `zero_rollout_logprob`:
observation and tool tokens are tens of percent of a multi-turn agent's tokens (verl#5229's
8-turn agent), while the samples and simulated regimes have none (a one-position shift gives
0.2%)."""

ZERO_TOKENS = 20
"""And the least such tokens, so that a handful in a small dump does not flag."""

JUMP_RATIO = 2.0
"""The least factor between the mean |d| of the windows either side of a position for
`position_jump` (or 1/2 for a fall). A smooth trend along the position, |d| ~ p^a, moves the
windows' ratio by (1.25 / 0.75)^a: under 2 up to a = 1.35, steeper than linear. The samples'
and regimes' largest is 1.85 (`moe_routing`, where few sequences reach and one routing-flip
span weighs): the ratio alone does not decide, `JUMP_Z` does."""

JUMP_Z = 8.0
"""The least z of the change in the share of tokens above their sequence's median |d| between
the two windows, in the ratio's direction: a share that one sequence cannot move by more than
its own weight, so a routing-flip span in a few sequences (which can double a window's mean
where few sequences reach) cannot make it. Its largest over every scanned position is 5.2 on
the samples and regimes (`moe_routing` with 4 turns whose seams are noisier: the scan tests
about a thousand positions, and a sequence's tokens are not independent); a 3x step at
position 96 over 64 sequences of two steps gives 10-12."""

JUMP_SEQUENCES = 16
"""The least loss tokens per position in each window (as many sequences reaching it), so that
the step is one across sequences, not of one sequence."""

JUMP_TOKENS = 1000
"""The least loss tokens in each window."""


def signature_flags(found: SignatureSummary | None) -> list[Flag]:
    """The signatures `found` shows, in the order `shifted_by_one`, `zero_rollout_logprob`,
    `position_jump`; none without a summary."""
    if found is None:
        return []
    return [*_shifted_by_one(found), *_zero_rollout_logprob(found), *_position_jump(found)]


def _shifted(correlations: tuple[float | None, ...], pairs: int) -> str | None:
    """Which shift ("next", "previous") the correlations show, None for neither."""
    aligned, *shifted = correlations
    if pairs < SHIFT_PAIRS:
        return None
    base = -1.0 if aligned is None else aligned
    for name, r in zip(("next", "previous"), shifted, strict=True):
        if r is not None and r >= SHIFT_CORRELATION and r >= base + SHIFT_MARGIN:
            return name
    return None


def _shifted_by_one(found: SignatureSummary) -> list[Flag]:
    """train_logprob[t] lines up with rollout_logprob[t + 1] or [t - 1] (ms-swift#8196)."""
    side = _shifted(found.correlation, found.pairs[1])
    if side is None:
        return []
    aligned, after, before = found.correlation
    r = after if side == "next" else before
    other = "t + 1" if side == "next" else "t - 1"
    steps = [s for s, corr, pairs in found.by_step if _shifted(corr, pairs) == side]
    where = (
        f" (in {len(steps)} of {len(found.by_step)} steps, from step {steps[0]})"
        if steps and len(found.by_step) > 1
        else ""
    )
    lead = "one token ahead of" if side == "next" else "one token behind"
    same = "n/a" if aligned is None else f"{aligned:+.2f}"
    return [
        Flag.of(
            "shifted_by_one",
            f"train_logprob[t] correlates with rollout_logprob[{other}] (r = {r:+.2f}) far more "
            f"than with rollout_logprob[t] (r = {same}), over {found.pairs[1]:,} pairs of "
            f"neighbouring loss tokens{where}: the trainer's log-probs run {lead} the "
            "rollout's. Check the trainer's gather (the logits at t score the token at t + 1: "
            "logits[:, :-1] against input_ids[:, 1:]) and that both sides' response slices "
            "start at the same token.",
        )
    ]


def _zero_rollout_logprob(found: SignatureSummary) -> list[Flag]:
    """A rollout log-prob of exactly 0 on loss tokens the trainer scores below `ZERO_TRAIN`
    (verl#5229, SkyRL#354, rllm#503)."""
    below = int(np.searchsorted(ZERO_TRAIN_EDGES, ZERO_TRAIN))
    count = sum(found.zero_rollout[:below])
    share = count / found.loss_tokens if found.loss_tokens else 0.0
    if count < ZERO_TOKENS or share < ZERO_SHARE:
        return []
    every = sum(found.zero_rollout)
    return [
        Flag.of(
            "zero_rollout_logprob",
            f"{share:.1%} of the loss tokens ({count:,}) have a rollout log-prob of exactly 0 "
            f"while the trainer gives them a probability below {math.exp(ZERO_TRAIN):.0%} "
            f"({every:,} loss tokens have a rollout log-prob of 0 in all): dummy values, as "
            "tool or observation tokens get where the engine did not generate them. Mask "
            "observation tokens out of the loss or record the engine's log-probs for them.",
        )
    ]


def _position_jump(found: SignatureSummary) -> list[Flag]:
    """The mean |d| steps by `JUMP_RATIO` at one position, across sequences (sglang#25790)."""
    scan = found.positions
    if not scan.position:
        return []
    tokens, width = np.asarray(scan.tokens), np.asarray(scan.width)
    mean, z = np.asarray(scan.abs_mean), np.asarray(scan.z)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.log(mean[1] / mean[0])
    enough = (tokens.min(axis=0) >= JUMP_TOKENS) & (
        (tokens / np.maximum(width, 1)).min(axis=0) >= JUMP_SEQUENCES
    )
    jump = (
        enough
        & np.isfinite(step)
        & (np.abs(step) >= math.log(JUMP_RATIO))
        & (np.abs(z) >= JUMP_Z)
        & (np.sign(z) == np.sign(step))
    )
    if not jump.any():
        return []
    best = int(np.argmax(np.where(jump, np.abs(z), 0.0)))
    at = scan.split(best)
    if at in scan.position:  # the windows at the change point itself, a few positions off
        best = scan.position.index(at)
    c = scan.position[best]
    lo, hi = c - scan.width[0][best], c + scan.width[1][best]
    direction = "rises" if step[best] > 0 else "falls"
    return [
        Flag.of(
            "position_jump",
            f"the mismatch {direction} abruptly at position {at}: mean |d| "
            f"{mean[0][best]:.3g} over positions {lo}-{c - 1}, {mean[1][best]:.3g} over "
            f"{c}-{hi - 1} ({math.exp(step[best]):.2g}x; the share of tokens above their "
            f"sequence's median |d| moves from {scan.above[0][best]:.0%} to "
            f"{scan.above[1][best]:.0%}, z = {z[best]:+.0f}), across sequences: a switch at a "
            "fixed position in one side's computation, as a KV-cache precision change "
            "between prefill and decode or a chunked-prefill boundary gives. Check what "
            f"changes at position {at} in the engine's or the trainer's configuration "
            "(prefill chunk size, KV-cache dtype, attention backend).",
        )
    ]
