"""Request guards: who is calling (cookie or bearer token), and CSRF on cookie-authenticated writes.

The API answers an unauthenticated call with 401 and a refused CSRF check with 403 (problem
details); a page redirects to the sign-in form instead. Both run before any handler body, so a
refused write appends nothing.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import RedirectResponse, Response

from console.auth import (
    SESSION_COOKIE,
    Identity,
    bearer_token,
    cookie_name,
    csrf_matches,
    operator_principal,
)
from console.inputs import FORM_FIELDS
from console.problems import Problem
from console.runtime import runtime

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf"
_FORMS = ("application/x-www-form-urlencoded", "multipart/form-data")


class LoginRequired(Exception):  # noqa: N818 - a condition, raised to redirect
    """A page was asked for without a sign-in: redirect to the sign-in form."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class CsrfRefused(Exception):  # noqa: N818 - a condition, raised to refuse
    """A page's form was posted without the session's CSRF token."""


def identify(request: Request) -> Identity | None:
    """The caller, from a bearer token or else the session cookie; None if neither holds (blocks:
    the tokens or users file may be read again, the sign-outs are read in Redis)."""
    rt = runtime(request)
    authorization = request.headers.get("authorization")
    if authorization is not None:
        token = bearer_token(authorization)
        if not token:
            return None
        rt.tokens_file.refresh()  # a withdrawn token is refused from now on
        return rt.tokens.caller(token)
    rt.users.refresh()  # a changed password or a removed operator ends the session now
    named = cookie_name(SESSION_COOKIE, rt.settings.console_cookie_secure)
    session = rt.cookies.read(request.cookies.get(named), rt.passwords.hash_of)
    if session is None:
        return None
    return Identity(
        operator_principal(session.username),
        "cookie",
        session.csrf,
        session.session_id,
        relaxes=True,
    )


async def read_form(request: Request) -> FormData:
    """The request's form: a few text fields, no file (a 400 otherwise)."""
    # Starlette parses a request's form once and hands every later read that first parse: every
    # read goes through here, so whichever comes first (this guard's or a handler's) sets the
    # limits. No console form has a file, and a file part would be spooled to disk.
    form = await request.form(max_files=0, max_fields=FORM_FIELDS)
    for value in form.values():
        # A part whose declared charset decodes to a lone surrogate (`charset=unicode_escape`,
        # `\ud800`) is no text: every later `.encode()` of it (the CSRF check, a hash, a
        # template) would raise, a 500 with a traceback logged for each such request.
        if isinstance(value, str) and not _encodable(value):
            raise StarletteHTTPException(400, "a form field is not valid text (UTF-8)")
    return form


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def presented_csrf(request: Request) -> str | None:
    """The CSRF token a request presents: the header, else a form field."""
    header = request.headers.get(CSRF_HEADER)
    if header:
        return header
    if request.headers.get("content-type", "").startswith(_FORMS):
        value = (await read_form(request)).get(CSRF_FIELD)
        return value if isinstance(value, str) else None
    return None


async def csrf_passes(request: Request, identity: Identity) -> bool:
    """Whether a request may act: safe methods and bearer tokens need no CSRF token."""
    if request.method not in UNSAFE_METHODS or identity.via == "bearer":
        return True
    return csrf_matches(identity.csrf, await presented_csrf(request))


async def api_identity(request: Request) -> Identity:
    """The API's guard: 401 without credentials, 403 `csrf_failed` without the CSRF token."""
    identity = await run_in_threadpool(identify, request)  # the sign-outs are read in Redis
    if identity is None:
        raise Problem(
            401,
            "unauthenticated",
            "sign in, or send `Authorization: Bearer <token>`",
            headers={"WWW-Authenticate": 'Bearer realm="milpa-console"'},
        )
    if not await csrf_passes(request, identity):
        raise Problem(403, "csrf_failed", f"a write needs the session's {CSRF_HEADER} header")
    return identity


async def page_identity(request: Request) -> Identity:
    """The pages' guard: redirect to sign in without a session, refuse a form without CSRF."""
    identity = await run_in_threadpool(identify, request)  # the sign-outs are read in Redis
    if identity is None:
        target = request.url.path if request.method == "GET" else "/"
        if request.method == "GET" and request.url.query:
            target += "?" + request.url.query
        raise LoginRequired(target)
    if not await csrf_passes(request, identity):
        raise CsrfRefused()
    return identity


ApiCaller = Annotated[Identity, Depends(api_identity)]
PageCaller = Annotated[Identity, Depends(page_identity)]


def login_redirect(next_path: str) -> Response:
    """A 303 to the sign-in form that comes back to `next_path`."""
    return RedirectResponse(f"/login?next={quote(safe_next(next_path), safe='')}", status_code=303)


def safe_next(path: str | None) -> str:
    """A local path to go to after signing in (anything else goes to the overview)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path
