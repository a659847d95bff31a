"""Simulate paired rollout/trainer logprob dumps whose mismatch is known exactly.

No public dataset pairs rollout and trainer log-probs token by token, so tests, demos and the
app use simulated dumps whose ground truth is exact rather than estimated.

The model, at every position of every sequence:

* The rollout engine has logits z over `vocab` candidates: candidate 0 gets a margin m over
  N(0, 1) logits for the others. Three quarters of positions are peaked (m = 6 +
  Gamma(2, 2), capped at 30; about 76% of sampled tokens have probability > 0.9), a
  quarter are forking (m ~ U(-1, 6)); the mean sampled log-prob is about -0.48.
* The trainer's logits are z + eps, eps_k = sigma_t * e_k with e_k Student-t (4 degrees of
  freedom, unit variance; one Gamma scale per position, so noisy positions are noisy on
  every candidate). sigma_t is the regime's sigma, times 30 on a rare outlier token
  (probability 5e-5) and times 15 inside a routing-flip span, capped at 4 nats.
* The rollout distribution mu is softmax(z), or softmax(z / temperature) restricted and
  renormalized to the top-p nucleus when the regime says so; the trainer's is
  pi = softmax(z + eps). The token a is sampled from mu (inverse CDF on a uniform), and
  `rollout_logprob` = log mu[a], `train_logprob` = log pi[a], d = train - rollout.

Because a is drawn from mu, E_mu[exp(d)] = sum of pi over mu's support: exactly 1 unless
the rollout truncated to a nucleus; the spread of d grows for low-probability tokens on its
own (d ~ eps_a - E_pi[eps]). The exact KL(mu || pi) and KL(pi || mu) of each position are
computed from the full distributions and token-averaged per step in float64 (`StepTruth`).

Regimes and what they give at the default `SimConfig` (256 sequences, seed 0, ~250k
tokens; k3 = mean(exp(d) - 1 - d), KL = exact mean KL(rollout || trainer)):

===============  =============================================  =======  ======  ======
regime           parameters                                     mean|d|  k3      KL
===============  =============================================  =======  ======  ======
dense_bf16       sigma 0.07                                     0.0097   4.5e-4  4.6e-4
fp8              sigma 0.75                                     0.12     0.052   0.052
moe_routing      sigma 0.07; 10% of sequences get a span        0.011    1.3e-3  1.4e-3
                 (5-30% of the sequence) with sigma x 15
offset_bug       sigma 0.07; rollout reports top-p 0.9          0.030    1.5e-3  0.029
                 processed log-probs; E[exp(d)] = 0.972
temperature_bug  sigma 0.07; rollout at temperature 0.7         0.073    0.023   0.023
drift            sigma 0.07 x 1.5 per step; steps 0, 1, 2, 3    0.0097   4.5e-4  4.6e-4
                                                                0.015    9.6e-4  9.8e-4
                                                                0.022    2.2e-3  2.2e-3
                                                                0.033    5.2e-3  5.2e-3
long_collapse    sigma 0.09; median length 4000 (1.5M tokens);  0.0125   7.5e-4  7.5e-4
                 median exp(sum d) per sequence 0.05, 15% of
                 them in [0.5, 2] (dense_bf16: 0.75, 64%)
===============  =============================================  =======  ======  ======

Rare outliers remain in every regime: max |d| over those ~250k tokens is 1.3 nats for
dense_bf16, 1.4 to 15 for the others. `SimConfig.median_len=None` takes the regime's
median length (4000 for `long_collapse`, 600 otherwise); an explicit value always wins.
Columns are `SEQUENCE_SCHEMA` (what `simulate` yields) or `TOKEN_SCHEMA`; with
`SimConfig.policy_sigma` > 0 a `policy_logprob` column follows `train_logprob`: the log-prob of
the sampled token under a current policy whose logits are the trainer's plus Gaussian noise of
that size (what bypass and current-policy corrections score against), with the exact
KL(trainer || policy) in the truth. With `SimConfig.experts` > 0 the dump gets
`rollout_experts` and `train_experts` (each token's expert ids; `routing_differ` of the tokens
routed to another expert on the trainer's side, their noise times `routing_scale`), and with
`SimConfig.turns` > 0 a `turn` column (the first `BOUNDARY_TOKENS` tokens of each turn after the
first with their noise times `turn_scale`): the sources the attribution's `routing` and
`retokenization` findings name, and with scale 1 the same columns without the source.

Generation is vectorized numpy in chunks of bounded scratch memory: about 2.8M tokens/s on
one core at vocab 16 (1.8M for offset_bug, which sorts for its nucleus). `write_simulated`
streams a step at a time, so a 50M-token dump (200 default steps) takes about half a minute
and under 0.5 GB of memory. The same seed gives identical output; every regime draws the
same random streams, so one seed gives the same lengths, rewards and contexts in every
regime.

>>> batch = next(simulate(SimConfig("fp8", sequences=16)))
>>> truth = json.loads(batch.schema.metadata[STEP_METADATA_KEY])
>>> truth["expected_ratio"], 0.01 < truth["kl_rollout_train"] < 0.1
(1.0, True)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from numbers import Integral, Real
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from iscore.dump.columns import TOPK_COLUMNS
from iscore.dump.stepfiles import step_file, write_atomic
from iscore.errors import ConfigError, DumpError, IscoreError, quote
from iscore.utils import output_path

METADATA_KEY = b"iscore.simulate"
"""Parquet key-value metadata key of the file's `SimTruth` (JSON, see `SimTruth.to_dict`)."""

STEP_METADATA_KEY = b"iscore.simulate.step"
"""Schema metadata key of each batch `simulate` yields: that step's `StepTruth` as JSON."""

_SCRATCH_ELEMENTS = 1 << 21
"""Candidates x tokens per generation chunk: each (vocab, tokens) float32 scratch array is
8 MiB whatever the vocab, so memory is bounded and the arrays stay cache friendly."""

_FORKING_FRACTION = 0.25
"""Fraction of positions that are uncertain ("forking" tokens)."""

_FORKING_MARGIN = (-1.0, 6.0)
"""Uniform range of the top candidate's logit margin at a forking position."""

_PEAKED_MARGIN = (6.0, 2.0, 2.0)
"""Peaked positions: margin = offset + Gamma(shape, scale)."""

_T_SHAPE = 2.0
"""Gamma shape whose inverse square root scales a position's noise: Student-t with 4
degrees of freedom and unit variance."""

_MAX_MARGIN = 30.0
"""Cap on the top candidate's margin (nats)."""

_MAX_NOISE = 4.0
"""Cap on a position's trainer-noise scale (nats): with |normal| <= 5.77 it bounds every
logit difference well inside float32 exp's range."""

_FLIP_SPAN = (0.05, 0.3)
"""Uniform range of a routing-flip span's length, as a fraction of its sequence."""

NUM_EXPERTS = 64
"""Experts a simulated router picks from (`SimConfig.experts` of them per token)."""

BOUNDARY_TOKENS = 4
"""The first this many tokens of each turn after the first get `SimConfig.turn_scale`."""


@dataclass(frozen=True, slots=True)
class Regime:
    """A kind of rollout/trainer mismatch and its parameters.

    Attributes:
        name: key in `REGIMES`.
        description: one line saying what it models.
        sigma: scale (nats) of the noise added to the trainer's logits at step 0.
        sigma_growth: factor by which `sigma` grows per step (drift); 1 keeps it constant.
        outlier_prob: per-token probability that the noise scale is multiplied by
            `outlier_scale` (rare heavy outliers).
        outlier_scale: noise multiplier of an outlier token.
        flip_fraction: fraction of sequences with one contiguous span of routing-flip noise.
        flip_scale: noise multiplier inside a routing-flip span.
        top_p: nucleus the rollout engine samples from and renormalizes its reported
            log-probs over; 1 disables it. Below 1 the trainer's raw log-probs disagree by
            about log(kept mass): the processed-vs-raw logprob bug.
        temperature: temperature the rollout samples and reports log-probs at; the trainer
            always reports temperature 1.
        median_len: the regime's default median sequence length, used when `SimConfig`
            gets none.
    """

    name: str
    description: str
    sigma: float
    sigma_growth: float = 1.0
    outlier_prob: float = 5e-5
    outlier_scale: float = 30.0
    flip_fraction: float = 0.0
    flip_scale: float = 15.0
    top_p: float = 1.0
    temperature: float = 1.0
    median_len: int = 600

    @property
    def unbiased(self) -> bool:
        """Whether E_rollout[exp(d)] = 1: the rollout's support is the trainer's."""
        return self.top_p >= 1.0


_BF16_SIGMA = 0.07

REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("dense_bf16", "Dense model, bf16 rollout vs bf16 trainer.", sigma=_BF16_SIGMA),
        Regime("fp8", "FP8-quantized rollout vs bf16 trainer.", sigma=0.75),
        Regime(
            "moe_routing",
            "MoE: bf16 noise plus routing-flip spans in a tenth of the sequences.",
            sigma=_BF16_SIGMA,
            flip_fraction=0.1,
        ),
        Regime(
            "offset_bug",
            "Rollout reports top-p 0.9 processed log-probs, trainer raw ones (biased).",
            sigma=_BF16_SIGMA,
            top_p=0.9,
        ),
        Regime(
            "temperature_bug",
            "Rollout samples and reports at temperature 0.7, trainer at 1.",
            sigma=_BF16_SIGMA,
            temperature=0.7,
        ),
        Regime(
            "drift",
            "bf16 mismatch growing 1.5x per step.",
            sigma=_BF16_SIGMA,
            sigma_growth=1.5,
        ),
        Regime(
            "long_collapse",
            "Long responses with MoE-level per-token KL: product weights collapse.",
            sigma=0.09,
            median_len=4000,
        ),
    )
}
"""The simulated regimes by name."""


def _check_int(name: str, value: Any, low: int, low_name: str = "") -> int:
    """Return `value` as an int, or raise if it is not an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        bound = f"{low_name}={low}" if low_name else str(low)
        raise ConfigError(
            f"Expected argument `{name}` to be an int >= {bound}, but got {quote(value)}"
        )
    return int(value)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What to simulate: regime, sizes, lengths and seed.

    Sequence lengths are log-normal around `median_len` with log-sd `length_sigma`,
    rounded and clipped to [min_len, max_len]. `median_len=None` takes the regime's
    default (4000 for `long_collapse`, 600 otherwise); an explicit value always wins.

    Args:
        regime: a key of `REGIMES`.
        sequences: sequences per step.
        steps: training steps (one Parquet row group each).
        seed: seed of the whole dump; each step draws from its own stream.
        min_len: shortest sequence.
        max_len: longest sequence.
        median_len: median sequence length, or None for the regime's default.
        length_sigma: log-normal sigma of the lengths; 0 makes every length `median_len`.
        vocab: candidate tokens per position.
        group_size: sequences per prompt group (advantages are normalized per group).
        policy_sigma: scale (nats) of the logit noise between the trainer and the current
            policy (the model after the step's first updates, which bypass and current-policy
            corrections score against); above 0 the dump gets a `policy_logprob` column, drawn
            from a stream of its own so that every other column is the same as without it.
        policy_growth: factor by which `policy_sigma` grows per step: a current policy that
            lags further behind the trainer each step (staleness growing with off-policy
            lag), while the engine's noise (the regime's) stays as it is; 1 keeps it constant.
        broken_share: the share of each step's sequences (at least one when above 0) that a
            stale replica scored: every token's train log-prob `BROKEN_SHIFT` nats above the
            rollout's, capped at 0. `broken_sequences` says which.
        broken_from: the first step with broken sequences (`broken_share` applies from it).
        grow_from: a scheduled change: from this step on the trainer noise grows by `growth`
            per step (at this step it is `growth` times the regime's); None keeps it as the
            regime has it.
        growth: the factor the trainer noise grows by per step from `grow_from`.
        experts: expert ids per token (an MoE router's top-k, of `NUM_EXPERTS`); above 0 the
            dump gets `rollout_experts` and `train_experts` columns (the trainer's in
            another order: the same choice), drawn from a stream of their own.
        routing_differ: the share of tokens whose routing differs between the two sides (the
            trainer's router swaps one of their experts for another), drawn from that
            stream; with `experts` 0 the columns are left out and only the noise stays.
        routing_scale: the trainer noise's multiplier on the tokens whose routing differs;
            1 (the default) makes a disagreement that carries no extra mismatch.
        turns: turns per sequence; above 0 the dump gets a `turn` column, each sequence cut
            into that many turns of equal length (a sequence shorter than that has fewer).
        turn_scale: the trainer noise's multiplier on the first `BOUNDARY_TOKENS` tokens of
            each turn after the first (re-tokenized seams); 1 (the default) leaves them be.
        floor_sigma: scale (nats) of the logit noise between the trainer and a second
            recompute of it (another micro-batch size or parallel layout); above 0 the dump
            gets a `floor_logprob` column, the noise floor, drawn from a stream of its own.
        topk: above 0, the dump gets the engine's `topk` most likely candidates at each token
            (`rollout_topk_ids`), their log-probs and the trainer's at them
            (docs/distribution.md): at most `vocab`, and not with a top-p regime (outside its
            nucleus the engine's log-prob is -inf, which a dump cannot hold). They describe
            the regime's distributions, before a broken sequence's shift.
        replicas: above 0, each prompt group is sampled by one of this many engine replicas
            (group g by replica g mod `replicas`): the dump gets `replica` and
            `weight_version` columns (docs/why.md#the-metadata-breakdown).
        noisy_replica: the replica whose trainer noise is `noisy_factor` times the others'
            (an engine instance on other kernels or hardware); None: all alike.
        noisy_factor: that multiplier, in [1, 30].
        stale_share: the share of each step's sequences (after the first) sampled with the
            previous step's weights: their `weight_version` is the step's minus one (the
            version is the step's otherwise). Only the label changes.
        fixed_version: every sequence's `weight_version` is 0: the policy never changes (a
            learning rate of 0), so a mismatch that grows is the engine's (`engine_drift`).
        retokenized: the share of sequences the trainer scored re-tokenized: the dump gets a
            `train_token_id` column, another id than `token_id` at the middle token of each
            of them (`token_id_mismatch`); 0 (the default) leaves the column out.

    Raises:
        ConfigError: a value is of the wrong type or out of range.

    >>> SimConfig("long_collapse").median_len
    4000
    >>> SimConfig(sequences=0)
    Traceback (most recent call last):
    ...
    iscore.errors.ConfigError: Expected argument `sequences` to be an int >= 1, but got 0
    """

    regime: str = "dense_bf16"
    sequences: int = 256
    steps: int = 1
    seed: int = 0
    min_len: int = 16
    max_len: int = 16384
    median_len: int | None = None
    length_sigma: float = 1.0
    vocab: int = 16
    group_size: int = 8
    broken_share: float = 0.0
    policy_sigma: float = 0.0
    broken_from: int = 0
    grow_from: int | None = None
    growth: float = 1.5
    policy_growth: float = 1.0
    experts: int = 0
    routing_differ: float = 0.0
    routing_scale: float = 1.0
    turns: int = 0
    turn_scale: float = 1.0
    floor_sigma: float = 0.0
    topk: int = 0
    replicas: int = 0
    noisy_replica: int | None = None
    noisy_factor: float = 1.0
    stale_share: float = 0.0
    fixed_version: bool = False
    retokenized: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.regime, str) or self.regime not in REGIMES:
            raise ConfigError(
                f"Expected argument `regime` to be one of {', '.join(map(repr, REGIMES))}, "
                f"but got {quote(self.regime)}"
            )
        # Normalized through object.__setattr__ so numpy integers become plain ints and
        # the config stays hashable and JSON-serializable.
        for name, low in (
            ("sequences", 1),
            ("steps", 1),
            ("seed", 0),
            ("min_len", 1),
            ("vocab", 2),
            ("group_size", 1),
            ("broken_from", 0),
            ("experts", 0),
            ("turns", 0),
            ("replicas", 0),
        ):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), low))
        if self.experts >= NUM_EXPERTS:
            raise ConfigError(
                f"Expected argument `experts` to be an int < {NUM_EXPERTS} (the experts a "
                f"simulated router picks from), but got {self.experts}"
            )
        for name, lo, hi in (
            ("routing_differ", 0.0, 1.0),
            ("routing_scale", 1.0, 30.0),
            ("turn_scale", 1.0, 30.0),
            ("noisy_factor", 1.0, 30.0),
            ("stale_share", 0.0, 1.0),
            ("retokenized", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not lo <= value <= hi:
                raise ConfigError(
                    f"Expected argument `{name}` to be a float in [{lo:g}, {hi:g}], but got "
                    f"{quote(value)}"
                )
            object.__setattr__(self, name, float(value))
        object.__setattr__(
            self, "max_len", _check_int("max_len", self.max_len, self.min_len, "min_len")
        )
        median = REGIMES[self.regime].median_len if self.median_len is None else self.median_len
        median = _check_int("median_len", median, self.min_len, "min_len")
        if median > self.max_len:
            raise ConfigError(
                f"Expected argument `median_len` to be an int <= max_len={self.max_len}, "
                f"but got {median}"
            )
        object.__setattr__(self, "median_len", median)
        sigma = self.length_sigma
        if isinstance(sigma, bool) or not isinstance(sigma, Real) or not 0 <= sigma <= 4:
            raise ConfigError(
                f"Expected argument `length_sigma` to be a float in [0, 4], but got {quote(sigma)}"
            )
        object.__setattr__(self, "length_sigma", float(sigma))
        share = self.broken_share
        if isinstance(share, bool) or not isinstance(share, Real) or not 0 <= share < 1:
            raise ConfigError(
                f"Expected argument `broken_share` to be a float in [0, 1), but got {quote(share)}"
            )
        object.__setattr__(self, "broken_share", float(share))
        for name in ("policy_sigma", "floor_sigma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 2:
                raise ConfigError(
                    f"Expected argument `{name}` to be a float in [0, 2], but got {quote(value)}"
                )
            object.__setattr__(self, name, float(value))
        if self.grow_from is not None:
            object.__setattr__(self, "grow_from", _check_int("grow_from", self.grow_from, 0))
        growth = self.growth
        if isinstance(growth, bool) or not isinstance(growth, Real) or not 1 <= growth <= 10:
            raise ConfigError(
                f"Expected argument `growth` to be a float in [1, 10], but got {quote(growth)}"
            )
        object.__setattr__(self, "growth", float(growth))
        growth = self.policy_growth
        if isinstance(growth, bool) or not isinstance(growth, Real) or not 0.5 <= growth <= 4:
            raise ConfigError(
                "Expected argument `policy_growth` to be a float in [0.5, 4], but got "
                f"{quote(growth)}"
            )
        object.__setattr__(self, "policy_growth", float(growth))
        object.__setattr__(self, "topk", _check_int("topk", self.topk, 0))
        self._check_replicas()
        if self.topk > self.vocab:
            raise ConfigError(
                f"Expected argument `topk` to be at most `vocab` ({self.vocab}), but got "
                f"{self.topk}"
            )
        if self.topk and REGIMES[self.regime].top_p < 1.0:
            raise ConfigError(
                f"Expected no `topk` with the {self.regime} regime: its engine samples from a "
                "top-p nucleus and reports -inf outside it, which a dump cannot hold"
            )

    def _check_replicas(self) -> None:
        """The metadata options need replicas to label (`replicas`)."""
        if not isinstance(self.fixed_version, bool):
            found = quote(self.fixed_version)
            raise ConfigError(f"Expected argument `fixed_version` to be a bool, but got {found}")
        needs = {"noisy_replica": self.noisy_replica is not None}
        needs |= {"stale_share": self.stale_share > 0, "fixed_version": self.fixed_version}
        for name, given in needs.items():
            if given and not self.replicas:
                raise ConfigError(
                    f"Expected argument `replicas` >= 1 with `{name}` (the replicas and the "
                    "weight versions are labelled together), but got 0"
                )
        if self.noisy_replica is not None:
            value = _check_int("noisy_replica", self.noisy_replica, 0)
            if value >= self.replicas:
                raise ConfigError(
                    f"Expected argument `noisy_replica` to be a replica, 0 to {self.replicas - 1}, "
                    f"but got {value}"
                )
            object.__setattr__(self, "noisy_replica", value)

    def sigma(self, step: int) -> float:
        """The trainer noise's scale (nats) at `step`: the regime's, grown from `grow_from`.

        >>> SimConfig(grow_from=2, growth=2.0).sigma(3) / SimConfig().sigma(3)
        4.0
        """
        regime = REGIMES[self.regime]
        sigma = regime.sigma * regime.sigma_growth**step
        if self.grow_from is not None and step >= self.grow_from:
            # Beyond the cap on a position's noise, more growth changes nothing.
            sigma *= self.growth ** min(step - self.grow_from + 1, 1000)
        return min(sigma, _MAX_NOISE)


@dataclass(frozen=True, slots=True)
class StepTruth:
    """Exact mismatch of one simulated step, averaged over its tokens.

    Attributes:
        step: the step.
        sequences: sequences in the step.
        tokens: tokens in the step.
        sigma: the regime's trainer-noise scale at this step (nats).
        kl_rollout_train: token mean of KL(rollout || trainer) at each position; the
            quantity k1 = mean(-d) and k3 = mean(exp(d) - 1 - d) estimate.
        kl_train_rollout: token mean of KL(trainer || rollout); infinite when the rollout
            renormalized over a top-p nucleus (the trainer has mass it cannot sample).
        expected_ratio: token mean of E_rollout[exp(d)], the trainer's mass on the
            rollout's support; exactly 1 unless the regime is biased (top-p).
        broken: sequences a stale replica scored (`SimConfig.broken_share`); the three
            figures above describe the regime's noise, before that shift.
        kl_train_policy: token mean of KL(trainer || current policy) at each position, what
            the k-estimators of `policy_logprob - train_logprob` estimate; None without a
            policy (`SimConfig.policy_sigma` 0).
        kl_train_floor: token mean of KL(trainer || its second recompute) at each position,
            what the floor's k3 estimates; None without a floor (`SimConfig.floor_sigma` 0).
    """

    step: int
    sequences: int
    tokens: int
    sigma: float
    kl_rollout_train: float
    kl_train_rollout: float
    expected_ratio: float
    broken: int = 0
    kl_train_policy: float | None = None
    kl_train_floor: float | None = None


def _json_float(value: float) -> float | None:
    # Strict JSON has no Infinity; None (null) stands for an infinite KL.
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class SimTruth:
    """Ground truth of a simulated dump: its config, regime and exact per-step mismatch.

    Attributes:
        config: the config simulated.
        regime: the regime's parameters.
        steps: one `StepTruth` per step.
    """

    config: SimConfig
    regime: Regime
    steps: tuple[StepTruth, ...]

    @property
    def tokens(self) -> int:
        """Tokens in the whole dump."""
        return sum(s.tokens for s in self.steps)

    @property
    def sequences(self) -> int:
        """Sequences in the whole dump."""
        return sum(s.sequences for s in self.steps)

    def _token_mean(self, name: str) -> float:
        return math.fsum(getattr(s, name) * s.tokens for s in self.steps) / self.tokens

    @property
    def kl_rollout_train(self) -> float:
        """Token mean of KL(rollout || trainer) over the whole dump."""
        return self._token_mean("kl_rollout_train")

    @property
    def kl_train_rollout(self) -> float:
        """Token mean of KL(trainer || rollout) over the whole dump (may be infinite)."""
        return self._token_mean("kl_train_rollout")

    @property
    def expected_ratio(self) -> float:
        """Token mean of E_rollout[exp(d)] over the whole dump."""
        return self._token_mean("expected_ratio")

    @property
    def kl_train_policy(self) -> float | None:
        """Token mean of KL(trainer || current policy) over the whole dump, or None without a
        policy."""
        if not self.config.policy_sigma:
            return None
        return self._token_mean("kl_train_policy")

    @property
    def kl_train_floor(self) -> float | None:
        """Token mean of KL(trainer || its second recompute) over the whole dump, or None
        without a floor."""
        if not self.config.floor_sigma:
            return None
        return self._token_mean("kl_train_floor")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; an infinite KL is None.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     truth = write_simulated(Path(tmp) / "sim.parquet", SimConfig(sequences=4))
        >>> d = truth.to_dict()
        >>> d["regime"]["name"], d["tokens"] == truth.tokens, SimTruth.from_dict(d) == truth
        ('dense_bf16', True, True)
        """
        return {
            "config": _config_dict(self.config),
            "regime": asdict(self.regime),
            "tokens": self.tokens,
            "sequences": self.sequences,
            "kl_rollout_train": self.kl_rollout_train,
            "kl_train_rollout": _json_float(self.kl_train_rollout),
            "expected_ratio": self.expected_ratio,
            "kl_train_policy": self.kl_train_policy,
            # Only with a floor: a dump without one records what it did before there was any.
            **({} if self.kl_train_floor is None else {"kl_train_floor": self.kl_train_floor}),
            "steps": [_step_dict(s) for s in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimTruth:
        """Rebuild a `SimTruth` from `to_dict`'s output (e.g. parsed from a file's metadata)."""
        steps = []
        for s in data["steps"]:
            reverse = s["kl_train_rollout"]
            steps.append(
                StepTruth(**{**s, "kl_train_rollout": math.inf if reverse is None else reverse})
            )
        return cls(SimConfig(**data["config"]), Regime(**data["regime"]), tuple(steps))


_SCHEDULE = ("broken_from", "grow_from", "growth")
"""A config's scheduled change (`SimConfig.grow_from`, `SimConfig.broken_from`)."""


def _config_dict(config: SimConfig) -> dict[str, Any]:
    """The config as JSON-ready fields, its scheduled change and a growing policy only where it
    has them (so that a dump without records what it did before there were any)."""
    fields = asdict(config)
    if config.grow_from is None and config.broken_from == 0:
        for name in _SCHEDULE:
            del fields[name]
    if config.policy_growth == 1.0:  # unset: written as before the field existed
        del fields["policy_growth"]
    defaults = {f.name: f.default for f in dataclass_fields(SimConfig)}
    for name in (
        "experts",
        "routing_differ",
        "routing_scale",
        "turns",
        "turn_scale",
        "floor_sigma",
        "topk",
        "replicas",
        "noisy_replica",
        "noisy_factor",
        "stale_share",
        "fixed_version",
        "retokenized",
    ):
        if fields[name] == defaults[name]:  # unset: written as before the field existed
            del fields[name]
    return fields


def read_truth(path: str | Path) -> SimTruth:
    """Read the ground truth `write_simulated` stored in a Parquet file's metadata.

    Raises:
        DumpError: the file cannot be read as Parquet or holds no simulation metadata.
    """
    try:
        metadata = pq.read_metadata(path).metadata or {}
    except (OSError, pa.ArrowException) as e:
        raise DumpError(f"{path}: cannot read the Parquet metadata: {e}") from e
    if METADATA_KEY not in metadata:
        raise DumpError(
            f"{path}: expected key {quote(METADATA_KEY.decode())} in the Parquet metadata of a "
            f"simulated dump, but found keys {sorted(k.decode() for k in metadata)}"
        )
    return SimTruth.from_dict(json.loads(metadata[METADATA_KEY]))


def _normals(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """float32 [rows, n] standard normals by Box-Muller, ~2.5x faster than numpy's."""
    half = (rows + 1) // 2
    u = rng.random((2, half, n), dtype=np.float32)
    # 1 - u lies in (0, 1], so the log is finite; |values| <= sqrt(2 * 24 * ln 2) = 5.77.
    radius = np.sqrt(np.float32(-2.0) * np.log1p(-u[0]))
    angle = u[1] * np.float32(2.0 * np.pi)
    out = np.empty((2 * half, n), dtype=np.float32)
    np.multiply(radius, np.cos(angle), out=out[:half])
    np.multiply(radius, np.sin(angle), out=out[half:])
    return out[:rows]


def _margins(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [n] logit margin of candidate 0: mostly peaked, a quarter forking."""
    forking = rng.random(n, dtype=np.float32) < _FORKING_FRACTION
    lo, hi = _FORKING_MARGIN
    fork = rng.random(n, dtype=np.float32) * np.float32(hi - lo) + np.float32(lo)
    offset, shape, scale = _PEAKED_MARGIN
    peak = rng.standard_gamma(shape, n, dtype=np.float32) * np.float32(scale) + np.float32(offset)
    # Beyond ~30 nats the top probability is 1 in float32 anyway; the cap keeps the
    # temperature regime's logit differences far from float32 exp overflow.
    return np.minimum(np.where(forking, fork, peak), np.float32(_MAX_MARGIN))


def _outside_nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """bool [K, n]: candidates outside the top-p nucleus of each column's distribution.

    A candidate is kept when the probability mass ranked strictly above it is < top_p, so
    the nucleus is the smallest top set reaching top_p and always holds the argmax.
    """
    probs = weights / weights.sum(axis=0)
    vocab, n = probs.shape
    # Sorting rows of the transpose is ~3x faster than sorting along axis 0.
    ascending = np.ascontiguousarray(np.sort(probs.T, axis=1).T)
    above = np.zeros_like(ascending)
    for k in range(vocab - 2, -1, -1):
        np.add(above[k + 1], ascending[k + 1], out=above[k])
    kept = np.count_nonzero(above < top_p, axis=0)
    smallest_kept = ascending[vocab - kept, np.arange(n)]
    return probs < smallest_kept


def _expm1_minus_x(x: np.ndarray) -> np.ndarray:
    """float32 exp(x) - 1 - x to ~1e-5 relative precision, also where expm1(x) - x cancels."""
    # Series on x clipped to [-0.03, 0.03] (first omitted term < 5e-7 relative), plus the
    # direct form's excess beyond the clip, which is exactly 0 inside it; branch-free,
    # because np.where over a random mask is slower than the arithmetic.
    clipped = np.clip(x, np.float32(-0.03), np.float32(0.03))
    out = clipped * np.float32(1 / 24)
    out += np.float32(1 / 6)
    out *= clipped
    out += np.float32(0.5)
    out *= clipped
    out *= clipped
    out -= np.expm1(clipped) - clipped
    out += np.expm1(x) - x
    return out


@dataclass(slots=True)
class _Positions:
    """Sampled tokens of a chunk of positions and their exact per-position truth."""

    token_id: np.ndarray  # int32 [n], the sampled candidate
    rollout: np.ndarray  # float32 [n], log mu[a]
    train: np.ndarray  # float32 [n], log pi[a]
    kl_forward: np.ndarray  # float32 [n], KL(mu || pi)
    kl_reverse: np.ndarray  # float32 [n], KL(pi || mu)
    ratio: np.ndarray  # float32 [n], E_mu[pi / mu]
    policy: np.ndarray | None = None  # float32 [n], log q[a] (with a policy)
    kl_policy: np.ndarray | None = None  # float32 [n], KL(pi || q)
    floor: np.ndarray | None = None  # float32 [n], log f[a] (with a floor)
    kl_floor: np.ndarray | None = None  # float32 [n], KL(pi || f)
    topk: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # [n, k] ids, log mu, log pi


def _sample_positions(
    rng: np.random.Generator,
    noise: np.ndarray,
    regime: Regime,
    vocab: int,
    policy_noise: np.ndarray | None = None,
    floor_noise: np.ndarray | None = None,
    topk: int = 0,
) -> _Positions:
    """Draw rollout/trainer distributions at n positions, sample from the rollout, score both.

    Arrays are [vocab, n] so every reduction over candidates is a vectorized sum of rows.

    Args:
        rng: the step's generator.
        noise: float32 [n], scale of the trainer's logit noise at each position.
        regime: the mismatch regime.
        vocab: candidates per position.
        policy_noise: float32 [vocab, n], the current policy's logits minus the trainer's, or
            None for no policy.
        floor_noise: float32 [vocab, n], a second recompute's logits minus the trainer's, or
            None for no floor.
        topk: how many of the rollout's most likely candidates to report (0: none).
    """
    n = noise.size
    logits = _normals(rng, vocab, n)
    logits[0] += _margins(rng, n)
    delta = _normals(rng, vocab, n)  # trainer minus rollout logits, filled in below
    delta *= noise
    uniform = rng.random(n, dtype=np.float32)

    if regime.temperature != 1.0:
        rollout_logits = logits * np.float32(1.0 / regime.temperature)
        delta += logits - rollout_logits
    else:
        rollout_logits = logits
    shifted = rollout_logits - rollout_logits.max(axis=0)
    weights = np.exp(shifted)
    if regime.top_p < 1.0:
        outside = _outside_nucleus(weights, regime.top_p)
        weights_outside = np.where(outside, weights, np.float32(0.0))
        weights[outside] = 0.0
    total = weights.sum(axis=0)
    mu = weights / total

    # With delta centred on its rollout mean, KL(mu || pi) = log E_mu[exp(delta)] =
    # log1p(E_mu[expm1(delta) - delta]): a sum of non-negative terms, accurate in float32
    # down to the 1e-10 KLs of peaked positions, where a difference of two log-sum-exps or
    # of E_mu[expm1(delta)] and E_mu[delta] would cancel catastrophically.
    delta -= (mu * delta).sum(axis=0)
    curvature = _expm1_minus_x(delta)
    inside = (mu * curvature).sum(axis=0)
    if regime.top_p < 1.0:
        escaped = (weights_outside / total * np.exp(delta)).sum(axis=0)
        excess = inside + escaped
    else:
        escaped = None
        excess = inside
    # log_norm = lse(trainer logits) - lse(rollout logits) - E_mu[delta] = KL(mu || pi).
    log_norm = np.log1p(excess)
    ratio = (np.float32(1.0) + inside) / (np.float32(1.0) + excess)
    # KL(pi || mu) = E_pi[delta] - log_norm, with E_pi[delta] = E_mu[expm1(delta) delta] / Z.
    spread = (mu * (curvature + delta) * delta).sum(axis=0)
    kl_reverse = spread / (np.float32(1.0) + excess) - log_norm
    if escaped is not None:
        # The trainer puts mass on candidates the rollout cannot sample.
        kl_reverse[escaped > 0] = np.inf

    # Inverse-CDF sampling; capping the target just below the total means the first
    # candidate whose CDF exceeds it always has positive mass.
    cdf = np.empty_like(mu)
    cdf[0] = mu[0]
    for k in range(1, vocab):
        np.add(cdf[k - 1], mu[k], out=cdf[k])
    target = np.minimum(uniform * cdf[-1], np.nextafter(cdf[-1], np.float32(0.0)))
    token = np.count_nonzero(cdf <= target, axis=0).astype(np.int32)

    columns = np.arange(n)
    rollout = shifted[token, columns] - np.log(total)
    log_pi = rollout + (delta[token, columns] - log_norm)
    train = np.minimum(log_pi, np.float32(0.0))
    top = _top_candidates(shifted - np.log(total), delta - log_norm, topk) if topk else None
    if policy_noise is None and floor_noise is None:
        return _Positions(token, rollout, train, log_norm, kl_reverse, ratio, topk=top)
    # The trainer's distribution over every candidate: mu e^delta on mu's support and, outside
    # a top-p nucleus, the untruncated rollout weight times e^delta; it sums to 1 + excess.
    pi = mu * np.exp(delta)
    if escaped is not None:
        pi += weights_outside / total * np.exp(delta)
    pi /= np.float32(1.0) + excess
    positions = _Positions(token, rollout, train, log_norm, kl_reverse, ratio, topk=top)
    if policy_noise is not None:
        positions.policy, positions.kl_policy = _rescored(pi, log_pi, policy_noise, token)
    if floor_noise is not None:
        positions.floor, positions.kl_floor = _rescored(pi, log_pi, floor_noise, token)
    return positions


def _top_candidates(
    log_mu: np.ndarray, shift: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The `k` candidates of largest rollout probability at each position (ids [n, k]), the
    rollout's log-probs of them, and the trainer's (log mu + `shift`, capped at 0 as the
    sampled token's is): [vocab, n] in, [n, k] out, computed as the sampled token's are."""
    order = np.argsort(-log_mu, axis=0, kind="stable")[:k]
    columns = np.arange(log_mu.shape[1])
    rollout = log_mu[order, columns]
    train = np.minimum(rollout + shift[order, columns], np.float32(0.0))
    return order.T.astype(np.int32), rollout.T.copy(), train.T.copy()


def _rescored(
    pi: np.ndarray, log_pi: np.ndarray, noise: np.ndarray, token: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The sampled tokens' log-probs under the trainer's logits plus `noise` [vocab, n] (a
    current policy, a second recompute), and KL(pi || that distribution) at each position."""
    # The same accurate form as for KL(mu || pi): with g centred on its trainer mean,
    # KL(pi || q) = log E_pi[exp(g)] = log1p(E_pi[expm1(g) - g]), and log q[a] = log pi[a] +
    # g[a] - KL(pi || q).
    g = noise - (pi * noise).sum(axis=0)
    kl = np.log1p((pi * _expm1_minus_x(g)).sum(axis=0))
    return np.minimum(log_pi + (g[token, np.arange(token.size)] - kl), np.float32(0.0)), kl


@dataclass(slots=True)
class _Step:
    """One simulated step as flat numpy arrays, before it becomes Arrow."""

    config: SimConfig
    truth: StepTruth
    lengths: np.ndarray  # int64 [S]
    offsets: np.ndarray  # int32 [S + 1]
    seq_id: np.ndarray  # int64 [S]
    group_id: np.ndarray  # int64 [S]
    reward: np.ndarray  # float32 [S]
    advantage: np.ndarray  # float32 [S]
    token_id: np.ndarray  # int32 [N]
    rollout: np.ndarray  # float32 [N]
    train: np.ndarray  # float32 [N]
    policy: np.ndarray | None = None  # float32 [N], with `SimConfig.policy_sigma`
    floor: np.ndarray | None = None  # float32 [N], with `SimConfig.floor_sigma`
    topk: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # [N, k], `SimConfig.topk`
    turn: np.ndarray | None = None  # int32 [N], with `SimConfig.turns`
    experts: tuple[np.ndarray, np.ndarray] | None = None  # int16 [N, k] each side's ids
    # int64 [S] each, with `SimConfig.replicas`: the replica and the weight version.
    metadata: tuple[np.ndarray, np.ndarray] | None = None
    train_token_id: np.ndarray | None = None  # int32 [N], with `SimConfig.retokenized`


def _lengths(rng: np.random.Generator, config: SimConfig) -> np.ndarray:
    """int64 [S] log-normal sequence lengths clipped to [min_len, max_len]."""
    raw = config.median_len * np.exp(config.length_sigma * rng.standard_normal(config.sequences))
    return np.clip(np.rint(raw), config.min_len, config.max_len).astype(np.int64)


def _rewards(rng: np.random.Generator, config: SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """float32 [S] 0/1 rewards and their group-normalized (GRPO) advantages."""
    group = np.arange(config.sequences) // config.group_size
    success = rng.random(group[-1] + 1)  # each prompt's solve rate
    reward = (rng.random(config.sequences) < success[group]).astype(np.float64)
    count = np.bincount(group)
    mean = np.bincount(group, reward) / count
    std = np.sqrt(np.bincount(group, (reward - mean[group]) ** 2) / count)
    advantage = (reward - mean[group]) / (std[group] + 1e-6)
    return reward.astype(np.float32), advantage.astype(np.float32)


def _flip_mask(rng: np.random.Generator, lengths: np.ndarray, fraction: float) -> np.ndarray:
    """bool [N]: tokens inside a routing-flip span (one span in `fraction` of sequences)."""
    flipped = rng.random(lengths.size) < fraction
    lo, hi = _FLIP_SPAN
    span = np.maximum(1, np.rint(lengths * rng.uniform(lo, hi, lengths.size))).astype(np.int64)
    span = np.minimum(span, lengths) * flipped
    start = np.floor(rng.random(lengths.size) * (lengths - span + 1)).astype(np.int64)
    # Each sequence is three runs: before, inside and after its span.
    runs = np.stack([start, span, lengths - start - span], axis=1).ravel()
    return np.repeat(np.tile(np.array([False, True, False]), lengths.size), runs)


def _routing(
    config: SimConfig, step: int, tokens: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """bool [N], the tokens whose routing differs, and int16 [N, experts] each side's expert
    ids (None without `experts`), from a stream of their own: the trainer's are the rollout's
    in reverse order, one of them swapped for another expert where the routing differs."""
    rng = np.random.default_rng([config.seed, step, 3])
    differ = rng.random(tokens) < config.routing_differ
    if not config.experts:
        return differ, None
    k = config.experts
    first = rng.integers(0, NUM_EXPERTS, tokens)
    rollout = ((first[:, None] + np.arange(k)) % NUM_EXPERTS).astype(np.int16)
    train = rollout[:, ::-1].copy()
    swapped = rng.integers(0, k, tokens)
    rows = np.flatnonzero(differ)
    train[rows, swapped[rows]] = (first[rows] + k) % NUM_EXPERTS  # outside the rollout's k
    return differ, (rollout, train)


def _turns(config: SimConfig, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int32 [N] each token's turn (each sequence cut into `turns` of equal length) and bool
    [N] the first `BOUNDARY_TOKENS` tokens of each turn after the first."""
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    length = np.repeat(lengths, lengths)
    turn = (pos * config.turns // length).astype(np.int32)
    # A turn j begins at the first position p with p * turns // length == j.
    start = -(-turn.astype(np.int64) * length // config.turns)
    boundary = (turn > 0) & (pos - start < BOUNDARY_TOKENS)
    return turn, boundary


def _replicas(config: SimConfig, step: int) -> tuple[np.ndarray, np.ndarray] | None:
    """int64 [S] each sequence's replica (its prompt group's, round robin) and weight version
    (the step's; the previous step's for a `stale_share` drawn from a stream of its own; 0
    with `fixed_version`), None without `replicas`."""
    if not config.replicas:
        return None
    group = np.arange(config.sequences, dtype=np.int64) // config.group_size
    replica = group % config.replicas
    stale = np.random.default_rng([config.seed, step, 5]).random(config.sequences)
    version = np.full(config.sequences, step, dtype=np.int64) - (stale < config.stale_share)
    if config.fixed_version:
        version[:] = 0
    return replica, np.maximum(version, 0)


def _retokenized(
    config: SimConfig, step: int, lengths: np.ndarray, token_id: np.ndarray
) -> np.ndarray | None:
    """int32 [N] the ids the trainer scored: `token_id` but at the middle token of a
    `retokenized` share of the sequences (drawn from a stream of their own), where it is the
    next id; None without `retokenized`."""
    if not config.retokenized:
        return None
    chosen = np.random.default_rng([config.seed, step, 6]).random(lengths.size)
    at = (np.cumsum(lengths) - lengths + lengths // 2)[chosen < config.retokenized]
    out = token_id.copy()
    out[at] = (out[at] + 1) % config.vocab
    return out


def _logit_noise(
    rng: np.random.Generator | None, scale: float, vocab: int, n: int
) -> np.ndarray | None:
    """float32 [vocab, n] Gaussian logit noise of `scale` nats from `rng` (a current policy's,
    a second recompute's), or None without its stream."""
    if rng is None:
        return None
    noise = _normals(rng, vocab, n)
    noise *= np.float32(scale)
    return noise


def _simulate_step(config: SimConfig, regime: Regime, step: int) -> _Step:
    """Generate one step, in chunks of bounded scratch memory."""
    # Seeding by (seed, step) lets any step be regenerated alone; all regimes draw the same
    # streams, so one seed gives the same lengths, rewards and contexts in every regime.
    rng = np.random.default_rng([config.seed, step])
    lengths = _lengths(rng, config)
    tokens = int(lengths.sum())
    if tokens > np.iinfo(np.int32).max:
        raise ConfigError(
            f"Expected at most {np.iinfo(np.int32).max} tokens per step (Arrow list offsets "
            f"are int32), but step {step} drew {tokens}; lower `sequences` or `median_len`"
        )
    offsets = np.zeros(config.sequences + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    reward, advantage = _rewards(rng, config)
    flips = _flip_mask(rng, lengths, regime.flip_fraction)
    differ, experts = _routing(config, step, tokens)
    turn, boundary = _turns(config, lengths) if config.turns else (None, None)
    metadata = _replicas(config, step)
    noisy = None
    if metadata is not None and config.noisy_replica is not None:
        noisy = np.repeat(metadata[0] == config.noisy_replica, lengths)

    sigma = config.sigma(step)
    token_id = np.empty(tokens, dtype=np.int32)
    rollout = np.empty(tokens, dtype=np.float32)
    train = np.empty(tokens, dtype=np.float32)
    kl_forward = kl_reverse = ratio = kl_policy = kl_floor = 0.0
    # The policy and the floor draw from streams of their own: with or without them, the
    # rest is the same.
    policy_rng = np.random.default_rng([config.seed, step, 2]) if config.policy_sigma else None
    policy = None if policy_rng is None else np.empty(tokens, dtype=np.float32)
    floor_rng = np.random.default_rng([config.seed, step, 4]) if config.floor_sigma else None
    floor = None if floor_rng is None else np.empty(tokens, dtype=np.float32)
    kinds = (np.int32, np.float32, np.float32)  # ids, log mu, log pi
    topk = tuple(np.empty((tokens, config.topk), t) for t in kinds) if config.topk else None
    chunk = max(1, _SCRATCH_ELEMENTS // config.vocab)
    for lo in range(0, tokens, chunk):
        hi = min(lo + chunk, tokens)
        n = hi - lo
        # Student-t scale mixture: one Gamma draw per position makes every logit's noise
        # t(4)-distributed with unit variance, and some positions much noisier than others.
        noise = np.float32(sigma) / np.sqrt(rng.standard_gamma(_T_SHAPE, n, dtype=np.float32))
        outlier = rng.random(n, dtype=np.float32) < regime.outlier_prob
        noise[outlier] *= np.float32(regime.outlier_scale)
        noise[flips[lo:hi]] *= np.float32(regime.flip_scale)
        noise[differ[lo:hi]] *= np.float32(config.routing_scale)
        if boundary is not None:
            noise[boundary[lo:hi]] *= np.float32(config.turn_scale)
        if noisy is not None:
            noise[noisy[lo:hi]] *= np.float32(config.noisy_factor)
        np.minimum(noise, np.float32(_MAX_NOISE), out=noise)
        scale = config.policy_sigma * config.policy_growth**step
        policy_noise = _logit_noise(policy_rng, scale, config.vocab, n)
        floor_noise = _logit_noise(floor_rng, config.floor_sigma, config.vocab, n)
        pos = _sample_positions(
            rng, noise, regime, config.vocab, policy_noise, floor_noise, config.topk
        )
        if topk is not None:
            for into, values in zip(topk, pos.topk, strict=True):
                into[lo:hi] = values
        if policy is not None:
            policy[lo:hi] = pos.policy
            kl_policy += float(pos.kl_policy.sum(dtype=np.float64))
        if floor is not None:
            floor[lo:hi] = pos.floor
            kl_floor += float(pos.kl_floor.sum(dtype=np.float64))
        token_id[lo:hi] = pos.token_id
        rollout[lo:hi] = pos.rollout
        train[lo:hi] = pos.train
        kl_forward += float(pos.kl_forward.sum(dtype=np.float64))
        kl_reverse += float(pos.kl_reverse.sum(dtype=np.float64))
        ratio += float(pos.ratio.sum(dtype=np.float64))

    broken = broken_sequences(config, step)
    if broken.any():
        shifted = np.repeat(broken, lengths)
        if floor is not None:  # the second recompute is of the same stale replica
            floor[shifted] -= train[shifted]
        train[shifted] = np.minimum(rollout[shifted] + np.float32(BROKEN_SHIFT), np.float32(0.0))
        if floor is not None:
            floor[shifted] = np.minimum(floor[shifted] + train[shifted], np.float32(0.0))

    first = step * config.sequences
    groups_per_step = -(-config.sequences // config.group_size)
    truth = StepTruth(
        step=step,
        sequences=config.sequences,
        tokens=tokens,
        sigma=sigma,
        kl_rollout_train=kl_forward / tokens,
        kl_train_rollout=kl_reverse / tokens,
        expected_ratio=ratio / tokens,
        broken=int(broken.sum()),
        kl_train_policy=None if policy is None else kl_policy / tokens,
        kl_train_floor=None if floor is None else kl_floor / tokens,
    )
    return _Step(
        config=config,
        truth=truth,
        lengths=lengths,
        offsets=offsets,
        seq_id=np.arange(first, first + config.sequences, dtype=np.int64),
        group_id=step * groups_per_step
        + np.arange(config.sequences, dtype=np.int64) // config.group_size,
        reward=reward,
        advantage=advantage,
        token_id=token_id,
        rollout=rollout,
        train=train,
        policy=policy,
        floor=floor,
        topk=topk,
        turn=turn,
        experts=experts,
        metadata=metadata,
        train_token_id=_retokenized(config, step, lengths, token_id),
    )


SEQUENCE_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("seq_id", pa.int64()),
        ("group_id", pa.int64()),
        ("rollout_logprob", pa.list_(pa.float32())),
        ("train_logprob", pa.list_(pa.float32())),
        ("loss_mask", pa.list_(pa.bool_())),
        ("token_id", pa.list_(pa.int32())),
        ("advantage", pa.float32()),
        ("reward", pa.float32()),
    ]
)
"""Columns of a simulated dump in sequence layout (one row per sequence)."""

TOKEN_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("seq_id", pa.int64()),
        ("group_id", pa.int64()),
        ("pos", pa.int32()),
        ("rollout_logprob", pa.float32()),
        ("train_logprob", pa.float32()),
        ("loss_mask", pa.bool_()),
        ("token_id", pa.int32()),
        ("advantage", pa.float32()),
        ("reward", pa.float32()),
    ]
)
"""Columns of a simulated dump in token layout (one row per token)."""


def _schema(layout: str, config: SimConfig) -> pa.Schema:
    """The columns of a dump of `config` in `layout`: `SEQUENCE_SCHEMA` or `TOKEN_SCHEMA`, with
    `policy_logprob` and `floor_logprob` after `train_logprob` (of its type), then `turn`,
    `rollout_experts`, `train_experts`, the top-k columns, `train_token_id`, `replica` and
    `weight_version` where the config has them."""
    schema = SEQUENCE_SCHEMA if layout == "sequence" else TOKEN_SCHEMA
    train = schema.get_field_index("train_logprob")
    for name, on in (
        ("floor_logprob", config.floor_sigma),
        ("policy_logprob", config.policy_sigma),
    ):
        if on:
            schema = schema.insert(train + 1, schema.field(train).with_name(name))

    def per_token(t: pa.DataType) -> pa.DataType:
        return pa.list_(t) if layout == "sequence" else t

    if config.turns:
        schema = schema.append(pa.field("turn", per_token(pa.int32())))
    if config.experts:
        for name in ("rollout_experts", "train_experts"):
            schema = schema.append(pa.field(name, per_token(pa.list_(pa.int16()))))
    if config.topk:
        for name, t in zip(TOPK_COLUMNS, (pa.int32(), pa.float32(), pa.float32()), strict=True):
            schema = schema.append(pa.field(name, per_token(pa.list_(t))))
    if config.retokenized:
        schema = schema.append(pa.field("train_token_id", per_token(pa.int32())))
    if config.replicas:
        for name in ("replica", "weight_version"):
            schema = schema.append(pa.field(name, pa.int64()))
    return schema


def _ids(ids: np.ndarray) -> pa.Array:
    """[N, k] values (expert ids, top-k ids or log-probs) as a list column of N lists of k."""
    n, k = ids.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * k), ids.ravel())


def _optional(s: _Step) -> list[pa.Array]:
    """The step's `turn`, expert-id, top-k and `train_token_id` columns, per token (where it
    has them)."""
    out = [] if s.turn is None else [pa.array(s.turn)]
    out += [] if s.experts is None else [_ids(ids) for ids in s.experts]
    out += [] if s.topk is None else [_ids(values) for values in s.topk]
    return out + ([] if s.train_token_id is None else [pa.array(s.train_token_id)])


def _sequence_batch(s: _Step) -> pa.RecordBatch:
    """A step in sequence layout, its truth in the schema metadata."""
    offsets = pa.array(s.offsets)

    def lists(values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(values))

    step = np.full(s.seq_id.size, s.truth.step, dtype=np.int64)
    columns = [
        step,
        s.seq_id,
        s.group_id,
        lists(s.rollout),
        lists(s.train),
        *([] if s.policy is None else [lists(s.policy)]),
        *([] if s.floor is None else [lists(s.floor)]),
        lists(np.ones(s.rollout.size, dtype=bool)),
        lists(s.token_id),
        s.advantage,
        s.reward,
        *(pa.ListArray.from_arrays(offsets, column) for column in _optional(s)),
        *(s.metadata or ()),
    ]
    schema = _schema("sequence", s.config)
    schema = schema.with_metadata({STEP_METADATA_KEY: json.dumps(_step_dict(s.truth))})
    return pa.RecordBatch.from_arrays(
        [pa.array(c) if isinstance(c, np.ndarray) else c for c in columns], schema=schema
    )


def _token_batch(s: _Step) -> pa.RecordBatch:
    """A step in token layout: sequence values repeated per token, plus `pos`."""

    def per_token(values: np.ndarray) -> np.ndarray:
        return np.repeat(values, s.lengths)

    pos = np.arange(s.rollout.size, dtype=np.int32) - per_token(s.offsets[:-1])
    columns = [
        np.full(s.rollout.size, s.truth.step, dtype=np.int64),
        per_token(s.seq_id),
        per_token(s.group_id),
        pos,
        s.rollout,
        s.train,
        *([] if s.policy is None else [s.policy]),
        *([] if s.floor is None else [s.floor]),
        np.ones(s.rollout.size, dtype=bool),
        s.token_id,
        per_token(s.advantage),
        per_token(s.reward),
        *_optional(s),
        *(per_token(values) for values in s.metadata or ()),
    ]
    columns = [pa.array(c) if isinstance(c, np.ndarray) else c for c in columns]
    return pa.RecordBatch.from_arrays(columns, schema=_schema("token", s.config))


def _step_dict(truth: StepTruth) -> dict[str, Any]:
    """A step's truth as a strict-JSON-ready dict (`kl_train_floor` only with a floor)."""
    out = {**asdict(truth), "kl_train_rollout": _json_float(truth.kl_train_rollout)}
    if truth.kl_train_floor is None:
        del out["kl_train_floor"]
    return out


def simulate(config: SimConfig) -> Iterator[pa.RecordBatch]:
    """Yield a simulated dump step by step, one sequence-layout `RecordBatch` per step.

    Each batch's schema metadata holds that step's `StepTruth` as JSON under
    `STEP_METADATA_KEY`; otherwise its schema is `SEQUENCE_SCHEMA` (with `policy_logprob`
    after `train_logprob` when `config.policy_sigma` > 0).

    Args:
        config: what to simulate.

    Yields:
        One batch per step, `config.sequences` rows.

    >>> batch = next(simulate(SimConfig(sequences=2, median_len=32)))
    >>> batch.num_rows, batch.schema.names[:3]
    (2, ['step', 'seq_id', 'group_id'])
    >>> json.loads(batch.schema.metadata[STEP_METADATA_KEY])["tokens"] > 0
    True
    """
    regime = REGIMES[config.regime]
    for step in range(config.steps):
        yield _sequence_batch(_simulate_step(config, regime, step))


def write_simulated(
    path: str | Path,
    config: SimConfig,
    *,
    layout: Literal["sequence", "token"] = "sequence",
) -> SimTruth:
    """Write a simulated dump to Parquet (zstd, one row group per step) and return its truth.

    Steps are generated and written one at a time, so memory is bounded by the largest
    step, not the dump; the file appears only when the whole dump is written. The `SimTruth`
    (with the config) is stored as JSON under `METADATA_KEY` in the file's key-value
    metadata; `read_truth` reads it back.

    Args:
        path: the Parquet file to write (overwritten).
        config: what to simulate.
        layout: "sequence" (one row per sequence, list columns) or "token" (one row per
            token with a `pos` column).

    Returns:
        The exact per-step mismatch of what was written.

    Raises:
        ConfigError: `layout` is neither "sequence" nor "token".
        IscoreError: `path` is a directory, its directory does not exist, or its name does
            not end with .parquet.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = Path(tmp) / "sim.parquet"
    ...     truth = write_simulated(path, SimConfig(steps=2, sequences=8), layout="token")
    ...     pq.ParquetFile(path).num_row_groups, len(truth.steps), read_truth(path) == truth
    (2, 2, True)
    """
    if layout not in ("sequence", "token"):
        raise ConfigError(
            f"Expected argument `layout` to be 'sequence' or 'token', but got {quote(layout)}"
        )
    regime = REGIMES[config.regime]
    schema = _schema(layout, config)
    steps = []
    with (
        output_path(path, suffixes=(".parquet",)) as tmp,
        pq.ParquetWriter(tmp, schema, compression="zstd") as writer,
    ):
        for step in range(config.steps):
            s = _simulate_step(config, regime, step)
            batch = _sequence_batch(s) if layout == "sequence" else _token_batch(s)
            # One explicit row group per step: readers filter steps by row group.
            writer.write_table(
                pa.Table.from_batches([batch.replace_schema_metadata(None)]),
                row_group_size=batch.num_rows,
            )
            steps.append(s.truth)
        truth = SimTruth(config, regime, tuple(steps))
        writer.add_key_value_metadata({METADATA_KEY: json.dumps(truth.to_dict(), allow_nan=False)})
    return truth


def write_run(
    folder: str | Path,
    config: SimConfig,
    *,
    ranks: int = 1,
    layout: Literal["sequence", "token"] = "sequence",
    every: float = 0.0,
) -> SimTruth:
    """Write a simulated run as a training loop's writer does: a folder with one Parquet file
    per step and rank, `folder/step_000123/rank_0000.parquet` (`iscore.dump.stepfiles`), each
    appearing whole, one step at a time; and return its truth.

    Each file's metadata holds, under `METADATA_KEY`, the config and its step's `StepTruth`
    (`read_truth` reads it): with `SimConfig.grow_from` and `SimConfig.broken_from`, the
    steps from which the mismatch grows and broken sequences appear.

    Args:
        folder: the run's folder: new, or empty.
        config: what to simulate.
        ranks: files per step; a step's sequences are split between them in order.
        layout: "sequence" or "token", as `write_simulated`.
        every: seconds to wait before each step after the first (a job still writing).

    Raises:
        ConfigError: `ranks` is not a positive integer or `layout` is neither layout.
        IscoreError: `folder` is a file, or a folder that holds files.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     truth = write_run(tmp, SimConfig(steps=3, sequences=4, grow_from=1), ranks=2)
    ...     files = sorted(p.relative_to(tmp).as_posix() for p in Path(tmp).rglob("*.parquet"))
    ...     step = read_truth(Path(tmp) / files[-1])
    >>> files[:2], len(files), step.steps[0].step, step.config.grow_from
    (['step_000000/rank_0000.parquet', 'step_000000/rank_0001.parquet'], 6, 2, 1)
    """
    if layout not in ("sequence", "token"):
        raise ConfigError(
            f"Expected argument `layout` to be 'sequence' or 'token', but got {quote(layout)}"
        )
    ranks = _check_int("ranks", ranks, 1)
    out = Path(folder)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a folder that holds files"
        raise IscoreError(f"{out}: is {what}; a simulated run is written into a new folder")
    regime = REGIMES[config.regime]
    steps = []
    for step in range(config.steps):
        if step and every > 0:
            time.sleep(every)
        s = _simulate_step(config, regime, step)
        table = pa.Table.from_batches(
            [(_sequence_batch(s) if layout == "sequence" else _token_batch(s))]
        ).replace_schema_metadata(None)
        truth = SimTruth(config, regime, (s.truth,))
        metadata = {METADATA_KEY.decode(): json.dumps(truth.to_dict(), allow_nan=False)}
        rows = s.offsets if layout == "token" else np.arange(config.sequences + 1)
        for rank, part in enumerate(np.array_split(np.arange(config.sequences), ranks)):
            if not part.size:  # more ranks than sequences
                continue
            lo, hi = int(rows[part[0]]), int(rows[part[-1] + 1])
            write_atomic(step_file(out, step, rank), [table.slice(lo, hi - lo)], metadata)
        steps.append(s.truth)
    return SimTruth(config, regime, tuple(steps))


BROKEN_SHIFT = 1.0
"""Nats a stale replica's train log-probs sit above the rollout's (`SimConfig.broken_share`)."""

BROKEN_FROM_SHARE = 0.04
"""The broken share `iscore simulate --broken-from` takes when not given one."""


def broken_sequences(config: SimConfig, step: int) -> np.ndarray:
    """bool [sequences]: which sequences of `step` a stale replica scored. Drawn from a stream
    of their own, so a dump with broken sequences is the same dump as without, but for them.

    >>> int(broken_sequences(SimConfig(sequences=100, broken_share=0.04), 0).sum())
    4
    """
    broken = np.zeros(config.sequences, dtype=bool)
    if config.broken_share > 0 and step >= config.broken_from:
        rng = np.random.default_rng([config.seed, step, 1])
        count = max(1, round(config.broken_share * config.sequences))
        broken[rng.choice(config.sequences, count, replace=False)] = True
    return broken
