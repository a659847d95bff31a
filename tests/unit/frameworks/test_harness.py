"""The differential harness, run over the registry: every registered framework's presets are
replayed against that framework's own float64 reference, on fresh random data and on the
hand-made edge cases of `conftest.py`, and on every accelerator against the CPU.

Each framework's test module, `tests/unit/frameworks/test_<name>.py`, exposes

    reference_of(spec, batch) -> (weight, keep, raw)

float64 [N], bool [N] and float64 [N], built on that module's reference, which is written from
the framework's formulas in numpy, one sequence at a time, and never from iscore's primitives.
A module may also list `EXTRA_SPECS` (name -> spec): settings that no preset has, which the
harness checks the same way (the shapes the per-framework device tests used to cover).
Registering a framework without such a module, or without `reference_of`, fails here.

Tolerances (the ones every per-framework test used before this harness):
- `keep` exactly: a token is in the loss or not.
- `weight` and `raw` to rtol 1e-6: the replay computes in float32 (float64 sequence sums) and
  rounds its outputs to float32, whose relative step is 6e-8; 1e-6 leaves room for the few
  roundings of a clamp, exp and division, and no more. atol 1e-37, just above float32's smallest
  normal number (1.2e-38): a reference value further down (NeMo-RL's e^-150 without a clamp)
  is a subnormal or 0 in float32, where relative error means nothing.
- Accelerator against CPU: `keep` exactly, every float output to rtol 1e-6 and atol 0 (the same
  float32 arithmetic in another order, e.g. the reductions).
Where a framework's semantics are float32's own near a bound (TRL's float32 e^S, slime's float32
veto threshold), its reference computes that step in float32 as the framework does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from types import ModuleType

import numpy as np
import pytest
import torch

from iscore import frameworks
from tests.conftest import ACCELERATORS
from tests.unit.frameworks.conftest import SEEDS, edge_batch, random_batch_of

RTOL = 1e-6
ATOL = 1e-37
BATCHES = {**{f"seed{seed}": partial(random_batch_of, seed) for seed in SEEDS}, "edges": edge_batch}

REGISTERED = frameworks.every()


def _test_module(name: str) -> ModuleType | None:
    module_name = f"tests.unit.frameworks.test_{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return None  # test_reference_is_registered says what is missing


def _cases() -> list:
    cases = []
    for fw in REGISTERED:
        module = _test_module(fw.name)
        specs = {**fw.presets(), **getattr(module, "EXTRA_SPECS", {})}
        cases += [pytest.param(fw, spec, id=f"{fw.name}:{name}") for name, spec in specs.items()]
    return cases


CASES = _cases()


def reference_of(fw) -> Callable:
    """`fw`'s `reference_of`, failing with what to write where it is missing."""
    module = _test_module(fw.name)
    where = f"tests/unit/frameworks/test_{fw.name}.py"
    if module is None:
        pytest.fail(
            f"{fw.name} is registered but {where} does not exist: write its float64 reference "
            "and `reference_of(spec, batch)` (docs/adding-a-framework.md)"
        )
    if not callable(getattr(module, "reference_of", None)):
        pytest.fail(f"{where} defines no `reference_of(spec, batch) -> (weight, keep, raw)`")
    return module.reference_of


def assert_matches_reference(result, expected) -> None:
    """The shared comparison: a replay against a reference's (weight, keep, raw)."""
    weight, keep, raw = expected
    np.testing.assert_array_equal(result.keep.cpu().numpy(), keep, err_msg="keep")
    for name, got, want in (("weight", result.weight, weight), ("raw", result.raw, raw)):
        got = got.cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("fw", REGISTERED, ids=lambda fw: fw.name)
def test_reference_is_registered(fw) -> None:
    reference_of(fw)  # fails naming the missing module or adapter


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(("fw", "spec"), CASES)
def test_replay_equals_reference(fw, spec, batch_name: str) -> None:
    batch = BATCHES[batch_name]()
    assert_matches_reference(spec.replay(batch), reference_of(fw)(spec, batch))


@pytest.mark.parametrize("device", ACCELERATORS)
@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(("fw", "spec"), CASES)
def test_device_replay_equals_cpu(fw, spec, batch_name: str, device: str) -> None:
    batch = BATCHES[batch_name]()
    cpu = spec.replay(batch)
    other = spec.replay(batch.to(device))
    assert other.weight.device.type == device
    assert torch.equal(other.keep.cpu(), cpu.keep)
    for name in ("weight", "raw", "seq_raw", "seq_weight"):
        expected, got = getattr(cpu, name), getattr(other, name)
        assert (got is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(got.cpu(), expected, rtol=RTOL, atol=0, msg=name)
