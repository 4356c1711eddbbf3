"""The dashboard's access check when the server has an `--api-key`.

A browser cannot send `Authorization: Bearer KEY` when it opens a page, so the
dashboard accepts either that header (scripts, tests) or a cookie that its login form
sets: the form posts the key once, and the cookie then holds an HMAC of a fixed label
under the key, never the key itself. The cookie is HttpOnly, SameSite=Strict and
scoped to /dashboard, so the OpenAI API (which keeps needing the header) never sees
it. Without the key, the page answers 401 with the login form and no data, and the
data and static paths answer a 401 error body.
"""

from __future__ import annotations

import hashlib
import hmac
import html
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from laneserve.entrypoints.middleware import error_json

COOKIE = "laneserve_dashboard"
MAX_FORM_BYTES = 4096
_LABEL = b"laneserve dashboard session"

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>laneserve dashboard</title></head>
<body style="font-family: sans-serif; margin: 3em">
<h1>laneserve dashboard</h1>
<p>This server needs its API key.{error}</p>
<form method="post" action="/dashboard/login">
<label>API key <input type="password" name="key" autocomplete="current-password" autofocus></label>
<button type="submit">Open</button>
</form></body></html>
"""


class DashboardAuth:
    def __init__(self, api_key: str | None) -> None:
        self.enabled = api_key is not None
        key = (api_key or "").encode()
        self._bearer = b"Bearer " + key
        self._key = key
        self._token = hmac.new(key, _LABEL, hashlib.sha256).hexdigest()

    def allowed(self, request: Request) -> bool:
        if not self.enabled:
            return True
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, self._bearer):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self._token.encode())

    def refuse(self, request: Request) -> Response:
        if request.url.path.rstrip("/") == "/dashboard":
            return login_page(failed=False)
        body = error_json("invalid or missing API key", "AuthenticationError", 401)
        return Response(body, status_code=401, media_type="application/json")

    async def login(self, request: Request) -> Response:
        """POST /dashboard/login (form field `key`): the cookie, or the form again."""
        if not self.enabled:
            return RedirectResponse("/dashboard", status_code=303)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return login_page(failed=True)
        try:
            fields = parse_qs(body.decode("utf-8"), max_num_fields=4)
        except (UnicodeDecodeError, ValueError):
            return login_page(failed=True)
        given = (fields.get("key") or [""])[0].encode()
        if not hmac.compare_digest(given, self._key):
            return login_page(failed=True)
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(
            COOKIE, self._token, path="/dashboard", httponly=True, samesite="strict"
        )
        return response


def login_page(failed: bool) -> HTMLResponse:
    error = html.escape(" That key is not right.") if failed else ""
    return HTMLResponse(_LOGIN.format(error=error), status_code=401)
