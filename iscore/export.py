"""Export a correction setting: as its framework's own config, on the canonical catalogue, and
as the closest setting of another framework.

Three things, each the inverse of something `parse` does or a bridge between frameworks:

- `snippet(spec)`: the text a user pastes into the framework's own config (YAML with the
  framework's nesting, or its command-line flags), and `to_file_text(spec)`, the iscore config
  file `iscore replay --config FILE` reads as is. Both come from the spec's `to_config()`, which
  each framework module writes next to its `parse`.
- `canonical(spec)`: the setting on the catalogue of docs/corrections.md (`iscore.canonical`),
  as a tuple of components (weights, masks, batch normalization) with the numerical details
  that decide whether two frameworks compute the same thing (the +-20 exponent clamp, float32
  comparisons, NeMo-RL's overflow to 0).
- `convert(spec, to)`: the target framework's closest setting. `exact` only when the target
  replays identically: by construction when the canonical forms agree, or, for settings that
  are the same rule computed along a different floating-point path, when a `batch` given shows
  identical weights and masks. Whatever the target cannot express is a note, and with a
  `batch` the difference is measured (`iscore.impact.quick_stats` of both).

>>> from iscore.frameworks import nemo_rl
>>> out = convert(nemo_rl.PRESETS["nemo_icepop"], "openrlhf")
>>> out.exact, canonical(out.spec).method
(True, 'icepop')
>>> print(out.text)
--algo.advantage.is_correction_enable \\
--algo.advantage.is_correction_type icepop \\
--algo.advantage.is_correction_threshold 0.5 5.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from iscore import frameworks
from iscore.batch import TokenBatch
from iscore.canonical import Canonical
from iscore.errors import ConfigError, quote
from iscore.frameworks._config import check_choice
from iscore.frameworks.base import Framework
from iscore.impact import aggregation_of, quick_stats
from iscore.render import yaml_text
from iscore.spec import Spec


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


@dataclass(frozen=True, slots=True)
class Export:
    """A setting converted to (or written for) one framework.

    Attributes:
        spec: the target framework's setting (for an older verl generation, the current-
            generation setting that generation's config expresses).
        text: the snippet to paste into the target's config (`snippet`).
        exact: whether `spec` replays identically to the source (weight and keep).
        notes: one line each: what the target could not express and what was chosen
            instead, numerical fine print, and loss-aggregation differences.
        difference: with a batch, `{"source": {...}, "target": {...}, "identical": bool}`:
            weight_mean, token_masked_fraction, seq_masked_fraction and lr_scale of both
            (`iscore.impact.quick_stats`), and whether weights and masks agree exactly.
    """

    spec: Spec
    text: str
    exact: bool
    notes: tuple[str, ...] = ()
    difference: dict[str, Any] | None = None


def convert(
    spec: Spec,
    to: str,
    *,
    generation: str | None = None,
    batch: TokenBatch | None = None,
) -> Export:
    """The closest setting of framework `to` to `spec`, with its snippet and what differs.

    Args:
        spec: the source setting (any framework's spec).
        to: the target framework, one of `iscore.frameworks.NAMES`.
        generation: an older config generation to write, for a framework that has them
            (`Framework.generations`; verl: "gen0", "gen1", "gen2", "gen3", or a version such
            as "v0.6.0"); None is current.
        batch: a dump to measure both settings on (`Export.difference`) and to verify
            settings that are the same rule computed along different numerical paths.

    >>> from iscore.frameworks import nemo_rl
    >>> out = convert(nemo_rl.PRESETS["nemo_icepop"], "verl")
    >>> out.exact, out.spec.is_lower, out.spec.is_upper
    (True, 0.5, 5.0)

    Raises:
        ConfigError: an unknown `to` or `generation`, or `generation` for a framework that has
            no older generations.
    """
    check_choice("to", to, frameworks.NAMES)
    target_framework = frameworks.get(to)
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
        target, notes = target_framework.closest(source, name)
    notes = list(notes)
    text = None
    generation_exact = True
    if generation is not None:
        written = target_framework.to_generation(target, generation)
        target, generation_exact = written.spec, written.exact
        notes += written.notes
        text = _render(target_framework, written.config, None)
    result = canonical(target)
    if result.anchor != source.anchor:
        notes.append(_ANCHOR_NOTES[source.anchor, result.anchor].format(to=to))
    identical, difference = _measure(spec, target, batch, notes)
    if result == source:
        exact = identical is not False
        if identical is False:
            notes.append("replays differently on the batch although the settings agree")
    elif result.loosely_equals(source):
        exact = identical is True
        notes.append(_loose_note(identical))
    else:
        exact = False
        target_label = to if generation is None else f"{to} {generation}"
        notes.append(
            f"source ({spec.framework}): {source.describe()}; "
            f"target ({target_label}): {result.describe()}"
        )
    exact = exact and generation_exact
    notes += _aggregation_notes(spec, target)
    return Export(target, text or snippet(target), exact, tuple(notes), difference)


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
        "the same rule computed along another numerical path (the +-20 exponent clamp, float32 "
        "or overflow handling, ratio vs log-space bounds): it can differ only for tokens "
        "with extreme log-ratios or ratios within rounding of a bound"
    )
    if identical is None:
        return note + "; pass a batch to check"
    return note + ("; identical on the batch" if identical else "; differs on the batch")


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
        side: {key: values.get(key) for key in _DIFFERENCE_KEYS} for side, values in stats.items()
    }
    difference["identical"] = identical
    return identical, difference


def _aggregation_notes(source: Spec, target: Spec) -> list[str]:
    """A note when the two frameworks turn the same weights into different step sizes: another
    aggregation mode, or (for settings that remove tokens) another denominator."""
    a, b = aggregation_of(source), aggregation_of(target)
    removes = bool(canonical(source).masks or canonical(target).masks)
    if a.mode == b.mode and (a.shrinks == b.shrinks or not removes):
        return []
    return [
        f"loss aggregation: {source.framework} {a.describe()}, {target.framework} "
        f"{b.describe()}: the same weights scale the step differently (see lr_scale)"
    ]


# ------------------------------------------------------------------ snippets


def snippet(spec: Spec, fmt: Literal["yaml", "flags"] | None = None) -> str:
    """The text to paste into the framework's own config for `spec`.

    Args:
        spec: any framework's setting.
        fmt: "yaml" (verl, SkyRL, NeMo-RL, AReaL, TRL, Fireworks: the config's own nesting),
            "flags" (slime, OpenRLHF: their launch flags, one per line with ` \\`
            continuations; verl, SkyRL, NeMo-RL: Hydra-style `key=value` overrides; TRL:
            `--key value`), or None for the framework's usual form.

    >>> from iscore.frameworks import openrlhf
    >>> print(snippet(openrlhf.PRESETS["openrlhf_icepop"]))
    --algo.advantage.is_correction_enable \\
    --algo.advantage.is_correction_type icepop \\
    --algo.advantage.is_correction_threshold 0.5 5.0

    Raises:
        ConfigError: a format the framework has no form for.
    """
    return _render(frameworks.of(spec), spec.to_config(), fmt)


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
    upstream = frameworks.of(spec).upstream
    header = (
        f"# iscore config for {spec.framework} (as of {upstream}); "
        "`iscore replay --config FILE` reads it as is\n"
    )
    return header + yaml_text(spec.to_config())


def _render(framework: Framework, config: Mapping[str, Any], fmt: str | None) -> str:
    """`config`'s text in `fmt` (None: the framework's usual form), without iscore's own keys."""
    body = {k: v for k, v in config.items() if k not in ("framework", "name")}
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
    return framework.render(body, fmt or formats[0])
