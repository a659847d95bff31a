"""The toy task and the tiny policy that learns it, for many independent runs at once.

A prompt is a sequence of L input tokens x; the answer is L output tokens y, and position t
is right when y_t is `rule[x_t, y_{t-1}]`, a random table drawn per seed (y_{-1} is the begin
token `Task.bos`). The reward of an answer is the share of its positions that are right, so it
lies in [0, 1] and a uniform policy earns 1 / vocab. The policy is autoregressive over a short
context: it sees x_t and y_{t-1}, through an embedding bag (their embeddings summed), tanh and
a linear layer to the logits. Because that is its whole context, its log-probs over every
(x, prev) pair form a small table [V, V + 1, V]: sampling gathers rows of it, training
differentiates through it, and the exact expected reward of a policy follows from it (a Markov
chain over the previous token, the inputs uniform), with no evaluation noise.

Every tensor carries a leading run dimension [C, S]: C candidate settings by S seeds, trained
side by side. Runs share nothing: each has its own parameters, Adam is elementwise, and a
seed's random draws come from that seed's own generator (`seed_generator`), so a run's result
does not depend on which other runs were batched with it.

>>> task = Task(vocab=4, hidden=8)
>>> policy = Policy(task, candidates=3, seeds=[0, 1])
>>> policy.log_probs().shape
torch.Size([3, 2, 4, 5, 4])
>>> uniform = torch.full((1, 1, 4, 5, 4), 0.25).log()
>>> expected_reward(uniform, targets(task, [0]), length=8)
tensor([[0.2500]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Task:
    """The size of the toy task and of its policy.

    Attributes:
        vocab: V, the number of tokens (inputs and outputs alike).
        hidden: the width of the policy's embeddings and hidden layer.
        init_scale: the standard deviation of the output layer at initialization; small, so
            a fresh policy is close to uniform and has everything to learn.
    """

    vocab: int = 16
    hidden: int = 64
    init_scale: float = 0.1

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2:
                raise ValueError(f"Expected `{name}` to be an int >= 2, but got {value!r}")

    @property
    def bos(self) -> int:
        """The begin token: the previous output of every answer's first position."""
        return self.vocab


def seed_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one seed's stream (0: the rule and the initial policy, 1: the
    rollouts, 2: the recommendation's dump run, 3: the engine's per-context noise), the same
    whatever else runs beside it."""
    return torch.Generator().manual_seed(1_000_003 * stream + seed)


def targets(task: Task, seeds: Sequence[int]) -> torch.Tensor:
    """int64 [S, V, V + 1]: each seed's hidden rule, the right output after each (x, prev)."""
    v = task.vocab
    return torch.stack(
        [torch.randint(v, (v, v + 1), generator=seed_generator(seed, 0)) for seed in seeds]
    )


class Policy(torch.nn.Module):
    """C x S independent tiny policies: run (c, s) starts from seed s's initialization, the
    same for every c, so the candidates of a seed start alike and differ only by training.

    Args:
        task: the task's size.
        candidates: C, the number of settings trained side by side.
        seeds: the S seeds; seed s draws its initialization after its rule (stream 0).
    """

    def __init__(self, task: Task, candidates: int, seeds: Sequence[int]) -> None:
        super().__init__()
        self.task = task
        v, h = task.vocab, task.hidden
        inits = []
        for seed in seeds:
            gen = seed_generator(seed, 0)
            torch.randint(v, (v, v + 1), generator=gen)  # the rule, drawn first (`targets`)
            inits.append(
                (
                    torch.randn(v, h, generator=gen),
                    torch.randn(v + 1, h, generator=gen),
                    torch.randn(h, v, generator=gen) * task.init_scale / h**0.5,
                )
            )

        def stacked(i: int) -> torch.nn.Parameter:
            per_seed = torch.stack([init[i] for init in inits])
            return torch.nn.Parameter(per_seed.expand(candidates, *per_seed.shape).clone())

        self.input_embedding = stacked(0)  # [C, S, V, H]
        self.token_embedding = stacked(1)  # [C, S, V + 1, H]
        self.output = stacked(2)  # [C, S, H, V]
        self.bias = torch.nn.Parameter(torch.zeros(candidates, len(seeds), 1, v))

    def log_probs(self) -> torch.Tensor:
        """float32 [C, S, V, V + 1, V]: log pi(y | x, prev) for every context."""
        c, s, v, h = self.input_embedding.shape
        hidden = torch.tanh(
            self.input_embedding.unsqueeze(-2) + self.token_embedding.unsqueeze(-3)
        )  # [C, S, V, V + 1, H]
        logits = hidden.reshape(c, s, -1, h) @ self.output + self.bias
        return torch.log_softmax(logits, -1).reshape(c, s, v, v + 1, v)


def expected_reward(log_probs: torch.Tensor, rule: torch.Tensor, length: int) -> torch.Tensor:
    """float32 [C, S]: each policy's exact expected reward, inputs uniform.

    Args:
        log_probs: float [C, S, V, V + 1, V], the policies' tables (`Policy.log_probs`).
        rule: int64 [S, V, V + 1], the hidden rules (`targets`).
        length: L, the number of tokens of an answer.
    """
    c, s, v, rows, _ = log_probs.shape
    probs = log_probs.detach().double().exp()
    # Averaged over the uniform input: the chance to be right, and the next output's law.
    right = probs.gather(-1, rule.expand(c, s, v, rows).unsqueeze(-1)).squeeze(-1).mean(2)
    step = probs.mean(2).reshape(-1, rows, v)  # [C S, V + 1, V]
    prev = torch.zeros(c * s, 1, rows, dtype=torch.float64)
    prev[..., -1] = 1.0
    total = torch.zeros(c, s, dtype=torch.float64)
    for _ in range(length):
        total += (prev.view(c, s, rows) * right).sum(-1)
        prev = torch.cat([prev @ step, prev.new_zeros(c * s, 1, 1)], -1)
    return (total / length).float()


def rewards(tokens: torch.Tensor, inputs: torch.Tensor, rule: torch.Tensor) -> torch.Tensor:
    """float32 [C, S, B]: each answer's share of right tokens.

    Args:
        tokens: int64 [C, S, B, L], the sampled answers.
        inputs: int64 [S, B, L], their prompts' input tokens.
        rule: int64 [S, V, V + 1], the hidden rules.
    """
    bos = rule.shape[-1] - 1
    prev = torch.cat([torch.full_like(tokens[..., :1], bos), tokens[..., :-1]], -1)
    s = torch.arange(rule.shape[0]).view(-1, 1, 1)
    return (tokens == rule[s, inputs, prev]).float().mean(-1)
