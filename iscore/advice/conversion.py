"""Export a correction setting: as its framework's own config, on the canonical catalogue, and
as the closest setting of another framework.

Three things, each the inverse of something `parse` does or a bridge between frameworks:

- `snippet(spec)`: the text a user pastes into the framework's own config (YAML with the
  framework's nesting, or its command-line flags), and `to_file_text(spec)`, the iscore config
  file `iscore replay --config FILE` reads as is. Both come from the spec's `to_config()`, which
  each framework module writes next to its `parse`.
- `canonical(spec)`: the setting on the catalogue of docs/corrections.md
  (`iscore.frameworks.canonical`), as a tuple of components (weights, masks, batch normalization)
  with the numerical details that decide whether two frameworks compute the same thing (the +-20
  exponent clamp, float32 comparisons, NeMo-RL's overflow to 0).
- `export(spec, to)`: the target framework's closest setting. `exact` only when the target
  replays identically: by construction when the canonical forms agree, or, for settings that
  are the same rule computed along a different floating-point path, when a `batch` given shows
  identical weights and masks. Whatever the target cannot express is a note, and with a
  `batch` the difference is measured (`iscore.stats.setting.quick_stats` of both).

>>> from iscore.frameworks import nemo_rl
>>> out = export(nemo_rl.PRESETS["nemo_icepop"], "openrlhf")
>>> out.exact, canonical(out.spec).method
(True, 'icepop')
>>> print(out.text)
--algo.advantage.is_correction_enable \\
--algo.advantage.is_correction_type icepop \\
--algo.advantage.is_correction_threshold 0.5 5.0
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import torch

from iscore import frameworks
from iscore.dump import Data, load_data
from iscore.errors import ConfigError, clip, quote
from iscore.frameworks import (
    Canonical,
    Framework,
    Setting,
    Spec,
    check_choice,
    resolve,
    sentence,
    without_segments,
    yaml_text,
)
from iscore.packed import TokenBatch
from iscore.stats import aggregation_of, quick_stats


def canonical(spec: Spec) -> Canonical:
    """Map a framework's setting onto the canonical catalogue.

    >>> from iscore.frameworks import verl
    >>> c = canonical(verl.PRESETS["decoupled_geo_rs_token_tis"])
    >>> for x in c.components:
    ...     print(x.describe())
    token TIS: w = min(rho, 2)
    geometric sequence mask: drop sequences unless 0.999001 <= e^G <= 1.001

    Raises:
        ConfigError: `spec` is not a setting of one of iscore's frameworks.
    """
    return frameworks.of(spec).to_canonical(spec)


_DIFFERENCE_KEYS = ("weight_mean", "token_masked_fraction", "seq_masked_fraction", "lr_scale")


Syntax = Literal["yaml", "flags"]
"""A snippet's syntax: the config's own YAML nesting, or command-line flags (launch flags,
Hydra-style `key=value` overrides); `#` starts a comment in both."""


@dataclass(frozen=True, slots=True)
class Export:
    """A setting converted to (or written for) one framework.

    Attributes:
        spec: the target framework's setting (for an older verl generation, the current-
            generation setting that generation's config expresses).
        text: the snippet to paste into the target's config (`snippet`).
        syntax: the syntax of `text`.
        exact: whether `spec` replays identically to the source (weight and keep).
        notes: one line each: what the target could not express and what was chosen
            instead, numerical fine print, and loss-aggregation differences.
        difference: with a batch, `{"source": {...}, "target": {...}, "identical": bool}`:
            weight_mean, token_masked_fraction, seq_masked_fraction and lr_scale of both
            (`iscore.stats.setting.quick_stats`), and whether weights and masks agree exactly.
        source: the setting converted.
        target: what it was written for: the framework's name and upstream commit, or its
            older config generation.
    """

    spec: Spec
    text: str
    syntax: Syntax
    exact: bool
    notes: tuple[str, ...] = ()
    difference: dict[str, Any] | None = None
    source: Spec | None = None
    target: str = ""

    def header(self) -> list[str]:
        """What the snippet alone does not say, as comment lines (`# ...`): exact or not,
        from what to what, each note, and with a batch both settings' numbers. They go above
        the snippet (a comment inside a run of ` \\`-continued flags would end it)."""
        # Names come from the user's config: a newline in one must not end the comment.
        source = (
            "" if self.source is None else f"{clip(self.source.name)} ({self.source.framework}) "
        )
        lines = [f"# {'exact' if self.exact else 'not exact'}: {source}-> {self.target}"]
        lines += [f"# note: {clip(note, 4000)}" for note in self.notes]
        for side in ("source", "target") if self.difference else ():
            stats = self.difference[side]
            lines.append(
                f"# {side}: mean w {stats['weight_mean']:.4g}, tokens masked "
                f"{stats['token_masked_fraction']:.2%}, sequences masked "
                f"{stats['seq_masked_fraction']:.2%}, LR scale {stats['lr_scale']:.4g}"
            )
        return lines

    def commented(self) -> str:
        """The snippet under its `header`: what `iscore export` prints, so that a redirect to
        a file keeps whether it is exact and what it could not express."""
        return "\n".join([*self.header(), self.text.rstrip()]) + "\n"


def export(
    setting: Setting,
    to: str,
    *,
    generation: str | None = None,
    batch: Data | None = None,
) -> Export:
    """The closest setting of framework `to` to `spec`, with its snippet and what differs.

    Args:
        setting: the source setting: any framework's spec, config mapping, config path or
            preset name (`iscore.frameworks.resolve.resolve`).
        to: the target framework, one of `iscore.frameworks.NAMES`.
        generation: an older config generation to write, for a framework that has them
            (`Framework.generations`; verl: "gen0", "gen1", "gen2", "gen3", or a version such
            as "v0.6.0"); None is current.
        batch: a dump to measure both settings on (`Export.difference`) and to verify
            settings that are the same rule computed along different numerical paths: a
            loaded batch, an opened `Dump` or its path (read whole).

    >>> from iscore.frameworks import nemo_rl
    >>> out = export(nemo_rl.PRESETS["nemo_icepop"], "verl")
    >>> out.exact, out.spec.is_lower, out.spec.is_upper
    (True, 0.5, 5.0)

    Raises:
        ConfigError: an unknown `to` or `generation`, or `generation` for a framework that has
            no older generations.
    """
    spec = resolve(setting)
    check_choice("to", to, frameworks.NAMES)
    target_framework = frameworks.get(to)
    batch = None if batch is None else load_data(batch)
    if generation is not None and target_framework.to_generation is None:
        with_generations = [fw.name for fw in frameworks.every() if fw.generations]
        raise ConfigError(
            f"Expected `generation` to be None for {to} (only {', '.join(with_generations)} "
            f"has config generations), but got {quote(generation)}"
        )
    source = canonical(spec)
    name = spec.name if spec.name != spec.framework else to
    if spec.framework == to:
        target, notes = spec, ()
    else:
        aim, first = source, ()
        if not target_framework.segments:
            aim, first = without_segments(source, target_framework.title)
        target, notes = target_framework.closest(aim, name)
        notes = (*first, *notes)
    notes = list(notes)
    text = None
    generation_exact = True
    if generation is not None:
        written = target_framework.to_generation(target, generation)
        target, generation_exact = written.spec, written.exact
        notes += written.notes
        if written.config != target.to_config():  # an older generation's own keys
            text = _render(target_framework, written.config, None)
    result = canonical(target)
    if result.anchor != source.anchor:
        notes.append(_ANCHOR_NOTES[source.anchor, result.anchor].format(to=target_framework.title))
    identical, difference = _measure(spec, target, batch, notes)
    if result == source:
        exact = identical is not False
        if identical is False:
            notes.append("Replays differently on this dump although the settings agree.")
    elif result.loosely_equals(source):
        exact = identical is True
        notes.append(_loose_note(identical))
    else:
        exact = False
        title = target_framework.title
        target_label = title if generation is None else f"{title} {generation}"
        notes.append(
            f"The {_title(spec)} setting: {source.describe()}. "
            f"The {target_label} setting: {result.describe()}."
        )
    exact = exact and generation_exact
    notes += _aggregation_notes(spec, target)
    notes = [sentence(note) for note in notes]
    written = (
        f"{to} in its {generation} config keys"
        if generation is not None
        else f"{to} (as of {target_framework.upstream_of(target)})"
    )
    return Export(
        target,
        text or snippet(target),
        target_framework.snippet_formats[0],
        exact,
        tuple(notes),
        difference,
        spec,
        written,
    )


_ANCHOR_NOTES = {
    ("rollout", "recompute"): "{to} recomputes the old log-probs and anchors its PPO ratio on "
    "them; the source skips the recompute (bypass, PPO anchored on the rollout)",
    ("none", "recompute"): "{to} keeps a PPO loss anchored on the recompute; the source's loss "
    "is REINFORCE-style, weighted by the current policy over the rollout",
    ("recompute", "rollout"): "{to} skips the recompute and anchors its PPO ratio on the "
    "rollout (bypass); the source anchors on the recompute",
    ("none", "rollout"): "{to} anchors its PPO ratio on the rollout (bypass); the source's "
    "loss is REINFORCE-style, weighted by the current policy",
    ("recompute", "none"): "{to}'s loss is REINFORCE-style (no PPO ratio); the source's is a "
    "PPO loss anchored on the recompute",
    ("rollout", "none"): "{to}'s loss is REINFORCE-style (no PPO ratio); the source's is a PPO "
    "loss anchored on the rollout",
}
"""What changes when the target's loss is anchored elsewhere than the source's."""


def _loose_note(identical: bool | None) -> str:
    note = (
        "The same rule, computed along another numerical path (the +-20 exponent clamp, "
        "float32 or overflow handling, bounds on ratios or on log-ratios): the two can differ "
        "only for tokens with extreme log-ratios or ratios within rounding of a bound"
    )
    if identical is None:
        return note + "; give a dump to check."
    return note + ("; identical on this dump." if identical else "; they differ on this dump.")


def _measure(
    source: Spec, target: Spec, batch: TokenBatch | None, notes: list[str]
) -> tuple[bool | None, dict[str, Any] | None]:
    """Replay both on `batch`: (weights and masks identical, the quick_stats difference)."""
    if batch is None:
        return None, None
    try:
        a, b = source.replay(batch), target.replay(batch)
        stats = {"source": quick_stats(batch, source), "target": quick_stats(batch, target)}
    except ConfigError as e:
        notes.append(f"not measured on the batch: {e}")
        return None, None
    identical = bool(torch.equal(a.weight, b.weight) and torch.equal(a.keep, b.keep))
    difference: dict[str, Any] = {
        side: {key: values.value(key) for key in _DIFFERENCE_KEYS} for side, values in stats.items()
    }
    difference["identical"] = identical
    return identical, difference


def _title(spec: Spec) -> str:
    return frameworks.of(spec).title


def _aggregation_notes(source: Spec, target: Spec) -> list[str]:
    """A note when the two frameworks turn the same weights into different step sizes: another
    aggregation mode, or (for settings that remove tokens) another denominator."""
    a, b = aggregation_of(source), aggregation_of(target)
    removes = bool(canonical(source).masks or canonical(target).masks)
    if a.mode == b.mode and (a.shrinks == b.shrinks or not removes):
        return []
    return [
        f"{_title(source)} {a.in_words()}; {_title(target)} {b.in_words()}: the same "
        "weights give a different step size (compare the LR scale)."
    ]


# ------------------------------------------------------------------ snippets


def snippet(spec: Spec, fmt: Literal["yaml", "flags"] | None = None) -> str:
    """The text to paste into the framework's own config for `spec`, as a person would write
    it: only the keys that differ from the framework's defaults (and those it needs whatever
    their value, `Framework.snippet_keys`); numbers with the digits the framework's float32
    comparisons can tell apart (1/1.001 is 0.999001), each such number commented with what it
    is; never empty (a setting that is the framework's default says so).

    Args:
        spec: any framework's setting.
        fmt: "yaml" (verl, SkyRL, NeMo-RL, AReaL, TRL, Fireworks: the config's own nesting),
            "flags" (slime, OpenRLHF: their launch flags, one per line with ` \\`
            continuations; verl, SkyRL, NeMo-RL: Hydra-style `key=value` overrides; TRL:
            `--key value`), or None for the framework's usual form.

    >>> from iscore.frameworks import openrlhf, verl
    >>> print(snippet(openrlhf.PRESETS["openrlhf_icepop"]))
    --algo.advantage.is_correction_enable \\
    --algo.advantage.is_correction_type icepop \\
    --algo.advantage.is_correction_threshold 0.5 5.0
    >>> print(snippet(verl.PRESETS["decoupled_geo_rs"]), end="")  # doctest: +ELLIPSIS
    # rollout_rs seq_mean_k1 keeps e^G in [0.999001, 1.001]: verl compares k1 = -log(ratio) ...
    algorithm:
      rollout_correction:
        rollout_rs: seq_mean_k1
        rollout_rs_threshold: '0.999_1.001'

    Raises:
        ConfigError: a format the framework has no form for.
    """
    framework = frameworks.of(spec)
    config, meanings = _shown(spec)
    text = _render(framework, config, fmt)
    if not text.strip():
        text = f"# nothing to set: {framework.title}'s default ({canonical(spec).describe()})"
    above = "".join(f"# {line}\n" for line in framework.comments(spec))
    return above + _commented(text, meanings)


def shown_config(spec: Spec) -> dict[str, Any]:
    """The config `snippet` writes, as a mapping its framework's `parse` reads: it parses to
    `spec`, up to float32 rounding of the bounds (tests/unit/test_export.py checks that every
    setting replays identically from it).

    >>> from iscore.frameworks import trl
    >>> shown_config(trl.PRESETS["trl_default"])
    {'framework': 'trl', 'name': 'trl_default', 'use_vllm': True}
    """
    return _shown(spec)[0]


def _shown(spec: Spec) -> tuple[dict[str, Any], dict[str, str]]:
    """The snippet's config and the meanings of its numbers: bounds shortened to their
    float32 value where the framework then computes exactly the same weights and masks (a
    bound that only meets float32 tensors), else as they are (AReaL's log-space bounds, verl's
    log of a truncation cap, which float64 arithmetic carries). Never for weights divided by
    their batch mean: the mean carries a bound's last float64 digits into every weight, so
    a probe cannot show that shortening is safe on every batch."""
    framework = frameworks.of(spec)
    config = _pruned(spec.to_config(), _defaults(framework), framework.snippet_keys)
    if framework.to_canonical(spec).normalize is not None:
        return _rounded(config, shorten=False)
    short, meanings = _rounded(config, shorten=True)
    if short != config:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # odd but legal settings warn when parsed
            shortened = framework.parse(short)
        batch = _probe(numbers(config))
        a, b = spec.replay(batch), shortened.replay(batch)
        if not (torch.equal(a.weight, b.weight) and torch.equal(a.keep, b.keep)):
            return _rounded(config, shorten=False)
    return short, meanings


def numbers(config: Any) -> list[float]:
    """Every float of a config, also those inside strings (flags, verl's "lo_hi")."""
    if isinstance(config, Mapping):
        return [x for value in config.values() for x in numbers(value)]
    if isinstance(config, list | tuple):
        return [x for value in config for x in numbers(value)]
    if isinstance(config, float):
        return [config]
    if isinstance(config, str):
        return [float(m.group()) for m in _NUMBER.finditer(config)]
    return []


def _probe(values: Sequence[float], steps: int = 40) -> TokenBatch:
    """Sequences on which two settings whose bounds differ by a float32 step replay some
    weight or mask differently: one-token sequences whose log-ratio d takes every float32
    within `steps` of where a bound v can sit (d = +-v, +-log v, +-sqrt(2|v|), a small k1 or
    k3 bound), and `_LONG`-token ones whose d sum to each of those (a sequence bound binds on
    them while their geometric mean stays near 1). Each beside a current policy a little off
    the trainer's: a policy loss's factor multiplies a capped weight, and the product's last
    float32 digit can tell a bound from its shortened value where neither factor alone does."""
    centers = []
    for v in values:
        centers += [v, math.sqrt(2 * abs(v))]
        if v > 0:
            centers.append(math.log(v))
    around = np.arange(-steps, steps + 1, dtype=np.int32)
    ds, lengths = [np.zeros(1, np.float32)], [np.ones(1, np.int64)]
    for c in centers:
        # The magnitudes `steps` float32 steps either side of |c| (none below 0), both signs.
        bits = np.float32(min(abs(c), 60.0)).view(np.int32) + around
        magnitudes = bits[bits >= 0].view(np.float32)
        magnitudes = magnitudes[np.isfinite(magnitudes)]
        ds += [magnitudes, -magnitudes]
        lengths.append(np.ones(2 * magnitudes.size, np.int64))
        spread = np.float32(min(abs(c), 60.0) / _LONG)
        ds += [np.full(_LONG, spread), np.full(_LONG, -spread)]
        lengths.append(np.full(2, _LONG))
    d = torch.from_numpy(np.concatenate(ds)).repeat(len(_POLICY_LAGS))
    T = torch.from_numpy(np.concatenate(lengths)).repeat(len(_POLICY_LAGS))
    lag = torch.tensor(_POLICY_LAGS).repeat_interleave(d.numel() // len(_POLICY_LAGS))
    rollout = torch.full((d.numel(),), -1.0)
    return TokenBatch(
        rollout=rollout,
        train=rollout + d,
        policy=rollout + d + lag,
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), T.cumsum(0)]),
    )


_LONG = 64
"""Tokens of the probe's long sequences."""

_POLICY_LAGS = (0.0, -0.1, -0.037, -0.011, 0.013, 0.041, 0.1)
"""Log-ratios of the current policy to the trainer's, beside every d of a probe."""


@cache
def _defaults(framework: Framework) -> dict[str, Any]:
    """The config of the framework's setting when no key is given."""
    return framework.parse({"framework": framework.name}).to_config()


def _pruned(
    config: Mapping[str, Any], defaults: Mapping[str, Any], keep: Sequence[str], prefix: str = ""
) -> dict[str, Any]:
    """`config` without the keys whose value is the default (sections left empty go too)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = prefix + key
        default = defaults.get(key, _MISSING)
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            inner = _pruned(value, default, keep, path + ".")
            if inner or path in keep:
                out[key] = inner if inner else dict(value)
        elif value != default or path in keep or key in ("framework", "name"):
            out[key] = value
    return out


_MISSING = object()

_NUMBER = re.compile(r"(?<![\d.])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\d.])")


def _rounded(config: Any, *, shorten: bool) -> tuple[Any, dict[str, str]]:
    """`config` with every float (also inside strings: flags, verl's "lo_hi") at the shortest
    decimal that is the same float32 (if `shorten`), and what each number that was long
    stands for."""
    meanings: dict[str, str] = {}

    def number(value: float) -> float:
        short = shortest(value) if shorten else value
        meaning = _meaning(value, shortened=short != value)
        if meaning is not None:
            meanings[repr(short)] = meaning
        return short

    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(v) for v in value)
        if isinstance(value, float):
            return number(value)
        if isinstance(value, str):
            return _NUMBER.sub(lambda m: repr(number(float(m.group()))), value)
        return value

    return walk(config), meanings


def shortest(value: float) -> float:
    """The shortest decimal with the same float32 value as `value` (frameworks compare float32
    tensors with their bounds, which torch casts to float32); `value` itself where that is not
    shorter or float32 cannot hold it.

    >>> shortest(1 / 1.001), shortest(2.0), shortest(0.1 + 0.2)
    (0.999001, 2.0, 0.3)
    """
    if not math.isfinite(value) or value == 0.0:
        return value
    single = np.float32(value)
    if not np.isfinite(single) or single == 0.0:
        return value
    short = float(np.format_float_scientific(single, unique=True, trim="-"))
    return short if len(repr(short)) < len(repr(value)) else value


def _meaning(value: float, shortened: bool = True) -> str | None:
    """What a long number is, where a short expression gives it (1/x, ln x, e^x), else that
    it was `shortened` to float32 precision; None for a number that is short already or only
    float noise away from its shortened form (51299999.99999999 is 5.13e7), and for one kept
    whole that no short expression gives.

    >>> _meaning(1 / 1.001), _meaning(-math.log(0.999)), _meaning(51299999.99999999)
    ('1/1.001', '-ln 0.999', None)
    >>> _meaning(1.23456789)
    '1.23456789 to float32 precision'
    """
    short = shortest(value)
    if short == value or abs(short - value) <= 1e-12 * abs(value):
        return None
    forms = [("1/{}", 1 / value, 1)]
    if value > 0:
        forms.append(("e^{}", math.log(value), 1))
    if abs(value) < 700:
        forms += [("ln {}", math.exp(value), 1), ("-ln {}", math.exp(-value), 1)]
    for form, x, _ in forms:
        for digits in range(1, 7):  # the fewest digits that give it
            short = float(f"{x:.{digits}g}")
            if short != 0 and abs(short - x) <= 1e-9 * abs(x):
                return form.format(f"{short:g}")
    return f"{value!r} to float32 precision" if shortened else None


def _commented(text: str, meanings: Mapping[str, str]) -> str:
    """`text` with each shortened number explained: at the end of its YAML line, or in comment
    lines after flags (a comment would end a ` \\` continuation)."""
    if not meanings:
        return text
    lines, after = text.splitlines(), []
    inline: dict[int, list[tuple[str, str]]] = {}
    for number, meaning in meanings.items():
        pattern = re.compile(rf"(?<![\d.-]){re.escape(number)}(?![\d.])")
        found = [i for i, line in enumerate(lines) if pattern.search(line)]
        yaml_lines = [i for i in found if ": " in lines[i] and not lines[i].endswith("\\")]
        for i in yaml_lines:
            inline.setdefault(i, []).append((number, meaning))
        if len(yaml_lines) < len(found) or not found:
            after.append(f"# {number} = {meaning}")
    for i, items in inline.items():
        one = len(items) == 1
        lines[i] += "  # " + ", ".join(m if one else f"{n} = {m}" for n, m in items)
    end = "\n" if text.endswith("\n") and not after else ""
    return "\n".join(lines + ([""] if after else []) + after) + end


def to_file_text(spec: Spec) -> str:
    """The iscore config file of `spec` (YAML with `framework:`), which
    `iscore replay --config FILE` reads as is.

    >>> from iscore.frameworks import trl
    >>> print(to_file_text(trl.PRESETS["trl_token_tis"]), end="")  # doctest: +ELLIPSIS
    # iscore config for trl (as of huggingface/trl@...); `iscore replay --config FILE` reads it ...
    framework: trl
    name: trl_token_tis
    use_vllm: true
    vllm_importance_sampling_correction: true
    vllm_importance_sampling_mode: token_truncate
    vllm_importance_sampling_clip_min: null
    vllm_importance_sampling_clip_max: 2.0
    loss_type: dapo
    """
    upstream = frameworks.of(spec).upstream_of(spec)
    header = (
        f"# iscore config for {spec.framework} (as of {upstream}); "
        "`iscore replay --config FILE` reads it as is\n"
    )
    return header + yaml_text(spec.to_config())


def _render(framework: Framework, config: Mapping[str, Any], fmt: str | None) -> str:
    """`config`'s text in `fmt` (None: the framework's usual form), without iscore's own keys
    (a version is named in the comments above it, `Framework.comments`)."""
    body = {k: v for k, v in config.items() if k not in ("framework", "name", "version")}
    formats = framework.snippet_formats
    if fmt not in (None, "yaml", "flags"):
        raise ConfigError(f"Expected `fmt` to be 'yaml', 'flags' or None, but got {quote(fmt)}")
    if fmt is not None and fmt not in formats:
        why = (
            "which is configured by its launch flags"
            if formats == ("flags",)
            else "which has no command-line form for these keys"
        )
        raise ConfigError(
            f"Expected `fmt` to be {formats[0]!r} or None for {framework.name}, {why}, "
            f"but got {quote(fmt)}"
        )
    return framework.render(body, fmt or formats[0]) if body else ""
