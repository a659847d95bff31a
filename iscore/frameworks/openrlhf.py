"""OpenRLHF: the vLLM importance-sampling correction of `PolicyLoss` (`openrlhf/models/loss.py`).

Source read: `OpenRLHF/OpenRLHF` @ 3c3be623 (2026-08-13), `openrlhf/models/loss.py`
(`PolicyLoss.forward`), `openrlhf/cli/train_ppo_ray.py` (flags) and
`openrlhf/trainer/ray/ppo_actor.py`; older flag names from the history of `train_ppo_ray.py`
(renamed in ed62d0e2, 2026-04-19).

What OpenRLHF computes, in its order, with d_t = train - rollout (`old_log_probs -
rollout_log_probs`) and rho_t = e^{d_t} with **no** +-20 safety clamp:

- `tis` (default): w_t = clamp(rho_t, LOW, HIGH), two-sided, [0.5, 5.0] by default, so
  ratios below 0.5 are *lifted* to 0.5.
- `icepop`: w_t = rho_t * 1[LOW <= rho_t <= HIGH] (inclusive; kept tokens carry the raw ratio).
- `seq-mask-tis`: w_t = rho_t * 1[LOW <= e^G <= HIGH] with G the mean of d over the action
  mask: raw, untruncated token weights inside a geometric-mean sequence mask. It shares the
  threshold pair with `tis`, so the default [0.5, 5.0] hardly ever masks anything.
  Version `pr1298` (the open PR #1298, head 0d7490c2, 2026-08-08, `loss.py` l.213) clamps those
  token weights: w_t = clamp(rho_t, LOW, HIGH) * 1[LOW <= e^G <= HIGH], the one pair of bounds
  serving both the gate and the clamp; nothing else changes (no new flag). On main a rejected
  sequence's overflowing rho (inf) times its false mask is a NaN loss term; clamped, it is 0.
- The weight multiplies the PPO / dual-clip loss; the action mask (the loss denominator) is
  never changed, so `keep` is the loss mask in every mode.
- With `--actor.policy_loss_type gspo` no weight is applied at all: the correction instead
  anchors GSPO's sequence ratio on the rollout log-probs (exp(mean_t(policy - rollout)), a
  PPO ratio, not an IS weight). The replay gives weight 1 there.

Config: `args:` holds the launch command's flags as one shell string or a list of strings
(a whole pasted `python -m openrlhf.cli.train_ppo_ray ...` command is fine). The IS flags are
parsed strictly; every other token is collected in the spec's `ignored_flags`:

| current flag (since 2026-04-19) | before | default |
|---|---|---|
| `--algo.advantage.is_correction_enable` | `--enable_vllm_is_correction` | off |
| `--algo.advantage.is_correction_threshold LOW HIGH` | `--vllm_is_truncated_threshold` | 0.5 5.0 |
| `--algo.advantage.is_correction_type` | `--vllm_is_correction_type` | tis |
| `--actor.policy_loss_type` | `--policy_loss_type` | ppo |

The type is one of `tis`, `icepop`, `seq-mask-tis`; the policy loss type `ppo` or `gspo`.
iscore's own top-level `version: pr1298` selects the PR's seq-mask-tis (null: the pinned commit).

Older forms also parse: `--use_icepop` (2025-12-11 to 2026-02-05, the forerunner of
`--vllm_is_correction_type icepop`) and a single `--vllm_is_truncated_threshold HIGH`
(2025-08 to 2025-12: w_t = min(rho_t, HIGH), no lower bound). No OpenRLHF version accepts old
and new names together, so mixing them is an error, as is an unknown flag that looks like an IS
flag (a typo would otherwise land silently in `ignored_flags`).

Where OpenRLHF's documentation (docs/corrections.md#openrlhf) and its code differ: nowhere in the
math. Details it leaves out,
read in the code: G is a plain masked mean (sum / count, float32), so a fully masked
sequence gets G = NaN and a false mask (irrelevant: none of its tokens is in the loss; the
replay reports e^0 = 1 for it); the thresholds are not validated. Here LOW must be >= 0 (0 is
no lower bound), HIGH > 0 and LOW <= HIGH (equal bounds are a constant weight for `tis`): a
reversed pair makes `tis` return HIGH everywhere (torch's clamp) and `icepop` / `seq-mask-tis`
zero everything.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([-2.0, -0.9]),
...                cu_seqlens=torch.tensor([0, 2]))
>>> spec = parse({"framework": "openrlhf", "args": "--algo.advantage.is_correction_enable"})
>>> [round(w, 4) for w in spec.replay(b).weight.tolist()]  # e^-1 is lifted to 0.5
[0.5, 1.1052]
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import check_choice, flag_parser, nearest, top_level, version
from iscore.frameworks.base import Aggregation, BatchFields, Framework, Trap, Upstream, Version
from iscore.frameworks.canonical import (
    Canonical,
    Translation,
    first_weight,
    lost,
    mask_component,
    note_extras,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.spec import Replay
from iscore.packed import TokenBatch, ops

NAME = "openrlhf"

CorrectionType = Literal["tis", "icepop", "seq-mask-tis"]
PolicyLossType = Literal["ppo", "gspo"]

_TYPES = ("tis", "icepop", "seq-mask-tis")
_LOSS_TYPES = ("ppo", "gspo")

# Flag names per setting: (current, pre-2026-04-19). `use_icepop` only ever existed in the old form.
_FLAGS = {
    "enable": ("--algo.advantage.is_correction_enable", "--enable_vllm_is_correction"),
    "threshold": ("--algo.advantage.is_correction_threshold", "--vllm_is_truncated_threshold"),
    "type": ("--algo.advantage.is_correction_type", "--vllm_is_correction_type"),
    "loss": ("--actor.policy_loss_type", "--policy_loss_type"),
    "use_icepop": (None, "--use_icepop"),
}
_THRESHOLD = _FLAGS["threshold"][0]

PR1298 = Version(
    "pr1298",
    1298,
    "open",
    Upstream("OpenRLHF/OpenRLHF", "0d7490c2052e00e0b6fe313981b64484ee1e5422", "2026-08-08"),
    "seq-mask-tis clamps the token weights to [LOW, HIGH], the gate's own bounds",
)
VERSIONS = (PR1298,)

# Substrings of OpenRLHF's IS flag names; an unparsed flag containing one is most likely a typo.
_IS_LIKE = ("is_correction", "vllm_is", "policy_loss_type", "icepop")


@dataclass(frozen=True, slots=True)
class OpenRLHFCorrection:
    """OpenRLHF's vLLM IS correction, as set by its launch flags.

    Args:
        enable: `--algo.advantage.is_correction_enable`; False applies no weight.
        type: `--algo.advantage.is_correction_type`.
        lower: LOW of `--algo.advantage.is_correction_threshold`; None only for the 2025
            single-value form (no lower clamp).
        upper: HIGH of the threshold pair.
        policy_loss_type: `--actor.policy_loss_type`; with "gspo" no weight is applied.
        version: iscore's `version:`; None is the pinned commit, "pr1298" the open PR #1298
            (seq-mask-tis clamps its token weights).
        ignored_flags: the launch command's tokens that are not IS flags (the command itself,
            unrelated flags and their values; `--` separators are dropped), kept so a user
            can see what was skipped.
        name: display name.
    """

    framework: ClassVar[str] = NAME
    enable: bool = False
    type: CorrectionType = "tis"
    lower: float | None = 0.5
    upper: float = 5.0
    policy_loss_type: PolicyLossType = "ppo"
    version: str | None = None
    ignored_flags: tuple[str, ...] = ()
    name: str = NAME

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ConfigError(
                f"Expected `{_FLAGS['enable'][0]}` to be a bool, but got {quote(self.enable)}"
            )
        if self.type not in _TYPES:
            raise ConfigError(
                f"Expected `{_FLAGS['type'][0]}` to be one of {', '.join(_TYPES)}, "
                f"but got {quote(self.type)}"
            )
        if self.policy_loss_type not in _LOSS_TYPES:
            raise ConfigError(
                f"Expected `{_FLAGS['loss'][0]}` to be one of {', '.join(_LOSS_TYPES)}, "
                f"but got {quote(self.policy_loss_type)}"
            )
        _check_threshold(self.lower, self.upper, _THRESHOLD)
        check_choice("version", self.version, (None, *(v.name for v in VERSIONS)))
        if self.version is not None and self.lower is None:
            raise ConfigError(
                f"Expected LOW of `{_THRESHOLD}` to be a number at version {self.version}: only "
                "OpenRLHF's 2025 single-value threshold had no lower bound"
            )

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: OpenRLHF's IS flags as one `args` string, the
        inverse of `parse`.

        The current (2026-04-19) flag names, except for a setting without a lower bound, which
        only the 2025 single-value `--vllm_is_truncated_threshold` expresses. With the
        correction on, every IS flag is written (the two-sided default is a trap worth seeing);
        with it off, only those that differ from OpenRLHF's defaults. `ignored_flags` (the
        rest of a pasted launch command) are not written; `version` only when set.

        Raises:
            ConfigError: a setting no OpenRLHF version accepts (no lower bound with a type
                other than tis).

        >>> OpenRLHFCorrection(enable=True, lower=None, upper=2.0).to_config()["args"]
        '--enable_vllm_is_correction --vllm_is_truncated_threshold 2.0'
        """
        if self.lower is None and self.type != "tis":
            raise ConfigError(
                f"Expected LOW of `{_THRESHOLD}` to be a number with type {quote(self.type)}: only "
                "OpenRLHF's 2025 single-value threshold had no lower bound, and only for tis"
            )
        generation = 1 if self.lower is None else 0
        flag = {key: names[generation] for key, names in _FLAGS.items()}
        flags: list[str] = []
        if self.enable:
            flags.append(flag["enable"])
        if self.lower is None:
            flags += [flag["threshold"], repr(float(self.upper))]
        else:
            if self.enable or self.type != "tis":
                flags += [flag["type"], self.type]
            if self.enable or (self.lower, self.upper) != (0.5, 5.0):
                flags += [flag["threshold"], repr(float(self.lower)), repr(float(self.upper))]
        if self.policy_loss_type != "ppo":
            flags += [flag["loss"], self.policy_loss_type]
        config = {"framework": NAME, "name": self.name, "args": shlex.join(flags)}
        return config if self.version is None else config | {"version": self.version}

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights as `PolicyLoss.forward` multiplies them into the PPO loss."""
        mask = batch.loss_mask
        if not self.enable or self.policy_loss_type == "gspo":
            # Correction off, or GSPO: the loss carries no IS weight (GSPO moves its ratio's
            # anchor to the rollout log-probs instead).
            ones = torch.ones(batch.num_tokens, dtype=torch.float64, device=batch.device)
            return Replay.build(batch, ones, mask, ones)
        d = ops.log_ratio(batch)
        rho = ops.exp(d, bound=None)  # OpenRLHF has no safety clamp on the exponent
        if self.type == "tis":
            return Replay.build(batch, ops.truncate(rho, self.lower, self.upper), mask, rho)
        if self.type == "icepop":
            weight = torch.where(ops.band(rho, self.lower, self.upper), rho, 0.0)
            return Replay.build(batch, weight, mask, rho)
        seq_raw = torch.exp(ops.segment_mean(d, batch, mask))
        seq_keep = ops.band(seq_raw, self.lower, self.upper)
        token = rho
        if self.version == PR1298.name:
            token = ops.truncate(rho, self.lower, self.upper)  # the gate's bounds clamp too
        weight = torch.where(ops.broadcast(seq_keep, batch), token, 0.0)
        return Replay.build(batch, weight, mask, rho, seq_raw=seq_raw, seq_weight=seq_keep.double())


def _check_threshold(lower: Any, upper: Any, flag: str) -> None:
    """Raise ConfigError naming `flag` unless 0 <= LOW <= HIGH and HIGH > 0 (LOW may be None,
    the 2025 single-value form); OpenRLHF itself does not check."""
    for side, value, bound in (("LOW", lower, ">= 0.0"), ("HIGH", upper, "> 0.0")):
        if value is None and side == "LOW":
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        # NaN fails both comparisons.
        if not number or not (value >= 0.0 if side == "LOW" else value > 0.0):
            raise ConfigError(
                f"Expected {side} of `{flag}` to be a float {bound}, but got {quote(value)}"
            )
    if lower is not None and lower > upper:
        raise ConfigError(
            f"Expected LOW of `{flag}` <= HIGH ({quote(upper)}), but got {quote(lower)} "
            "(OpenRLHF does not check it; no ratio would lie within the bounds)"
        )


def _parser() -> argparse.ArgumentParser:
    """The IS flags of every OpenRLHF version, all defaulting to None to see which were given."""
    parser = flag_parser(NAME)
    for dest, (current, old) in _FLAGS.items():
        for generation, flag in (("current", current), ("old", old)):
            if flag is None:
                continue
            kwargs: dict[str, Any] = {"dest": f"{generation}_{dest}", "default": None}
            if dest in ("enable", "use_icepop"):
                kwargs["action"] = "store_true"
            elif dest == "threshold":
                # The old flag took one value until 2025-12-11, then two.
                kwargs.update(type=float, nargs=2 if generation == "current" else "+")
            else:
                kwargs["choices"] = _TYPES if dest == "type" else _LOSS_TYPES
            parser.add_argument(flag, **kwargs)
    return parser


def _argv(args: Any) -> list[str]:
    """The launch command as tokens, minus bare newlines (left by pasted line continuations)
    and `--` separators (`ray job submit ... -- python3 -m ...`), which would end argparse's
    option parsing before the trainer's flags."""
    if isinstance(args, str):
        # A line continuation joins lines as the shell does, also when the next line is not
        # indented (shlex alone would glue the newline to the next flag).
        tokens = shlex.split(args.replace("\\\n", " "))
    elif (
        isinstance(args, Sequence)
        and not isinstance(args, bytes)
        and all(isinstance(a, str) for a in args)
    ):
        tokens = list(args)
    else:
        raise ConfigError(f"Expected `args` to be a string of CLI flags, but got {quote(args)}")
    return [t for t in tokens if t.strip() and t != "--"]


def _parse_known(parser: argparse.ArgumentParser, argv: list[str]):
    """`parse_known_args` with argparse's errors as ConfigError (flag_parser raises on the rest)."""
    try:
        return parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"`args`: {e}") from e


def parse(config: Mapping[str, Any]) -> OpenRLHFCorrection:
    """Parse `{framework: openrlhf, name?, version?, args: "<launch flags>"}` into a spec.

    Raises:
        ConfigError: a malformed IS flag, a typo of one, old and new flag names mixed, or
            a version with the flag names it no longer has.

    >>> spec = parse({"framework": "openrlhf", "args": "python3 -m openrlhf.cli.train_ppo_ray "
    ...     "--algo.advantage.is_correction_enable --algo.advantage.is_correction_type icepop"})
    >>> spec.type, spec.lower, spec.upper, spec.ignored_flags
    ('icepop', 0.5, 5.0, ('python3', '-m', 'openrlhf.cli.train_ppo_ray'))
    """
    section, name = top_level(config, NAME)
    args = section.raw("args", "")
    pr = version(section, [v.name for v in VERSIONS])
    section.done()
    ns, rest = _parse_known(_parser(), _argv(args))

    typos = [t for t in rest if t.startswith("-") and any(s in t for s in _IS_LIKE)]
    if typos:
        flags = [f for pair in _FLAGS.values() for f in pair if f]
        named = ", ".join(t + nearest(t.split("=", 1)[0], flags) for t in typos)
        raise ConfigError(
            f"`args`: unknown OpenRLHF IS flag{'s' * (len(typos) > 1)} {named}; "
            f"expected {', '.join(flags)}"
        )
    given = {k: v for k, v in vars(ns).items() if v is not None}
    flag_of = {
        f"{generation}_{key}": flag
        for key, pair in _FLAGS.items()
        for generation, flag in zip(("current", "old"), pair, strict=True)
    }
    current = sorted(flag_of[k] for k in given if k.startswith("current_"))
    old = sorted(flag_of[k] for k in given if k.startswith("old_"))
    if current and old:
        raise ConfigError(
            f"`args`: {', '.join(old)} (OpenRLHF before 2026-04-19) cannot be mixed with "
            f"{', '.join(current)} (the renamed flags); no OpenRLHF version accepts both"
        )
    if old and pr is not None:
        raise ConfigError(
            f"`args`: {', '.join(old)} (OpenRLHF before 2026-04-19) do not exist at version "
            f"{pr}; its flags are {', '.join(f for f, _ in _FLAGS.values() if f)}"
        )
    prefix = "old_" if old else "current_"

    def get(key: str, default: Any) -> Any:
        return given.get(prefix + key, default)

    threshold = get("threshold", [0.5, 5.0])
    correction_type = get("type", "tis")
    if get("use_icepop", False):
        if "old_type" in given:
            raise ConfigError(
                "`args`: --use_icepop was replaced by --vllm_is_correction_type (2026-02-05); "
                "give only one of them"
            )
        correction_type = "icepop"
    if len(threshold) == 1:
        lower, upper = None, threshold[0]
        if "old_type" in given or "old_use_icepop" in given:
            raise ConfigError(
                "`args`: a single --vllm_is_truncated_threshold value (OpenRLHF before "
                "2025-12-11) cannot be combined with --vllm_is_correction_type or --use_icepop, "
                "which take the LOW HIGH pair"
            )
    elif len(threshold) == 2:
        lower, upper = threshold
    else:
        raise ConfigError(
            f"`args`: expected one or two values for --vllm_is_truncated_threshold, "
            f"but got {len(threshold)}"
        )
    _check_threshold(lower, upper, _FLAGS["threshold"][1 if old else 0])
    return OpenRLHFCorrection(
        enable=get("enable", False),
        type=correction_type,
        lower=lower,
        upper=upper,
        policy_loss_type=get("loss", "ppo"),
        version=pr,
        ignored_flags=tuple(rest),
        name=name,
    )


PRESETS: dict[str, OpenRLHFCorrection] = {
    "openrlhf_tis": OpenRLHFCorrection(enable=True, name="openrlhf_tis"),
    # The ProRL v2 example script (`examples/scripts/train_prorlv2_math_hybrid_engine.sh`).
    "openrlhf_icepop": OpenRLHFCorrection(enable=True, type="icepop", name="openrlhf_icepop"),
    # PR #1298's own test setting: seq-mask-tis at the default [0.5, 5], token weights clamped.
    "openrlhf_seq_mask_tis_pr1298": OpenRLHFCorrection(
        enable=True, type="seq-mask-tis", version="pr1298", name="openrlhf_seq_mask_tis_pr1298"
    ),
}
"""OpenRLHF's documented settings: the README default (TIS [0.5, 5]) and its IcePop recipes;
open PR #1298's seq-mask-tis (version pr1298)."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: OpenRLHFCorrection) -> Canonical:
    if not spec.enable or spec.policy_loss_type == "gspo":
        # GSPO with the correction on anchors its sequence ratio on the rollout instead.
        return Canonical(anchor="rollout" if spec.enable else "recompute")
    if spec.type == "tis":
        weight = weight_component("token", lower=spec.lower, upper=spec.upper)
    elif spec.type == "icepop":
        weight = weight_component("token", zero=mask_component("token", spec.lower, spec.upper))
    else:
        gate = mask_component("geometric", spec.lower, spec.upper)
        if spec.version == PR1298.name:
            weight = weight_component("token", lower=spec.lower, upper=spec.upper, zero=gate)
        else:
            weight = weight_component("token", zero=gate)
    return Canonical((weight,))


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    """The setting of the pinned commit closest to `c`; where `c` clamps token weights inside
    a geometric gate, also PR #1298's seq-mask-tis (version pr1298), which does that."""
    candidates = [_from_canonical(c, name)]
    w = c.weights[0] if c.weights else None
    gate = None if w is None else w.zero
    clamped = w is not None and (w.lower, w.upper) != (None, None)
    if clamped and w.level == "token" and gate is not None and gate.level == "geometric":
        # The gate as main's seq-mask-tis writes it, then the PR's clamp to the gate's bounds.
        raw = replace(w, lower=None, upper=None)
        others = tuple(x for x in c.components if x is not w)
        spec, notes = _from_canonical(replace(c, components=(raw, *others)), name)
        if spec.type == "seq-mask-tis":
            notes = list(notes)
            if ((w.lower or 0.0), math.inf if w.upper is None else w.upper) != (
                spec.lower,
                spec.upper,
            ):
                lost(notes, w, "OpenRLHF #1298 clamps to the gate's own bounds")
            notes.append(
                f"Needs OpenRLHF's open PR #1298 (head {PR1298.upstream.commit[:8]}): "
                "`version: pr1298`."
            )
            candidates.append((replace(spec, version=PR1298.name), tuple(notes)))
    return candidates


def _from_canonical(c: Canonical, name: str) -> Translation:
    notes: list[str] = []
    if c.anchor == "rollout":
        for x in c.components:
            lost(
                notes,
                x,
                "OpenRLHF's rollout anchor (GSPO with the correction on) applies no IS weight",
            )
        notes.append(
            "OpenRLHF anchors on the rollout only in its GSPO loss, whose sequence "
            "ratio is exp(mean(policy - rollout))"
        )
        spec = OpenRLHFCorrection(enable=True, policy_loss_type="gspo", name=name)
        return spec, tuple(notes)
    w = first_weight(c, notes, "OpenRLHF")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    if w is not None:
        note_numerator(notes, w, "train", "OpenRLHF")
        if w.level != "token":
            lost(notes, w, "OpenRLHF weights tokens only; written per token")
        zero = w.zero
        if zero is not None:
            masks.insert(0, zero)
            if w.upper is not None or w.lower is not None:
                lost(
                    notes,
                    w,
                    "OpenRLHF's icepop / seq-mask-tis keep the raw ratio; the "
                    "truncation is dropped",
                )
        elif w.lower is not None or w.upper is not None:
            fields = {"type": "tis", "lower": w.lower or 0.0}
            fields["upper"] = math.inf if w.upper is None else w.upper
    for m in masks:
        bounds = ratio_bounds(m)
        level = ratio_level(m)
        if not fields and bounds is not None and level in ("token", "geometric"):
            kind = "icepop" if level == "token" else "seq-mask-tis"
            fields = {"type": kind, "lower": bounds[0] or 0.0}
            fields["upper"] = math.inf if bounds[1] is None else bounds[1]
            if w is None:
                notes.append(
                    f"OpenRLHF's {kind} weights kept tokens by their raw ratio; the "
                    "source applies no weight"
                )
            if w is None or m is not w.zero:
                lost(
                    notes,
                    m,
                    "OpenRLHF zeroes those weights instead of removing them from the loss mask",
                )
            if m.strict:
                lost(notes, m, "OpenRLHF's bounds are inclusive")
        else:
            lost(notes, m, "no OpenRLHF setting expresses it beside the rest; dropped")
    if w is not None and not fields:
        fields = {"type": "tis", "lower": 0.0, "upper": math.inf}  # the raw weight
    note_extras(notes, c, "OpenRLHF")
    spec = OpenRLHFCorrection(enable=bool(fields), name=name, **fields)
    return spec, tuple(notes)


# ------------------------------------------------------------------ dump adapter


def read_batch(experiences: Any) -> list[BatchFields]:
    """An OpenRLHF `Experience`, or the list `make_experience_batch` returns -> dump fields.

    Where (openrlhf/trainer/ppo_trainer.py at OpenRLHF/OpenRLHF@3c3be623): `train_step` gets
    the step's experiences at l.216, with both log-probs, rewards and advantages, before
    `balance_experiences` reshuffles them across ranks (l.230-231); the driver holds them all.

    Each `Experience` (openrlhf/trainer/ppo_utils/experience.py l.29-64) is a padded block:
    `rollout_log_probs` (b, A), the vLLM log-probs, requested only with
    `--algo.advantage.is_correction_enable` (samples_generator.py l.210); `action_log_probs`
    (b, A), the actor's forward in `make_experience` before the update (experience_maker.py
    l.222): pi_old, although experience.py's comment calls it the current policy;
    `action_mask` (b, A); `advantages` (b, A); `rewards` (b,); `index`, each sample's place in
    the step's rollout (experience_maker.py l.46), written as its sequence id; `sequences`
    (b, T), whose last A columns are the tokens the action columns score (the actor keeps
    `log_probs[:, -A:]` of the next-token log-probs, models/actor.py l.290-294).
    """
    if not isinstance(experiences, list | tuple):
        experiences = [experiences]
    what = "OpenRLHF's Experience"
    parts = []
    for experience in experiences:
        mask = _batch.need(experience, "action_mask", what, "make_experience_batch fills it")
        sequences = _batch.field(experience, "sequences")
        parts.append(
            BatchFields(
                _batch.need(
                    experience,
                    "rollout_log_probs",
                    what,
                    "OpenRLHF asks vLLM for log-probs only with "
                    "--algo.advantage.is_correction_enable (samples_generator.py l.210)",
                ),
                _batch.need(
                    experience,
                    "action_log_probs",
                    what,
                    "call add_batch on what make_experience_batch returns (ppo_trainer.py l.216)",
                ),
                mask=mask,
                advantages=_batch.field(experience, "advantages"),
                token_ids=None if sequences is None else sequences[:, -mask.shape[1] :],
                rewards=_batch.field(experience, "rewards"),
                seq_ids=_batch.field(experience, "index"),
            )
        )
    return parts


# ------------------------------------------------------------------ the framework


def _comments(spec: OpenRLHFCorrection) -> tuple[str, ...]:
    """What the flags alone do not say: the PR a version needs.

    >>> spec = PRESETS["openrlhf_seq_mask_tis_pr1298"]
    >>> print(_comments(spec)[0])  # doctest: +NORMALIZE_WHITESPACE
    needs OpenRLHF PR #1298 (open, head 0d7490c2): seq-mask-tis clamps each token's weight to
    the gate's [0.5, 5]
    """
    if spec.version is None:
        return ()
    line = f"needs OpenRLHF PR #{PR1298.pr} ({PR1298.state}, head {PR1298.upstream.commit[:8]})"
    if spec.enable and spec.type == "seq-mask-tis" and spec.policy_loss_type == "ppo":
        line += f": seq-mask-tis clamps each token's weight to the gate's [{spec.lower:g}, "
        line += f"{spec.upper:g}]"
    return (line,)


def _aggregation(spec: OpenRLHFCorrection) -> Aggregation:
    gspo = spec.policy_loss_type == "gspo"
    return Aggregation("seq-mean-token-mean" if gspo else "token-mean")


FRAMEWORK = Framework(
    name=NAME,
    title="OpenRLHF",
    upstream=Upstream(
        "OpenRLHF/OpenRLHF", "3c3be6234e0cb353e76bb8019947db9dfe99fca7", "2026-08-13"
    ),
    versions=VERSIONS,
    spec_types=(OpenRLHFCorrection,),
    parse=parse,
    presets=lambda: PRESETS,
    default="openrlhf_tis",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=lambda body, fmt: snippets.flag_lines(body.get("args", "")),
    aggregation=_aggregation,
    families=frozenset({"token_tis", "icepop"}),
    columns={  # Experience fields
        "rollout_logprob": ("rollout_log_probs",),
        "train_logprob": ("action_log_probs",),
    },
    metrics={"k1": ("vllm_kl",)},
    traps=(
        Trap(
            "seq-mask-tis-shares-thresholds",
            "OpenRLHF's seq-mask-tis shares the TIS threshold pair; the default [0.5, 5] is "
            "effectively no mask for a geometric mean: set thresholds like the candidate's.",
        ),
        Trap(
            "pr1298-one-pair-of-bounds",
            "OpenRLHF PR #1298's seq-mask-tis clamps token weights with the same LOW HIGH pair "
            "that gates e^G: a tight gate such as 0.999 1.002 also clamps every token weight "
            "into it, a loose one such as the default 0.5 5 gates almost nothing.",
            about=lambda spec: spec.version == PR1298.name,
        ),
    ),
    comments=_comments,
    snippet_formats=("flags",),
    read_batch=read_batch,
)
