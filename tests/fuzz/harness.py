"""Running iscore's commands in-process, as a user would, and checking what they leave.

The property every fuzz test asserts through `run`: `iscore.cli.main` returns (any other
exception escapes and fails the test with its traceback); 0 is success; 1 is a dump's
problems, one line each under a count; 2 is one `error:` line (argparse's usage errors
included); nothing else.
"""

from __future__ import annotations

import io
import json
import os
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import settings

from iscore.cli import main
from iscore.packed.batch import TokenBatch

PROFILE = os.environ.get("ISCORE_FUZZ", "ci")
"""The hypothesis profile: "ci" (quick, fixed) or "night" (long); see `tests/fuzz`."""


def fuzzing(examples: int) -> settings:
    """The profile's settings: in CI, `examples` examples (sized to the test's cost)."""
    profile = settings.get_profile(f"iscore-fuzz-{PROFILE}")
    return settings(profile, max_examples=examples) if PROFILE == "ci" else profile


@dataclass(frozen=True)
class Ran:
    """What one command did: its exit status and what it printed."""

    argv: tuple[str, ...]
    code: int
    out: str
    err: str

    @property
    def refused(self) -> bool:
        return self.code != 0


def run(argv: list[str]) -> Ran:
    """`iscore ARGV` in this process, its output captured and its failure's shape checked."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    ran = Ran(tuple(argv), code, out.getvalue(), err.getvalue())
    text = ran.out + ran.err
    assert "Traceback" not in text, text[-3000:]
    assert code in (0, 1, 2), (code, text[-2000:])
    if code == 1 and argv[0] != "validate":
        problems(ran.err)
    elif code == 1:
        problems(ran.out if ran.out.strip() else ran.err)
    elif code == 2 and not ran.err.startswith("usage:"):
        lines = ran.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), ran.err[-2000:]
        assert len(lines[0]) < 2000, lines[0][:300]
    return ran


def problems(text: str) -> list[str]:
    """The problem lines of a dump's refusal: a count, then one `  - ` line each."""
    lines = text.splitlines()
    assert lines and re.match(r"^(\S.*: )?\d+ problems?:?$", lines[0]), text[-2000:]
    assert lines[1:] and all(line.startswith("  - ") for line in lines[1:]), text[-2000:]
    assert all(len(line) < 2000 for line in lines), max(lines, key=len)[:300]
    return lines[1:]


def strict_json(path: Path) -> object:
    """The file's JSON, refusing NaN and Infinity (Python writes them; JSON has neither)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def check_replay(path: Path, batch: TokenBatch) -> None:
    """A replay's output passes the rules: a row per token, in the batch's order; weights in
    [0, inf], never NaN (inf only where a setting leaves e^d unbounded and d overflows, as
    the framework computes it); keep only where the loss mask is."""
    table = pq.read_table(path)
    assert table.num_rows == batch.num_tokens
    weight = table["weight"].to_numpy()
    keep = table["keep"].to_numpy(zero_copy_only=False)
    assert (weight >= 0).all(), weight
    assert not (keep & ~batch.loss_mask.numpy()).any()


def leftovers(folder: Path) -> list[str]:
    """The files in `folder` (outputs, temporaries): a refused command leaves none."""
    return sorted(p.name for p in folder.iterdir())
