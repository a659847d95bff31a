"""The testbed's pieces, each against an independent reference: the engine's log-probs are the
engine's, the trainer's are the policy's, a setting's weights reach the loss exactly, zero noise
makes every correction a no-op, and a run does not depend on the runs beside it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from iscore import frameworks
from iscore.frameworks.base import Aggregation
from iscore.frameworks.canonical import Canonical, mask_component
from iscore.frameworks.verl import VerlSpec
from testbed.engine import REGIMES, Regime, _draws, context_noise, sample
from testbed.task import Policy, Task, expected_reward, rewards, seed_generator, targets
from testbed.training import Training, _gather, policy_loss, token_batch, train

TASK = Task(vocab=6, hidden=8, init_scale=1.0)  # a sharp random policy: log-probs far from uniform
VERL = frameworks.get("verl")
SPECS = [
    VERL.express(Canonical(()), "off"),
    *(VERL.presets()[name] for name in ("decoupled_token_is", "decoupled_seq_is")),
    *(VERL.presets()[name] for name in ("decoupled_token_icepop", "decoupled_geo_rs")),
    VERL.presets()["decoupled_k3_rs"],
    VerlSpec(name="normalized", is_level="token", is_upper=1.5, batch_normalize=True),
]


def _table(candidates: int = 2, seeds: tuple[int, ...] = (0, 1)) -> torch.Tensor:
    return Policy(TASK, candidates, list(seeds)).log_probs().detach()


def test_engine_reports_its_own_log_probs():
    """Each rollout log-prob is log softmax(policy + that draw's noise) at the sampled token,
    recomputed here from the seed's draws."""
    regime = Regime("t", "", length=5, sigma=0.3, tail_share=0.1, tail_sigma=2.0)
    table = _table()
    batch = sample(regime, table, table, [seed_generator(s, 1) for s in (0, 1)], 2, 3)
    for s in (0, 1):
        _, _, noise, _ = _draws(regime, seed_generator(s, 1), TASK.vocab, 2, 3)
        for c in (0, 1):
            for b in range(6):
                prev = TASK.bos
                for t in range(regime.length):
                    x, y = int(batch.inputs[s, b, t]), int(batch.tokens[c, s, b, t])
                    logits = table[c, s, x, prev].double() + noise[b, t].double()
                    want = torch.log_softmax(logits, -1)[y]
                    assert math.isclose(float(batch.rollout[c, s, b, t]), want, abs_tol=1e-5)
                    prev = y


def _per_context_log_probs(regime: Regime, table: torch.Tensor, stream: int) -> dict:
    """{(seed, x, prev, y): the engine's log-prob of y} over one batch of the two seeds."""
    context = context_noise(regime, TASK.vocab, [seed_generator(s, 3) for s in (0, 1)])
    gens = [seed_generator(s, stream) for s in (0, 1)]
    batch = sample(regime, table, table, gens, 4, 4, context)
    found = {}
    for s in (0, 1):
        for b in range(16):
            prev = TASK.bos
            for t in range(regime.length):
                x, y = int(batch.inputs[s, b, t]), int(batch.tokens[0, s, b, t])
                found[s, x, prev, y] = float(batch.rollout[0, s, b, t])
                prev = y
    return found


def test_per_context_noise_is_a_function_of_the_context():
    """Per-context noise: the same (seed, x, prev) context gets the same perturbation in every
    batch and at every position, so the engine's log-prob of a token is the same wherever the
    context recurs; it is log softmax(policy + that context's noise), and the noise differs
    from one context, and one seed, to the next."""
    regime = Regime("t", "", length=6, sigma=0.3, tail_share=0.1, tail_sigma=2.0)
    regime = replace(regime, noise="per_context")
    table = _table(candidates=1)
    first = _per_context_log_probs(regime, table, stream=1)
    second = _per_context_log_probs(regime, table, stream=2)  # other prompts and draws
    shared = first.keys() & second.keys()
    assert len(shared) > 10
    for key in shared:
        assert math.isclose(first[key], second[key], abs_tol=1e-6)
    context = context_noise(regime, TASK.vocab, [seed_generator(s, 3) for s in (0, 1)])
    for (s, x, prev, y), got in first.items():
        want = torch.log_softmax(table[0, s, x, prev].double() + context[s, x, prev].double(), -1)
        assert math.isclose(got, float(want[y]), abs_tol=1e-5)
    again = context_noise(regime, TASK.vocab, [seed_generator(s, 3) for s in (0, 1)])
    assert torch.equal(context, again)
    rows = context.flatten(1, 2)  # [S, contexts, V]
    assert torch.cdist(rows[0], rows[0]).add(torch.eye(rows.shape[1])).min() > 0
    assert not torch.equal(context[0], context[1])


def test_fresh_noise_changes_with_every_draw():
    """Fresh noise: the same context gets a different perturbation at each position."""
    regime = Regime("t", "", length=64, sigma=0.3)
    _, _, noise, _ = _draws(regime, seed_generator(0, 1), TASK.vocab, 1, 1)
    assert torch.cdist(noise[0], noise[0]).add(torch.eye(64)).min() > 0
    with pytest.raises(ValueError, match="noise"):
        Regime("t", "", noise="sometimes")
    one = _table(1, (0,))
    with pytest.raises(ValueError, match="context"):
        sample(replace(regime, noise="per_context"), one, one, [seed_generator(0, 1)], 1, 1)


def test_engine_samples_from_its_distribution():
    """Without noise the engine's token frequencies match the policy's probabilities."""
    regime = Regime("t", "", length=1)
    table = _table(1, (0,))
    batch = sample(regime, table, table, [seed_generator(0, 1)], 4000, 1)
    x = batch.inputs[0, :, 0]
    for value in range(TASK.vocab):
        tokens = batch.tokens[0, 0, x == value, 0]
        freq = torch.bincount(tokens, minlength=TASK.vocab).double() / tokens.numel()
        probs = table[0, 0, value, TASK.bos].double().exp()
        se = (probs * (1 - probs) / tokens.numel()).sqrt()
        assert ((freq - probs).abs() <= 5 * se + 1e-3).all()


def test_stale_replica_samples_from_its_own_table():
    """Stale sequences' log-probs come from the stale table, the others' from the policy's."""
    regime = Regime("t", "", length=4, stale_share=0.5)
    table, old = _table(1, (0,)), _table(1, (1,))
    batch = sample(regime, table, old, [seed_generator(0, 1)], 8, 2)
    assert batch.stale.any() and not batch.stale.all()
    ref = _gather(table, batch.inputs, batch.tokens)
    ref_old = _gather(old, batch.inputs, batch.tokens)
    stale = batch.stale.expand_as(batch.rollout[..., 0])
    torch.testing.assert_close(batch.rollout[..., 0][stale], ref_old[..., 0][stale])
    torch.testing.assert_close(batch.rollout[..., 0][~stale], ref[..., 0][~stale])


def test_trainer_log_probs_are_the_policys():
    """`_gather` reads log pi(y_t | x_t, y_{t-1}) from the policy's table, with gradient."""
    policy = Policy(TASK, 2, [0, 1])
    log_probs = policy.log_probs()
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(TASK.vocab, (2, 3, 4), generator=gen)
    tokens = torch.randint(TASK.vocab, (2, 2, 3, 4), generator=gen)
    got = _gather(log_probs, inputs, tokens)
    assert got.requires_grad
    for c, s, b in torch.cartesian_prod(*(torch.arange(n) for n in (2, 2, 3))).tolist():
        prev = TASK.bos
        for t in range(4):
            y = int(tokens[c, s, b, t])
            assert got[c, s, b, t] == log_probs[c, s, int(inputs[s, b, t]), prev, y]
            prev = y


def test_expected_reward_matches_sampling():
    """The exact expected reward agrees with the mean reward of many sampled answers."""
    regime = Regime("t", "", length=6)
    table = _table(1, (3,))
    rule = targets(TASK, [3])
    batch = sample(regime, table, table, [seed_generator(3, 1)], 5000, 1)
    got = rewards(batch.tokens, batch.inputs, rule)
    mean, se = got.mean().item(), got.std().item() / got.numel() ** 0.5
    assert abs(expected_reward(table, rule, 6).item() - mean) < 4 * se


@pytest.mark.parametrize(
    "aggregation",
    [
        Aggregation("token-mean", shrinks=True),
        Aggregation("token-mean", shrinks=False),
        Aggregation("seq-mean-token-mean", shrinks=True),
        Aggregation("seq-mean-token-mean", shrinks=False),
        Aggregation("seq-mean-token-sum"),
    ],
)
def test_weights_reach_the_loss_exactly(aggregation):
    """d loss / d log pi of each token is -w A over the aggregation's denominator, in float64
    from the definitions (docs/corrections.md#loss-aggregation)."""
    gen = torch.Generator().manual_seed(1)
    s, b, length = 2, 3, 4
    logp = torch.randn(s, b, length, generator=gen, dtype=torch.float64, requires_grad=True)
    advantage = torch.randn(s, b, generator=gen, dtype=torch.float64)
    weight = torch.rand(s, b, length, generator=gen, dtype=torch.float64) * 3
    keep = torch.rand(s, b, length, generator=gen) > 0.3
    weight = weight * keep
    policy_loss(logp, advantage, weight, keep, aggregation).sum().backward()
    want = torch.zeros(s, b, length, dtype=torch.float64)
    for i in range(s):
        for j in range(b):
            for t in range(length):
                term = -float(weight[i, j, t] * advantage[i, j])
                if aggregation.mode == "token-mean":
                    n = int(keep[i].sum()) if aggregation.shrinks else b * length
                    want[i, j, t] = term / n
                elif aggregation.mode == "seq-mean-token-mean":
                    n = int(keep[i, j].sum()) if aggregation.shrinks else length
                    want[i, j, t] = term / n / b if n else 0.0
                else:
                    want[i, j, t] = term / b
    torch.testing.assert_close(logp.grad, want)


def test_replaying_runs_together_equals_replaying_each():
    """A candidate's seeds are replayed as one batch, a seed per step: for every setting, and
    batch normalization (per step) too, that equals replaying each seed's batch alone."""
    gen = torch.Generator().manual_seed(2)
    train = torch.log_softmax(torch.randn(3, 4, 5, 6, generator=gen), -1)[..., 0]
    rollout = train + 0.2 * torch.randn(3, 4, 5, generator=gen)
    together_batch = token_batch(rollout, train)
    for spec in SPECS:
        together = spec.replay(together_batch)
        for s in range(3):
            alone = spec.replay(token_batch(rollout[s : s + 1], train[s : s + 1]))
            span = slice(s * 20, (s + 1) * 20)
            torch.testing.assert_close(together.weight[span], alone.weight, rtol=1e-6, atol=0)
            assert torch.equal(together.keep[span], alone.keep)


def test_zero_noise_makes_every_correction_a_no_op():
    """With an engine equal to the trainer every setting trains exactly as no correction."""
    regime = Regime("t", "", length=8)
    training = Training(steps=6, groups=2, group_size=4, final_window=2, curve_every=2)
    trained = train(TASK, regime, training, SPECS, [0, 1])
    off = trained.runs[0]
    for runs in trained.runs[1:]:
        for run, ref in zip(runs, off, strict=True):
            assert math.isclose(run.final_reward, ref.final_reward, rel_tol=1e-5)
            assert run.stats["token_masked_fraction"] == 0.0


def test_a_run_does_not_depend_on_its_neighbours():
    """Run (setting, seed) gives the same result trained alone as beside other settings and
    seeds: what makes the seed-by-seed cache honest."""
    regime = replace(REGIMES["stale"], length=6)
    training = Training(steps=5, groups=2, group_size=4, final_window=2, curve_every=2)
    together = train(TASK, regime, training, SPECS[:3], [0, 1])
    alone = train(TASK, regime, training, SPECS[2:3], [1])
    assert together.runs[2][1].final_reward == alone.runs[0][0].final_reward
    assert together.runs[2][1].stats == alone.runs[0][0].stats


def test_a_lagging_replica_is_the_never_synced_one_until_it_lags():
    """A replica `stale_lag` steps behind samples from the initial policy for its first
    `stale_lag` steps (nothing older exists), so over fewer steps it trains as one that
    never syncs; one step behind, it does not (token TIS reads the rollout log-probs; no
    correction would ignore them, and the tokens barely change)."""
    training = Training(steps=4, groups=2, group_size=4, final_window=1, curve_every=4)
    never = Regime("t", "", length=4, sigma=0.05, stale_share=0.5)

    def reward(regime: Regime) -> float:
        return train(TASK, regime, training, SPECS[1:2], [0]).runs[0][0].final_reward

    assert reward(replace(never, stale_lag=4)) == reward(never)
    assert reward(replace(never, stale_lag=1)) != reward(never)


def test_a_mask_that_drops_everything_never_moves_the_policy():
    """The weights are the loss's only path to the gradient: a setting that masks every
    sequence leaves the policy where it started."""
    regime = Regime("t", "", length=4, sigma=0.1)
    drop_all = VERL.express(Canonical((mask_component("geometric", 3.0, 4.0),)), "drop all")
    training = Training(steps=5, groups=2, group_size=4, final_window=5, curve_every=1)
    trained = train(TASK, regime, training, [drop_all, SPECS[0]], [0])
    frozen, moving = trained.runs[0][0], trained.runs[1][0]
    assert frozen.stats["seq_masked_fraction"] == 1.0
    assert len({value for _, value in frozen.curve}) == 1
    assert len({value for _, value in moving.curve}) > 1
