"""The viewer's web app: runs -> episodes -> turns, comparisons, a SQL box, live updates.

Pages are rendered on the server with Jinja2 (autoescaping on for every template: what the
model wrote is text, never markup) and served with a Content-Security-Policy that allows
only this server's own script and styles, so even a slip in escaping could not run a
script. The one script (static/viewer.js) polls server-rendered fragments for live runs
and never builds HTML from data. Requests for other host names are refused (a web page
elsewhere cannot reach the viewer through DNS rebinding). Nothing here writes.

This module assembles the app: security middleware, static files, and the routers of
sandflow/viewer/routes/ (one per page group), which share one `Pages`
(sandflow/viewer/pages.py: templates, rendering, error pages) kept on ``app.state``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from sandflow.viewer.pages import HERE, Pages
from sandflow.viewer.routes import ROUTERS
from sandflow.viewer.store import LiveWarehouse

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


async def _security_headers(request: Request, call_next: Any) -> Response:
    response: Response = await call_next(request)
    for k, v in SECURITY_HEADERS.items():
        response.headers.setdefault(k, v)
    return response


def create_app(lw: LiveWarehouse, *, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The viewer over `lw` (opened by the caller). `allowed_hosts`: Host header values
    accepted (default: the loopback names); ["*"] accepts any."""
    app = FastAPI(title="sandflow view", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pages = Pages(lw)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.add_middleware(
        TrustedHostMiddleware,
        allowed_hosts=allowed_hosts or ["127.0.0.1", "localhost", "::1", "[::1]"],
    )
    app.middleware("http")(_security_headers)
    for router in ROUTERS:
        app.include_router(router)
    return app
