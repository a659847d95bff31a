"""prime-rl: the rl loss component of `[trainer.loss]` (DPPO + KL by default, or IPO).

Citation read: `PrimeIntellect-ai/prime-rl` @ 559b4477 (2026-08-21),
`src/prime_rl/trainer/rl/loss.py` (`default_loss_fn` l.109-161, `ipo_loss_fn` l.164-196,
`setup_rl_loss_fn` l.262-282, `compute_loss` l.285-403), `src/prime_rl/trainer/rl/train.py`
(the global rl-token count l.307-323, the logged `mismatch_kl` l.496-519) and
`packages/prime-rl-configs/src/prime_rl/configs/trainer.py` (`DefaultLossConfig`,
`IPOLossConfig`, `CustomLossConfig` l.494-532; `TrainerConfig.loss` l.604).

prime-rl has no recompute: its trainer log-prob l_theta is the training forward itself, with
its gradient, and the inference engine's l_r is the behaviour policy. Per sample, in its order:

1. d = l_theta - l_r; rho = e^d, **neither detached nor clamped** (value rho, gradient
   rho * grad l_theta); dp = e^l_theta - e^l_r, all in the log-probs' float32.
2. The trust region (a token is *dropped* from the policy-gradient term):
   - `type = "default"` (DPPO): dropped iff (A > 0 and dp > `dppo_mask_high`) or (A <= 0 and
     dp < -`dppo_mask_low`): `torch.where(A > 0, high, low)`, so A = 0 takes the low side.
   - `type = "ipo"`: dropped iff |dp| > `ipo_threshold`, whatever the advantage.
3. loss_t = -(loss_mask and not dropped) * `adv_tau` * A * rho + `kl_tau` * loss_mask * d^2.
   A dropped token stays in the KL term and in the denominator.
4. The sum over every sample of the step is divided by the global count of rl loss tokens
   (all ranks, all micro-batches); masking never shrinks it.

The replay's weight is the factor on the token's -A * grad l_theta term: (not dropped) *
`adv_tau` * rho; `keep` is the loss mask (no token leaves it), `raw` is rho. It needs the
dump's trainer log-probs as l_theta (`train_logprob`: prime-rl takes one optimizer step per
batch, after every micro-batch's forward, so its forward scores at the weights a recompute
would) and, for the default loss, each sequence's advantage
(the `advantage` column, carried as the batch's per-sequence `extra`: prime-rl's advantage
algorithms broadcast one value over a sequence's completion tokens, so its sign is every
token's). The KL term is a separate loss term, not a weight on the policy gradient: it is
described in the snippet and the docs, not replayed.

Config (`[trainer.loss]`, document `{"framework": "prime_rl", "loss": {...}}`):

| key | default | type |
|---|---|---|
| `type` | `default` (absent: the default, as pydantic-config injects it) | default, ipo |
| `dppo_mask_low`, `dppo_mask_high` | 0.2, 0.2 | default |
| `ipo_threshold` | 0.1 | ipo |
| `adv_tau` | 1.0 | both |
| `kl_tau` | 1e-3 | both |

Every value is a float >= 0 (pydantic's `Field(ge=0)`; infinity allowed, NaN not); keys of
the other type are refused, as pydantic-config's `extra="forbid"` refuses them; `type = "custom"`
(an imported loss function) cannot be replayed and is refused.

Where prime-rl's documentation and its code differ (the code wins): docs/algorithms.md writes
the policy-gradient term with min(rho, delta), "the importance-sampling clipping ratio"; the code
has no such clamp and no such key, and the DPPO mask of step 2 does not appear in the doc's
formula. The defaults moved after this commit (#3418: IPO the default, `ipo_threshold` renamed
`eps`; #3586: eps 0.3 and kl_tau 0), which `prime_rl_ipo_eps03` writes in this commit's keys.

Version `pr3283` (`"version": "pr3283"`; PR #3283, open, head 489621ac of 2026-08-16, whose
`loss.py` is this commit's but for the addition) adds `type = "kpop"` (`KPopLossConfig`:
`kpop_threshold` 0.1, `adv_tau`, `kl_tau`, each a float >= 0) and changes nothing else: with
p = e^l_theta and q = e^l_r, in the log-probs' float32 and each clamped into [1e-6, 1 - 1e-6],
a token is dropped iff B(p||q) > `kpop_threshold` or B(q||p) > it (strict: B = phi stays), B
the binary KL `ops.binary_kl`; the policy-gradient and KL terms are IPO's. Its metrics:
`masked_mismatch_kl`, `unmasked_mismatch_kl`, `is_masked`. Without the version, `type: kpop`
is refused.

>>> import torch, pyarrow as pa
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([-0.2, -1.0]),
...                cu_seqlens=torch.tensor([0, 1, 2]),
...                extra=pa.table({"advantage": [1.0, -1.0]}))
>>> r = parse({"framework": "prime_rl"}).replay(b)  # dp = 0.45 > 0.2 with A > 0: dropped
>>> [round(w, 4) for w in r.weight.tolist()], r.keep.tolist()
([0.0, 1.0], [True, True])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError, quote
from iscore.frameworks import snippets
from iscore.frameworks._config import check_choice, check_number, top_level, version
from iscore.frameworks.base import (
    Aggregation,
    Citation,
    Framework,
    HealthBand,
    Measure,
    ReferencePoint,
    Trap,
    Upstream,
    Version,
)
from iscore.frameworks.canonical import (
    Canonical,
    Component,
    Translation,
    first_weight,
    lost,
    mask_component,
    note_extras,
    note_numerator,
    weight_component,
)
from iscore.frameworks.spec import Replay
from iscore.packed import TokenBatch, ops

NAME = "prime_rl"

LossType = Literal["default", "ipo", "kpop"]

PR3283 = Version(
    "pr3283",
    3283,
    "open",
    Upstream(
        "PrimeIntellect-ai/prime-rl", "489621ac422b13124533e35b7d4fb1d4d973c47d", "2026-08-16"
    ),
    "loss.type may be kpop (KPop: drop a token whose binary KL either way > kpop_threshold)",
)

_TYPES = ("default", "ipo", "kpop", "custom")
_KEYS = {
    "default": ("dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"),
    "ipo": ("ipo_threshold", "adv_tau", "kl_tau"),
    "kpop": ("kpop_threshold", "adv_tau", "kl_tau"),
}
_DEFAULTS = {
    "dppo_mask_low": 0.2,
    "dppo_mask_high": 0.2,
    "ipo_threshold": 0.1,
    "kpop_threshold": 0.1,
    "adv_tau": 1.0,
    "kl_tau": 1e-3,
}
_NO_TRUST_REGION = 1.0
"""An IPO threshold no token exceeds: |e^l_theta - e^l_r| <= 1 for any two probabilities."""


@dataclass(frozen=True, slots=True)
class PrimeRLLoss:
    """prime-rl's rl loss, as `[trainer.loss]` sets it.

    Args:
        type: `type`: "default" (DPPO + KL), "ipo", or "kpop" (version pr3283).
        dppo_mask_low: `dppo_mask_low` (default type): A <= 0 tokens with dp below -it drop.
        dppo_mask_high: `dppo_mask_high` (default type): A > 0 tokens with dp above it drop.
        ipo_threshold: `ipo_threshold` (ipo type): tokens with |dp| above it drop.
        kpop_threshold: `kpop_threshold` (kpop type): tokens whose binary KL either way is
            above it drop.
        adv_tau: `adv_tau`, the factor on the policy-gradient term.
        kl_tau: `kl_tau`, the factor on the squared-log-ratio KL term.
        name: display name.
        version: None (the pinned release) or "pr3283", which the kpop type needs.
    """

    framework: ClassVar[str] = NAME
    type: LossType = "default"
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    ipo_threshold: float = 0.1
    kpop_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3
    name: str = NAME
    version: Literal["pr3283"] | None = None

    def __post_init__(self) -> None:
        check_choice("version", self.version, (None, PR3283.name))
        check_choice("loss.type", self.type, ("default", "ipo", "kpop"))
        if self.type == "kpop" and self.version != PR3283.name:
            raise _needs_version()
        for key, default in _DEFAULTS.items():
            value = getattr(self, key)
            check_number(f"loss.{key}", value, ge=0.0)
            if key not in _KEYS[self.type] and value != default:
                raise ConfigError(
                    f"Expected `loss.{key}` to be left at {default} with `loss.type: "
                    f"{self.type}` (prime-rl's {self.type} loss has no such key), but got "
                    f"{quote(value)}"
                )

    @property
    def needs_advantage(self) -> bool:
        """Whether replaying needs each sequence's advantage (the default loss's sign test)."""
        return self.type == "default"

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting, the inverse of `parse`.

        >>> PrimeRLLoss(type="ipo", ipo_threshold=0.3, kl_tau=0.0).to_config()["loss"]
        {'type': 'ipo', 'ipo_threshold': 0.3, 'adv_tau': 1.0, 'kl_tau': 0.0}
        """
        loss = {"type": self.type} | {key: getattr(self, key) for key in _KEYS[self.type]}
        version = {} if self.version is None else {"version": self.version}
        return {"framework": NAME, "name": self.name, **version, "loss": loss}

    def dropped(self, batch: TokenBatch) -> torch.Tensor:
        """bool [N]: the tokens the trust region drops from the policy-gradient term (over
        every token; the loss mask is applied by `replay`)."""
        if self.type == "kpop":
            theta, rollout, threshold = _policy(batch), batch.rollout, self.kpop_threshold
            forward, reverse = ops.binary_kl(theta, rollout), ops.binary_kl(rollout, theta)
            return (forward > threshold) | (reverse > threshold)
        dp = ops.prob_diff(batch)  # float32, as prime-rl's
        if self.type == "ipo":
            return dp.abs() > self.ipo_threshold
        positive = _advantage(batch) > 0
        return torch.where(positive, dp > self.dppo_mask_high, dp < -self.dppo_mask_low)

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights: the factor on each token's -A * grad l_theta term.

        Raises:
            ConfigError: (default loss) the batch carries no advantage.
        """
        rho = ops.raw_ratio(batch)  # float32; no clamp
        weight = torch.where(self.dropped(batch), rho.new_zeros(()), rho * self.adv_tau)
        return Replay.build(batch, weight, batch.loss_mask, rho)


def _needs_version() -> ConfigError:
    return ConfigError(
        f"`loss.type: kpop` needs version {PR3283.name} (prime-rl PR #{PR3283.pr}, "
        f"{PR3283.status}; prime-rl's main has no such type): add `version: {PR3283.name}` to "
        "the config"
    )


def _policy(batch: TokenBatch) -> torch.Tensor:
    """l_theta: the trainer's log-probs. prime-rl takes one optimizer step per batch, after
    every micro-batch's forward, so its loss forward scores at the weights a recompute would:
    the dump's `train_logprob` (a prime-rl export's `trainer_logprobs`)."""
    return batch.train.float()


def _advantage(batch: TokenBatch) -> torch.Tensor:
    """float64 [N]: each token's copy of its sequence's advantage (null as NaN: low side)."""
    values = ops.sequence_values(batch, "advantage")
    if values is None:
        raise ConfigError(
            "prime-rl's default loss (DPPO) picks the trust region's side by the advantage's "
            "sign, so it needs the dump's `advantage` column carried with the batch (open the "
            "dump with extras, as the app and `iscore sequences` do), which this batch lacks"
        )
    return values


def parse(config: Mapping[str, Any]) -> PrimeRLLoss:
    """Parse `{"framework": "prime_rl", "loss": {...}}` (prime-rl's `[trainer.loss]`).

    Raises:
        ConfigError: an unknown key (one of the other type's included), a value below 0,
            `type: custom`, or `type: kpop` without `version: pr3283`.

    >>> spec = parse({"framework": "prime_rl", "loss": {"type": "ipo", "ipo_threshold": 0.2}})
    >>> spec.type, spec.ipo_threshold, spec.kl_tau
    ('ipo', 0.2, 0.001)
    """
    top, name = top_level(config, NAME)
    chosen = version(top, (PR3283.name,))
    s = top.section("loss")
    top.done()
    kind = s.choice("type", "default", _TYPES)
    if kind == "custom":
        raise ConfigError(
            f"`{s.key('type')}: custom` runs the loss function at `import_path`, which iscore "
            "cannot replay; expected 'default', 'ipo' or (version pr3283) 'kpop'"
        )
    if kind == "kpop" and chosen is None:
        raise _needs_version()
    values = {key: s.float(key, _DEFAULTS[key], ge=0.0) for key in _KEYS[kind]}
    s.done()
    return PrimeRLLoss(type=kind, name=name, version=chosen, **values)


PRESETS: dict[str, PrimeRLLoss] = {
    "prime_rl_default": PrimeRLLoss(name="prime_rl_default"),
    "prime_rl_ipo": PrimeRLLoss(type="ipo", name="prime_rl_ipo"),
    # #3586 (2026-09-18): IPO's defaults became eps 0.3 and kl_tau 0 (eps is this commit's
    # ipo_threshold, renamed by #3418).
    "prime_rl_ipo_eps03": PrimeRLLoss(
        type="ipo", ipo_threshold=0.3, kl_tau=0.0, name="prime_rl_ipo_eps03"
    ),
    "prime_rl_kpop_pr3283": PrimeRLLoss(
        type="kpop", name="prime_rl_kpop_pr3283", version=PR3283.name
    ),
}
"""prime-rl's default at 559b4477 (DPPO + KL), its IPO loss there, IPO as #3586 set it, and
version pr3283's KPop loss with its defaults."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: PrimeRLLoss) -> Canonical:
    weight = weight_component("token", numerator="train")
    if spec.type == "kpop":
        # Dropped iff either binary KL > phi: kept iff both <= phi, an inclusive band.
        kpop = mask_component(
            "token",
            None,
            spec.kpop_threshold,
            statistic="binary_kl",
            numerator="train",
            numerics="float32",
        )
        return Canonical((weight, kpop), anchor="none")
    if spec.type == "ipo":
        low, high = -spec.ipo_threshold, spec.ipo_threshold
        by_advantage = False
    else:
        low, high = -spec.dppo_mask_low, spec.dppo_mask_high
        by_advantage = True
    if by_advantage or high < _NO_TRUST_REGION:
        band = mask_component(
            "token",
            low,
            high,
            statistic="prob_diff",
            numerator="train",
            numerics="float32",
            by_advantage=by_advantage,
        )
        return Canonical((weight, band), anchor="none")
    return Canonical((weight,), anchor="none")


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    w = first_weight(c, notes, "prime-rl")
    if w is None:
        notes.append(
            "prime-rl always weights the policy gradient by the raw ratio e^(l_theta - "
            "l_rollout); the source applies no weight"
        )
    else:
        note_numerator(notes, w, "train", "prime-rl")
        if w.lower is not None or w.upper is not None or w.zero is not None:
            lost(notes, w, "prime-rl's ratio is neither truncated nor zeroed")
    fields: dict[str, Any] = {"type": "ipo", "ipo_threshold": _NO_TRUST_REGION}
    for m in c.masks:
        taken = fields["type"] != "ipo" or fields["ipo_threshold"] != _NO_TRUST_REGION
        if taken:
            lost(notes, m, "prime-rl has one trust region; dropped")
        elif _trust_region(m):
            fields = _trust_region_fields(m, notes)
        elif m.statistic == "binary_kl" and m.upper is not None:
            fields = _kpop_fields(m, notes)
        else:
            lost(
                notes,
                m,
                "prime-rl masks only by the probability difference (or, version pr3283, "
                "its binary KL); dropped",
            )
    note_extras(notes, c, "prime-rl")
    chosen = None
    if fields["type"] == "kpop":
        chosen = PR3283.name
        notes.append(
            f"loss.type kpop is prime-rl PR #{PR3283.pr}'s ({PR3283.status}), not in "
            f"prime-rl's main: written for `version: {PR3283.name}`"
        )
    notes.append(
        "kl_tau 0: the source has no KL term (prime-rl's own default, 1e-3, adds "
        "kl_tau * (l_theta - l_rollout)^2 on every loss token)"
    )
    return [(PrimeRLLoss(name=name, kl_tau=0.0, version=chosen, **fields), tuple(notes))]


def _trust_region(m: Component) -> bool:
    return m.statistic == "prob_diff" and m.level == "token" and not m.strict


def _kpop_fields(m: Component, notes: list[str]) -> dict[str, Any]:
    """Version pr3283's KPop loss for a binary-KL token mask."""
    note_numerator(notes, m, "train", "prime-rl")
    if m.lower is not None:
        lost(notes, m, "prime-rl's KPop bounds the binary KL from above only")
    if m.strict:
        lost(notes, m, "prime-rl keeps a token whose binary KL equals kpop_threshold")
    return {"type": "kpop", "kpop_threshold": m.upper}


def _trust_region_fields(m: Component, notes: list[str]) -> dict[str, Any]:
    """The loss type and thresholds of a probability trust region."""
    note_numerator(notes, m, "train", "prime-rl")
    low = math.inf if m.lower is None else -m.lower
    high = math.inf if m.upper is None else m.upper
    if m.by_advantage:
        return {"type": "default", "dppo_mask_low": max(low, 0.0), "dppo_mask_high": max(high, 0)}
    if low != high:
        lost(notes, m, "prime-rl's IPO band is symmetric; its wider side is kept")
    return {"type": "ipo", "ipo_threshold": min(max(low, high, 0.0), _NO_TRUST_REGION)}


# ------------------------------------------------------------------ the framework


def _render(body: Mapping[str, Any], fmt: str | None) -> str:
    """The YAML of the trainer's `loss` (pydantic-config reads YAML as it reads TOML), or the
    `--trainer.loss.*` flags of `uv run rl`."""
    if fmt == "flags":
        loss = body.get("loss", {})
        flags = {f"trainer.loss.{key.replace('_', '-')}": value for key, value in loss.items()}
        return snippets.option_flags(flags)
    header = "# the trainer's [loss] (rl.toml: [trainer.loss]), as YAML\n"
    return header + snippets.yaml_text(body)


def _comments(spec: PrimeRLLoss) -> tuple[str, ...]:
    lines = []
    if spec.version == PR3283.name:
        lines.append(
            f"needs prime-rl PR #{PR3283.pr} ({PR3283.status}): loss type kpop is not in "
            "prime-rl's main"
        )
    if spec.kl_tau > 0:
        lines.append(
            f"kl_tau {spec.kl_tau:g} adds kl_tau * (l_theta - l_rollout)^2 on every loss token, "
            "dropped ones included: a loss term, not a weight"
        )
    if spec.type == "default":
        lines.append("the side of the trust region follows the advantage; A = 0 takes the low side")
    return tuple(lines)


def _nan_loss(batch: TokenBatch, measure: Measure) -> str | None:
    """The tokens whose float32 ratio overflows, on the default setting."""
    rho = torch.exp(_policy(batch) - batch.rollout)
    overflow = batch.loss_mask & torch.isinf(rho)
    if not bool(overflow.any()):
        return None
    return (
        f"{int(overflow.sum()):,} loss tokens of this dump have a float32 ratio of inf "
        "(l_theta - l_rollout > 88.7): prime-rl's loss is inf there, or NaN where the trust "
        "region drops the token (0 * inf), since rho is neither detached nor clamped."
    )


METRICS = {"k3": ("mismatch_kl/all/mean",)}
"""iscore's statistics as prime-rl logs them: `mismatch_kl` is rho - log rho - 1 per loss token
(train.py l.496-519), its token mean iscore's k3. The loss function's own metrics
(`masked_mismatch_kl`, `unmasked_mismatch_kl`, `is_masked`, default type also `is_masked_low`,
`is_masked_high`, `masked_advantage_positive`, `masked_advantage_negative`) are per-sample means
over dropped, kept or loss tokens (docs/corrections.md#prime-rl)."""

GATES = (
    HealthBand(
        "k3",
        None,
        0.015,
        "mismatch_kl",
        "its merge bar for a new architecture; prime-rl's mismatch_kl is the token mean of "
        "rho - log rho - 1: iscore's k3",
        Citation("prime-rl PR #3543", "https://github.com/PrimeIntellect-ai/prime-rl/pull/3543"),
    ),
)
"""The bar prime-rl holds a new architecture's mismatch to before merging it."""

_R3 = Citation(
    "prime-rl pull request #2808 (MoE router replay end to end)",
    "https://github.com/PrimeIntellect-ai/prime-rl/pull/2808",
)
_KL_AS_K3 = (
    "the source does not state its KL estimator; iscore compares it with k3, its unbiased "
    "estimate of KL(rollout || train)"
)
REFERENCES = tuple(
    ReferencePoint(
        setting, "Qwen3-30B-A3B (MoE)", "bf16", "k3", value, "mismatch KL", _R3, _KL_AS_K3
    )
    for setting, value in (
        ("MoE without routing replay (step 0)", 0.0015),
        ("MoE with routing replay (step 0)", 0.0005),
    )
)
"""Measurements published in prime-rl's pull requests."""

TRAPS = (
    Trap(
        "rho-undetached-unclamped",
        "prime-rl's ratio rho = e^(l_theta - l_rollout) is neither detached nor clamped (its "
        "docs' min(rho, delta) is not in the code): a float32 overflow gives an inf loss, and a "
        "NaN one on a token the trust region drops (0 * inf).",
        _nan_loss,
    ),
    Trap(
        "zero-advantage-low-side",
        "prime-rl's default loss holds A = 0 tokens to the low side of its trust region "
        "(dp < -dppo_mask_low drops them), and logs them in is_masked but in neither "
        "is_masked_low nor masked_advantage_negative.",
        about=lambda spec: spec.type == "default",
    ),
    Trap(
        "defaults-moved",
        "prime-rl's defaults moved after 559b4477: #3418 made IPO the default (ipo_threshold "
        "renamed eps, 0.1) and removed DPPO, #3586 set eps 0.3 and kl_tau 0; a config without "
        "`type` means DPPO here and IPO on later commits.",
    ),
)


FRAMEWORK = Framework(
    name=NAME,
    title="prime-rl",
    upstream=Upstream(
        "PrimeIntellect-ai/prime-rl", "559b44772e471d1538537b8805cc77f3824a5e64", "2026-08-21"
    ),
    spec_types=(PrimeRLLoss,),
    parse=parse,
    presets=lambda: PRESETS,
    # IPO as prime-rl sets it by default since #3586, and a loss that replays without the
    # advantages a batch may not carry.
    default="prime_rl_ipo_eps03",
    versions=(PR3283,),
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=_render,
    # Each component's sum over the step's global count of its tokens (loss.py l.394).
    aggregation=lambda spec: Aggregation("token-mean"),
    metrics=METRICS,
    gates=GATES,
    references=REFERENCES,
    comments=_comments,
    traps=TRAPS,
    support="replays vLLM's sampling mask over the trainer's logits since #3431 (after this "
    "commit; no flag)",
    snippet_formats=("yaml", "flags"),
    families=frozenset({"dppo", "ipo"}),
)
