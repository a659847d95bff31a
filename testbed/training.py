"""Train C candidate settings x S seeds side by side, each correction applied through iscore.

One on-policy step per batch (pi_theta = pi_old at the step, so PPO's clip never acts):
sample through the engine (`testbed.engine`), score each sequence, take the advantage as the
reward minus its prompt group's mean (GRPO without the std division), and for each candidate
replay its setting on the batch as a `iscore.TokenBatch` (`spec.replay`): the detached
`weight` multiplies each token's policy-gradient term and `keep` decides the denominator where
the framework's aggregation lets rejected tokens leave it (`policy_loss`). Adam then steps
every run at once (elementwise, so the runs stay independent).

Each candidate's S runs are replayed as one batch, a seed per `step`: iscore replays tokens
and sequences independently and batch-normalizes within a step, so that equals replaying
each run alone (checked in tests/testbed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from iscore import frameworks
from iscore.frameworks.base import Aggregation
from iscore.frameworks.spec import Replay, Spec
from iscore.packed.batch import TokenBatch
from iscore.stats.setting import SettingStats
from testbed.engine import Regime, context_noise, sample
from testbed.task import Policy, Task, expected_reward, rewards, seed_generator, targets

STATS = ("lr_scale", "token_masked_fraction", "seq_masked_fraction", "ess", "weight_mean")
"""What iscore reports of a setting on each replayed batch, averaged over the run."""


@dataclass(frozen=True, slots=True)
class Training:
    """The training run's size.

    Attributes:
        steps: policy updates (one per batch).
        groups: prompt groups per batch.
        group_size: sequences per group.
        lr: Adam's learning rate.
        final_window: the final reward is the mean exact expected reward of the policies of
            the last this many steps.
        curve_every: the reward curve keeps every this many steps' expected reward.
        stats_every: iscore's statistics of the setting are taken every this many steps.
    """

    steps: int = 150
    groups: int = 8
    group_size: int = 8
    lr: float = 0.01
    final_window: int = 10
    curve_every: int = 10
    stats_every: int = 5

    def __post_init__(self) -> None:
        for name in ("steps", "groups", "group_size", "final_window", "curve_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"Expected `{name}` >= 1, but got {getattr(self, name)!r}")
        if self.final_window > self.steps:
            raise ValueError(
                f"Expected `final_window` <= `steps` ({self.steps}), but got {self.final_window}"
            )


@dataclass(slots=True)
class Run:
    """What one (setting, seed) run gave.

    Attributes:
        final_reward: the mean exact expected reward over the last `final_window` steps.
        curve: (step, expected reward) every `curve_every` steps.
        stats: the means over the run of iscore's `STATS` of the setting on each batch.
    """

    final_reward: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "final_reward": self.final_reward,
            "curve": [list(point) for point in self.curve],
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Run:
        return cls(d["final_reward"], [tuple(p) for p in d["curve"]], d["stats"])


def token_batch(rollout: torch.Tensor, train: torch.Tensor) -> TokenBatch:
    """The `iscore.TokenBatch` of S runs' batches, run s as step s.

    Args:
        rollout: float32 [S, B, L], the engine's log-probs.
        train: float32 [S, B, L], the trainer's log-probs of the same tokens.
    """
    s, b, length = rollout.shape
    return TokenBatch(
        rollout=rollout.reshape(-1).contiguous(),
        train=train.detach().reshape(-1).contiguous(),
        cu_seqlens=torch.arange(s * b + 1) * length,
        step=torch.arange(s).repeat_interleave(b),
    )


def policy_loss(
    logp: torch.Tensor,
    advantage: torch.Tensor,
    weight: torch.Tensor,
    keep: torch.Tensor,
    aggregation: Aggregation,
) -> torch.Tensor:
    """float [S]: each run's policy-gradient loss -(w A log pi) under the framework's
    aggregation (docs/corrections.md#loss-aggregation); every token is a loss token.

    Args:
        logp: float [S, B, L], log pi_theta of the sampled tokens (with gradient).
        advantage: float [S, B], per sequence.
        weight: float [S, B, L], the setting's detached weights (0 where not kept).
        keep: bool [S, B, L], the tokens the setting keeps in the loss mask.
        aggregation: the framework's for the setting (`Framework.aggregation`).

    >>> logp = torch.zeros(1, 2, 2, requires_grad=True)
    >>> w = torch.tensor([[[2.0, 0.0], [1.0, 1.0]]])
    >>> loss = policy_loss(logp, torch.ones(1, 2), w, w > 0, Aggregation("token-mean", True))
    >>> loss.sum().backward(); logp.grad  # kept tokens share the denominator: 3 of them
    tensor([[[-0.6667, -0.0000],
             [-0.3333, -0.3333]]])
    """
    term = weight * advantage.unsqueeze(-1) * logp
    length = logp.shape[-1]
    if aggregation.mode == "token-mean":
        count = keep.sum((-1, -2)) if aggregation.shrinks else keep[0].numel()
        return -term.sum((-1, -2)) / torch.as_tensor(count).clamp(min=1)
    if aggregation.mode == "seq-mean-token-mean":
        count = keep.sum(-1) if aggregation.shrinks else torch.full(keep.shape[:-1], length)
        return -(term.sum(-1) / count.clamp(min=1)).mean(-1)
    return -term.sum(-1).mean(-1)  # seq-mean-token-sum


@dataclass(frozen=True, slots=True)
class Trained:
    """The runs of one `train` call: `runs[c][s]` for candidate c and seed s, and the
    recorded steps' batches of candidate 0 (seed by seed as steps; `record`)."""

    runs: list[list[Run]]
    recorded: list[TokenBatch]


def train(
    task: Task,
    regime: Regime,
    training: Training,
    specs: Sequence[Spec],
    seeds: Sequence[int],
    progress: Callable[[int], None] | None = None,
    record: range = range(0),
    stream: int = 1,
) -> Trained:
    """Train every setting in `specs` on every seed in `seeds`, side by side.

    Args:
        task: the toy task's size.
        regime: the rollout engine's perturbation.
        training: the run's size.
        specs: C settings; each is replayed with `spec.replay` and aggregated as its
            framework does.
        seeds: the S seeds.
        progress: called with 1 after each step.
        record: the steps whose batches (candidate 0, every seed) to keep, each a
            `TokenBatch` with the step number in `step`: a dump of the run.
        stream: the seeds' rollout stream (`seed_generator`): the recommendation's dump run
            uses its own, so it never replays the evaluation's batches.
    """
    c, s = len(specs), len(seeds)
    rule = targets(task, seeds)
    policy = Policy(task, c, seeds)
    optimizer = torch.optim.Adam(policy.parameters(), lr=training.lr)
    gens = [seed_generator(seed, stream) for seed in seeds]
    context = None
    if regime.noise == "per_context":
        context = context_noise(regime, task.vocab, [seed_generator(s, 3) for s in seeds])
    aggregations = [frameworks.of(spec).aggregation(spec) for spec in specs]
    initial = policy.log_probs().detach()
    history: deque[torch.Tensor] = deque(maxlen=(regime.stale_lag or 0) + 1)
    finals = torch.zeros(c, s)
    curves: list[tuple[int, torch.Tensor]] = []
    stats = {name: np.zeros((c, s)) for name in STATS}
    stats_taken = 0
    recorded = []
    for step in range(training.steps):
        log_probs = policy.log_probs()
        current = log_probs.detach()
        history.append(current)
        stale = initial if regime.stale_lag is None else history[0]
        if regime.stale_from is not None:
            if step <= regime.stale_from:
                frozen = current
            stale = frozen
        size = training.groups, training.group_size
        batch = sample(regime, current, stale, gens, *size, context, regime.scale(step))
        logp = _gather(log_probs, batch.inputs, batch.tokens)
        reward = rewards(batch.tokens, batch.inputs, rule)
        group = reward.unflatten(-1, (training.groups, training.group_size))
        advantage = (group - group.mean(-1, keepdim=True)).flatten(-2)
        take_stats = step % training.stats_every == 0
        losses = []
        for i, spec in enumerate(specs):
            replayed = token_batch(batch.rollout[i], logp[i])
            result = spec.replay(replayed)
            shape = logp.shape[1:]
            weight = result.weight.view(shape)
            keep = result.keep.view(shape)
            losses.append(policy_loss(logp[i], advantage[i], weight, keep, aggregations[i]))
            if take_stats:
                _add_stats(stats, i, spec, replayed, result)
            if i == 0 and step in record:
                recorded.append(_as_step(replayed, step))
        stats_taken += take_stats
        optimizer.zero_grad(set_to_none=True)
        torch.stack(losses).sum().backward()
        optimizer.step()
        last = step >= training.steps - training.final_window
        if last or step % training.curve_every == 0:
            value = expected_reward(current, rule, regime.length)
            if last:
                finals += value / training.final_window
            if step % training.curve_every == 0:
                curves.append((step, value))
        if progress is not None:
            progress(1)
    runs = [
        [
            Run(
                float(finals[i, j]),
                [(step, float(value[i, j])) for step, value in curves],
                {name: float(stats[name][i, j] / max(stats_taken, 1)) for name in STATS},
            )
            for j in range(s)
        ]
        for i in range(c)
    ]
    return Trained(runs, recorded)


def _gather(log_probs: torch.Tensor, inputs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [C, S, B, L]: log pi of each sampled token in its context (with gradient)."""
    c, s, v, rows, _ = log_probs.shape
    bos = torch.full_like(tokens[..., :1], rows - 1)
    prev = torch.cat([bos, tokens[..., :-1]], -1)
    run = torch.arange(c * s).view(c, s, 1, 1)
    index = (((run * v + inputs) * rows + prev) * v) + tokens
    return log_probs.reshape(-1)[index]


def _add_stats(
    stats: dict[str, np.ndarray], i: int, spec: Spec, batch: TokenBatch, result: Replay
) -> None:
    """Add iscore's statistics of candidate i's setting on each seed's batch (a step each)."""
    setting = SettingStats(spec, histograms=False)
    setting.update(batch, result)
    for j, row in enumerate(setting.compute().by_step):
        for name in STATS:
            stats[name][i, j] += row[name]


def _as_step(batch: TokenBatch, step: int) -> TokenBatch:
    """The batch with every sequence at training step `step`, as a dump records it."""
    return TokenBatch(
        rollout=batch.rollout,
        train=batch.train,
        cu_seqlens=batch.cu_seqlens,
        step=torch.full_like(batch.step, step),
    )
