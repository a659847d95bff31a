"""Recommend a correction setting for your framework from your own dump (docs/recommend.md).

First, what numerical noise looks like in this dump, robustly (medians and MADs, per step), and
what stands out of it: broken sequences (`iscore.stats.noise.outside`: a stale replica, a bad rank),
a global offset, long-sequence collapse, drift over steps. Thresholds are then placed by the
objective: the loosest token cap within a variance budget, sequence bounds just outside the
healthy sequences (none is dropped) or just inside the nearest broken one beyond them.
Candidates are framework-neutral kinds (token TIS, IcePop, token and geometric masks, k3 masks,
sequence-level weights) kept where the framework expresses them; each is replayed exactly as
the framework would (`iscore.stats.setting.quick_stats`), held to the targets (and, with broken
sequences, to removing them), and ranked: the fewest targets missed, then the objective (the
bias left plus the variance added, in units of one token's gradient), then the setting to
beat, then the fewer components.

>>> rec = recommend(iscore.load("data/long_collapse.parquet"), "verl")  # doctest: +SKIP
>>> rec.best.spec.name, rec.regimes, rec.pick                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from iscore import frameworks
from iscore.advice.candidates import KINDS, POLICY_KINDS, TRUST_REGION_KINDS, Candidate
from iscore.advice.explain import (
    elsewhere_words,
    reason_words,
    regime_words,
    trap_warnings,
    versus_words,
)
from iscore.advice.objective import measure, preference
from iscore.advice.targets import Targets
from iscore.advice.thresholds import Normal, Thresholds
from iscore.dump import Data, load_data
from iscore.frameworks import Framework, Setting, Spec, resolve
from iscore.packed import TokenBatch, ops
from iscore.utils import Engine


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Candidates ranked best first, the regimes found, and warnings about traps.

    Attributes:
        framework: the framework's name.
        targets: the targets the candidates were held to.
        candidates: best first.
        regimes: what was found in the data and why it matters for the pick, one line each.
        warnings: the traps that bite this data.
        pick: why the best beat the runner-up, and what would change the pick.
        thresholds: the bounds placed from the data (token ratio band and cap, e^G band,
            mean-k3 bound), how many sequences were found broken, and the median token
            log-ratio where the healthy tokens break E_rollout[e^d] = 1 (a semantics bug;
            None otherwise).
        default: the setting to beat, replayed beside the candidates and ranked among them
            (kind "default"): the user's own, or the framework's default.
    """

    framework: str
    targets: Targets
    candidates: tuple[Candidate, ...]
    regimes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)
    pick: str = ""
    thresholds: dict[str, Any] = field(default_factory=dict)
    default: Candidate | None = None

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def runner_up(self) -> Candidate | None:
        return self.candidates[1] if len(self.candidates) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        """The document `iscore recommend --json` writes: each candidate's `config` is what
        `iscore replay --config` reads (with `framework:`)."""
        return {
            "framework": self.framework,
            "targets": {
                "max_token_drop": self.targets.max_token_drop,
                "max_seq_drop": self.targets.max_seq_drop,
                "lr_scale": list(self.targets.lr_scale),
                "min_ess": self.targets.min_ess,
            },
            "regimes": list(self.regimes),
            "best": self.best.to_dict(),
            "runner_up": None if self.runner_up is None else self.runner_up.to_dict(),
            "default": None if self.default is None else self.default.to_dict(),
            "pick": self.pick,
            "thresholds": self.thresholds,
            "candidates": [c.to_dict() for c in self.candidates],
            "warnings": list(self.warnings),
        }


def recommend(
    data: Data,
    framework: str,
    targets: Targets | None = None,
    progress: Callable[[int, int], None] | None = None,
    default: Setting | None = None,
    engine: Engine = "local",
) -> Recommendation:
    """Rank the framework's candidate settings on a dump against `targets` (docs/recommend.md).

    Args:
        data: the dump: a loaded batch, an opened `Dump` or its path (read whole).
        framework: one of `iscore.frameworks.NAMES`.
        targets: what a good setting does; defaults to `Targets()`.
        progress: called after each candidate is replayed with (candidates replayed,
            candidates in all).
        default: the setting to beat: the user's own (any form `iscore.frameworks.resolve.resolve`
            takes); None for the framework's default (`Framework.default`). It is replayed
            beside the candidates, and kept where none does better.
        engine: "local" reads the dump here; "ray" in Ray tasks, a file or range of its
            steps each, joined here into the same batch (`Dump.load`); the candidates are
            replayed here either way (each against thresholds from every token).

    >>> import iscore
    >>> rec = recommend(iscore.load("data/fp8.parquet"), "skyrl")
    >>> rec.best.passes, rec.best.stats["token_masked_fraction"] <= 0.01
    (True, True)
    """
    fw = frameworks.get(framework)
    targets = targets or Targets()
    own = default is not None
    default_spec = resolve(default) if own else fw.presets()[fw.default]
    batch = load_data(data, engine)
    with ops.shared(batch):  # d, e^d and the sequence sums, computed once for every candidate
        return _recommend(batch, fw, targets, progress, default_spec, own)


def _recommend(
    batch: TokenBatch,
    fw: Framework,
    targets: Targets,
    progress: Callable[[int, int], None] | None,
    default: Spec,
    own: bool,
) -> Recommendation:
    framework = fw.name
    normal = Normal.of(batch)
    thresholds = Thresholds.of(normal)
    sides = batch.extra is not None and "advantage" in batch.extra.column_names
    trust = TRUST_REGION_KINDS if sides else TRUST_REGION_KINDS[1:]  # DPPO needs the advantage
    kinds = KINDS + trust + (POLICY_KINDS if normal.target is not None else ())
    expressed = [
        (kind.key, f"{kind.description}, {thresholds.describe(kind.key)}", spec)
        for kind in kinds
        if (spec := fw.express(kind.setting(thresholds), f"{framework} {kind.description}"))
    ]
    whose = "your setting" if own else f"{fw.title}'s default"
    expressed.append(("default", f"{whose}, {default.name}", default))
    candidates = []
    for key, title, spec in expressed:
        canonical = frameworks.of(spec).to_canonical(spec)
        stats, missed = measure(batch, spec, normal, targets, canonical.anchor)
        stats["components"] = float(len(canonical.components))  # the simpler, the fewer
        candidates.append(
            Candidate(
                spec,
                key,
                title,
                stats,
                tuple(missed),
                reason_words(title, stats, tuple(missed)),
                canonical.describe(),
            )
        )
        if progress is not None:
            progress(len(candidates), len(expressed))
    ranked = tuple(sorted(candidates, key=preference))
    chosen = next(c for c in ranked if c.kind == "default")
    regimes = regime_words(batch, normal)
    if normal.broken.any() and not any(c.passes for c in ranked):
        regimes.append(elsewhere_words(batch, fw, normal, targets))
    found = {
        "token_band": list(thresholds.band),
        "token_cap": thresholds.token_cap,
        "geometric_band": list(thresholds.geo),
        "k3": thresholds.k3,
        "mult_error": thresholds.mult_error,
        "broken_sequences": int(normal.broken.sum()),
        "global_offset": normal.d_center if normal.offset else None,
    }
    warnings = trap_warnings(batch, fw, normal, (ranked[0].spec, chosen.spec))
    if normal.offset:
        warnings.insert(
            0,
            f"Fix the semantics bug first: <e^d> is {normal.ratio:.4f}, not 1 "
            "(processed vs raw log-probs, a temperature on one side). No IS correction removes "
            "it; the pick only keeps its damage within the targets meanwhile.",
        )
    return Recommendation(
        framework,
        targets,
        ranked,
        tuple(regimes),
        tuple(warnings),
        _pick(ranked, chosen),
        found,
        chosen,
    )


def _pick(ranked: tuple[Candidate, ...], default: Candidate) -> str:
    """Why the best beat the runner-up and the setting to beat, with the deciding term's
    numbers; "keep your default" where that setting is as good."""
    best = ranked[0]
    if len(ranked) < 2:
        return "the only setting this framework expresses"
    second = next(c for c in ranked[1:] if c is not best)
    if best is default:
        return f"keep {default.title}: over {versus_words(best, second, 'the best candidate')}"
    text = f"{best.title} over the runner-up, {versus_words(best, second, second.title)}"
    if second is not default:
        text += f"; over {versus_words(best, default, default.title)}"
    return text
