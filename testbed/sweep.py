"""The sweep: for each regime, the candidate settings, trained over several seeds, cached.

A regime's candidates are what a user of the framework would weigh:

- `off`: no correction (the framework's setting with no weight and no mask);
- `default`: the framework's shipped default (`Framework.default`);
- `pick`: `iscore.recommend`'s best, computed as a user would: on a dump of a few steps of an
  uncorrected run of the regime (its own seed and rollout stream, never an evaluation run);
- `rec <kind>`: the recommendation's other candidates;
- the classic fixed settings of `CLASSIC`, where the framework expresses them exactly;
- any other settings of the framework (`Sweep.extra`, the CLI's `--setting`).

Settings with the same config are trained once, under the first label (`Candidate.aliases`
keeps the others). Every (setting, seed) run is cached in a JSON file under a key made of
everything its result depends on (`run_key`), so a rerun trains only what changed: after a
change to the recommendation, only the new picks.

>>> [label for label, _, _ in CLASSIC]
['tis 2', 'icepop 0.5-5', 'geo 0.999-1.001', 'seq-tis 2', 'k3 0.01']
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import iscore
from iscore import frameworks
from iscore.frameworks.canonical import Canonical, mask_component, weight_component
from iscore.frameworks.spec import Spec
from iscore.packed.batch import TokenBatch
from testbed.engine import Regime
from testbed.task import Task
from testbed.training import Run, Training, train

CACHE_VERSION = 1
"""Part of every cache key: bump it when a change to the testbed changes what a run gives."""


def _token_tis(cap: float) -> Canonical:
    return Canonical((weight_component("token", upper=cap, numerics="clamp"),))


def _icepop(lower: float, upper: float) -> Canonical:
    band = mask_component("token", lower, upper, numerics="clamp")
    return Canonical((weight_component("token", numerics="clamp", zero=band),))


def _geo_mask(lower: float, upper: float) -> Canonical:
    return Canonical((mask_component("geometric", lower, upper),))


def _seq_tis(cap: float) -> Canonical:
    return Canonical((weight_component("sequence", upper=cap, numerics="clamp"),))


def _k3_mask(upper: float) -> Canonical:
    k3 = mask_component("geometric", upper=upper, statistic="k3", numerics="clamp_each")
    return Canonical((k3,))


CLASSIC = (
    ("tis 2", "token TIS, cap 2", _token_tis(2.0)),
    ("icepop 0.5-5", "IcePop, token band [0.5, 5]", _icepop(0.5, 5.0)),
    ("geo 0.999-1.001", "geometric mask, e^G in [0.999, 1.001]", _geo_mask(0.999, 1.001)),
    ("seq-tis 2", "sequence (product) TIS, cap 2", _seq_tis(2.0)),
    ("k3 0.01", "k3 sequence mask, mean k3 <= 0.01", _k3_mask(0.01)),
)
"""(label, description, framework-neutral setting) of the fixed settings every regime tries."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting of the sweep.

    Attributes:
        label: its short name in the table ("off", "default", "pick", "rec token_tis", ...).
        spec: the framework's setting, replayed by iscore on every batch.
        title: what it is, e.g. recommend's "token TIS, cap 2.87".
        aliases: the labels of the other candidates with the same config.
    """

    label: str
    spec: Spec
    title: str
    aliases: tuple[str, ...] = ()

    @property
    def config(self) -> dict[str, Any]:
        """The setting's config without its name: what the runs depend on."""
        config = self.spec.to_config()
        config.pop("name", None)
        return config


@dataclass(frozen=True, slots=True)
class Dump:
    """What the recommendation was computed on, and what it said.

    Attributes:
        steps: the dumped training steps of the uncorrected run.
        sequences: the dump's sequences.
        tokens: its tokens.
        regimes: the recommendation's reading of the dump (`Recommendation.regimes`).
        thresholds: the bounds it placed (`Recommendation.thresholds`).
    """

    steps: tuple[int, int]
    sequences: int
    tokens: int
    regimes: tuple[str, ...]
    thresholds: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sweep:
    """What the sweep trains.

    Attributes:
        framework: whose settings, replay and loss aggregation.
        regimes: the regimes, in table order.
        seeds: the seeds every candidate trains on.
        task: the toy task's size.
        training: each run's size (the `long` regime's too).
        dump_steps: (first, last + 1): the steps of the uncorrected run the recommendation
            reads, as a user dumps a few steps of a run under way.
        dump_seed: that run's seed (its rule and initialization; its rollouts use their own
            stream).
        extra: settings every regime tries besides its own candidates.
    """

    framework: str = "verl"
    regimes: tuple[Regime, ...] = ()
    seeds: tuple[int, ...] = tuple(range(8))
    task: Task = field(default_factory=Task)
    training: Training = field(default_factory=Training)
    dump_steps: tuple[int, int] = (20, 24)
    dump_seed: int = 1000
    extra: tuple[Candidate, ...] = ()


def recommendation_dump(sweep: Sweep, regime: Regime) -> TokenBatch:
    """The dump a user would hand `iscore recommend`: `sweep.dump_steps` of an uncorrected run
    of the regime, every sequence with its step and a distinct id."""
    first, stop = sweep.dump_steps
    off = _off(sweep.framework)
    dump_training = Training(**{**asdict(sweep.training), "steps": stop, "final_window": 1})
    trained = train(
        sweep.task,
        regime,
        dump_training,
        [off],
        [sweep.dump_seed],
        record=range(first, stop),
        stream=2,
    )
    parts = trained.recorded
    lengths = torch.cat([part.lengths for part in parts])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return TokenBatch(
        rollout=torch.cat([part.rollout for part in parts]),
        train=torch.cat([part.train for part in parts]),
        cu_seqlens=cu,
        step=torch.cat([part.step for part in parts]),
    )


def candidates(sweep: Sweep, regime: Regime) -> tuple[list[Candidate], Dump]:
    """The regime's candidates (module docstring), duplicates merged, and the dump the
    recommendation read."""
    fw = frameworks.get(sweep.framework)
    batch = recommendation_dump(sweep, regime)
    rec = iscore.recommend(batch, sweep.framework)
    found = [
        Candidate("off", _off(fw.name), "no correction"),
        Candidate("default", fw.presets()[fw.default], f"{fw.name} default {fw.default}"),
        Candidate("pick", rec.best.spec, rec.best.title),
    ]
    for c in rec.candidates[1:]:
        found.append(Candidate(f"rec {c.kind}", c.spec, c.title))
    for label, title, setting in CLASSIC:
        spec = fw.express(setting, label)
        if spec is not None:
            found.append(Candidate(label, spec, title))
    found.extend(sweep.extra)
    steps = (sweep.dump_steps[0], sweep.dump_steps[1] - 1)
    dump = Dump(steps, batch.num_sequences, batch.num_tokens, rec.regimes, rec.thresholds)
    return _merge(found), dump


def _off(framework: str) -> Spec:
    spec = frameworks.get(framework).express(Canonical(()), "off")
    if spec is None:
        raise ValueError(
            f"{framework} cannot switch its correction off, so no uncorrected run can be "
            "dumped for its recommendation"
        )
    return spec


def _merge(found: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with distinct configs, in order; the later labels of a config become
    aliases of the first."""
    merged: dict[str, Candidate] = {}
    for c in found:
        key = json.dumps(c.config, sort_keys=True)
        if key in merged:
            first = merged[key]
            merged[key] = Candidate(first.label, first.spec, first.title, (*first.aliases, c.label))
        else:
            merged[key] = c
    return list(merged.values())


def run_key(sweep: Sweep, regime: Regime, candidate: Candidate, seed: int) -> str:
    """The cache key of one run: a digest of everything its result depends on."""
    regime_fields = {k: v for k, v in asdict(regime).items() if k not in ("name", "description")}
    for name in _MIDRUN_FIELDS:  # at their defaults: the keys of the runs cached before them
        if regime_fields[name] == Regime.__dataclass_fields__[name].default:
            del regime_fields[name]
    what = {
        "version": CACHE_VERSION,
        "task": asdict(sweep.task),
        "training": asdict(sweep.training),
        "regime": regime_fields,
        "config": candidate.config,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


_MIDRUN_FIELDS = ("stale_from", "grow_from", "growth")
"""The regime's fields of a change mid-run (`testbed.engine.MIDRUN`)."""


class Cache:
    """Runs by `run_key`, in a JSON file (written whole, through a temporary file, after each
    regime; never pickled). A missing path keeps nothing."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else Path(path)
        self.runs: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            self.runs = json.loads(self.path.read_text())

    def get(self, key: str) -> Run | None:
        found = self.runs.get(key)
        return None if found is None else Run.from_dict(found)

    def put(self, key: str, run: Run) -> None:
        self.runs[key] = run.to_dict()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.runs, sort_keys=True))
        partial.replace(self.path)


def train_regime(
    sweep: Sweep,
    regime: Regime,
    found: Sequence[Candidate],
    cache: Cache,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[Run]]:
    """Every candidate's runs over `sweep.seeds`, by label: the cached ones read, the others
    trained side by side (the candidates missing a run, on the seeds missing one)."""
    keys = {(c.label, seed): run_key(sweep, regime, c, seed) for c in found for seed in sweep.seeds}
    missing = [pair for pair, key in keys.items() if cache.get(key) is None]
    todo = [c for c in found if c.label in {label for label, _ in missing}]
    seeds = [s for s in sweep.seeds if s in {seed for _, seed in missing}]
    if todo:
        trained = train(sweep.task, regime, sweep.training, [c.spec for c in todo], seeds, progress)
        for c, runs in zip(todo, trained.runs, strict=True):
            for seed, run in zip(seeds, runs, strict=True):
                cache.put(keys[c.label, seed], run)
        cache.save()
    elif progress is not None:
        progress(sweep.training.steps)
    return {c.label: [cache.get(keys[c.label, seed]) for seed in sweep.seeds] for c in found}
