"""What a good setting does to the data: the targets a recommendation holds its candidates to,
and the grade (good, fair, bad) of each statistic against them that every settings table is
coloured by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from iscore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Targets:
    """What a good setting does to this data.

    Attributes:
        max_token_drop: at most this share of loss tokens may lose their gradient (weight 0).
        max_seq_drop: at most this share of sequences may be dropped entirely.
        lr_scale: the effective learning-rate scale must lie in [lo, hi].
        min_ess: the effective sample size (fraction of tokens) must be at least this.
    """

    max_token_drop: float = 0.01
    max_seq_drop: float = 0.05
    lr_scale: tuple[float, float] = (0.8, 1.25)
    min_ess: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_token_drop", "max_seq_drop", "min_ess"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Expected `{name}` to be a fraction in [0, 1], but got {value}")
        lo, hi = self.lr_scale
        if not 0.0 < lo <= 1.0 <= hi:
            raise ConfigError(
                f"Expected `lr_scale` to be a range lo <= 1 <= hi with lo > 0, but got {lo}:{hi}"
            )

    def grade(self, key: str, value: float | None) -> Literal["good", "fair", "bad"] | None:
        """Whether `value` of statistic `key` (a column of the settings table) is good, fair or
        bad for training, against these targets where they say (None for a missing value):

        - `lr_scale`: good within `lr_scale`, fair within half its low and twice its high end;
        - `ess`: good from `min_ess` (at least 0.8), fair from 0.3;
        - `weight_mean`, `weight_mean_seq`: good within [0.9, 1.1], fair within [0.5, 2];
        - `broken_gradient_kept`: good up to `MAX_BROKEN_KEPT` (10%), fair up to 50%;
        - dropped and truncated shares: good up to `max_token_drop` (tokens),
          `max_seq_drop` (sequences) or 0.01 (truncation), fair up to 5 times that.

        >>> Targets().grade("ess", 0.043), Targets().grade("lr_scale", 1.0)
        ('bad', 'good')
        """
        if value is None or value != value:
            return None
        if key == "lr_scale":
            lo, hi = self.lr_scale
            good, fair = lo <= value <= hi, lo / 2 <= value <= hi * 2
        elif key == "ess":
            good, fair = value >= max(self.min_ess, 0.8), value >= 0.3
        elif key in ("weight_mean", "weight_mean_seq"):
            good, fair = 0.9 <= value <= 1.1, 0.5 <= value <= 2
        elif key == "broken_gradient_kept":
            good, fair = value <= MAX_BROKEN_KEPT, value <= 0.5
        else:
            limit = {
                "token_masked_fraction": self.max_token_drop,
                "seq_masked_fraction": self.max_seq_drop,
            }.get(key, 0.01)
            good, fair = value <= limit, value <= 5 * limit
        return "good" if good else "fair" if fair else "bad"

    def violations(self, stats: dict[str, float]) -> list[str]:
        """The targets a candidate's statistics miss, in words."""
        missed = []
        if stats["token_masked_fraction"] > self.max_token_drop:
            missed.append(f"drops {stats['token_masked_fraction']:.1%} of tokens")
        if stats["seq_masked_fraction"] > self.max_seq_drop:
            missed.append(f"drops {stats['seq_masked_fraction']:.1%} of sequences")
        lo, hi = self.lr_scale
        if not lo <= stats["lr_scale"] <= hi:
            missed.append(f"LR scale {stats['lr_scale']:.4g} outside [{lo:g}, {hi:g}]")
        if stats["ess"] < self.min_ess:
            missed.append(f"ESS {stats['ess']:.1%} below {self.min_ess:.0%}")
        return missed


MAX_BROKEN_KEPT = 0.10
"""With broken sequences found, a setting must remove at least 90% of their gradient."""
