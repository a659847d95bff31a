"""Memory budgets: tokens counted from the Parquet footer, the LRU cache of workspaces, and
the resident memory of a process after sessions open and close."""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.dump.simulate import SimConfig, write_simulated
from iscore.errors import DumpError
from iscore.packed import kernels
from iscore.session.budget import (
    IMPORT_BYTES_PER_TOKEN,
    WorkspaceCache,
    check_paths,
    check_upload,
    footprint,
    parquet_tokens,
)

ROOT = Path(__file__).resolve().parents[2]


def _parquet(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=2)
    return buffer.getvalue()


def test_tokens_come_from_the_footer_in_both_layouts() -> None:
    token = pa.table({"seq_id": [0, 0, 1, 1, 1], "rollout_logprob": [-1.0] * 5})
    sequence = pa.table({"rollout_logprob": [[-1.0] * 3, [-1.0] * 1000, []]})
    assert parquet_tokens(_parquet(token)) == 5
    assert parquet_tokens(_parquet(sequence)) >= 1003
    assert parquet_tokens(b"not parquet at all") is None


def test_a_small_file_of_many_tokens_is_refused_before_decoding() -> None:
    # 2M equal values compress to a few KB: the footer says what decoding would cost.
    table = pa.table({"rollout_logprob": [[-0.5] * 1_000_000, [-0.5] * 1_000_000]})
    data = _parquet(table)
    assert len(data) < 100_000
    with pytest.raises(DumpError, match=r"holds 2,000,00[0-9] tokens, more than the 1,000,000"):
        check_upload([("bomb.parquet", data)], limit=1_000_000)
    assert check_upload([("bomb.parquet", data)], limit=3_000_000) >= 2_000_000


def test_server_files_are_counted_from_their_footers_and_sizes(tmp_path) -> None:
    # The same bomb on disk: refused from its footer, naming the file and the flag to raise.
    bomb = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"rollout_logprob": [[-0.5] * 1_000_000, [-0.5] * 1_000_000]}), bomb)
    with pytest.raises(DumpError) as refused:
        check_paths([str(bomb)], limit=1_000_000)
    message = str(refused.value)
    assert message.startswith(f"{bomb} holds 2,000,00")
    assert "more than the 1,000,000 one session may load" in message
    assert "--max-path-tokens" in message and "iscore analyze" in message
    # Token layout, two files: their tokens add up.
    token = tmp_path / "token.parquet"
    pq.write_table(pa.table({"seq_id": [0, 0, 1], "rollout_logprob": [-1.0] * 3}), token)
    assert check_paths([str(bomb), str(token)], limit=2_000_003) == 2_000_003
    with pytest.raises(DumpError, match=r"^the dump's 2 files hold 2,000,003 tokens"):
        check_paths([str(bomb), str(token)], limit=2_000_002)
    # A framework's own dump has no footer: its size is bounded, 8 bytes a token of the budget.
    jsonl = tmp_path / "train_data_step1.jsonl"
    jsonl.write_bytes(b"x" * (10 * IMPORT_BYTES_PER_TOKEN + 1))
    with pytest.raises(DumpError, match=r"holds 81 bytes of framework dumps .*the 80 bytes"):
        check_paths([str(jsonl)], limit=10)
    assert check_paths([str(jsonl)], limit=11) == 0


def test_footprint_counts_each_storage_once() -> None:
    t = torch.zeros(1000, dtype=torch.float32)
    assert footprint({"a": t, "b": [t, t[:10]], "c": (1, "x", 2.0)}) == 4000


def test_least_recently_used_goes_first_never_the_one_asked_for() -> None:
    cache = WorkspaceCache(limit_bytes=10_000)
    cache.get("a", "s1", lambda: torch.zeros(1000))  # 4000 bytes
    cache.get("b", "s1", lambda: torch.zeros(1000))
    cache.get("a", "s1", lambda: pytest.fail("a is cached"))
    cache.get("c", "s2", lambda: torch.zeros(1000))  # 12000 > 10000: b goes
    assert cache.nbytes() == 8000
    cache.get("b", "s1", lambda: torch.zeros(1000))  # a goes (c, then b, used since)
    built = cache.get("a", "s1", lambda: torch.ones(4000))  # alone over the budget: kept
    assert built.sum() == 4000 and len(cache) == 1


def test_an_entry_leaves_with_the_last_session_that_used_it() -> None:
    cache = WorkspaceCache(limit_bytes=1 << 30)
    cache.get("shared", "s1", lambda: torch.zeros(10))
    cache.get("shared", "s2", lambda: pytest.fail("shared is cached"))
    cache.get("mine", "s1", lambda: torch.zeros(10))
    cache.release("s1")
    assert len(cache) == 1
    cache.discard("s2", keep=lambda key: key != "shared")
    assert len(cache) == 0


MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    from pathlib import Path
    from iscore.frameworks.resolve import presets
    from iscore.session.budget import WorkspaceCache
    from iscore.session.workspace import open_path, open_uploads

    def rss_mb():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    data, sample = Path(sys.argv[1]).read_bytes(), sys.argv[2]
    cache = WorkspaceCache(limit_bytes=int(sys.argv[3]))
    spec = presets()["verl:decoupled_geo_rs"]

    def session(owner):
        # What a browser session does: its own upload, a shared server-side dump, analyses.
        ws = cache.get(("upload", owner), owner, lambda: open_uploads([("u.parquet", data)]))
        ws.summary(); ws.mismatch(); ws.tuner(); ws.setting(spec)
        cache.get(("path", sample), owner, lambda: open_path(sample)).mismatch()
        cache.get(("upload", owner), owner, None)  # the next rerun: measured again

    cold = rss_mb()
    session("warm-up"); cache.release("warm-up"); gc.collect()
    idle = rss_mb()
    peak, held = idle, 0
    for group in range(5):  # 20 sessions, four open at a time
        owners = [f"s{group}-{k}" for k in range(4)]
        for owner in owners:
            session(owner)
        peak, held = max(peak, rss_mb()), max(held, cache.nbytes())
        for owner in owners:
            cache.release(owner)
    gc.collect()
    print(json.dumps({"cold": cold, "idle": idle, "peak": peak, "after": rss_mb(),
                      "held_mb": held / 2**20, "entries_left": len(cache)}))
    """
)


def _limit_address_space() -> None:
    # A leak or a blow-up fails with MemoryError here instead of pressing on the machine.
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))


def test_memory_returns_to_idle_after_20_sessions(tmp_path) -> None:
    dump = tmp_path / "upload.parquet"
    write_simulated(dump, SimConfig(sequences=400, steps=2, seed=3))
    # The compiled kernels from the warm-up on: loaded once a process has analyzed enough
    # tokens (about 110 MB of numba and LLVM, kept like any imported library), they would
    # otherwise arrive among the 20 sessions and read as memory that stayed.
    env = {**os.environ, kernels.ENV: "numba"}
    run = subprocess.run(
        [
            sys.executable, "-c", MEMORY_SCRIPT, str(dump),
            str(ROOT / "data" / "fp8.parquet"), str(4 << 30),
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        preexec_fn=_limit_address_space, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    mb = json.loads(run.stdout)
    print(f"RSS (MB): {mb}")
    assert mb["entries_left"] == 0
    assert mb["held_mb"] > 50  # four sessions' dumps were held at once...
    assert mb["after"] - mb["idle"] < 100  # ...and nothing stays once they end
