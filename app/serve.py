"""The dashboard's server: `streamlit run app/serve.py [-- --path DUMP]`, what `iscore app` runs.

Streamlit checks the Host header of its WebSocket against `server.allowedHosts`, but not that
of plain HTTP requests (the page, uploads, media, downloads), so a page on another site whose
DNS name is rebound to this machine could still fetch those. This serves `main.py` with
Streamlit's own server (`st.App`) behind a middleware that refuses, on every request and
WebSocket upgrade, a Host outside `server.allowedHosts`. An empty list means the loopback
names, so that a server started without iscore's `app/.streamlit/config.toml` is safe too; `*`
accepts any Host (for a proxy that checks it itself).
"""

from __future__ import annotations

from typing import Any

import streamlit as st
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from streamlit import config

from iscore.session import LOOPBACK_HOSTS, host_allowed


class HostAllowList:
    """ASGI middleware: a request or WebSocket upgrade whose Host is not allowed gets 403."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            allowed = config.get_option("server.allowedHosts") or LOOPBACK_HOSTS
            if not host_allowed(Headers(scope=scope).get("host"), allowed):
                if scope["type"] == "websocket":
                    # Closing before accepting answers the upgrade with 403.
                    await send({"type": "websocket.close", "code": 1008})
                else:
                    refuse = PlainTextResponse("Host not allowed\n", status_code=403)
                    await refuse(scope, receive, send)
                return
        await self.app(scope, receive, send)


app = st.App("main.py", middleware=[Middleware(HostAllowList)])
