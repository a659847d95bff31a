"""Fireworks cookbook (`fw-ai/cookbook`): the TIS weight of its RL recipes, now and in PR #169.

Sources read: `fw-ai/cookbook` @ 76821fa1 (2026-08-19), `training/utils/rl/tis.py` (`TISConfig`,
`compute_tis_weight`), `training/utils/rl/common.py` (`run_loss_loop`),
`training/recipes/rl_loop.py` (`Config.tis`, `Config.anchor_logp`); PR #169 as merged
(227d25a2, 2026-03-05), `training/utils/rl/importance_sampling.py` (`ISConfig`) and
`training/utils/rl/grpo.py`.

**Current form** (`FireworksTIS`), per sequence, restricted to the active tokens (loss mask
> 0.5; masked bridge/tool tokens are left out of the sequence mean):

1. z_t = clamp(old_policy - rollout, -20, 20) (old_policy = the trainer's forward, `train`).
2. `level: token`: raw_t = e^{z_t}; `level: sequence`: raw = e^{mean_active z}, broadcast (a
   geometric mean, not the product).
3. w = clamp(raw, 0, cap).
4. `icepop_threshold: tau` (token level only): w <- w * 1[1/tau <= raw <= tau] (inclusive), so kept
   tokens carry min(raw, cap), not the raw ratio.
5. The weight multiplies each token's policy term (GRPO, DAPO, GSPO, CISPO, IS, DRO); the loss
   mask is not changed, so `keep` is the loss mask.

`anchor_logp: rollout` skips the trainer forward and uses the rollout log-probs as old_policy
(bypass: the PPO ratio is anchored on the rollout). Then z = 0 and the weight is
clamp(1, 0, cap) = min(1, cap): 1 for every cap >= 1 (the cookbook's notes say "TIS weight 1"; the
code gives `cap` when cap < 1, and so does the replay).

Config keys: `tis: {cap: 5.0, level: token, icepop_threshold: null}` (`TISConfig`: cap >= 0;
icepop only at token level; tau >= 1) and `anchor_logp: old_policy | rollout`, both top level.

**PR #169 form** (`FireworksISCorrection`, cookbook 2026-03-05 until `TISConfig` replaced it):
`is_correction: {eps_clip: 0.2, eps_clip_high: null, tis_cap: 5.0, tis_level: token}`. Same math
as steps 1-3 without IcePop, but the PR-era loss had no loss mask: the sequence mean runs over
**every** response token (loss-masked ones included). `eps_clip`/`eps_clip_high` are the PPO clip
of the same config; they do not change the IS weight and are kept only so the setting can be
written back. The PR-era `ISConfig` validated nothing (any `tis_level` other than "sequence" meant
token, a negative cap clamped everything to it); the replay rejects those instead.

Where the cookbook's documentation (docs/corrections.md#fireworks) and its code differ:
`anchor_logp: rollout` gives min(1, cap), not 1
(above). Everything else matches; the bounds compare in float64 here (the cookbook compares its
float32 ratios with a Python float), which only matters for a ratio within float32 rounding of
1/tau.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([1.0, -1.1]),
...                cu_seqlens=torch.tensor([0, 2]))
>>> r = parse({"framework": "fireworks", "tis": {"cap": 5.0, "icepop_threshold": 2.0}}).replay(b)
>>> [round(w, 4) for w in r.weight.tolist()]  # e^2 is outside [0.5, 2]
[0.0, 0.9048]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError
from iscore.frameworks import snippets
from iscore.frameworks._config import check_choice, check_number, top_level
from iscore.frameworks.base import Framework, Upstream
from iscore.frameworks.canonical import (
    BIG,
    Canonical,
    Numerator,
    Translation,
    first_weight,
    identity_at_zero,
    lost,
    mask_component,
    note_extras,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.canonical import Anchor as CanonicalAnchor
from iscore.frameworks.canonical import Level as CanonicalLevel
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "fireworks"

Level = Literal["token", "sequence"]
Anchor = Literal["old_policy", "rollout"]

_LEVELS = ("token", "sequence")
_ANCHORS = ("old_policy", "rollout")


def _tis_weight(
    batch: TokenBatch, d: torch.Tensor, mean_mask: torch.Tensor, level: Level, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Steps 1-3 shared by both forms: (weight, raw, seq_raw, seq_weight) from the log-ratio d
    (z = d clamped to +-20)."""
    if level == "token":
        raw = ops.exp(d)  # e^z, shared with every setting that takes e^{clamp(d, +-20)}
        return ops.truncate(raw, 0.0, cap), raw, None, None
    z = d.clamp(-ops.SAFETY_BOUND, ops.SAFETY_BOUND)
    seq_raw = torch.exp(ops.segment_mean(z, batch, mean_mask))
    seq_weight = ops.truncate(seq_raw, 0.0, cap)
    return per_token(seq_weight, batch), per_token(seq_raw, batch), seq_raw, seq_weight


@dataclass(frozen=True, slots=True)
class FireworksTIS:
    """The cookbook's current TIS weight (`TISConfig` plus the recipe's `anchor_logp`).

    Args:
        cap: `tis.cap`, the upper clamp (>= 0).
        level: `tis.level`; "sequence" is the geometric mean over active tokens.
        icepop_threshold: `tis.icepop_threshold` tau (>= 1, token level only): zero the weight
            of tokens whose raw ratio is outside [1/tau, tau].
        anchor_logp: `anchor_logp`; "rollout" uses the rollout log-probs as old policy.
        name: display name.
    """

    framework: ClassVar[str] = NAME
    cap: float = 5.0
    level: Level = "token"
    icepop_threshold: float | None = None
    anchor_logp: Anchor = "old_policy"
    name: str = NAME

    def __post_init__(self) -> None:
        check_number("tis.cap", self.cap, ge=0.0)
        check_choice("tis.level", self.level, _LEVELS)
        check_number("tis.icepop_threshold", self.icepop_threshold, ge=1.0, nullable=True)
        if self.icepop_threshold is not None and self.level != "token":
            raise ConfigError(
                "Expected `tis.icepop_threshold` to be null with `tis.level: sequence`: "
                "the cookbook supports IcePop at token level only"
            )
        check_choice("anchor_logp", self.anchor_logp, _ANCHORS)

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: the recipe `Config`'s `tis` (a `TISConfig`) and
        `anchor_logp` fields, the inverse of `parse`.

        >>> FireworksTIS(cap=2.0).to_config()["tis"]
        {'cap': 2.0, 'level': 'token', 'icepop_threshold': None}
        """
        tis = {"cap": self.cap, "level": self.level, "icepop_threshold": self.icepop_threshold}
        return {
            "framework": NAME,
            "name": self.name,
            "tis": tis,
            "anchor_logp": self.anchor_logp,
        }

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights as `run_loss_loop` hands them to the policy loss."""
        active = batch.loss_mask
        if self.anchor_logp == "rollout":
            d = torch.zeros(batch.num_tokens, dtype=torch.float64, device=batch.device)
        else:
            d = ops.log_ratio(batch)
        weight, raw, seq_raw, seq_weight = _tis_weight(batch, d, active, self.level, self.cap)
        if self.icepop_threshold is not None:
            tau = self.icepop_threshold
            weight = torch.where(ops.band(raw, 1.0 / tau, tau), weight, 0.0)
        return Replay.build(batch, weight, active, raw, seq_raw=seq_raw, seq_weight=seq_weight)


@dataclass(frozen=True, slots=True)
class FireworksISCorrection:
    """The TIS weight of PR #169's `ISConfig` (`is_correction:`), cookbook of 2026-03.

    Args:
        tis_cap: `is_correction.tis_cap`, the upper clamp (>= 0).
        tis_level: `is_correction.tis_level`; "sequence" is the geometric mean over the whole
            response (the PR-era loss had no loss mask).
        eps_clip: `is_correction.eps_clip`, PPO clip (does not change the IS weight).
        eps_clip_high: `is_correction.eps_clip_high`, asymmetric PPO upper clip (likewise).
        name: display name.
    """

    framework: ClassVar[str] = NAME
    tis_cap: float = 5.0
    tis_level: Level = "token"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    name: str = NAME

    def __post_init__(self) -> None:
        check_number("is_correction.tis_cap", self.tis_cap, ge=0.0)
        check_choice("is_correction.tis_level", self.tis_level, _LEVELS)
        check_number("is_correction.eps_clip", self.eps_clip)
        check_number("is_correction.eps_clip_high", self.eps_clip_high, nullable=True)

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: PR #169's `is_correction` (an `ISConfig`), the
        inverse of `parse`.

        >>> FireworksISCorrection(tis_cap=2.0).to_config()["is_correction"]["tis_cap"]
        2.0
        """
        is_correction = {
            "eps_clip": self.eps_clip,
            "eps_clip_high": self.eps_clip_high,
            "tis_cap": self.tis_cap,
            "tis_level": self.tis_level,
        }
        return {"framework": NAME, "name": self.name, "is_correction": is_correction}

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights as PR #169's losses multiply them (no IcePop, no anchor choice)."""
        everything = torch.ones_like(batch.loss_mask)
        weight, raw, seq_raw, seq_weight = _tis_weight(
            batch, ops.log_ratio(batch), everything, self.tis_level, self.tis_cap
        )
        return Replay.build(
            batch, weight, batch.loss_mask, raw, seq_raw=seq_raw, seq_weight=seq_weight
        )


def parse(config: Mapping[str, Any]) -> FireworksTIS | FireworksISCorrection:
    """Parse `tis:` + `anchor_logp:` (current) or `is_correction:` (PR #169) into a spec.

    Raises:
        ConfigError: an unknown key, a wrong type or range, or both forms at once.

    >>> spec = parse({"framework": "fireworks", "tis": {"cap": 2.0, "level": "sequence"}})
    >>> spec.cap, spec.level, spec.icepop_threshold, spec.anchor_logp
    (2.0, 'sequence', None, 'old_policy')
    >>> parse({"framework": "fireworks", "is_correction": {"tis_cap": 10}}).tis_cap
    10.0
    """
    top, name = top_level(config, NAME)
    if "is_correction" in config:
        newer = [k for k in ("tis", "anchor_logp") if k in config]
        if newer:
            raise ConfigError(
                f"Expected either `is_correction` (cookbook PR #169) or `tis`/`anchor_logp` "
                f"(current cookbook), but got both `is_correction` and `{newer[0]}`"
            )
        s = top.section("is_correction")
        values = {
            "tis_cap": s.float("tis_cap", 5.0),
            "tis_level": s.choice("tis_level", "token", _LEVELS),
            "eps_clip": s.float("eps_clip", 0.2),
            "eps_clip_high": s.float("eps_clip_high", None),
        }
        s.done()
        top.done()
        return FireworksISCorrection(**values, name=name)
    s = top.section("tis")
    values = {
        "cap": s.float("cap", 5.0),
        "level": s.choice("level", "token", _LEVELS),
        "icepop_threshold": s.float("icepop_threshold", None),
    }
    anchor = top.choice("anchor_logp", "old_policy", _ANCHORS)
    s.done()
    top.done()
    return FireworksTIS(**values, anchor_logp=anchor, name=name)


PRESETS: dict[str, FireworksTIS] = {
    "fireworks_default": FireworksTIS(name="fireworks_default"),
    # `training/examples/rl/deepmath/train_deepmath.py`: TISConfig(cap=2.0).
    "fireworks_deepmath": FireworksTIS(cap=2.0, name="fireworks_deepmath"),
}
"""The recipes' default `TISConfig()` (token, cap 5) and the deepmath example's cap 2."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: FireworksTIS | FireworksISCorrection) -> Canonical:
    if isinstance(spec, FireworksISCorrection):
        return _pr169_canonical(spec)
    # Each token's log-ratio is clamped to +-20 before the sequence mean.
    numerator: Numerator = "rollout" if spec.anchor_logp == "rollout" else "train"
    level: CanonicalLevel = "token" if spec.level == "token" else "geometric"
    zero = None
    if spec.icepop_threshold is not None:
        tau = spec.icepop_threshold
        zero = mask_component("token", 1.0 / tau, tau, numerator=numerator, numerics="clamp")
    weight = weight_component(
        level, upper=spec.cap, numerator=numerator, numerics="clamp_each", zero=zero
    )
    anchor: CanonicalAnchor = "rollout" if spec.anchor_logp == "rollout" else "recompute"
    components = () if numerator == "rollout" and identity_at_zero(weight) else (weight,)
    return Canonical(components, anchor)


def _pr169_canonical(spec: FireworksISCorrection) -> Canonical:
    # PR #169's sequence mean runs over every response token, loss-masked ones included.
    level: CanonicalLevel = "token" if spec.tis_level == "token" else "geometric_unmasked"
    return Canonical((weight_component(level, upper=spec.tis_cap, numerics="clamp_each"),))


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    if c.anchor == "rollout":
        for x in c.components:
            lost(notes, x, "the cookbook's rollout anchor makes every TIS weight 1")
        return [(FireworksTIS(anchor_logp="rollout", name=name), tuple(notes))]
    w = first_weight(c, notes, "the Fireworks cookbook")
    masks = list(c.masks)
    fields: dict[str, Any] = {"cap": BIG}
    if w is not None:
        note_numerator(notes, w, "train", "the cookbook")
        if w.level != "token":
            fields["level"] = "sequence"
            if w.level == "sequence":
                lost(
                    notes,
                    w,
                    "the cookbook's sequence level is the geometric mean e^G, not the product e^S",
                )
            elif w.level == "geometric_unmasked":
                lost(
                    notes,
                    w,
                    "the current cookbook averages over loss tokens only (PR #169's "
                    "is_correction did over every token)",
                )
        if w.lower is not None:
            lost(notes, w, f"the cookbook has no lower clamp; weights below {w.lower:g} pass")
        if w.upper is not None:
            fields["cap"] = w.upper
        elif w.zero is None:
            lost(notes, w, "the cookbook always caps; a cap of 1e9, above e^20, never binds")
        if w.zero is not None:
            masks.insert(0, w.zero)
    for m in masks:
        bounds = ratio_bounds(m)
        token = fields.get("level", "token") == "token"
        if (
            token
            and bounds is not None
            and ratio_level(m) == "token"
            and "icepop_threshold" not in fields
        ):
            lower, upper = bounds
            # The cookbook's band is [1/tau, tau]: take the wider side of the source's band.
            tau = max(x for x in (upper, 1.0 / lower if lower else None, 1.0) if x is not None)
            fields["icepop_threshold"] = tau
            if lower != 1.0 / tau or upper != tau:
                lost(notes, m, f"the cookbook's IcePop band is symmetric: [1/{tau:g}, {tau:g}]")
            if w is None or m is not w.zero:
                lost(notes, m, "the cookbook zeroes those weights instead of removing them")
            if w is None:
                notes.append(
                    "the cookbook weights kept tokens by their ratio; the source applies no weight"
                )
        else:
            lost(notes, m, "the cookbook has no rejection mask; dropped")
    note_extras(notes, c, "the Fireworks cookbook")
    if w is None and "icepop_threshold" not in fields:
        notes.append(
            "the cookbook's TIS weight is always on; anchor_logp: rollout makes it 1, but also "
            "skips the recompute and anchors PPO on the rollout"
        )
        return [(FireworksTIS(anchor_logp="rollout", name=name), tuple(notes))]
    return [(FireworksTIS(name=name, **fields), tuple(notes))]


# ------------------------------------------------------------------ the framework


def _render(body: Mapping[str, Any], fmt: str | None) -> str:
    """YAML under the Python `Config(...)` it stands for."""
    parts: dict[str, Any] = {
        key: snippets.Raw(snippets.python_call(cls, body[key]))
        for key, cls in (("tis", "TISConfig"), ("is_correction", "ISConfig"))
        if key in body
    }
    if "anchor_logp" in body:
        parts["anchor_logp"] = body["anchor_logp"]
    where = "cookbook PR #169" if "is_correction" in body else "training/recipes/rl_loop.py"
    return f"# {where}: {snippets.python_call('Config', parts)}\n" + snippets.yaml_text(body)


FRAMEWORK = Framework(
    name=NAME,
    title="Fireworks cookbook",
    upstream=Upstream("fw-ai/cookbook", "76821fa1ded720d903029381b37d3c3ea7ce9ddd", "2026-08-19"),
    spec_types=(FireworksTIS, FireworksISCorrection),
    parse=parse,
    presets=lambda: PRESETS,
    default="fireworks_default",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=_render,
    families=frozenset({"token_tis"}),
    snippet_formats=("yaml",),
)
