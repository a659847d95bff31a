"""`detect`, `read` and `convert` across formats: sources, ambiguity, schema, provenance."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from iscore.dump.importers import FORMATS, ConvertReport, convert, detect, read
from iscore.dump.writer import PROVENANCE_KEY
from iscore.errors import DumpError
from tests.unit.importers.conftest import make_seqs
from tests.unit.importers.test_nemo_rl import write_step
from tests.unit.importers.test_prime_rl import write_rank


class TestDetect:
    def test_each_layout(self, tmp_path):
        nemo, prime = tmp_path / "nemo", tmp_path / "prime"
        nemo.mkdir()
        write_step(nemo, 1, make_seqs([2]))
        write_rank(prime, 1, 0, make_seqs([2]))
        assert detect(nemo) == "nemo_rl"
        assert detect(prime) == "prime_rl"
        assert detect(str(nemo / "train_data_step*.jsonl")) == "nemo_rl"

    def test_ambiguous_lists_the_candidates(self, tmp_path):
        write_step(tmp_path, 1, make_seqs([2]))
        write_step(tmp_path, 2, make_seqs([2]))
        write_rank(tmp_path, 1, 0, make_seqs([2]))
        with pytest.raises(DumpError, match=r"nemo_rl \(2 files, .*\); prime_rl \(1 file, "):
            detect(tmp_path)
        assert read(tmp_path, fmt="nemo_rl").num_rows == 2  # naming the format settles it

    def test_nothing_recognized(self, tmp_path):
        (tmp_path / "notes.jsonl").write_text('{"a": 1}\n')
        (tmp_path / "weights.pt").write_bytes(b"PK\x03\x04")
        with pytest.raises(DumpError, match="no file looks like a dump iscore can import"):
            detect(tmp_path)

    def test_missing_sources(self, tmp_path):
        with pytest.raises(DumpError, match="no such file or directory"):
            detect(tmp_path / "absent")
        with pytest.raises(DumpError, match="the pattern matches no files"):
            detect(str(tmp_path / "*.jsonl"))

    def test_format_named_but_absent(self, tmp_path):
        write_step(tmp_path, 1, make_seqs([2]))
        with pytest.raises(DumpError, match=r"no prime-rl .* files found"):
            read(tmp_path, fmt="prime_rl")
        with pytest.raises(DumpError, match="Unknown dump format 'verl'; expected one of"):
            read(tmp_path, fmt="verl")
        assert FORMATS == ("nemo_rl", "prime_rl", "slime", "skyrl")


class TestSchema:
    def test_files_with_different_columns(self, tmp_path):
        write_step(tmp_path, 1, make_seqs([2]))
        line = (
            '{"token_loss_mask": [[1]], "generation_logprobs": [[-1.0]], "prev_logprobs": [[-1.0]]}'
        )
        (tmp_path / "train_data_step2.jsonl").write_text(line + "\n")
        with pytest.raises(DumpError, match=r"train_data_step2.jsonl: lacks advantage, token_id"):
            read(tmp_path)
        out = tmp_path / "out.parquet"
        with pytest.raises(DumpError, match=r"train_data_step2.jsonl: lacks advantage"):
            convert(tmp_path, out)
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if "out" in p.name] == []


def test_provenance_in_footer_and_schema(tmp_path):
    write_rank(tmp_path, 4, 0, make_seqs([3, 1]), stable=False)
    write_rank(tmp_path, 9, 1, make_seqs([2]))
    out = tmp_path / "x.parquet"
    report = convert(tmp_path, out)
    assert isinstance(report, ConvertReport)
    assert report.out == str(out) and report.tokens == 6
    assert any("STABLE" in note for note in report.notes)
    footer = json.loads(pq.ParquetFile(out).metadata.metadata[PROVENANCE_KEY])
    assert footer == json.loads(pq.read_table(out).schema.metadata[PROVENANCE_KEY])
    assert footer["framework"] == "prime_rl"
    assert footer["steps"] == [4, 9]
    assert footer["format_version"] == 1
    assert [p.rsplit("/", 2)[-2:] for p in footer["source_files"]] == [
        ["step_4", "rank_0.jsonl"],
        ["step_9", "rank_1.jsonl"],
    ]
    assert footer["notes"] == list(report.notes)
