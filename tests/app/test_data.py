"""The Data page: uploads, server paths, samples, errors, the step filter, session isolation."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from streamlit.runtime.caching import cache_resource_api
from streamlit.testing.v1 import AppTest

from tests.app.conftest import (
    DATA,
    metric,
    new_app,
    no_exception,
    open_path,
    parquet_bytes,
    plain,
)


def test_landing_page_asks_for_a_dump(at: AppTest) -> None:
    no_exception(at)
    assert at.title[0].value == "Data"
    assert [i.value for i in at.info] == ["No dump loaded yet."]
    assert at.file_uploader[0].accept_multiple_files


def test_upload_shows_the_summary(at: AppTest) -> None:
    data = (DATA / "dense_bf16.parquet").read_bytes()
    at.file_uploader[0].upload("dense_bf16.parquet", data, "application/octet-stream").run()
    no_exception(at)
    assert metric(at, "Sequences") == "112"
    assert metric(at, "Tokens") == "106,256"
    assert metric(at, "Training steps") == "2"
    hist = at.get("plotly_chart")[0].proto.spec
    assert '"type":"bar"' in hist.replace(" ", "")
    assert at.session_state.loaded.kind == "upload"


def test_several_uploaded_files_make_one_dump(at: AppTest) -> None:
    table = pq.read_table(DATA / "dense_bf16.parquet")
    parts = [table.filter(pc.equal(table["step"], s)) for s in (0, 1)]
    for i, part in enumerate(parts):
        at.file_uploader[0].upload(f"step{i}.parquet", parquet_bytes(part))
    at.run()
    no_exception(at)
    assert metric(at, "Sequences") == "112"
    assert at.subheader[0].value == "2 files"


def test_malformed_upload_is_an_error_in_the_page(at: AppTest) -> None:
    at.file_uploader[0].upload("broken.parquet", b'{"seq_id": 1}\n').run()
    no_exception(at)
    assert "not a Parquet file (looks like JSON Lines)" in plain(at.error[0].value)
    assert at.session_state.loaded is None


def test_invalid_values_list_every_problem_and_can_be_dropped(at: AppTest) -> None:
    table = pq.read_table(DATA / "fp8.parquet")
    rollout = table["rollout_logprob"].to_pylist()
    rollout[3][0], rollout[7][5] = float("nan"), 0.5
    bad = table.set_column(
        table.schema.get_field_index("rollout_logprob"),
        "rollout_logprob",
        pa.array(rollout, pa.list_(pa.float32())),
    )
    at.file_uploader[0].upload("bad.parquet", parquet_bytes(bad)).run()
    no_exception(at)
    message = plain(at.error[0].value)
    assert "2 problems" in message and "NaN" in message and "positive" in message
    at.toggle[0].set_value(True).run()
    no_exception(at)
    assert metric(at, "Sequences") == "46"
    tokens = len(rollout[3]) + len(rollout[7])
    dropped = f"2 sequences ({tokens:,} tokens) dropped as invalid"
    assert any(dropped in plain(w.value) for w in at.warning)


def test_server_path_and_glob(at: AppTest) -> None:
    open_path(at, DATA / "drift.parquet")
    no_exception(at)
    assert metric(at, "Training steps") == "4"
    open_path(at, DATA / "nothing_*.parquet")
    assert "the pattern matches no files" in plain(at.error[0].value)
    assert metric(at, "Training steps") == "4"  # the dump before stays loaded


def test_sample_data(at: AppTest) -> None:
    at.selectbox[0].set_value(DATA / "offset_bug.parquet")
    next(b for b in at.button if b.label == "Open sample").click().run()
    no_exception(at)
    assert plain(at.subheader[0].value) == "offset_bug.parquet"


def test_step_filter_selects_the_steps_for_every_page(at: AppTest) -> None:
    open_path(at, DATA / "drift.parquet")
    at.select_slider[0].set_range(1, 2).run()
    assert metric(at, "Training steps") == "2"
    at.switch_page("pages/mismatch.py").run()
    no_exception(at)
    by_step = next(
        c.proto.spec for c in at.get("plotly_chart") if "Mismatch by training step" in c.proto.spec
    )
    assert '"x":[1,2]' in by_step.replace(" ", "")


def test_the_path_given_to_iscore_app_is_preloaded(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["main.py", "--path", str(DATA / "fp8.parquet")])
    at = new_app()
    no_exception(at)
    assert metric(at, "Sequences") == "48"
    # A bundled sample named at start-up is the one the Sample tab shows.
    assert next(s for s in at.selectbox if s.label == "Sample").value.name == "fp8.parquet"


def test_the_sample_tab_starts_on_the_first_sample_without_a_preload(at) -> None:
    assert next(s for s in at.selectbox if s.label == "Sample").value.name == "dense_bf16.parquet"


def test_uploads_stay_in_their_session_and_leave_with_it(monkeypatch) -> None:
    # AppTest gives every app the same session id; the server gives each browser its own.
    session = {"id": "first"}
    monkeypatch.setattr(cache_resource_api, "get_session_id_or_throw", lambda: session["id"])
    first, second = new_app(), new_app()
    first.file_uploader[0].upload("fp8.parquet", (DATA / "fp8.parquet").read_bytes()).run()
    assert metric(first, "Sequences") == "48"

    # Another session that asks for the same upload by its digest does not get it.
    session["id"] = "second"
    second.session_state["loaded"] = first.session_state.loaded
    second.run()
    no_exception(second)
    assert "no longer in this session's memory" in plain(second.error[0].value)

    session["id"] = "first"
    assert metric(first.run(), "Sequences") == "48"
    cache_resource_api.clear_session_cache("first")  # what the server does on disconnect
    first.switch_page("pages/mismatch.py").run()
    assert "no longer in this session's memory" in plain(first.error[0].value)


def test_framework_dump_opens_by_path_and_shows_its_provenance(monkeypatch, tmp_path) -> None:
    """A NeMo-RL log directory is read directly (format detected) and says where it came from."""
    line = {
        "token_loss_mask": [[0, 1, 1]],
        "generation_logprobs": [[0.0, -0.5, -0.25]],
        "prev_logprobs": [[0.0, -0.5, -0.375]],
    }
    (tmp_path / "train_data_step7.jsonl").write_text(json.dumps(line) + "\n")
    monkeypatch.setattr(sys, "argv", ["main.py", "--data-dir", str(tmp_path)])
    at = open_path(new_app(), tmp_path)
    no_exception(at)
    # No error but the verdict: two loss tokens, one 0.125 nats off, read as an offset.
    assert [plain(e.value)[:8] for e in at.error] == ["**Broken"]
    shown = [plain(info.value) for info in at.info]
    assert any("imported from nemo_rl" in line for line in shown)
    assert any("train_data_step7.jsonl (steps 7)" in line for line in shown)


def _refusal(at: AppTest) -> str:
    """The error shown for the server path, with the path typed left out."""
    return plain(at.error[0].value).split(": ", 1)[1]


def test_server_paths_outside_the_data_folders_are_refused_alike(at: AppTest) -> None:
    """Missing or not allowed: one message, so the box tells nothing about other files."""
    open_path(at, "/etc/passwd")
    outside = _refusal(at)
    assert "no such file, directory or glob match in the folders this app may read" in outside
    for path in ("/etc/no-such-file", "/etc", "/etc/*", str(DATA / "missing.parquet")):
        open_path(at, path)
        no_exception(at)
        assert _refusal(at) == outside, path
    assert [i.value for i in at.info] == ["No dump loaded yet."]


def test_symlinks_and_dotdot_do_not_leave_the_data_folders(monkeypatch, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "fp8.parquet").write_bytes((DATA / "fp8.parquet").read_bytes())
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.parquet").symlink_to(outside / "fp8.parquet")
    (root / "linked_dir").symlink_to(outside)
    monkeypatch.setattr(sys, "argv", ["main.py", "--data-dir", str(root)])
    at = new_app()
    for path in (
        root / "link.parquet",
        root / "linked_dir",
        root / "linked_dir" / "*.parquet",
        root / ".." / "outside" / "fp8.parquet",
        f"{root}/*/../../outside/*.parquet",
    ):
        open_path(at, path)
        no_exception(at)
        assert "folders this app may read" in plain(at.error[0].value), path
    assert [i.value for i in at.info] == ["No dump loaded yet."]


def test_a_data_folder_named_by_the_operator_opens(monkeypatch, tmp_path) -> None:
    (tmp_path / "run.parquet").write_bytes((DATA / "fp8.parquet").read_bytes())
    monkeypatch.setattr(sys, "argv", ["main.py", "--data-dir", str(tmp_path)])
    at = new_app()
    assert str(tmp_path) in plain(at.caption[1].value)  # the Server path tab names it
    at = open_path(at, tmp_path / "*.parquet")
    no_exception(at)
    assert metric(at, "Sequences") == "48"


def test_an_upload_over_the_token_budget_is_refused_before_decoding(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["main.py", "--max-upload-tokens", "1000"])
    at = new_app()
    at.file_uploader[0].upload("fp8.parquet", (DATA / "fp8.parquet").read_bytes()).run()
    no_exception(at)
    message = plain(at.error[0].value)
    assert "more than the 1,000 one session may load" in message
    assert [i.value for i in at.info] == ["No dump loaded yet."]


def test_a_server_path_over_the_token_budget_is_refused_but_the_operators_dump_opens(
    monkeypatch, tmp_path
) -> None:
    (tmp_path / "run.parquet").write_bytes((DATA / "fp8.parquet").read_bytes())
    budget = ["--max-path-tokens", "1000", "--data-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["main.py", *budget])
    at = open_path(new_app(), tmp_path / "run.parquet")
    no_exception(at)
    message = plain(at.error[0].value)
    assert "more than the 1,000 one session may load" in message
    assert "--max-path-tokens" in message
    assert [i.value for i in at.info] == ["No dump loaded yet."]
    # The same file, named by the operator when starting the app, is theirs to open.
    monkeypatch.setattr(sys, "argv", ["main.py", "--path", str(tmp_path / "run.parquet"), *budget])
    at = new_app()
    no_exception(at)
    assert metric(at, "Sequences") == "48"


# ------------------------------------------------------------------------------------------
# Column mapping, framework dumps, pickles, the step filter of a new dump


def _click(at: AppTest, label: str) -> AppTest:
    return next(b for b in at.button if b.label == label).click().run()


def _pick(at: AppTest, label: str, column: str) -> None:
    """Choose the file's `column` in the mapping's picker labelled `label`."""
    next(s for s in at.selectbox if s.label == label).set_value(column)


def _mean_abs_d(at: AppTest) -> str:
    """mean |d| as the Mismatch page shows it; back on the Data page after."""
    value = metric(at.switch_page("pages/mismatch.py").run(), "mean |d|")
    at.switch_page("pages/data.py").run()
    return value


def _unused(at: AppTest) -> str:
    """The warning naming the columns that look like log-probs but were not read."""
    return next(plain(w.value) for w in at.warning if "were not used" in plain(w.value))


def test_a_column_mapped_in_the_page_is_the_one_read(at: AppTest) -> None:
    """An extra log-prob column is reported, never ignored silently; mapped, it is read."""
    table = pq.read_table(DATA / "fp8.parquet")
    bf16 = table.append_column("train_bf16_logprob", table["rollout_logprob"])  # d = 0
    at.file_uploader[0].upload("run.parquet", parquet_bytes(bf16)).run()
    no_exception(at)
    warning = _unused(at)
    assert "These columns were not used: `train_bf16_logprob`" in warning

    _pick(at, "Train log-prob", "train_bf16_logprob")
    _click(at, "Reload with this mapping")
    no_exception(at)
    assert at.session_state.loaded.columns == (("train_logprob", "train_bf16_logprob"),)
    assert "`train_logprob`" in _unused(at)  # now the unused one
    shown = dict(at.dataframe[-1].value.values.tolist())
    assert shown["train_logprob"] == "train_bf16_logprob"
    assert metric(at, "Sequences") == "48"

    # Other files start from iscore's detection again, pickers included.
    other = pq.read_table(DATA / "offset_bug.parquet")
    other = other.append_column("train_bf16_logprob", other["train_logprob"])
    at.file_uploader[0].set_value(("other.parquet", parquet_bytes(other), "application/x")).run()
    assert at.session_state.loaded.columns == ()
    assert next(s for s in at.selectbox if s.label == "Train log-prob").value == "train_logprob"
    at.file_uploader[0].set_value(("run.parquet", parquet_bytes(bf16), "application/x")).run()
    _pick(at, "Train log-prob", "train_bf16_logprob")
    _click(at, "Reload with this mapping")

    assert _mean_abs_d(at) == "0"
    assert float(_mean_abs_d(open_path(new_app(), DATA / "fp8.parquet"))) > 0.05  # unmapped

    # Back from another page the upload box is empty: remapping needs the files again.
    expander = next(e for e in at.expander if e.label == "Columns")
    assert "upload the files again" in expander.info[0].value
    assert not [b for b in at.button if b.label == "Reload with this mapping"]


def test_renamed_columns_are_mapped_after_the_load_fails(at: AppTest) -> None:
    table = pq.read_table(DATA / "fp8.parquet")
    renamed = table.rename_columns(
        [{"rollout_logprob": "lp_vllm", "train_logprob": "lp_megatron"}.get(n, n)
         for n in table.column_names]
    )  # fmt: skip
    expected = _mean_abs_d(open_path(at, DATA / "fp8.parquet"))
    at.file_uploader[0].upload("renamed.parquet", parquet_bytes(renamed)).run()
    no_exception(at)
    assert "missing required columns rollout_logprob (tried " in plain(at.error[0].value)
    expander = next(e for e in at.expander if e.label == "Columns")
    preview = expander.dataframe[0].value
    assert list(preview.columns) == renamed.column_names and len(preview) == 5
    _pick(at, "Rollout log-prob", "lp_vllm")
    _pick(at, "Train log-prob", "lp_megatron")
    _click(at, "Reload with this mapping")
    no_exception(at)
    assert at.session_state.loaded.label == "renamed.parquet"
    assert _mean_abs_d(at) == expected
    shown = dict(at.dataframe[-1].value.values.tolist())
    assert shown["rollout_logprob"] == "lp_vllm" and shown["train_logprob"] == "lp_megatron"


def _nemo_line(rollout: list[float], train: list[float]) -> bytes:
    record = {
        "token_loss_mask": [[0] + [1] * len(rollout)],
        "generation_logprobs": [[0.0, *rollout]],
        "prev_logprobs": [[0.0, *train]],
    }
    return json.dumps(record).encode() + b"\n"


def test_a_framework_dump_is_uploaded(at: AppTest) -> None:
    data = _nemo_line([-0.5, -0.25], [-0.5, -0.375]) + _nemo_line([-1.0], [-0.75])
    at.file_uploader[0].upload("train_data_step7.jsonl", data).run()
    no_exception(at)
    assert metric(at, "Sequences") == "2"
    assert metric(at, "Tokens") == "3"
    assert plain(at.subheader[0].value) == "train_data_step7.jsonl (nemo_rl)"
    assert any("imported from nemo_rl: train_data_step7.jsonl (steps 7)" in plain(i.value)
               for i in at.info)  # fmt: skip
    assert _mean_abs_d(at) == "0.125"


def test_an_upload_of_no_known_format_is_an_error(at: AppTest) -> None:
    at.file_uploader[0].upload("notes.jsonl", b'{"a": 1}\n').run()
    no_exception(at)
    assert "notes.jsonl: no file looks like a dump iscore can import" in plain(at.error[0].value)
    assert at.session_state.loaded is None


def test_framework_uploads_are_bounded_before_they_are_read(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["main.py", "--max-upload-tokens", "10"])
    at = new_app()
    at.file_uploader[0].upload("train_data_step1.jsonl", _nemo_line([-0.5] * 20, [-0.5] * 20))
    at.run()
    no_exception(at)
    assert "bytes of framework dumps (train_data_step1.jsonl), more than the 80 bytes" in plain(
        at.error[0].value
    )
    assert at.session_state.loaded is None


def _slime_dump(folder) -> bytes:
    from tests.unit.importers.conftest import make_seqs
    from tests.unit.importers.test_slime import write_v2

    return write_v2(folder, 3, make_seqs([4, 2, 5])).read_bytes()


def test_a_pickle_upload_needs_the_opt_in(at: AppTest, tmp_path) -> None:
    at.file_uploader[0].upload("3.pt", _slime_dump(tmp_path)).run()
    no_exception(at)
    message = plain(at.error[0].value)
    assert message.startswith("3.pt is a pickled file (.pt/.pkl)")
    assert 'turn on "Allow pickled files" above' in message
    assert at.session_state.loaded is None
    allow = next(t for t in at.toggle if t.label.startswith("Allow pickled files"))
    assert allow.value is False  # off by default
    allow.set_value(True).run()
    no_exception(at)
    assert metric(at, "Sequences") == "3"
    assert plain(at.subheader[0].value) == "3.pt (slime)"


def test_a_pickle_on_the_server_needs_the_opt_in_too(monkeypatch, tmp_path) -> None:
    (tmp_path / "train_data").mkdir()
    (tmp_path / "train_data" / "3.pt").write_bytes(_slime_dump(tmp_path / "made"))
    monkeypatch.setattr(sys, "argv", ["main.py", "--data-dir", str(tmp_path)])
    at = open_path(new_app(), tmp_path / "train_data")
    no_exception(at)
    assert "is a pickled file (.pt/.pkl): loading one can run code" in plain(at.error[0].value)
    assert at.session_state.loaded is None
    next(t for t in at.toggle if t.label.startswith("Allow pickled files")).set_value(True)
    at = open_path(at, tmp_path / "train_data")
    no_exception(at)
    assert metric(at, "Sequences") == "3"


def test_a_new_dump_resets_the_step_filter(at: AppTest) -> None:
    open_path(at, DATA / "drift.parquet")  # steps 0-3
    at.select_slider[0].set_range(1, 2).run()
    assert metric(at, "Training steps") == "2"
    old = at.select_slider[0]
    stale = old._widget_state  # what a browser keeps for this widget, by its id

    at.file_uploader[0].upload("dense_bf16.parquet", (DATA / "dense_bf16.parquet").read_bytes())
    at.run()  # steps 0-1
    slider = at.select_slider[0]
    assert slider.options == ["0", "1"] and slider.value == (0, 1)
    assert metric(at, "Training steps") == "2"
    assert "step_range" not in at.session_state  # every step
    # A browser keeps a widget's value for as long as its id and sends it back on the next
    # interaction; AppTest sends only the widgets of its last run, so send the old one too.
    # The slider of the new dump is a new widget: the old range cannot come back.
    assert slider.id != old.id
    states = at._tree.get_widget_states()
    states.widgets.append(stale)
    at._run(states)
    no_exception(at)
    assert at.select_slider[0].value == (0, 1)
    assert metric(at, "Training steps") == "2"

    at.select_slider[0].set_range(1, 1).run()
    assert metric(at, "Training steps") == "1"
    open_path(at, DATA / "drift.parquet")
    assert at.select_slider[0].value == (0, 3)
    assert metric(at, "Training steps") == "4"
