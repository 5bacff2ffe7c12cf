"""Sign-up, sign-in, sign-out, password change and API tokens."""

from __future__ import annotations

import re
from typing import Annotated, Literal, cast

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.auth import display_prefix, hash_token, new_token
from idlegrid.dashboard import forms, security
from idlegrid.dashboard.pages import (
    Csrf,
    Id,
    PageError,
    SignedIn,
    Viewer,
    address_of,
    dashboard_of,
    grid_of,
    local_path,
    redirect,
    render,
    set_cookie,
    store_of,
)
from idlegrid.store import Store, web
from idlegrid.store import accounts as store_accounts
from idlegrid.store.base import AccountExists

router = APIRouter()
# Any printable name but an email address (sign-in tells them apart by the "@").
USERNAME = re.compile(r"[^\s@\x00-\x1f\x7f](?:[^@\x00-\x1f\x7f]{1,38})[^\s@\x00-\x1f\x7f]")
EMAIL = re.compile(r"[^@\s]{1,64}@[^@\s]+\.[^@\s]{2,}")
FAILED = "That username (or email) and password do not match an account."


@router.get("/signup", response_class=HTMLResponse)
async def signup_page(request: Request, session: Viewer) -> Response:
    if session is not None:
        return RedirectResponse("/my/nodes", status_code=303)
    return await render(request, "signup.html", values={}, error=None)


@router.post("/signup", response_class=HTMLResponse, dependencies=[Csrf])
async def signup(
    request: Request,
    username: Annotated[str, Form(max_length=200)],
    email: Annotated[str, Form(max_length=254)],
    password: Annotated[str, Form(max_length=2000)],
) -> Response:
    dash = dashboard_of(request)
    if not dash.settings.web_open_signup:
        raise PageError(403, "Sign-up is closed on this coordinator; ask its operator.")
    username, email = username.strip(), email.strip().lower()
    values = {"username": username, "email": email}
    error = _signup_problem(username, email, password)
    if error is None:
        try:
            account_id = await store_of(request).web.web_write(
                store_accounts.sign_up,
                username,
                email=email,
                password_hash=await security.hash_password(password),
                role="volunteer",
                now=grid_of(request).clock(),
            )
        except (AccountExists, web.Conflict) as exc:
            error = f"{str(exc).capitalize()}."
        else:
            return await _start_session(request, account_id, "/my/nodes", "Welcome to idlegrid!")
    return await render(request, "signup.html", status=422, values=values, error=error)


@forms.again(r"/signup")
async def _signup_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    values = {"username": typed.get("username", ""), "email": typed.get("email", "")}
    return await render(
        request, "signup.html", status=422, values=values, error=line, field_errors=errors
    )


@forms.again(r"/signin")
async def _signin_form_again(
    request: Request, typed: dict[str, str], errors: dict[str, str], line: str
) -> Response:
    return await render(
        request,
        "signin.html",
        status=422,
        login=typed.get("login", ""),
        next=local_path(typed.get("next"), ""),
        error=line,
        field_errors=errors,
    )


def _signup_problem(username: str, email: str, password: str) -> str | None:
    # The username is free text on many pages, escaped wherever it is shown.
    if not USERNAME.fullmatch(username):
        return "Choose a username of 3 to 40 characters, without an @."
    if not EMAIL.fullmatch(email):
        return "Enter an email address like name@example.org."
    return security.password_problem(password, username=username, email=email)


@router.get("/signin", response_class=HTMLResponse)
async def signin_page(request: Request, session: Viewer, next: str = "") -> Response:
    if session is not None:
        return RedirectResponse(local_path(next, "/my/nodes"), status_code=303)
    return await render(request, "signin.html", next=local_path(next, ""), login="", error=None)


@router.post("/signin", response_class=HTMLResponse, dependencies=[Csrf])
async def signin(
    request: Request,
    login: Annotated[str, Form(max_length=254)],
    password: Annotated[str, Form(max_length=2000)],
    next: Annotated[str, Form(max_length=2000)] = "",
) -> Response:
    limiter = dashboard_of(request).limiter
    address = address_of(request)
    wait = limiter.wait_s(login, address)
    if wait > 0:
        error = f"Too many failed sign-ins. Try again in {max(1, round(wait / 60))} minute(s)."
        return await _signin_again(request, login, next, error, status=429)
    account = await store_of(request).web.web_read(store_accounts.account_by_login, login)
    stored = account.password_hash if account else None
    matches = await security.check_password(stored, password)
    if not matches or account is None or account.disabled_at is not None:
        limiter.failed(login, address)
        return await _signin_again(request, login, next, FAILED, status=401)
    limiter.succeeded(login, address)
    return await _start_session(request, account.id, local_path(next, "/my/nodes"), None)


async def _signin_again(
    request: Request, login: str, next: str, error: str, *, status: int
) -> HTMLResponse:
    return await render(
        request, "signin.html", status=status, login=login, next=local_path(next, ""), error=error
    )


async def _start_session(
    request: Request, account_id: int, target: str, flash: str | None
) -> Response:
    settings = dashboard_of(request).settings
    secret = security.new_secret()
    await store_of(request).web.web_write(
        web.create_session,
        security.session_id(secret),
        account_id,
        csrf=security.new_secret(),
        now=grid_of(request).clock(),
        ttl_s=settings.web_session_s,
    )
    response = redirect(request, target, flash=flash)
    set_cookie(
        request, response, security.SESSION_COOKIE, secret, max_age=int(settings.web_session_s)
    )
    return response


@router.post("/signout", dependencies=[Csrf])
async def signout(request: Request, session: SignedIn) -> Response:
    await store_of(request).web.web_write(web.end_session, session.id, now=grid_of(request).clock())
    response = redirect(request, "/", flash="You are signed out.")
    response.delete_cookie(security.SESSION_COOKIE, path="/")
    return response


# -- account settings ----------------------------------------------------------------------


@router.get("/account", response_class=HTMLResponse)
async def account_page(request: Request, session: SignedIn) -> Response:
    return await _account(request, session)


async def _account(
    request: Request,
    session: web.WebSession,
    *,
    error: str | None = None,
    new_secret: str | None = None,
    status: int = 200,
) -> HTMLResponse:
    tokens = await store_of(request).accounts.list_tokens(
        session.account.id, include_revoked=True, for_page=True
    )
    return await render(
        request,
        "account.html",
        status=status,
        tokens=tokens,
        error=error,
        new_secret=new_secret,
    )


@router.post("/account/password", response_class=HTMLResponse, dependencies=[Csrf])
async def change_password(
    request: Request,
    session: SignedIn,
    current: Annotated[str, Form(max_length=2000)],
    new: Annotated[str, Form(max_length=2000)],
) -> Response:
    account = session.account
    if not await security.check_password(account.password_hash, current):
        return await _account(
            request, session, error="Your current password is not that.", status=422
        )
    problem = security.password_problem(new, username=account.name, email=account.email or "")
    if problem:
        return await _account(request, session, error=problem, status=422)
    await store_of(request).web.web_write(
        store_accounts.set_password,
        account.id,
        await security.hash_password(new),
        keep_session=session.id,
    )
    return redirect(request, "/account", flash="Password changed; other sessions are signed out.")


@router.post("/account/tokens", response_class=HTMLResponse, dependencies=[Csrf])
async def create_token(
    request: Request,
    session: SignedIn,
    kind: Annotated[Literal["api", "node"], Form()],
    label: Annotated[str, Form(max_length=100)] = "",
) -> Response:
    if kind == "api" and not session.account.is_researcher:
        raise PageError(403, "API tokens are for researchers; volunteers make node tokens.")
    secret = await make_token(request, session.account.id, kind=kind, label=label.strip())
    return await _account(request, session, new_secret=secret)


async def make_token(
    request: Request, account_id: int, *, kind: Literal["api", "node"], label: str
) -> str:
    """A new token of the account: its secret, to be shown once."""
    grid = grid_of(request)
    try:
        await quotas.check_new_token(grid.store, grid.settings, account_id)
    except quotas.QuotaExceeded as exc:
        raise PageError(exc.status, exc.message) from None
    secret = new_token(kind)
    await grid_of(request).store.accounts.add_token(
        account_id,
        kind=kind,
        token_hash=hash_token(secret),
        prefix=display_prefix(secret),
        label=label,
        now=grid_of(request).clock(),
    )
    return secret


@router.post("/account/tokens/{token_id}/revoke", dependencies=[Csrf])
async def revoke_token(request: Request, token_id: Id, session: SignedIn) -> Response:
    revoked = await store_of(request).accounts.revoke_token(
        token_id, account_id=session.account.id, now=grid_of(request).clock()
    )
    if revoked is None:
        raise PageError(404, f"You have no live token {token_id}.")
    return redirect(request, "/account", flash="Token revoked.")


async def set_login(
    store: object,
    name: str,
    *,
    email: str | None,
    password: str,
    role: store_accounts.AccountRole,
    now: float | None = None,
) -> int:
    """Give an account (made if missing) a password and a role (the CLI, the demo)."""
    import time

    problem = security.password_problem(password, username=name, email=email or "")
    if problem:
        raise ValueError(problem)
    dashboard_store = cast(Store, store)
    return await dashboard_store.web.web_write(
        store_accounts.set_login,
        name,
        email=email,
        password_hash=await security.hash_password(password),
        role=role,
        now=time.time() if now is None else now,
    )
