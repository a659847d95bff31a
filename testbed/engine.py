"""The rollout engine: a perturbed copy of the policy that samples the training batches.

At every position the engine's logits are the policy's log-probs for the context (a valid set
of logits) plus noise: Gaussian on every logit (bf16-like), plus rare large outliers
(FP8-like heavy tails). `Regime.noise` says how the noise is drawn:

- `"fresh"`: afresh for every token of every step, as a nondeterministic kernel whose error
  does not depend on the context would. The mismatch is zero-mean across steps: its effect on
  the uncorrected gradient averages out over training, and a correction mostly adds variance.
- `"per_context"`: a deterministic function of the context, the same at every step: the
  engine's logits are the policy's plus a fixed table of noise per (x_t, y_{t-1}) pair (the
  policy's whole context), drawn once per seed from its own stream (`context_noise`). This is
  what bf16 kernels do, batch-invariant or not: their error is a function of the weights and
  the context, so the same prompt and prefix get the same perturbation, and the uncorrected
  gradient is biased the same way step after step. The table is fixed across steps, as the
  rounding of weights that move by less than their bf16 step is; a stale replica gets the
  same table.

Two regimes change mid-run (`MIDRUN`, for `testbed.leadtime`): a replica that stops syncing at
a step, and noise that starts growing at a step (`Regime.scale`: every logit's noise, the table
or the fresh draws, times 1 + `growth` per step from `grow_from`). Neither draws anything the
others do not, so every regime's random streams are those of a regime without them.

A share of the sequences may come from a stale replica, whose table is the policy of
`Regime.stale_lag` steps ago (or the initial policy when it never syncs; or, from
`Regime.stale_from` on, that step's policy: a replica that stops syncing mid-run): each sample
is its own request (verl's agent loop sends them one by one), so the replica serves single
sequences, not whole prompt groups. Tokens are sampled from the engine's
distribution, and `rollout` holds the engine's log-prob of each: what vLLM or SGLang would
report. The trainer's log-probs are the policy's own, gathered by the training loop.

>>> REGIMES["stale"].stale_share
0.125
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NOISES = ("fresh", "per_context")
"""How the engine's noise is drawn (module docstring)."""


@dataclass(frozen=True, slots=True)
class Regime:
    """How the rollout engine differs from the trainer.

    Attributes:
        name: key in `REGIMES`.
        description: what it models, in a line.
        length: L, the tokens of every sequence.
        sigma: standard deviation of the Gaussian noise on every logit.
        tail_share: the share of logits that also get an outlier.
        tail_sigma: the outliers' standard deviation.
        stale_share: the share of sequences a stale replica samples.
        stale_lag: how many steps behind the stale replica is; None: it never syncs and
            samples from the initial policy.
        noise: `"fresh"` or `"per_context"` (module docstring).
        stale_from: the stale replica syncs until this step and samples from this step's
            policy after it; None: `stale_lag` says what it samples from.
        grow_from: the noise starts growing at this step (`scale`); None: it never does.
        growth: how much of its first size the noise adds per step from `grow_from`.
    """

    name: str
    description: str
    length: int = 16
    sigma: float = 0.0
    tail_share: float = 0.0
    tail_sigma: float = 0.0
    stale_share: float = 0.0
    stale_lag: int | None = None
    noise: str = "fresh"
    stale_from: int | None = None
    grow_from: int | None = None
    growth: float = 0.0

    def __post_init__(self) -> None:
        if self.noise not in NOISES:
            raise ValueError(f"Expected `noise` of {NOISES}, but got {self.noise!r}")
        if self.length < 1:
            raise ValueError(f"Expected `length` to be an int >= 1, but got {self.length!r}")
        for name in ("sigma", "tail_share", "tail_sigma", "stale_share"):
            if getattr(self, name) < 0:
                raise ValueError(f"Expected `{name}` >= 0, but got {getattr(self, name)!r}")
        if self.tail_share > 1 or self.stale_share > 1:
            raise ValueError("Expected `tail_share` and `stale_share` to be fractions <= 1")
        if self.stale_lag is not None and self.stale_lag < 1:
            raise ValueError(f"Expected `stale_lag` >= 1 or None, but got {self.stale_lag!r}")
        for name in ("stale_from", "grow_from"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"Expected `{name}` >= 0 or None, but got {getattr(self, name)!r}")
        if self.growth < 0:
            raise ValueError(f"Expected `growth` >= 0, but got {self.growth!r}")

    def scale(self, step: int) -> float:
        """The noise's size at `step`, as a multiple of its first: 1 before `grow_from`,
        then 1 + `growth` more each step.

        >>> MIDRUN["drift_mid"].scale(MIDRUN["drift_mid"].grow_from + 10)
        4.0
        """
        if self.grow_from is None or step < self.grow_from:
            return 1.0
        return 1.0 + self.growth * (step - self.grow_from)


REGIMES = {
    r.name: r
    for r in (
        Regime(
            "bf16",
            "Gaussian noise, sd 0.05, on every logit, fixed per context",
            sigma=0.05,
            noise="per_context",
        ),
        Regime(
            "fp8",
            "Gaussian noise, sd 0.1, and an outlier of sd 4 on 1% of the logits, fixed per context",
            sigma=0.1,
            tail_share=0.01,
            tail_sigma=4.0,
            noise="per_context",
        ),
        Regime(
            "stale",
            "bf16 noise (fixed per context); a replica that never syncs samples 1 sequence in 8",
            sigma=0.05,
            stale_share=0.125,
            noise="per_context",
        ),
        Regime(
            "long",
            "bf16 noise (fixed per context), 1024-token sequences",
            length=1024,
            sigma=0.05,
            noise="per_context",
        ),
    )
}
"""The regimes of the sweep. Each draws its noise per context, as bf16 and FP8 kernels err
(docs/recommend.md: under fresh noise no correction beat every token-level one in long, an
artefact of noise that averages out over steps)."""

MIDRUN = {
    r.name: r
    for r in (
        Regime(
            "stale_mid",
            "bf16 noise (fixed per context); from step 60 a replica serving 1 sequence in 8 "
            "stops syncing",
            sigma=0.05,
            stale_share=0.125,
            noise="per_context",
            stale_from=60,
        ),
        Regime(
            "drift_mid",
            "bf16 noise (fixed per context) that grows from step 60 by 0.3 of its first size "
            "a step",
            sigma=0.05,
            noise="per_context",
            grow_from=60,
            growth=0.3,
        ),
    )
}
"""The regimes whose mismatch starts mid-run (`testbed.leadtime`): the step the change begins
at, and nothing before it that the bf16 regime lacks."""


@dataclass(frozen=True, slots=True)
class Rollouts:
    """One step's sampled batch of every run.

    Attributes:
        inputs: int64 [S, B, L], each sequence's prompt (the sequences of a group share one).
        stale: bool [S, B], whether the stale replica sampled the sequence.
        tokens: int64 [C, S, B, L], the sampled tokens.
        rollout: float32 [C, S, B, L], the engine's log-prob of each sampled token.
    """

    inputs: torch.Tensor
    stale: torch.Tensor
    tokens: torch.Tensor
    rollout: torch.Tensor


def sample(
    regime: Regime,
    log_probs: torch.Tensor,
    stale_log_probs: torch.Tensor,
    generators: Sequence[torch.Generator],
    groups: int,
    group_size: int,
    context: torch.Tensor | None = None,
    scale: float = 1.0,
) -> Rollouts:
    """Sample a batch for every run through the perturbed engine.

    Each seed draws, from its own generator and in this order, its groups' prompts, which
    sequences the stale replica serves, the logit noise (fresh noise only) and the sampling
    noise; so the runs of one seed (the candidates) see the same draws (common random numbers),
    and a run's draws do not depend on the other seeds.

    Args:
        regime: the engine's perturbation.
        log_probs: float32 [C, S, V, V + 1, V], the policies (no gradient needed).
        stale_log_probs: the same shape, the stale replica's policies.
        generators: S generators, one per seed.
        groups: prompt groups per batch.
        group_size: sequences per group; B = groups x group_size.
        context: float32 [S, V, V + 1, V], each seed's `context_noise`: required with
            per-context noise, added to the tables of both the policy and the stale replica.
        scale: the noise's size as a multiple of the regime's (`Regime.scale` of the step).
    """
    c, s, v, rows, _ = log_probs.shape
    length = regime.length
    draws = [_draws(regime, gen, v, groups, group_size) for gen in generators]
    inputs, stale, noise, gumbel = (torch.stack(x) for x in zip(*draws, strict=True))
    b = inputs.shape[1]
    table = torch.stack([log_probs, stale_log_probs]).detach()
    if regime.noise == "per_context":
        if context is None:
            raise ValueError("Expected the seeds' `context` noise with per-context noise")
        table = table + (context if scale == 1.0 else context * scale)
    table = table.reshape(-1, v)
    run = torch.arange(c * s).view(c, s, 1, 1)
    # Row of each position's context in `table`, before adding its previous token; time
    # first, so that each position's slices are contiguous.
    base = ((stale.long().unsqueeze(-1) * c * s + run) * v + inputs) * rows  # [C, S, B, L]
    base = base.movedim(-1, 0).contiguous()
    noise = noise.movedim(2, 0).contiguous()  # [L, S, B, V]
    if scale != 1.0:
        noise = noise * scale
    perturbed = noise + gumbel.movedim(2, 0)
    prev = torch.full((c, s, b), rows - 1)
    tokens = torch.empty(length, c, s, b, dtype=torch.int64)
    # Gumbel-max: the argmax of the engine's logits plus Gumbel noise is a draw from the
    # engine's softmax; its log-probs are computed afterwards, for all positions at once.
    for t in range(length):
        logits = table.index_select(0, (base[t] + prev).view(-1)).view(c, s, b, v)
        prev = logits.add_(perturbed[t]).argmax(-1)
        tokens[t] = prev
    prevs = torch.cat([torch.full_like(tokens[:1], rows - 1), tokens[:-1]])
    rollout = torch.empty(length, c, s, b)
    chunk = max(1, _CHUNK_ELEMENTS // (c * s * b * v))
    for t in range(0, length, chunk):
        at = slice(t, t + chunk)
        logits = table.index_select(0, (base[at] + prevs[at]).view(-1)).view(-1, c, s, b, v)
        engine = torch.log_softmax(logits.add_(noise[at].unsqueeze(1)), -1)
        rollout[at] = engine.gather(-1, tokens[at].unsqueeze(-1)).squeeze(-1)
    return Rollouts(inputs, stale, tokens.movedim(0, -1), rollout.movedim(0, -1))


_CHUNK_ELEMENTS = 1 << 22
"""Logits per chunk of positions when computing the engine's log-probs (16 MiB)."""


def _draws(
    regime: Regime, gen: torch.Generator, vocab: int, groups: int, group_size: int
) -> tuple[torch.Tensor, ...]:
    """One seed's draws for a step: inputs [B, L], stale [B], fresh noise [B, L, V] (zeros,
    not drawn, with per-context noise) and Gumbel noise [B, L, V] for sampling."""
    b, length = groups * group_size, regime.length
    inputs = torch.randint(vocab, (groups, length), generator=gen).repeat_interleave(group_size, 0)
    stale = torch.rand(b, generator=gen) < regime.stale_share
    if regime.noise == "fresh":
        noise = _noise(regime, gen, (b, length, vocab))
    else:
        noise = torch.zeros(()).expand(b, length, vocab)
    uniform = torch.rand(b, length, vocab, generator=gen).clamp_(min=1e-12)
    return inputs, stale, noise, uniform.log_().neg_().log_().neg_()


def context_noise(
    regime: Regime, vocab: int, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """float32 [S, V, V + 1, V]: each seed's per-context noise, one set of logit noise (the
    regime's Gaussian and outliers) per (x, prev) context, drawn from that seed's generator."""
    shape = (vocab, vocab + 1, vocab)
    return torch.stack([_noise(regime, gen, shape) for gen in generators])


def _noise(regime: Regime, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """The regime's logit noise of `shape`: Gaussian, plus outliers on `tail_share` of it."""
    noise = torch.randn(shape, generator=gen) * regime.sigma
    if regime.tail_share > 0:
        hit = torch.rand(shape, generator=gen) < regime.tail_share
        noise += hit * torch.randn(shape, generator=gen) * regime.tail_sigma
    return noise
