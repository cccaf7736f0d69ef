"""The operator's pages: /dashboard (live figures and charts) and /dashboard/adapters (search, cards, upload,
delete), plain HTML with a little JavaScript served from services/gateway/static, no build step.

The pages hold nothing secret and are served to anyone; what they show comes from /v1/status and the
adapter API, which ask for the admin key when keys are configured (the page asks for it and keeps it in
sessionStorage). Assets are looked up by a fixed name pattern in one folder, so no path can reach outside it,
and a strict Content-Security-Policy allows only this origin's own scripts and styles.
"""
from __future__ import annotations

import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from services.gateway.errors import ApiError

STATIC = Path(__file__).resolve().parent / "static"
ASSET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}\.(css|js|svg)")
MEDIA_TYPES = {"css": "text/css; charset=utf-8", "js": "text/javascript; charset=utf-8", "svg": "image/svg+xml",
               "html": "text/html; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate every time: after an upgrade the browser must not pair a new page with an old script.
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    path = STATIC / name
    if not path.is_file():
        raise ApiError(404, f"no such file: {name}", None, "not_found")
    return FileResponse(path, media_type=MEDIA_TYPES[name.rsplit(".", 1)[1]], headers=HEADERS)


async def dashboard_page(request: Request) -> Response:
    return _file("dashboard.html")


async def adapters_page(request: Request) -> Response:
    return _file("adapters.html")


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if not ASSET_NAME.fullmatch(name):
        return ApiError(404, f"no such file: {name[:80]}", None, "not_found").response()
    try:
        return _file(name)
    except ApiError as e:
        return e.response()
