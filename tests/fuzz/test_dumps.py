"""Hostile Parquet dumps through every command that reads a dump: each either succeeds with
results that pass the rules, or refuses as `validate` does, leaving nothing behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import event, given
from hypothesis import strategies as st

import iscore
from iscore.dump import Dump
from iscore.errors import DumpError
from iscore.frameworks.resolve import presets
from iscore.passes.validation import validate
from iscore.session.budget import parquet_tokens
from iscore.utils import footer
from tests.fuzz.harness import check_replay, fuzzing, leftovers, run, strict_json
from tests.fuzz.strategies import parquet_dumps

PRESETS = sorted(presets())


def commands(dump: Path, out: Path, preset: str) -> dict[str, list[str]]:
    """Every command that reads a dump, each writing its output under `out`."""
    return {
        "analyze": ["analyze", str(dump), "-q", "--preset", preset, "--json", f"{out}/a.json"],
        "replay": ["replay", str(dump), "-q", "--config", preset, "--out", f"{out}/w.parquet"],
        "recommend": [
            "recommend",
            str(dump),
            "-q",
            "--framework",
            preset.split(":")[0],
            "--json",
            f"{out}/r.json",
        ],
        "export": ["export", "--config", preset, "--to", "verl", "--dump", str(dump)],
        "sequences": ["sequences", str(dump), "--out", f"{out}/s.parquet"],
    }


def _core_ok(dump: Path | list[tuple[str, bytes]]) -> bool:
    """Whether the columns the engine reads are valid (the per-sequence ones left unread),
    through the Python API, from disk or (as the app reads uploads) from memory."""
    try:
        opened = Dump.from_buffers(dump) if isinstance(dump, list) else Dump(dump)
        return validate(opened).ok
    except DumpError:
        return False


@fuzzing(examples=60)
@given(files=parquet_dumps(), preset=st.sampled_from(PRESETS))
def test_every_command_agrees_with_validate(files, preset):
    """validate's verdict is every command's: where it passes a dump, each command succeeds
    with outputs that pass the rules; where it lists problems, each refuses with them (exit
    1) and writes nothing, except those that never read the per-sequence columns where the
    problems are only there (validate reads every column a command may read)."""
    with tempfile.TemporaryDirectory() as tmp:
        dump, out = Path(tmp) / "dump", Path(tmp) / "out"
        dump.mkdir()
        out.mkdir()
        for name, data in files:
            (dump / name).write_bytes(data)
        verdict = run(["validate", str(dump), "-q", "--json", f"{out}/v.json"])
        event(f"validate exits {verdict.code}")
        assert verdict.code in (0, 1), verdict  # a dump's problems exit 1, whatever they are
        for _, data in files:  # the app's token budget, from each footer
            parquet_tokens(data)
        core_ok = _core_ok(dump)
        assert _core_ok(files) == core_ok  # an upload reads as the files on disk
        assert core_ok or verdict.code == 1
        if core_ok:
            batch = iscore.load(dump)
        if verdict.code == 0:
            strict_json(out / "v.json")
        for command, argv in commands(dump, out, preset).items():
            before = leftovers(out)
            ran = run(argv)
            if ran.code == 2 and "needs the `policy_logprob` column" in ran.err:
                continue  # a setting of current-policy IS, refused before the dump is read
            if not (verdict.code == 0 or (core_ok and command != "sequences")):
                assert ran.code == 1, (command, verdict, ran)
                assert leftovers(out) == before, command
                continue
            assert ran.code == 0, (command, ran)
            if command == "replay":
                check_replay(out / "w.parquet", batch)
            elif command in ("analyze", "recommend"):
                strict_json(out / f"{command[0]}.json")


def _metadata_survives(data: bytes) -> bool:
    """Whether every column chunk's metadata and statistics of `data` can be read without
    pyarrow aborting the process: tried in a forked child, which an abort kills instead."""
    pid = os.fork()
    if pid == 0:  # the child: no threads, no return into pytest
        os.close(2)  # pyarrow's "terminate called after throwing ..." is expected noise
        try:
            meta = pq.ParquetFile(pa.BufferReader(data)).metadata
            for g in range(meta.num_row_groups):
                for i in range(meta.row_group(g).num_columns):
                    meta.row_group(g).column(i).statistics  # noqa: B018 - decoded on reading
        except Exception:  # a Python exception is a refusal iscore can make
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return not os.WIFSIGNALED(status)


@fuzzing(examples=100)
@given(files=parquet_dumps(), at=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_a_footer_iscore_reads_never_aborts_pyarrow(files, at, bit):
    """pyarrow aborts the process on some damaged footers: `iscore.utils.footer.check` refuses
    every footer whose column chunks' metadata pyarrow cannot read without aborting."""
    data = bytearray(files[0][1])
    length = int.from_bytes(data[-8:-4], "little")
    if data[-4:] != b"PAR1" or len(data) < length + 8:
        return
    data[len(data) - 8 - length + at % max(length, 1)] ^= 1 << bit  # a byte of the footer
    try:
        footer.check(bytes(data), "f.parquet")
    except DumpError:
        return
    assert _metadata_survives(bytes(data))
