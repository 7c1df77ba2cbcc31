"""The web console at ``/ui``: static files from the package, no build step.

The page holds no data: it asks for the daemon's token and calls the API with
it, like any client. So its files are served without the token, and with
headers that keep other pages of this origin away from it. That matters here:
preview URLs (``/v1/preview/...``) serve a guest's own pages on this same
origin, so the token is kept only in the page's memory (no cookie, no
storage), the page cannot be framed, and a window that opened it cannot reach
into it (``Cross-Origin-Opener-Policy``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse, Response

UI_DIR = Path(__file__).with_name("ui")
FILES = {
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "style.css": ("style.css", "text/css; charset=utf-8"),
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PATHS = frozenset({"/ui", *(f"/ui/{name}" for name in FILES)})

router = APIRouter(include_in_schema=False)


@router.get("/ui")
def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/{name}")
@router.get("/ui/", name="ui_index")
def ui_file(name: str = "") -> Response:
    """One of the console's files; anything else is a 404."""
    if name not in FILES:
        return Response("not found\n", status_code=404, media_type="text/plain")
    filename, media_type = FILES[name]
    return FileResponse(UI_DIR / filename, media_type=media_type, headers=HEADERS)
