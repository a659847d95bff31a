"""Hostile framework dumps (NeMo-RL and prime-rl JSON Lines, slime `.pt`, SkyRL pickles read
by the restricted unpickler) through validate, analyze and convert: each command succeeds or
refuses as `validate` does, and a converted dump is what the original is."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.harness import fuzzing, leftovers, run, strict_json
from tests.fuzz.strategies import nemo_rl_files, prime_rl_files, skyrl_files, slime_files

FORMATS = {
    "nemo_rl": nemo_rl_files(),
    "prime_rl": prime_rl_files(),
    "slime": slime_files(),
    "skyrl": skyrl_files(),
}
PRESETS = ["verl:decoupled_geo_rs", "skyrl:skyrl_geo_mask", "nemo_rl:nemo_icepop"]


@pytest.mark.parametrize("fmt", list(FORMATS))
@fuzzing(examples=40)
@given(data=st.data())
def test_framework_dump_commands_agree(fmt, data):
    """validate, analyze and convert agree on a framework dump: where validate refuses it
    for what a file holds (exit 1), so do the others, and nothing is written; where it
    passes, so do they. convert writes invalid log-probs through (for validate to report),
    and its output reads as the original does."""
    files = data.draw(FORMATS[fmt], label="files")
    preset = data.draw(st.sampled_from(PRESETS), label="preset")
    with tempfile.TemporaryDirectory() as tmp:
        dump, out = Path(tmp) / "dump", Path(tmp) / "out"
        out.mkdir()
        for name, content in files:
            (dump / name).parent.mkdir(parents=True, exist_ok=True)
            (dump / name).write_bytes(content)
        pickle = ["--allow-pickle"]
        verdict = run(["validate", str(dump), "-q", "--json", f"{out}/v.json", *pickle])
        event(f"validate exits {verdict.code}")
        if verdict.code == 0:
            strict_json(out / "v.json")
        analyzed = run(["analyze", str(dump), "-q", "--preset", preset, *pickle])
        assert analyzed.code == verdict.code, (verdict, analyzed)
        before = leftovers(out)
        converted = run(["convert", str(dump), "--out", f"{out}/c.parquet", *pickle])
        if converted.code != 0:
            assert verdict.code != 0 and converted.code == verdict.code, (verdict, converted)
            assert leftovers(out) == before
            return
        assert verdict.code in (0, 1), (verdict, converted)
        again = run(["validate", f"{out}/c.parquet", "-q", "--json", f"{out}/c.json"])
        assert again.code == verdict.code, (verdict, again)
        if verdict.code == 0:
            mine, theirs = strict_json(out / "v.json"), strict_json(out / "c.json")
            for key in ("steps", "sequences", "tokens", "loss_tokens", "length", "k3"):
                assert mine[key] == theirs[key], key
