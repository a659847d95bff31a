"""A warning before the damage (docs/why.md#a-warning-before-the-damage): the testbed's
mid-run regimes, and `iscore watch`'s default alerts checked on seeds they were not chosen on."""

from __future__ import annotations

import numpy as np
import pytest

from testbed import leadtime
from testbed.__main__ import main
from testbed.engine import MIDRUN, REGIMES
from testbed.sweep import _off
from testbed.task import Task
from testbed.training import Training, train


@pytest.mark.parametrize("name", list(MIDRUN))
def test_a_mid_run_regime_is_bf16_until_its_change(name):
    """Nothing is drawn that bf16 does not draw: the runs agree exactly up to the change."""
    regime = MIDRUN[name]
    start = leadtime.change_step(regime)
    training = Training(steps=start + 6, curve_every=1, final_window=1)
    specs = [_off("verl")]
    curves = [
        np.array([v for _, v in train(Task(), r, training, specs, [0, 1]).runs[0][0].curve])
        for r in (REGIMES["bf16"], regime)
    ]
    assert np.array_equal(curves[0][: start + 1], curves[1][: start + 1])
    assert not np.array_equal(curves[0], curves[1])


@pytest.mark.slow
def test_the_default_alerts_fire_after_the_change_and_before_the_damage_on_held_out_seeds():
    seeds = leadtime.TEST_SEEDS
    assert not set(seeds) & set(leadtime.TUNE_SEEDS)
    for name, regime in MIDRUN.items():
        line = leadtime.measure(regime, seeds)
        start = leadtime.change_step(regime)
        alerts = [run.alert for run in line.runs]
        assert all(a is not None and start <= a for a in alerts), (name, alerts)
        if line.damage is not None:
            assert max(alerts) < line.damage, (name, alerts, line.damage)
    line = leadtime.measure(REGIMES["bf16"], seeds)
    assert [run.alert for run in line.runs] == [None] * len(seeds)  # no false alarm
    assert line.damage is None and "| bf16 | - |" in leadtime.markdown([line])


def test_the_leadtime_command_refuses_what_it_does_not_know(capsys):
    for argv in (["--regimes", "nope"], ["--seeds", "a-b"], ["--regimes", ""]):
        with pytest.raises(SystemExit):
            main(["leadtime", *argv])
    assert "expected --regimes of stale_mid, drift_mid" in capsys.readouterr().err


def test_the_damage_step_needs_the_gap_to_hold():
    steps = np.arange(40.0)
    off = np.stack([steps * 0, steps * 0 + 0.01, steps * 0 - 0.01])
    ahead = off + np.where(steps >= 25, [[0.1], [0.12], [0.11]], 0)
    assert leadtime.damage_step(off, ahead, 10) == 25
    # Ahead for fewer than SUSTAIN + 1 steps in a row is not damage.
    brief = off + np.where(
        (steps >= 25) & (steps < 25 + leadtime.SUSTAIN), [[0.1], [0.12], [0.11]], 0
    )
    assert leadtime.damage_step(off, brief, 10) is None
    # Before the change is not looked at.
    assert leadtime.damage_step(off, ahead, 30) == 30
