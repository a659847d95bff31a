"""The contract every framework module fulfils, and the small types it is written in.

A framework module (`iscore/frameworks/verl.py`, ...) is the one place that knows that framework:
its config keys and how they parse into a frozen spec, its replay, its presets, its mapping to and
from the framework-neutral `iscore.frameworks.canonical.Canonical`, the threshold families it can
express, its loss aggregation, the metric names it logs, how its config snippet is written, its
traps and the upstream commit it follows. It exposes all of that as one `Framework` value named
`FRAMEWORK`; the registry (`iscore.frameworks`) lists the modules, and everything else asks the
registry.

>>> from iscore import frameworks
>>> fw = frameworks.get("verl")
>>> fw.name, fw.upstream.repository
('verl', 'verl-project/verl')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from iscore.errors import ConfigError

if TYPE_CHECKING:
    from iscore.frameworks.canonical import Canonical, Translation
    from iscore.frameworks.spec import Spec
    from iscore.packed import TokenBatch

Measure = Callable[["Spec"], dict[str, float]]
"""What a setting does to a dump (`iscore.stats.setting.quick_stats` bound to it), for traps that
quote the dump's numbers without the framework module calling up into the statistics."""

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@dataclass(frozen=True, slots=True)
class Aggregation:
    """How a framework turns per-token losses into the batch loss.

    Attributes:
        mode: token-mean (sum / tokens), seq-mean-token-mean (mean over sequences of each
            sequence's token mean) or seq-mean-token-sum (mean over sequences of token sums).
        shrinks: whether tokens a correction rejects leave the denominator (verl's decoupled
            rejection sampling under token-mean) instead of only zeroing their numerator.
    """

    mode: AggregationMode = "token-mean"
    shrinks: bool = False

    def describe(self) -> str:
        return self.mode + (", rejected tokens leave the denominator" if self.shrinks else "")

    def in_words(self) -> str:
        """What the mode does, for a sentence that starts with the framework's name."""
        words = {
            "token-mean": "averages the loss over the batch's tokens",
            "seq-mean-token-mean": "averages each sequence's tokens, then the sequences",
            "seq-mean-token-sum": "sums each sequence's tokens, then averages the sequences",
        }[self.mode]
        return words + (" (the tokens it rejects leave the count)" if self.shrinks else "")


@dataclass(frozen=True, slots=True)
class Upstream:
    """The framework source a module replays.

    >>> print(Upstream("verl-project/verl", "1dda039b9c63", "2026-08-22"))
    verl-project/verl@1dda039b (2026-08-22)
    """

    repository: str
    commit: str
    date: str

    def __str__(self) -> str:
        return f"{self.repository}@{self.commit[:8]} ({self.date})"


@dataclass(frozen=True, slots=True)
class Version:
    """A version of a framework's correction other than its pinned release: an open pull
    request's, pinned at its head commit. A config document names it (`"version": "pr6800"`);
    it changes only what its pull request changes.

    >>> head = Upstream("verl-project/verl", "b26dfa5c8", "2026-06-21")
    >>> v = Version("pr6800", 6800, "open", head, "rollout_rs may hold binary_kl (KPop)")
    >>> print(v)
    pr6800: open PR #6800, head b26dfa5c (2026-06-21): rollout_rs may hold binary_kl (KPop)
    >>> v.status
    'open PR, head b26dfa5c'
    """

    name: str
    pr: int
    state: str
    upstream: Upstream
    changes: str

    def __post_init__(self) -> None:
        if self.name != f"pr{self.pr}":
            raise ValueError(f"Expected a version named pr{self.pr}, but got {self.name!r}")

    @property
    def status(self) -> str:
        """Where the pull request stands, for listings: "open PR, head b26dfa5c"."""
        return f"{self.state} PR, head {self.upstream.commit[:8]}"

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.state} PR #{self.pr}, head {self.upstream.commit[:8]} "
            f"({self.upstream.date}): {self.changes}"
        )


@dataclass(frozen=True, slots=True)
class Citation:
    """Where a published number comes from: a name a reader recognizes and a link to it.

    >>> print(Citation("verl docs, Rollout Correction", "https://example.org/rollout_corr"))
    verl docs, Rollout Correction (https://example.org/rollout_corr)
    """

    name: str
    url: str

    def __post_init__(self) -> None:
        if not self.name or not self.url.startswith("https://"):
            raise ValueError(f"Expected a source name and an https link, but got {self!r}")

    def __str__(self) -> str:
        return f"{self.name} ({self.url})"


@dataclass(frozen=True, slots=True)
class HealthBand:
    """A published health band on one of iscore's mismatch statistics: a value inside it is
    what its source calls normal, one outside it is elevated (`iscore.advice.health`).

    Attributes:
        statistic: the `iscore.stats.mismatch` statistic it bounds (`mismatch.METRIC_NAMES` keys).
        low: the lowest healthy value, or None for no lower limit.
        high: the highest healthy value, or None for no upper limit.
        logged_as: the metric the source states the band for, as the framework logs it.
        meaning: what a value outside the band means, as the source says it.
        source: where the band is published.

    >>> band = HealthBand("k3", None, 1e-3, "gen_kl_error", "investigate", Citation("x", "https://x"))
    >>> band.describe(), band.contains(4e-4), band.contains(0.05)
    ('<= 0.001', True, False)
    """

    statistic: str
    low: float | None
    high: float | None
    logged_as: str
    meaning: str
    source: Citation

    def __post_init__(self) -> None:
        if self.low is None and self.high is None:
            raise ValueError(f"Expected a band with at least one limit, but got {self!r}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"Expected low <= high, but got {self.low} > {self.high}")

    def contains(self, value: float) -> bool:
        """Whether `value` is healthy by this band (limits included, as the sources write
        them: "below", "at most")."""
        above = self.low is None or value >= self.low
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        """The healthy range in symbols: "<= 1.05", ">= 0.3" or "in [0.5, 2]"."""
        return limits(self.low, self.high)


def limits(low: float | None, high: float | None) -> str:
    """A range with either end open, in symbols.

    >>> limits(None, 1.05), limits(0.3, None), limits(0.5, 2.0)
    ('<= 1.05', '>= 0.3', 'in [0.5, 2]')
    """
    if low is None:
        return f"<= {high:g}"
    if high is None:
        return f">= {low:g}"
    return f"in [{low:g}, {high:g}]"


@dataclass(frozen=True, slots=True)
class ReferencePoint:
    """A published measurement of the mismatch in one setting, to place a dump among
    (`iscore.advice.reference`).

    Attributes:
        setting: what was measured, in words ("bf16 rollout", "FP8 rollout").
        model: the model, as the source names it.
        precision: the rollout's precision (and the trainer's where it differs).
        statistic: the `iscore.stats.mismatch` statistic the value is compared with.
        value: the published value.
        logged_as: the metric the source reports, as it names it.
        source: where it is published.
        note: what differs between the source's metric and iscore's statistic, if anything.
    """

    setting: str
    model: str
    precision: str
    statistic: str
    value: float
    logged_as: str
    source: Citation
    note: str = ""


@dataclass(frozen=True, slots=True)
class Trap:
    """A way a framework's setting surprises its users, in plain words.

    Attributes:
        name: a short identifier, e.g. "k1-reciprocal-bounds".
        text: the trap in a sentence or two.
        check: given a dump and a way to measure a setting on it, the warning with that dump's
            numbers, or None where the trap does not bite it; None means it always applies.
        about: whether a setting of the framework is one the trap is about (a version's, a
            loss type's, a key's); None: every setting. A recommendation names the trap only
            where its pick or the setting to beat is one.
    """

    name: str
    text: str
    check: Callable[[TokenBatch, Measure], str | None] | None = None
    about: Callable[[Any], bool] | None = None

    def warning(self, batch: TokenBatch, measure: Measure) -> str | None:
        """The warning for `batch`, or None where the trap does not bite it."""
        return self.text if self.check is None else self.check(batch, measure)


@dataclass(frozen=True, slots=True)
class BatchFields:
    """What a framework's own batch object holds for a dump, in the arguments of
    `iscore.dump.writer.DumpWriter.add`: tensors, arrays or lists exactly as the framework keeps
    them (never copied here), read by the writer later.

    Per-token fields share one layout: padded [B, T] (any alignment; `mask` marks the tokens)
    or B per-sequence 1-D arrays. A framework module's `read_batch` returns one `BatchFields`
    per padded block of its object (OpenRLHF's experiences, AReaL's trajectory groups).

    Attributes:
        rollout_logprobs: the rollout engine's log-probs, per token.
        train_logprobs: the trainer's recompute (pi_old), per token.
        mask: which positions are tokens of the dump (bool or 0/1), or None for lists.
        loss_mask: of those tokens, the ones the loss trains on; per token or per sequence.
        policy_logprobs: the current policy's log-probs, where the framework holds them.
        floor_logprobs: the trainer's log-probs from a second recompute (the noise floor);
            no framework holds one, so only `DumpWriter.add`'s caller gives it.
        rollout_topk_ids, rollout_topk_logprobs, train_topk_logprobs: the engine's top-k
            ids and log-probs and the trainer's at them, per token ([B, T, k]); given by the
            caller too.
        advantages: per token, or [B] per sequence.
        token_ids: the sampled tokens, per token.
        entropy: per token.
        rewards: [B].
        group_ids: [B] the prompt group of each sequence (integers or strings).
        seq_ids: [B] the framework's own sequence ids, unique within a step.
        train_token_ids: the ids of the tokens the trainer scored, per token.
        weight_versions, replicas, ranks, hosts, devices: [B] each sequence's metadata (the
            policy version it was sampled with, the engine instance, the trainer's rank, the
            host, the GPU model); given by the caller.
    """

    rollout_logprobs: Any
    train_logprobs: Any
    mask: Any = None
    loss_mask: Any = None
    policy_logprobs: Any = None
    floor_logprobs: Any = None
    rollout_topk_ids: Any = None
    rollout_topk_logprobs: Any = None
    train_topk_logprobs: Any = None
    advantages: Any = None
    token_ids: Any = None
    entropy: Any = None
    rewards: Any = None
    group_ids: Any = None
    seq_ids: Any = None
    train_token_ids: Any = None
    weight_versions: Any = None
    replicas: Any = None
    ranks: Any = None
    hosts: Any = None
    devices: Any = None


@dataclass(frozen=True, eq=False)
class Framework:
    """Everything iscore knows about one RL framework, behind one interface.

    Attributes:
        name: the `framework:` value of its configs.
        title: its name for people.
        upstream: the commit its semantics were read from (its pinned release).
        versions: its other versions a config may name (`"version"`): open pull requests'
            corrections, each pinned at its head; a spec of one has `spec.version` set.
        spec_types: the spec classes `parse` returns.
        parse: its own config (a mapping with a top-level `framework:`) -> a frozen spec.
        presets: the named settings, built on first use.
        default: the preset its users most likely run: what its docs and examples switch on
            when the correction is enabled (the app's starting point).
        to_canonical: a spec -> the framework-neutral setting.
        from_canonical: a neutral setting and a name -> candidate specs, each with notes on
            what it could not express (`iscore.advice.conversion.export` picks the closest).
        render: the body of `spec.to_config()` (without `framework:`/`name:`) and a format
            ("yaml", "flags" or None for the usual one) -> the text to paste.
        aggregation: a spec -> the loss aggregation it trains with.
        families: the `iscore.advice.tuning.FAMILIES` it expresses exactly.
        metrics: per iscore mismatch statistic, the name(s) it logs it under.
        bands: the health bands its docs publish on iscore's mismatch statistics.
        gates: the bars its CI or docs hold a run to, on iscore's mismatch statistics
            (`iscore gate --table`; `meaning` says how its metric relates to iscore's).
        support: how it scores the trainer over the support a truncating engine sampled
            from (top-p / top-k with renormalized log-probs), or that it has no way yet: the
            fix `support_normalized` names (docs/distribution.md); "" where none is known.
        references: mismatch measurements published in its own repository (issues, pull
            requests, docs), to place a dump among (`iscore.advice.reference`).
        columns: per canonical dump column, the names it writes for it (its batch's keys),
            found in a dump file as aliases (`iscore.dump.columns.aliases`).
        traps: its traps.
        comments: a spec -> what a reader of its snippet would misread, one line each: every
            snippet of the framework carries them as comments above its keys (verl's k1
            bounds are the reciprocals of the ratios they keep).
        snippet_formats: the formats `render` accepts, the usual one first.
        snippet_keys: dotted config keys every snippet shows even at iscore's default: where
            iscore's default is not the framework's own (TRL's `use_vllm`).
        generations: older config generations it can write (verl only).
        to_generation: (spec, generation) -> `GenerationConfig`, when `generations`.
        segments: whether its `from_canonical` reads the canonical "segment" level (ROLL's);
            for the others `iscore.advice.conversion.export` first writes segment-level
            components over the whole sequence, with a note each (`canonical.without_segments`).
        read_batch: the framework's own batch object at the point where both log-probs exist
            (verl's `DataProto`, TRL's loss inputs, ...) -> its `BatchFields`, one per padded
            block; read duck-typed, so iscore never imports the framework. None where iscore
            has no adapter. Raises `DumpError` naming what is missing and where it comes from.
    """

    name: str
    title: str
    upstream: Upstream
    spec_types: tuple[type, ...]
    parse: Callable[[Mapping[str, Any]], Spec]
    presets: Callable[[], Mapping[str, Spec]]
    to_canonical: Callable[[Any], Canonical]
    from_canonical: Callable[[Canonical, str], list[Translation]]
    render: Callable[[Mapping[str, Any], str | None], str]
    default: str = ""
    versions: tuple[Version, ...] = ()
    aggregation: Callable[[Any], Aggregation] = lambda spec: Aggregation()
    families: frozenset[str] = frozenset()
    metrics: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    bands: tuple[HealthBand, ...] = ()
    gates: tuple[HealthBand, ...] = ()
    support: str = ""
    references: tuple[ReferencePoint, ...] = ()
    columns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    traps: tuple[Trap, ...] = ()
    comments: Callable[[Any], tuple[str, ...]] = lambda spec: ()
    snippet_formats: tuple[str, ...] = ("yaml", "flags")
    snippet_keys: tuple[str, ...] = ()
    generations: tuple[str, ...] = ()
    to_generation: Callable[[Any, str], Any] | None = None
    segments: bool = False
    read_batch: Callable[[Any], Sequence[BatchFields]] | None = None

    def closest(self, setting: Canonical, name: str) -> Translation:
        """This framework's setting closest to `setting`, with notes on what differs: identical
        canonical forms first, then the same rule computed along another numerical path, then
        the fewest notes; ties go to the framework's first candidate."""

        def rank(candidate: Translation) -> tuple[int, int]:
            result = self.to_canonical(candidate[0])
            same = 2 if result == setting else 1 if result.loosely_equals(setting) else 0
            return -same, len(candidate[1])

        return min(self.from_canonical(setting, name), key=rank)

    def express(self, setting: Canonical, name: str) -> Spec | None:
        """This framework's setting that computes `setting` (up to the +-20 clamp and float32
        details of `Canonical.loosely_equals`), or None where it cannot."""
        spec, _ = self.closest(setting, name)
        result = self.to_canonical(spec)
        return spec if result == setting or result.loosely_equals(setting) else None

    def version(self, name: str | None) -> Version | None:
        """The version called `name`; None for None (the pinned release).

        Raises:
            ConfigError: no such version; the message lists this framework's.
        """
        if name is None:
            return None
        for version in self.versions:
            if version.name == name:
                return version
        known = ", ".join(v.name for v in self.versions) or "none but its pinned release"
        raise ConfigError(
            f"Expected `version` to be null (the pinned {self.upstream}) or one of {self.name}'s "
            f"versions ({known}), but got {name!r}"
        )

    def upstream_of(self, spec: object) -> str:
        """The source `spec` replays, for reports and exports: the pinned commit, or its
        version's pull request and head."""
        version = self.version(getattr(spec, "version", None))
        if version is None:
            return str(self.upstream)
        return f"{version.upstream}, {version.state} PR #{version.pr}"

    def owns(self, spec: object) -> bool:
        """Whether `spec` is one of this framework's settings."""
        return isinstance(spec, self.spec_types)

    def __repr__(self) -> str:
        return f"Framework({self.name!r})"
