"""The Framework contract, checked for every registered framework: registering a framework
runs these on its presets, fresh random data and the hand-made edge cases of `conftest.py`.

The differential harness (`test_harness.py`) checks each framework's arithmetic against its own
float64 reference (`test_<framework>.py`); these check that the parts fit: parse and `to_config`
invert each other, the canonical form maps back to an identical setting, snippets render, the
Tune families it declares are the ones it expresses, and every replay is well formed.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import yaml

from iscore import frameworks
from iscore.advice.conversion import to_file_text
from iscore.advice.tuning import FAMILIES, family_setting
from iscore.cli import main
from iscore.dump.columns import CANONICAL, COMMON_NAMES, aliases, match_columns
from iscore.dump.writer import DumpWriter
from iscore.errors import ConfigError, DumpError
from iscore.frameworks.base import Aggregation
from iscore.frameworks.resolve import parse_config
from iscore.passes.replay import replay
from iscore.stats.catalogue import METRIC_NAMES
from tests.batches import LIKE, TRAIN_KEY, check_dump, expected, make_truth, without
from tests.unit.frameworks.conftest import random_batch_of

REGISTERED = frameworks.every()
PRESETS = [(fw, name, spec) for fw in REGISTERED for name, spec in fw.presets().items()]
VERSIONED = [case for case in PRESETS if getattr(case[2], "version", None) is not None]
ADAPTED = [fw for fw in REGISTERED if fw.read_batch is not None]


def _id(case) -> str:
    return f"{case[0].name}:{case[1]}"


@pytest.mark.parametrize("fw", REGISTERED, ids=lambda fw: fw.name)
def test_its_column_names_are_found_as_aliases(fw) -> None:
    """A framework's own column names live in its module (`Framework.columns`) and the dump
    reader finds them through the registry: none is written twice, in `COMMON_NAMES` too."""
    for canonical, names in fw.columns.items():
        assert canonical in CANONICAL
        for name in names:
            assert name in aliases()[canonical]
            assert name not in COMMON_NAMES[canonical], f"{name} is {fw.name}'s: declare it once"


def test_a_new_framework_s_column_names_need_no_edit_elsewhere(monkeypatch) -> None:
    newcomer = dataclasses.replace(REGISTERED[-1], columns={"train_logprob": ("fw_trainer_lp",)})
    monkeypatch.setattr(frameworks, "every", lambda: (*REGISTERED, newcomer))
    aliases.cache_clear()
    try:
        assert match_columns(["seq_id", "rollout_logprob", "fw_trainer_lp"])[0] == {
            "seq_id": "seq_id",
            "rollout_logprob": "rollout_logprob",
            "train_logprob": "fw_trainer_lp",
        }
    finally:
        monkeypatch.undo()
        aliases.cache_clear()


@pytest.mark.parametrize("fw", REGISTERED, ids=lambda fw: fw.name)
def test_registered_under_its_name(fw) -> None:
    assert frameworks.get(fw.name) is fw
    assert re.fullmatch(r"[0-9a-f]{40}", fw.upstream.commit), "upstream: a full commit hash"
    assert all(t.framework == fw.name for t in fw.spec_types)
    assert fw.presets(), "at least one preset"
    assert fw.default in fw.presets(), "the default (the app's starting point) is a preset"
    assert set(fw.metrics) <= set(METRIC_NAMES), "metrics keyed by iscore's statistics"
    for cited in (*fw.bands, *fw.references):
        assert cited.statistic in METRIC_NAMES, "bands and references on iscore's statistics"
        assert cited.source.name and cited.source.url.startswith("https://"), "cited with a link"
    assert fw.snippet_formats and set(fw.snippet_formats) <= {"yaml", "flags"}
    assert set(fw.families) <= set(FAMILIES)
    for trap in fw.traps:
        assert trap.name and trap.text.endswith("."), "a trap is a named, whole sentence"


@pytest.mark.parametrize("case", PRESETS, ids=_id)
def test_config_round_trip(case) -> None:
    fw, _, spec = case
    assert fw.parse(spec.to_config()) == spec
    # The iscore config file is read back as the same setting.
    assert parse_config(yaml.safe_load(to_file_text(spec))) == spec
    assert isinstance(fw.aggregation(spec), Aggregation)


@pytest.mark.parametrize("case", PRESETS, ids=_id)
def test_canonical_form_maps_back_to_an_identical_setting(case) -> None:
    fw, _, spec = case
    setting = fw.to_canonical(spec)
    back, _ = fw.closest(setting, spec.name)
    result = fw.to_canonical(back)
    # Equal, or equal up to the last digit of a bound written as its reciprocal (verl's k1).
    assert result == setting or result.loosely_equals(setting)


@pytest.mark.parametrize("case", PRESETS, ids=_id)
def test_snippets_render_in_every_declared_format(case) -> None:
    fw, _, spec = case
    body = {k: v for k, v in spec.to_config().items() if k not in ("framework", "name")}
    for fmt in fw.snippet_formats:
        assert isinstance(fw.render(body, fmt), str)


@pytest.mark.parametrize(
    ("fw", "family"),
    [(fw, family) for fw in REGISTERED for family in sorted(fw.families)],
    ids=lambda x: getattr(x, "name", x),
)
def test_declared_families_are_expressed(fw, family: str) -> None:
    # A framework may leave out a family it expresses only up to numerics that matter on real
    # data (NeMo-RL's overflow of e^S to 0), never declare one it cannot express.
    spec = fw.express(family_setting(family, FAMILIES[family].defaults), "tuned")
    assert spec is not None and fw.owns(spec)


@pytest.mark.parametrize("case", PRESETS, ids=_id)
def test_replays_are_well_formed(case, random_batch, edges) -> None:
    _, _, spec = case
    for batch in (random_batch, edges):
        result = spec.replay(batch)
        n = batch.num_tokens
        assert result.weight.shape == result.keep.shape == result.raw.shape == (n,)
        assert result.weight.dtype == torch.float32 and result.keep.dtype == torch.bool
        assert bool(torch.isfinite(result.weight).all())
        assert not bool((result.keep & ~batch.loss_mask).any()), "keep within the loss mask"
        assert not bool(result.weight[~result.keep].any()), "dropped tokens carry weight 0"


@pytest.mark.parametrize("case", PRESETS, ids=_id)
def test_the_api_replays_a_preset_by_name(case) -> None:
    """`iscore.replay(batch, "framework:preset")`, as the CLI and `analyze` take it."""
    fw, name, spec = case
    batch = random_batch_of(0)
    try:
        expected = spec.replay(batch)
    except ConfigError:  # a setting this batch cannot replay (it needs policy log-probs)
        with pytest.raises(ConfigError, match=f"^{fw.name}:{name}: "):
            replay(batch, f"{fw.name}:{name}")
        return
    got = replay(batch, f"{fw.name}:{name}")
    assert torch.equal(got.weight, expected.weight) and torch.equal(got.keep, expected.keep)


def test_every_dump_adapter_has_a_batch_to_test() -> None:
    # tests/batches.py builds each adapted framework's object; tests/integrations the real one.
    assert {fw.name for fw in ADAPTED} == set(LIKE) == set(TRAIN_KEY)


@pytest.mark.parametrize("fw", ADAPTED, ids=lambda fw: fw.name)
def test_dump_adapter_round_trips_every_value(fw, tmp_path) -> None:
    truth = make_truth(seed=1)
    path = tmp_path / "run.parquet"
    with DumpWriter(path, framework=fw.name) as writer:
        writer.add_batch(LIKE[fw.name](truth), step=3)
    check_dump(path, expected(fw.name, truth), step=3)


@pytest.mark.parametrize("fw", ADAPTED, ids=lambda fw: fw.name)
def test_dump_adapter_names_what_is_missing(fw) -> None:
    batch = without(LIKE[fw.name](make_truth()), TRAIN_KEY[fw.name])
    with pytest.raises(DumpError, match=TRAIN_KEY[fw.name]):
        fw.read_batch(batch)


@pytest.mark.parametrize("fw", REGISTERED, ids=lambda fw: fw.name)
def test_versions_are_pull_requests_pinned_at_their_heads(fw, capsys) -> None:
    """Each version is an open pull request's head, found by name and listed by
    `iscore presets --versions` with its status; an unknown name is refused."""
    names = [version.name for version in fw.versions]
    assert len(set(names)) == len(names)
    for version in fw.versions:
        assert re.fullmatch(r"[0-9a-f]{40}", version.upstream.commit), "a full commit hash"
        assert fw.version(version.name) is version
    assert fw.version(None) is None
    with pytest.raises(ConfigError, match="`version`"):
        fw.version("pr0")
    assert main(["presets", "--framework", fw.name, "--versions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{fw.name}: pinned release {fw.upstream} (version: null)",
        *(f"  {version}" for version in fw.versions),
    ]


@pytest.mark.parametrize("case", VERSIONED, ids=_id)
def test_a_versioned_preset_is_its_pull_request_s(case, capsys) -> None:
    """A preset of a version names it in its config and wherever its source is cited, is
    listed by `iscore presets`, and without its `version:` its config is refused (naming the
    version) or means another setting: the pinned release's."""
    fw, name, spec = case
    version = fw.version(spec.version)
    config = spec.to_config()
    assert config["version"] == version.name
    assert fw.upstream_of(spec) == f"{version.upstream}, {version.state} PR #{version.pr}"
    pinned = {key: value for key, value in config.items() if key != "version"}
    try:
        assert fw.parse(pinned) != spec
    except ConfigError as error:
        assert version.name in str(error), "the refusal names the version"
    with pytest.raises(ConfigError, match="`version`"):
        fw.parse({**config, "version": "pr0"})
    assert main(["presets", "--framework", fw.name]) == 0
    assert f"{fw.name}:{name}" in capsys.readouterr().out.splitlines()
