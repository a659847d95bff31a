"""Hostile framework configs through parse, replay and export to every framework, and
hostile command-line flags through `main`: a setting that parses replays to weights that
pass the rules and exports to a config that parses again; anything else is a ConfigError
(exit 2, one line)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from iscore import frameworks
from iscore.advice.conversion import export, snippet, to_file_text
from iscore.errors import IscoreError
from iscore.frameworks.resolve import load_config_text, parse_config
from iscore.packed.batch import TokenBatch
from tests.fuzz.harness import fuzzing, leftovers, run
from tests.fuzz.strategies import FLAG_TOKENS, configs
from tests.unit import hostile


def _batch() -> TokenBatch:
    """Three sequences whose log-ratios span noise, broken tokens and the extreme -3e38."""
    rollout = torch.tensor([-1.0, -0.5, -2.0, -3e38, -0.1, -5.0, -0.2, -1.0, -0.3])
    train = torch.tensor([-1.1, -0.5, -0.01, -1.0, -0.1, -40.0, -0.25, -0.9, -0.3])
    return TokenBatch(
        rollout=rollout,
        train=train,
        policy=train + 0.01 * torch.arange(9.0),
        cu_seqlens=torch.tensor([0, 3, 6, 9]),
        loss_mask=torch.tensor([True, True, False, True, True, True, True, False, True]),
        extra=pa.table({"advantage": [0.5, 0.0, -1.0]}),  # A = 0 too (prime-rl's sign test)
    )


BATCH = _batch()


def _check(result) -> None:
    weight, keep = result.weight.double().numpy(), result.keep.numpy()
    assert (weight >= 0).all(), weight  # never NaN; inf where a setting leaves e^d unbounded
    assert not (keep & ~BATCH.loss_mask.numpy()).any()


@fuzzing(examples=150)
@given(text=configs())
def test_a_config_parses_replays_and_exports_or_is_refused(text):
    try:
        spec = parse_config(load_config_text(text, "c.yaml"))
    except IscoreError as e:  # ConfigError: one line naming the key
        event("refused")
        assert str(e) and "\n" not in str(e).strip(), str(e)
        return
    event("parsed")
    _check(spec.replay(BATCH))
    snippet(spec)
    for target in frameworks.NAMES:
        try:
            exported = export(spec, target, batch=BATCH)
        except IscoreError:
            continue
        again = parse_config(load_config_text(to_file_text(exported.spec), "exported.yaml"))
        _check(again.replay(BATCH))


@fuzzing(examples=40)
@given(text=configs())
def test_a_config_file_through_the_commands(text):
    """The same configs as files through replay and export: exit 0 or one line, exit 2."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dump = folder / "d.parquet"
        table = hostile.valid_dump()
        table = table.append_column("policy_logprob", table["train_logprob"])
        # Each sequence's advantage, -1, 0 or 1 (prime-rl's default loss reads its sign).
        seq = table["seq_id"].to_numpy()
        pq.write_table(table.append_column("advantage", pa.array(seq % 3 - 1.0)), dump)
        config = folder / "c.yaml"
        config.write_text(text)
        out = folder / "out"
        out.mkdir()
        replayed = run(
            ["replay", str(dump), "-q", "--config", str(config), "--out", f"{out}/w.parquet"]
        )
        exported = run(
            ["export", "--config", str(config), "--to", "verl", "--out", f"{out}/e.yaml"]
        )
        assert {replayed.code, exported.code} <= {0, 2}, (replayed, exported)
        assert (replayed.code == 0) == (exported.code == 0), (replayed, exported)
        if replayed.code == 0:
            assert (
                run(
                    [
                        "replay",
                        str(dump),
                        "-q",
                        "--config",
                        f"{out}/e.yaml",
                        "--out",
                        f"{out}/again.parquet",
                    ]
                ).code
                == 0
            )
        else:
            assert leftovers(out) == [], leftovers(out)


_OPTIONS = {
    "--steps": st.one_of(
        st.sampled_from(["5", "3:7", ":", "a:b", "-1:", "99999999999999999999"]),
        st.text(max_size=6),
    ),
    "--chunk-tokens": st.one_of(
        st.sampled_from(["0", "-1", "1", "1e9", "2" * 30]), st.text(max_size=4)
    ),
    "--where": st.one_of(
        st.sampled_from(
            [
                "length > 1",
                "k3 > 1e999",
                "reward = 'x'",
                "1/0 > 1",
                "seq_id IS NULL",
                "length > ",
                "(SELECT 1)",
                "step IN (SELECT step FROM tokens)",
                "nan > 1",
            ]
        ),
        st.text(max_size=12),
    ),
    "--column": st.one_of(
        st.sampled_from(["rollout_logprob=", "train_logprob=x", "a=b", "=", "loss_mask="]),
        st.text(max_size=8),
    ),
    "--max-token-drop": st.sampled_from(FLAG_TOKENS),
    "--max-seq-drop": st.sampled_from(FLAG_TOKENS),
    "--lr-scale": st.sampled_from(["0.8:1.25", "2:1", "nan:1", "0:inf", ":", "x", "1e999:1e999"]),
    "--min-ess": st.sampled_from(FLAG_TOKENS),
}
_COMMANDS = {
    "validate": ["--steps", "--chunk-tokens", "--where", "--column"],
    "analyze": ["--steps", "--chunk-tokens", "--where", "--column"],
    "sequences": ["--steps", "--where", "--column"],
    "recommend": [
        "--steps",
        "--where",
        "--column",
        "--max-token-drop",
        "--max-seq-drop",
        "--lr-scale",
        "--min-ess",
    ],
}


@fuzzing(examples=80)
@given(data=st.data())
def test_command_line_flags(data):
    """Hostile option values for the commands that read a dump: exit 0, or one line."""
    command = data.draw(st.sampled_from(sorted(_COMMANDS)), label="command")
    flags = data.draw(
        st.lists(st.sampled_from(_COMMANDS[command]), min_size=1, max_size=3), label="flags"
    )
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "d.parquet"
        pq.write_table(hostile.valid_dump(), dump)
        argv = [
            command,
            str(dump),
            "-q" if command != "sequences" else "--out",
            *([] if command != "sequences" else [f"{tmp}/s.csv"]),
        ]
        if command == "recommend":
            argv += ["--framework", "verl"]
        for flag in flags:
            argv += [flag, data.draw(_OPTIONS[flag], label=flag)]
        ran = run(argv)
        event(f"exit {ran.code}")
