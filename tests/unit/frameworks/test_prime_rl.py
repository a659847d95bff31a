"""prime-rl: replay vs a reference written from `default_loss_fn` / `ipo_loss_fn` (loss.py at
559b4477) and version pr3283's `kpop_loss_fn` (PR #3283 at 489621ac); `[trainer.loss]` parsing,
the canonical form, the traps and the merge bar."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from iscore import frameworks
from iscore.advice.conversion import export, snippet
from iscore.advice.gates import TABLES
from iscore.errors import ConfigError
from iscore.frameworks import prime_rl, verl
from iscore.frameworks.prime_rl import PRESETS, PrimeRLLoss, parse
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import binary_kl, edge_batch, make_batch, sequences


def reference(batch: TokenBatch, spec: PrimeRLLoss):
    """(weight, dropped, raw) per token, from the formulas: l_theta is the trainer's; the
    ratio, the probability difference and its comparison are float32, as prime-rl's tensors;
    KPop's binary KL is `conftest.binary_kl` (float32 probabilities, float64 B)."""
    extra = batch.extra
    advantages = None if extra is None else extra["advantage"].to_numpy(zero_copy_only=False)
    weight, dropped, raw = [], [], []
    for i, (rollout, theta, _, mask) in enumerate(sequences(batch)):
        r32, t32 = rollout.astype(np.float32), theta.astype(np.float32)
        with np.errstate(over="ignore"):
            rho = np.exp(t32 - r32)
        dp = np.exp(t32) - np.exp(r32)
        if spec.type == "kpop":  # strict: B = phi stays
            phi = spec.kpop_threshold
            out = (binary_kl(theta, rollout) > phi) | (binary_kl(rollout, theta) > phi)
        elif spec.type == "ipo":
            out = np.abs(dp) > np.float32(spec.ipo_threshold)
        elif advantages[i] > 0:
            out = dp > np.float32(spec.dppo_mask_high)
        else:  # A <= 0 (and a NaN advantage) take the low side
            out = dp < -np.float32(spec.dppo_mask_low)
        keep_pg = mask & ~out
        weight.append(np.where(keep_pg, spec.adv_tau * rho.astype(np.float64), 0.0))
        dropped.append(out)
        raw.append(rho.astype(np.float64))
    return np.concatenate(weight), np.concatenate(dropped), np.concatenate(raw)


def reference_of(spec: PrimeRLLoss, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness: no token
    leaves the loss mask (a dropped one stays in the KL term and the denominator)."""
    weight, _, raw = reference(batch, spec)
    return weight, batch.loss_mask.numpy(), raw


EXTRA_SPECS = {
    "asymmetric": PrimeRLLoss(dppo_mask_low=0.05, dppo_mask_high=0.3, adv_tau=0.5, name="asym"),
    "tight_ipo": PrimeRLLoss(type="ipo", ipo_threshold=0.01, kl_tau=0.0, name="tight_ipo"),
    "no_pg": PrimeRLLoss(adv_tau=0.0, name="no_pg"),
    "tight_kpop": PrimeRLLoss(
        type="kpop", kpop_threshold=0.002, adv_tau=0.5, name="tight_kpop", version="pr3283"
    ),
    "loose_kpop": PrimeRLLoss(type="kpop", kpop_threshold=2.0, name="loose_kpop", version="pr3283"),
}


def check(batch: TokenBatch, spec: PrimeRLLoss) -> None:
    result = spec.replay(batch)
    weight, dropped, raw = reference(batch, spec)
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=0)
    assert torch.equal(result.keep, batch.loss_mask)
    assert np.array_equal(spec.dropped(batch).numpy(), dropped)


@pytest.mark.parametrize("spec", [*PRESETS.values(), *EXTRA_SPECS.values()], ids=str)
@pytest.mark.parametrize("seed", [3, 4, 5])
def test_replay_matches_the_reference_on_fresh_data(spec, seed) -> None:
    rng = np.random.default_rng(seed)
    lengths = [1, 1, *rng.integers(1, 400, 30).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=0.3, masked_fraction=0.2)
    check(batch, spec)
    # The trust region bites on this data: some tokens drop, some stay.
    dropped = spec.dropped(batch) & batch.loss_mask
    if spec.name != "prime_rl_ipo_eps03":
        assert 0 < int(dropped.sum()) < int(batch.loss_mask.sum())


@pytest.mark.parametrize("spec", [*PRESETS.values(), *EXTRA_SPECS.values()], ids=str)
def test_replay_matches_the_reference_on_the_edge_cases(spec) -> None:
    check(edge_batch(), spec)


def _one(rollout: float, theta: float, advantage: float, mask: bool = True) -> TokenBatch:
    return TokenBatch(
        rollout=torch.tensor([rollout], dtype=torch.float32),
        train=torch.tensor([theta], dtype=torch.float32),
        cu_seqlens=torch.tensor([0, 1]),
        loss_mask=torch.tensor([mask]),
        extra=pa.table({"advantage": [advantage]}),
    )


def test_zero_advantage_takes_the_low_side() -> None:
    spec = PrimeRLLoss()
    up = (math.log(0.2), math.log(0.9))  # dp = +0.7: drops A > 0 only
    down = (math.log(0.9), math.log(0.2))  # dp = -0.7: drops A <= 0 only
    assert [bool(spec.dropped(_one(*up, a))) for a in (1.0, 0.0, -1.0)] == [True, False, False]
    assert [bool(spec.dropped(_one(*down, a))) for a in (1.0, 0.0, -1.0)] == [False, True, True]
    # IPO ignores the advantage.
    ipo = PrimeRLLoss(type="ipo")
    assert [bool(ipo.dropped(_one(*down, a))) for a in (1.0, 0.0, -1.0)] == [True] * 3


def test_a_bound_hit_exactly_keeps_the_token() -> None:
    """dp > high drops, dp == high (in float32, as prime-rl compares) does not. Checked on
    torch's own float32 dp: numpy's float32 exp may differ from it by an ulp at the bound."""
    rollout = np.float32(-1.0)
    p = np.float32(np.exp(rollout)) + np.float32(0.25)  # dp = 0.25 exactly in float32
    theta = float(np.log(p))
    batch = _one(float(rollout), theta, 1.0)
    dp = float(torch.exp(batch.train) - torch.exp(batch.rollout))
    at = PrimeRLLoss(dppo_mask_high=dp)
    assert not bool(at.dropped(batch)) and float(at.replay(batch).weight) > 0
    below = float(np.nextafter(np.float32(dp), np.float32(0.0)))  # the float32 just below
    assert bool(PrimeRLLoss(dppo_mask_high=below).dropped(batch))


def test_an_overflowing_ratio_is_kept_as_prime_rl_computes_it() -> None:
    """d > 88.7: rho is inf in float32. A kept token weighs inf (prime-rl's loss is inf); a
    dropped one weighs 0 here, where prime-rl's 0 * inf is NaN (the trap says so)."""
    kept = _one(-100.0, -2.0, 1.0)  # dp = e^-2 = 0.135 <= 0.2: kept
    assert math.isinf(float(PrimeRLLoss().replay(kept).weight))
    dropped = _one(-100.0, -0.1, 1.0)  # dp = 0.9 > 0.2: dropped
    result = PrimeRLLoss().replay(dropped)
    assert float(result.weight) == 0.0 and math.isinf(float(result.raw))
    assert bool(result.keep), "a dropped token stays in the loss mask (KL term, denominator)"
    trap = next(t for t in prime_rl.TRAPS if t.name == "rho-undetached-unclamped")
    assert "1 loss tokens" in trap.warning(dropped, lambda spec: {})
    assert trap.warning(make_batch([5, 5]), lambda spec: {}) is None


def test_fully_masked_and_one_token_sequences() -> None:
    batch = edge_batch()
    result = PrimeRLLoss().replay(batch)
    fully_masked = slice(3, 7)  # sequence 3 of edge_batch
    assert not result.keep[fully_masked].any() and not result.weight[fully_masked].any()
    # one token, d = 0, A = 1: dp = 0, kept, weight 1.
    assert float(result.weight[0]) == 1.0


def test_the_default_loss_needs_the_advantage() -> None:
    check(make_batch([3, 4], policy=False), PrimeRLLoss())  # l_theta is the trainer's
    no_advantage = make_batch([3, 4], advantages=False)
    with pytest.raises(ConfigError, match="`advantage` column"):
        PrimeRLLoss().replay(no_advantage)
    PrimeRLLoss(type="ipo").replay(no_advantage)  # IPO does not read the advantage


# ------------------------------------------------------------------ config


def test_parse_reads_its_keys_with_the_default_type() -> None:
    spec = parse({"framework": "prime_rl", "loss": {"dppo_mask_low": 0.1, "kl_tau": 0}})
    assert spec == PrimeRLLoss(dppo_mask_low=0.1, kl_tau=0.0)
    assert parse({"framework": "prime_rl"}) == PRESETS["prime_rl_default"].__class__()
    assert parse({"framework": "prime_rl", "loss": {"type": "ipo"}}).ipo_threshold == 0.1
    inf = parse({"framework": "prime_rl", "loss": {"dppo_mask_high": float("inf")}})
    assert inf.dppo_mask_high == math.inf  # pydantic allows infinity


@pytest.mark.parametrize(
    ("loss", "match"),
    [
        ({"type": "custom", "import_path": "m.f"}, "custom.*cannot replay"),
        ({"type": "kpop"}, "loss.type: kpop` needs version pr3283"),
        ({"type": "kpop", "kpop_threshold": 0.2}, "needs version pr3283"),
        ({"type": "kpo"}, "loss.type.*'default', 'ipo', 'kpop', 'custom'"),
        ({"kpop_threshold": 0.1}, "Unknown key `loss.kpop_threshold`"),
        ({"ipo_threshold": 0.1}, "Unknown key `loss.ipo_threshold`"),
        ({"type": "ipo", "dppo_mask_low": 0.1}, "Unknown key `loss.dppo_mask_low`"),
        ({"type": "ipo", "eps": 0.3}, "Unknown key `loss.eps`"),
        ({"kl_tau": -1e-3}, r"`loss.kl_tau` to be a float >= 0.0"),
        ({"adv_tau": float("nan")}, r"`loss.adv_tau` to be a float"),
        ({"dppo_mask_high": True}, r"`loss.dppo_mask_high` to be a float"),
    ],
)
def test_parse_refuses_what_prime_rl_refuses(loss, match) -> None:
    with pytest.raises(ConfigError, match=match):
        parse({"framework": "prime_rl", "loss": loss})


def test_a_key_of_the_other_type_is_refused_on_the_spec() -> None:
    with pytest.raises(ConfigError, match=r"ipo_threshold.*left at 0\.1"):
        PrimeRLLoss(ipo_threshold=0.3)


def test_snippets() -> None:
    body = {k: v for k, v in PRESETS["prime_rl_ipo_eps03"].to_config().items() if k == "loss"}
    assert prime_rl.FRAMEWORK.render(body, "flags") == (
        "--trainer.loss.type ipo \\\n--trainer.loss.ipo-threshold 0.3 \\\n"
        "--trainer.loss.adv-tau 1.0 \\\n--trainer.loss.kl-tau 0.0"
    )
    assert "\nloss:\n  type: ipo\n" in prime_rl.FRAMEWORK.render(body, "yaml")


# ------------------------------------------------------------------ canonical form, export


def test_canonical_form_tells_the_losses_apart() -> None:
    forms = {name: prime_rl.to_canonical(spec) for name, spec in PRESETS.items()}
    assert len(set(forms.values())) == len(PRESETS)
    assert forms["prime_rl_default"].anchor == "none"
    assert [c.method for c in forms["prime_rl_default"].components] == [
        "token-tis",
        "trust-region-mask",
    ]
    assert "A <= 0 unless -0.2 <= dp" in forms["prime_rl_default"].describe()
    no_region = prime_rl.to_canonical(PrimeRLLoss(type="ipo", ipo_threshold=1.0))
    assert [c.method for c in no_region.components] == ["token-tis"]


def test_from_another_framework_the_losses_are_noted() -> None:
    source = frameworks.get("trl").presets()["trl_token_tis"]
    spec, notes = prime_rl.FRAMEWORK.closest(frameworks.get("trl").to_canonical(source), "x")
    assert spec.type == "ipo" and spec.ipo_threshold == 1.0 and spec.kl_tau == 0.0
    text = " ".join(notes)
    assert "neither truncated nor zeroed" in text
    assert "kl_tau 0" in text


def test_the_merge_bar_is_its_gate() -> None:
    assert [g.describe() for g in prime_rl.FRAMEWORK.gates] == ["<= 0.015"]
    table = TABLES["prime-rl-ci"]
    assert [b.describe() for b in table.bounds] == ["k3 <= 0.015"]
    assert "prime-rl PR #3543" in table.bounds[0].source.name


# ------------------------------------------------------------------ version pr3283: KPop


def kpop(phi: float = 0.1, **fields) -> PrimeRLLoss:
    return PrimeRLLoss(type="kpop", kpop_threshold=phi, version="pr3283", **fields)


def _stat32(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """PR #3283's two binary KLs as it computes them: torch float32, no upcast."""

    def b(lp, lq):
        p, q = (
            torch.exp(lp).clamp(min=1e-6, max=1 - 1e-6),
            torch.exp(lq).clamp(min=1e-6, max=1 - 1e-6),
        )
        return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))

    return b(batch.train, batch.rollout), b(batch.rollout, batch.train)


def test_kpop_ignores_the_advantage() -> None:
    """No sign test: A = 0, A < 0 and no advantage column at all replay the same."""
    for advantage in (1.0, 0.0, -1.0):
        assert bool(kpop().dropped(_one(-0.1, -3.0, advantage)))  # p = e^-3, q = e^-0.1
    check(make_batch([3, 4, 1], seed=2, sigma=0.5, advantages=False), kpop())
    assert not kpop().needs_advantage


def test_kpop_a_threshold_hit_exactly_keeps_the_token() -> None:
    """Dropped iff either B > phi (strict): B = phi, in prime-rl's float32, stays."""
    for rollout, theta in ((-1.0, -0.3), (-0.05, -0.6), (-3.0, -2.2)):
        batch = _one(rollout, theta, 1.0)
        forward, reverse = _stat32(batch)
        phi = float(torch.maximum(forward, reverse))
        assert not bool(kpop(phi).dropped(batch))
        below = float(np.nextafter(np.float32(phi), np.float32(0.0)))
        assert bool(kpop(below).dropped(batch))


def test_kpop_clamps_probabilities_that_round_to_one_and_overflowing_ratios() -> None:
    """A log-prob above -6e-8 has e^l = 1 in float32, clamped to 1 - 1e-6; both at ~0: B = 0.
    d > 88.7: rho = inf; a kept token weighs inf, a dropped one 0 (prime-rl's 0 * inf is NaN,
    the rho-undetached-unclamped trap)."""
    near_one = _one(-1e-9, 0.0, 1.0)
    assert not bool(kpop(0.0).dropped(near_one))  # both p and q clamp to 1 - 1e-6: B = 0
    forward, reverse = _stat32(_one(-1e-9, -0.5, 1.0))
    expected = binary_kl(np.array([-0.5]), np.array([-1e-9]))[0]
    np.testing.assert_allclose(float(forward), expected, rtol=1e-5)
    assert bool(torch.isfinite(reverse))
    overflow = _one(-100.0, -2.0, 1.0)
    kept = kpop(2.0).replay(overflow)
    assert math.isinf(float(kept.weight)) and bool(kept.keep)
    dropped = kpop(0.1).replay(overflow)
    assert float(dropped.weight) == 0.0 and math.isinf(float(dropped.raw)) and bool(dropped.keep)


def test_kpop_fully_masked_and_one_token_sequences() -> None:
    result = kpop().replay(edge_batch())
    assert not result.keep[3:7].any() and not result.weight[3:7].any()
    assert float(result.weight[0]) == 1.0, "one token, d = 0: B = 0, kept"
    assert result.weight[1:3].tolist() == [0.0, 0.0], "one token, d = +-30: dropped"


def test_kpop_drops_what_verl_pr6800_rejects() -> None:
    """The same rule: prime-rl drops iff either B > phi, verl keeps iff max(B) <= phi, both on
    float32 probabilities clamped at 1e-6 (prime-rl with no upcast: its log-probs are float32)."""
    batch = make_batch([1, 5, 40, 300], seed=9, sigma=0.4)
    for phi in (0.01, 0.1, 2.0):
        rs = (verl.RSCriterion("binary_kl", upper=phi),)
        verl_keep = verl.VerlSpec(rs=rs, version="pr6800").replay(batch).keep
        assert torch.equal(~kpop(phi).dropped(batch) & batch.loss_mask, verl_keep)


def test_kpop_config() -> None:
    config = {"framework": "prime_rl", "version": "pr3283", "loss": {"type": "kpop"}}
    assert parse(config) == PrimeRLLoss(type="kpop", version="pr3283")
    spec = parse({**config, "loss": {"type": "kpop", "kpop_threshold": 0.3, "kl_tau": 0}})
    assert (spec.kpop_threshold, spec.kl_tau, spec.adv_tau) == (0.3, 0.0, 1.0)
    assert parse(spec.to_config()) == spec and spec.to_config()["version"] == "pr3283"
    assert "version" not in PRESETS["prime_rl_ipo"].to_config()
    # pydantic's Field(ge=0): 0 and infinity allowed.
    assert parse({**config, "loss": {"type": "kpop", "kpop_threshold": 0}}).kpop_threshold == 0.0
    # The version changes only what its pull request changes.
    assert parse({"framework": "prime_rl", "version": "pr3283"}) == PrimeRLLoss(version="pr3283")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"version": "pr3283", "loss": {"type": "kpop", "kpop_threshold": -0.1}}, ">= 0.0"),
        ({"version": "pr3283", "loss": {"type": "kpop", "ipo_threshold": 0.1}}, "Unknown key"),
        ({"version": "pr3283", "loss": {"type": "kpop", "eps": 0.1}}, "Unknown key `loss.eps`"),
        ({"version": "pr3384", "loss": {"type": "kpop"}}, "`version`.*pr3283.*'pr3384'"),
        ({"version": "pr3283", "loss": {"type": "kpop", "kpop_threshold": "x"}}, "a float"),
    ],
)
def test_kpop_configs_refused(config, match) -> None:
    with pytest.raises(ConfigError, match=match):
        parse({"framework": "prime_rl", **config})


def test_kpop_spec_needs_the_version() -> None:
    with pytest.raises(ConfigError, match="kpop` needs version pr3283"):
        PrimeRLLoss(type="kpop")
    with pytest.raises(ConfigError, match=r"`loss\.kpop_threshold` to be left at 0\.1"):
        PrimeRLLoss(type="ipo", kpop_threshold=0.3)
    with pytest.raises(ConfigError, match="`version`"):
        PrimeRLLoss(version="pr1")


def test_kpop_canonical_form_and_export_both_ways() -> None:
    spec = PRESETS["prime_rl_kpop_pr3283"]
    weight, mask = prime_rl.to_canonical(spec).components
    assert (weight.method, mask.method) == ("token-tis", "binary-kl-mask")
    assert (mask.statistic, mask.upper, mask.strict, mask.numerics) == (
        "binary_kl",
        0.1,
        False,
        "float32",
    )
    # prime-rl's KPop to verl: version pr6800's binary_kl, the same mask, named in the export.
    out = export(spec, "verl")
    assert out.spec.version == "pr6800"
    assert out.spec.rs == (verl.RSCriterion("binary_kl", upper=0.1),)
    assert "open PR #6800" in out.target
    assert any("PR #6800" in note for note in out.notes)
    # verl's closest loss is bypass REINFORCE, whose statistic takes the current policy's
    # log-probs where prime-rl's takes its training forward's: the one difference, noted.
    (verl_mask,) = verl.to_canonical(out.spec).masks
    assert dataclasses.replace(verl_mask, numerator="train") == mask
    assert any("against the current policy" in note for note in out.notes)
    # verl's KPop preset to prime-rl: version pr3283's kpop type at verl's phi.
    back = export(verl.PRESETS["decoupled_token_kpop_pr6800"], "prime_rl")
    assert (back.spec.type, back.spec.kpop_threshold, back.spec.version) == ("kpop", 2.0, "pr3283")
    assert "open PR #3283" in back.target
    assert any("PR #3283" in note for note in back.notes)
    # Frameworks without it say what is lost.
    for target in ("skyrl", "nemo_rl", "areal", "roll"):
        notes = " ".join(export(spec, target).notes)
        assert "KPop binary-KL token mask" in notes, target


def test_kpop_snippet_names_the_pr() -> None:
    text = snippet(PRESETS["prime_rl_kpop_pr3283"])
    assert text.startswith("# needs prime-rl PR #3283 (open PR, head 489621ac)")
    assert "version" not in text.split("\n", 1)[1]
    assert "type: kpop\n  kpop_threshold: 0.1" in text
    body = {"loss": PRESETS["prime_rl_kpop_pr3283"].to_config()["loss"]}
    assert "--trainer.loss.kpop-threshold 0.1" in prime_rl.FRAMEWORK.render(body, "flags")
