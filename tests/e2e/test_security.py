"""Against the running server: foreign Host names refused (HTTP and the WebSocket upgrade),
server paths outside the data folders refused, sessions kept apart (docs/security.md)."""

from __future__ import annotations

import base64
import http.client
import os
from urllib.parse import urlsplit

import pytest

from tests.e2e.conftest import CHROMIUM, ROOT

pytestmark = pytest.mark.e2e
DATA = ROOT / "data"


def _status(app_url: str, path: str, host: str, websocket: bool = False) -> int:
    """The status of a GET of `path` sent with the Host header `host`."""
    where = urlsplit(app_url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    headers = {"Host": host}
    if websocket:
        headers |= {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
        }
    try:
        connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.parametrize("path", ["/", "/_stcore/health", "/_stcore/host-config", "/media/x"])
def test_a_foreign_host_is_refused_over_http(app_url: str, path: str) -> None:
    port = urlsplit(app_url).port
    assert _status(app_url, path, f"rebound.attacker.example:{port}") == 403
    assert _status(app_url, path, f"localhost.attacker.example:{port}") == 403


def test_a_foreign_host_is_refused_on_the_websocket(app_url: str) -> None:
    port = urlsplit(app_url).port
    assert _status(app_url, "/_stcore/stream", f"attacker.example:{port}", websocket=True) == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert _status(app_url, "/_stcore/stream", host, websocket=True) == 101
        assert _status(app_url, "/", host) == 200


browser_only = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"
)


@browser_only
def test_a_server_path_outside_the_data_folders_is_refused(page, app_url: str) -> None:
    from playwright.sync_api import expect

    page.goto(app_url)
    page.get_by_role("tab", name="Server path").click()
    box = page.get_by_label("File, directory or glob on the server")
    messages = []
    for path in ("/etc/passwd", "/etc/no-such-file", "/etc/*", str(DATA / "missing.parquet")):
        box.fill(path)
        page.get_by_role("button", name="Open").click()
        error = page.get_by_test_id("stAlertContentError")
        expect(error).to_contain_text("folders this app may read")
        messages.append(error.inner_text().split(": ", 1)[1])
    assert len(set(messages)) == 1
    expect(page.get_by_test_id("stSidebar")).to_contain_text("No dump loaded.")


@browser_only
def test_two_sessions_never_see_each_others_data(browser, app_url: str) -> None:
    from playwright.sync_api import expect

    first, second = browser.new_page(), browser.new_page()
    try:
        for page, sample, sequences in ((first, "fp8", "48"), (second, "drift", None)):
            page.goto(app_url)
            expect(page.get_by_test_id("stSidebar")).to_contain_text("No dump loaded.")
            if sequences is None:
                continue
            uploader = page.get_by_test_id("stFileUploader").locator("input[type=file]")
            uploader.set_input_files(DATA / f"{sample}.parquet")
            metric = page.get_by_test_id("stMetric").filter(has_text="Sequences")
            expect(metric).to_contain_text(sequences, timeout=60_000)
        # The second session, opened after the first upload, holds nothing of it.
        expect(second.get_by_test_id("stSidebar")).to_contain_text("No dump loaded.")
        uploader = second.get_by_test_id("stFileUploader").locator("input[type=file]")
        uploader.set_input_files(DATA / "drift.parquet")
        expect(second.get_by_test_id("stSidebar")).to_contain_text(
            "Dump: drift.parquet", timeout=60_000
        )
        # The first, run again, still has its own (and only its own) dump.
        first.get_by_test_id("stSidebarNav").get_by_role("link", name="Mismatch").click()
        expect(first.get_by_test_id("stSidebar")).to_contain_text("Dump: fp8.parquet")
    finally:
        first.close()
        second.close()
