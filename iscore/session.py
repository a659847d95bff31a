"""What an interactive front end needs on top of the engine: in-memory dumps, one loaded dump
with everything derived from it computed on demand, and the threshold families of `Tuner`
as framework settings.

Headless (no streamlit): the app caches `Workspace` objects and calls their methods; every
number it shows comes from here or from the modules these call.

>>> from iscore.analyze import presets
>>> ws = open_path("data/dense_bf16.parquet")  # doctest: +SKIP
>>> ws.analysis([presets()["verl:decoupled_geo_rs"]]).settings[0]["lr_scale"]  # doctest: +SKIP
>>> family_spec("icepop", (0.5, 5.0), "nemo_rl").truncated_importance_sampling_type
'icepop'
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from iscore.analyze import Analysis, analyze
from iscore.batch import TokenBatch
from iscore.dump import (
    Dump,
    StepRange,
    is_framework_dump,
    resolve_files,
)
from iscore.errors import ConfigError, DumpError
from iscore.frameworks.areal import ArealCorrection, RejectionSampling
from iscore.frameworks.fireworks import FireworksTIS
from iscore.frameworks.nemo_rl import NemoRLSpec
from iscore.frameworks.openrlhf import OpenRLHFCorrection
from iscore.frameworks.skyrl import SkyRLSpec
from iscore.frameworks.slime import MisConfig, SlimeCorrection
from iscore.frameworks.trl import TRLCorrection
from iscore.frameworks.verl import RSCriterion, VerlSpec
from iscore.impact import SettingStats
from iscore.replay import Spec
from iscore.tune import Tuner, TuneResult

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Dumps held in memory (uploads): never written to disk.


def digest(files: Sequence[tuple[str, bytes]]) -> str:
    """sha256 over the files' contents, in order (names do not count).

    >>> digest([("a.parquet", b"x")]) == digest([("b.parquet", b"x")])
    True
    """
    whole = hashlib.sha256()
    for _, data in files:
        whole.update(hashlib.sha256(data).digest())
    return whole.hexdigest()


# --------------------------------------------------------------------------------------------
# One loaded dump and what is derived from it.


def select_steps(batch: TokenBatch, steps: StepRange) -> TokenBatch:
    """The sequences of `batch` whose training step lies in `steps` (the batch itself if all).

    >>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3),
    ...                cu_seqlens=torch.tensor([0, 2, 3]), step=torch.tensor([4, 5]))
    >>> select_steps(b, StepRange(5, 5)).lengths.tolist()
    [1]
    """
    keep = torch.ones(batch.num_sequences, dtype=torch.bool, device=batch.device)
    if steps.lo is not None:
        keep &= batch.step >= steps.lo
    if steps.hi is not None:
        keep &= batch.step <= steps.hi
    if bool(keep.all()):
        return batch
    tokens = keep[batch.seq_index]
    lengths = batch.lengths[keep]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=batch.device)
    torch.cumsum(lengths, 0, out=cu[1:])

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[tokens]

    return TokenBatch(
        rollout=batch.rollout[tokens],
        train=batch.train[tokens],
        cu_seqlens=cu,
        loss_mask=pick(batch.loss_mask),
        policy=pick(batch.policy),
        step=batch.step[keep],
        seq_id=batch.seq_id.filter(pa.array(keep.cpu().numpy())),
        pos=pick(batch.pos),
    )


def summarize(batch: TokenBatch, bins: int = 40) -> dict[str, Any]:
    """Counts, length quantiles and a pre-binned length histogram (`edges`, `counts`)."""
    lengths = batch.lengths.cpu().numpy()
    counts, edges = np.histogram(lengths, bins=min(bins, max(int(np.ptp(lengths)), 1)))
    return {
        "steps": sorted(int(s) for s in torch.unique(batch.step).tolist()),
        "sequences": batch.num_sequences,
        "tokens": batch.num_tokens,
        "loss_tokens": int(batch.loss_mask.sum()),
        "length": {
            "min": int(lengths.min()),
            **{f"p{q}": int(np.quantile(lengths, q / 100)) for q in (10, 50, 90, 99)},
            "max": int(lengths.max()),
        },
        "length_hist": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def sequence_tokens(batch: TokenBatch, step: int, seq_id: Any) -> dict[str, np.ndarray]:
    """The per-token values of sequence (`step`, `seq_id`): pos, rollout, train, d, loss_mask.

    Raises:
        DumpError: no such sequence in the batch.
    """
    ids = batch.seq_id
    try:
        same_id = pc.equal(ids, pa.scalar(seq_id, type=ids.type)).to_numpy(zero_copy_only=False)
    except (pa.ArrowException, TypeError, ValueError):
        same_id = np.zeros(len(ids), dtype=bool)
    hits = np.flatnonzero(same_id & (batch.step.cpu().numpy() == step))
    if not hits.size:
        raise DumpError(f"no sequence seq_id={seq_id!r} step={step} in the loaded dump")
    i = int(hits[0])
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    rollout = batch.rollout[a:b].cpu().numpy()
    train = batch.train[a:b].cpu().numpy()
    return {
        "pos": batch.positions()[a:b].cpu().numpy(),
        "rollout": rollout,
        "train": train,
        "d": train.astype(np.float64) - rollout.astype(np.float64),
        "loss_mask": batch.loss_mask[a:b].cpu().numpy(),
    }


class _Memo:
    """A small thread-safe LRU of computed values (a workspace of a server-side dump is shared
    by every session that opened it). Two callers may compute the same value at once; the
    second result is kept, both are equal."""

    def __init__(self, size: int):
        self._size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


@dataclass(frozen=True, slots=True)
class Source:
    """Where a workspace's dump came from, for display.

    Attributes:
        name: a short label (the file name, or how many files).
        files: the files read (paths, or upload names).
        layout: "token" or "sequence".
        columns: canonical column -> the file's column it was read from.
        dropped_sequences: sequences dropped as invalid (`drop_invalid`).
        provenance: for a dump imported from a framework's own files, one line per file
            saying which framework, source files and steps (empty otherwise).
    """

    name: str
    files: tuple[str, ...]
    layout: str
    columns: tuple[tuple[str, str], ...]
    dropped_sequences: int = 0
    provenance: tuple[str, ...] = ()


class Workspace:
    """A loaded dump and everything derived from it, computed on first use and memoized.

    Every method takes the training steps to look at (`StepRange`, None for all); results
    are memoized per steps (and per setting), so moving back to an earlier selection is free.

    Args:
        batch: the whole dump, loaded.
        source: where it came from.
    """

    def __init__(self, batch: TokenBatch, source: Source):
        self.source = source
        self.full = batch
        self.steps = sorted(int(s) for s in torch.unique(batch.step).tolist())
        self._batches = _Memo(4)
        self._summaries = _Memo(8)
        self._mismatch = _Memo(8)
        self._settings = _Memo(128)
        self._tuners = _Memo(2)
        self._grids = _Memo(16)
        self._other = _Memo(32)

    @classmethod
    def from_dump(cls, dump: Dump) -> Workspace:
        """Load `dump` whole."""
        batch = dump.load()
        files = tuple(f.path for f in dump.files)
        name = Path(files[0]).name if len(files) == 1 else f"{len(files)} files"
        columns = tuple(dump.files[0].columns.source.items())
        provenance = tuple(
            f"imported from {p['framework']}: {', '.join(map(str, p.get('source_files', [])))} "
            f"(steps {', '.join(map(str, p.get('steps', [])))})"
            for p in dump.provenance
            if p.get("framework")
        )
        source = Source(name, files, dump.layout, columns, dump.dropped.sequences, provenance)
        return cls(batch, source)

    def selection(self, steps: StepRange | None) -> StepRange:
        """`steps`, or StepRange() when it covers every step (one memo entry for "all")."""
        if steps is None or (
            (steps.lo is None or steps.lo <= self.steps[0])
            and (steps.hi is None or steps.hi >= self.steps[-1])
        ):
            return StepRange()
        return steps

    def batch(self, steps: StepRange | None = None) -> TokenBatch:
        """The sequences of the selected steps."""
        steps = self.selection(steps)
        return self._batches.get(steps, lambda: select_steps(self.full, steps))

    def summary(self, steps: StepRange | None = None) -> dict[str, Any]:
        """`summarize` of the selected steps."""
        steps = self.selection(steps)
        return self._summaries.get(steps, lambda: summarize(self.batch(steps)))

    def mismatch(self, steps: StepRange | None = None) -> Analysis:
        """The mismatch diagnostics of the selected steps (an analysis without settings)."""
        steps = self.selection(steps)

        def compute() -> Analysis:
            result = analyze(self.batch(steps), [])
            result.source["files"] = list(self.source.files)
            return result

        return self._mismatch.get(steps, compute)

    def setting(self, spec: Spec, steps: StepRange | None = None) -> dict[str, Any]:
        """What one setting does to the selected steps (one entry of `Analysis.settings`)."""

        def compute() -> dict[str, Any]:
            batch = self.batch(steps)
            stats = SettingStats(spec)
            stats.update(batch, spec.replay(batch))
            return stats.compute()

        return self._settings.get((self.selection(steps), spec), compute)

    def analysis(self, specs: Sequence[Spec], steps: StepRange | None = None) -> Analysis:
        """The analysis of the selected steps with `specs`, each setting computed once."""
        base = self.mismatch(steps)
        return replace(base, settings=[self.setting(spec, steps) for spec in specs])

    def tuner(self, steps: StepRange | None = None) -> Tuner:
        """The sorted statistics of the selected steps, for threshold queries."""
        steps = self.selection(steps)
        return self._tuners.get(steps, lambda: Tuner(self.batch(steps)))

    def grid(self, family: str, steps: StepRange | None = None) -> dict[str, list[float]]:
        """`grid` of the selected steps' tuner: slider values per bound of `family`."""
        steps = self.selection(steps)
        return self._grids.get((family, steps), lambda: grid(self.tuner(steps), family))

    def cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """Anything else derived from this dump, memoized with it under `key`."""
        return self._other.get(key, compute)

    def sequence(self, step: int, seq_id: Any) -> dict[str, np.ndarray]:
        """`sequence_tokens` of one sequence of the dump."""
        return sequence_tokens(self.full, step, seq_id)


def open_path(source: str | Sequence[str], *, drop_invalid: bool = False) -> Workspace:
    """Load a dump on this machine: a file, a directory, a glob, or a list of those.

    Raises:
        DumpProblems: the dump has problems (all listed).
    """
    return Workspace.from_dump(Dump(source, drop_invalid=drop_invalid))


def open_uploads(files: Sequence[tuple[str, bytes]], *, drop_invalid: bool = False) -> Workspace:
    """Load a dump from (name, bytes) pairs held in memory.

    Raises:
        DumpProblems: the files have problems (all listed).
    """
    return Workspace.from_dump(Dump.from_buffers(files, drop_invalid=drop_invalid))


def fingerprint(source: str) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of every file a path or glob names: changes when they do.

    Raises:
        DumpError: nothing matches.
    """
    if is_framework_dump(source):  # JSONL / .pt / .pkl files, imported when opened
        root = Path(source)
        paths = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    else:
        paths = resolve_files(source)
    out = []
    for path in paths:
        stat = Path(path).stat()
        out.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Threshold families: Tuner queries, and the same setting in each framework's terms.

Statistic = Literal["token", "geometric", "product", "k3"]


@dataclass(frozen=True, slots=True)
class Family:
    """A family of threshold settings that `Tuner` answers in O(log N).

    Attributes:
        key: the `Tuner` method; its positional arguments are `bounds`, in order.
        label: for people.
        statistic: what the bounds threshold (`Tuner.quantiles` family).
        bounds: the thresholds' names.
        defaults: a common setting, one value per bound.
        span: the least range the thresholds' sliders cover, widened to the data's
            0.1%-99.9% quantiles.
        rule: the family's rule in one line.
        truncates: whether it clamps weights (else `TuneResult.truncated_fraction` is 0).
    """

    key: str
    label: str
    statistic: Statistic
    bounds: tuple[str, ...]
    defaults: tuple[float, ...]
    span: tuple[float, float]
    rule: str
    truncates: bool = False


FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family(
            "token_tis", "Token TIS cap", "token", ("upper",), (2.0,), (1.0, 10.0),
            "w = min(rho, upper) per token, rho = e^d", truncates=True,
        ),
        Family(
            "icepop", "IcePop band", "token", ("lower", "upper"), (0.5, 5.0), (0.1, 10.0),
            "w = rho where lower ≤ rho ≤ upper, else 0",
        ),
        Family(
            "seq_tis", "Sequence TIS cap", "product", ("upper",), (2.0,), (1.0, 10.0),
            "w = min(e^S, upper) for every token of the sequence, S = Σd", truncates=True,
        ),
        Family(
            "geometric_mask", "Geometric sequence mask", "geometric", ("lower", "upper"),
            (0.999, 1.001), (0.999, 1.001),
            "keep a sequence iff lower ≤ e^(S/T) ≤ upper; w = 1",
        ),
        Family(
            "product_mask", "Product sequence mask", "product", ("lower", "upper"), (0.5, 2.0),
            (0.1, 10.0), "keep a sequence iff lower ≤ e^S ≤ upper; w = 1",
        ),
        Family(
            "k3_mask", "k3 sequence mask", "k3", ("threshold",), (0.01,), (1e-4, 0.1),
            "keep a sequence iff its mean per-token k3 ≤ threshold; w = 1",
        ),
    )
}  # fmt: skip
"""The families of `Tuner`, by its method names."""


def query(tuner: Tuner, family: str, values: Sequence[float]) -> TuneResult:
    """What the setting `values` (one per bound) of `family` does, in O(log N)."""
    return getattr(tuner, FAMILIES[family].key)(*values)


def grid(tuner: Tuner, family: str, points: int = 61) -> dict[str, list[float]]:
    """Log-spaced slider values per bound, from the family's span widened to the data's
    0.1%-99.9% quantiles of the statistic it thresholds, rounded to 4 significant digits,
    with the family's default among them.

    Bounds named `lower` run up to 1, `upper` from 1; a lone `threshold` covers the span.
    """
    f = FAMILIES[family]
    q = tuner.quantiles(f.statistic)
    low = max(float(np.nanmin([f.span[0], q[0.001]])), 1e-9)
    high = float(np.nanmax([f.span[1], q[0.999]]))
    ranges = {"lower": (low, 1.0), "upper": (1.0, high), "threshold": (low, high)}
    out = {}
    for bound, default in zip(f.bounds, f.defaults, strict=True):
        values = {float(f"{v:.4g}") for v in np.geomspace(*ranges[bound], points)}
        out[bound] = sorted(values | {default})
    return out


def nearest(values: Sequence[float], target: float) -> float:
    """The value of `values` closest to `target` on a log scale.

    >>> nearest([0.5, 1.0, 2.0], 1.9)
    2.0
    """
    logs = np.log(np.asarray(values, dtype=np.float64))
    return float(values[int(np.argmin(np.abs(logs - np.log(target))))])


def sweep(
    tuner: Tuner, family: str, values: Sequence[float], bound: int, xs: Sequence[float]
) -> list[TuneResult]:
    """`query` with bound number `bound` set to each of `xs`, the others held at `values`."""
    out = []
    for x in xs:
        point = list(values)
        point[bound] = x
        out.append(query(tuner, family, point))
    return out


def _verl_rs(option: str) -> Callable[..., VerlSpec]:
    # verl's k1 statistic is -d, so a band [L, U] on the ratio is the k1 band [1/U, 1/L].
    def build(lower: float, upper: float, name: str) -> VerlSpec:
        return VerlSpec(name=name, rs=(RSCriterion(option, upper=1 / lower, lower=1 / upper),))

    return build


_BUILDERS: dict[str, dict[str, Callable[..., Spec]]] = {
    "token_tis": {
        "verl": lambda u, name: VerlSpec(name=name, is_level="token", is_upper=u),
        "skyrl": lambda u, name: SkyRLSpec(
            name=name, tis_ratio_type="token", token_tis_ratio_clip_high=u
        ),
        "nemo_rl": lambda u, name: NemoRLSpec(
            name=name,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=u,
        ),
        "slime": lambda u, name: SlimeCorrection(use_tis=True, tis_clip=u, name=name),
        "openrlhf": lambda u, name: OpenRLHFCorrection(enable=True, lower=None, upper=u, name=name),
        "trl": lambda u, name: TRLCorrection(mode="token_truncate", clip_max=u, name=name),
        "fireworks": lambda u, name: FireworksTIS(cap=u, name=name),
        "areal": lambda u, name: ArealCorrection(
            use_decoupled_loss=True,
            rejection_sampling=RejectionSampling(action="clamp", upper=u),
            name=name,
        ),
    },
    "icepop": {
        "verl": lambda lo, u, name: VerlSpec(name=name, is_level="token", is_upper=u, is_lower=lo),
        "nemo_rl": lambda lo, u, name: NemoRLSpec(
            name=name,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=u,
            truncated_importance_sampling_ratio_min=lo,
        ),
        "slime": lambda lo, u, name: SlimeCorrection(
            use_tis=True, tis_function="icepop", tis_clip=u, tis_clip_low=lo, name=name
        ),
        "openrlhf": lambda lo, u, name: OpenRLHFCorrection(
            enable=True, type="icepop", lower=lo, upper=u, name=name
        ),
        "trl": lambda lo, u, name: TRLCorrection(
            mode="token_mask", clip_min=lo, clip_max=u, name=name
        ),
        "areal": lambda lo, u, name: ArealCorrection(
            use_decoupled_loss=True,
            rejection_sampling=RejectionSampling(action="mask", upper=u, lower=lo),
            name=name,
        ),
    },
    "seq_tis": {
        "verl": lambda u, name: VerlSpec(name=name, is_level="sequence", is_upper=u),
        "skyrl": lambda u, name: SkyRLSpec(
            name=name, tis_ratio_type="sequence", sequence_tis_ratio_clip_high=u
        ),
        "slime": lambda u, name: SlimeCorrection(
            use_tis=True,
            tis_function="mis",
            mis=MisConfig(tis_level="sequence", tis_upper_bound=u),
            name=name,
        ),
        "trl": lambda u, name: TRLCorrection(mode="sequence_truncate", clip_max=u, name=name),
    },
    "geometric_mask": {
        "verl": _verl_rs("seq_mean_k1"),
        "skyrl": lambda lo, u, name: SkyRLSpec(
            name=name, sequence_mask_metric="geometric", geo_mask_low=lo, geo_mask_high=u
        ),
    },
    "product_mask": {
        "verl": _verl_rs("seq_sum_k1"),
        "skyrl": lambda lo, u, name: SkyRLSpec(
            name=name, sequence_mask_metric="product", product_mask_low=lo, product_mask_high=u
        ),
    },
    "k3_mask": {
        "verl": lambda t, name: VerlSpec(name=name, rs=(RSCriterion("seq_mean_k3", upper=t),)),
    },
}


def frameworks_for(family: str) -> list[str]:
    """The frameworks that have `family` as a setting of their own (the same weights)."""
    return list(_BUILDERS[family])


def setting_name(family: str, values: Sequence[float]) -> str:
    """A default name for a tuned setting, e.g. `icepop_0.5_5`.

    >>> setting_name("icepop", (0.5, 5.0))
    'icepop_0.5_5'
    """
    return "_".join([family, *(f"{v:.4g}" for v in values)])


def family_spec(
    family: str, values: Sequence[float], framework: str, name: str | None = None
) -> Spec:
    """The setting `values` of `family` as `framework`'s own spec (its weights are the family's
    up to the framework's float32 / +-20-clamp details).

    >>> family_spec("token_tis", (2.0,), "verl").is_upper
    2.0

    Raises:
        ConfigError: `framework` has no such setting, or rejects the values.
    """
    builders = _BUILDERS[family]
    if framework not in builders:
        raise ConfigError(
            f"{framework} has no {FAMILIES[family].label.lower()}; "
            f"frameworks that do: {', '.join(builders)}"
        )
    return builders[framework](*values, name or setting_name(family, values))
