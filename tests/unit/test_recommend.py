"""Recommendations on simulator regimes whose right answer is known."""

from __future__ import annotations

import pytest

from iscore import load
from iscore.errors import ConfigError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.recommend import Targets, recommend
from iscore.simulate import SimConfig, write_simulated
from tests.unit.frameworks.conftest import edge_batch

PRODUCT_KINDS = {"seq_tis", "seq_mask"}  # product (sequence-sum) weights or masks


@pytest.fixture(scope="module")
def long_dense(tmp_path_factory):
    """Long sequences (median 4k tokens) with dense-bf16-to-MoE-level per-token mismatch."""
    path = tmp_path_factory.mktemp("rec") / "long.parquet"
    write_simulated(path, SimConfig(regime="long_collapse", sequences=64, seed=3))
    return load(path)


@pytest.fixture(scope="module")
def short_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "fp8.parquet"
    write_simulated(path, SimConfig(regime="fp8", sequences=96, median_len=300, seed=4))
    return load(path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_long_sequences_are_not_given_product_weights(long_dense, framework):
    rec = recommend(long_dense, framework)
    assert rec.best.passes, rec.best.reason
    assert rec.best.kind not in PRODUCT_KINDS
    for candidate in rec.candidates:
        if candidate.kind in PRODUCT_KINDS and framework != "trl":
            # e^S collapses: the learning rate is cut far below the target range.
            assert not candidate.passes
            assert candidate.stats["lr_scale"] < 0.5
    assert any("Product (sequence-level) weights collapse" in w for w in rec.warnings)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_data_derived_thresholds_meet_the_budgets(short_fp8, framework):
    targets = Targets(max_token_drop=0.02, max_seq_drop=0.05)
    rec = recommend(short_fp8, framework, targets)
    assert rec.best.passes
    for candidate in rec.candidates:
        if candidate.kind in ("icepop", "token_mask", "geo_mask", "seq_mask_tis", "k3_mask"):
            # thresholds come from the data's quantiles so the drop budgets hold
            assert candidate.stats["token_masked_fraction"] <= 0.02 + 1e-9, candidate.reason
            assert candidate.stats["seq_masked_fraction"] <= 0.05 + 1e-9, candidate.reason
    assert all(c.reason for c in rec.candidates)
    ranks = [len(c.missed) for c in rec.candidates]
    assert ranks == sorted(ranks)  # passing candidates first


def test_traps_are_named():
    batch = edge_batch()
    assert any("overflows float32" in w for w in recommend(batch, "nemo_rl").warnings)
    assert any("[1/U, 1/L]" in w for w in recommend(batch, "verl").warnings)
    assert any("without rejection_sampling" in w for w in recommend(batch, "areal").warnings)
    assert any("effectively no mask" in w for w in recommend(batch, "openrlhf").warnings)
    assert any("sequence_mask" in w for w in recommend(batch, "trl").warnings)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_token_drop": 1.5}, "max_token_drop"),
        ({"min_ess": -0.1}, "min_ess"),
        ({"lr_scale": (1.2, 2.0)}, "lr_scale"),
    ],
)
def test_invalid_targets(kwargs, key):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        Targets(**kwargs)


def test_unknown_framework():
    with pytest.raises(ConfigError, match="Expected `framework` to be one of"):
        recommend(edge_batch(), "nope")
