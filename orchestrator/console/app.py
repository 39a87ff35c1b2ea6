"""The console's app: its state, routes and middleware, built once from the command's config."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import jinja2
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from orchestrator.client.stores import Stores
from orchestrator.client.streaming import OutputFollower
from orchestrator.console import routes
from orchestrator.console.auth import Auth
from orchestrator.console.identity import Accounts
from orchestrator.console.oidc import CALLBACK_PATH, OidcConfig, OidcSignIn
from orchestrator.console.pages import ConsoleState
from orchestrator.console.privacy import Shown
from orchestrator.console.signin import AccountSignIn

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
REFRESH_SECONDS = 3
ACCOUNTS_COOKIE = "orchestrator_console_account"


@dataclass(frozen=True)
class ConsoleConfig:
    auth: Auth
    accounts: Accounts | None = None
    """Accounts mode: people sign in as themselves and their role decides (``auth`` unused)."""
    oidc: OidcConfig | None = None
    session_key: str = ""
    """Signs accounts-mode session cookies; empty: a random key (sessions end on restart)."""
    secure_cookies: bool = False
    """Accounts-mode session cookies only over https (browsers reach the console through TLS)."""
    show_payloads: bool = False
    schema: str = "orchestrator"
    refresh_seconds: float = REFRESH_SECONDS
    allowed_hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1")
    """Host headers served (``*``: any). Pages need no token to read, so a page served to any
    Host could be read by another site through DNS rebinding."""


def _templates() -> Jinja2Templates:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        # Every value is escaped: run data may hold markup, and a page must never run it.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.tests["shown"] = lambda value: isinstance(value, Shown)
    environment.filters["when"] = _when
    return Jinja2Templates(env=environment)


def _when(value: Any) -> str | Markup:
    if value is None:
        return ""
    if hasattr(value, "strftime"):
        # Marked as a time, so that a narrow column breaks it between date and time only.
        text = value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
        return Markup('<span class="time">{}</span>').format(text)
    return str(value)


def create_app(pool: asyncpg.Pool, config: ConsoleConfig) -> Starlette:
    stores = Stores(pool, schema=config.schema)
    oidc = OidcSignIn(config.oidc) if config.oidc is not None else None
    if oidc is not None and config.accounts is None:
        raise ValueError("OpenID Connect sign-in needs accounts mode")
    app = Starlette(
        routes=_routes(),
        exception_handlers={HTTPException: routes.not_found},
        middleware=_middleware(config),
    )
    app.state.console = ConsoleState(
        pool=pool,
        stores=stores,
        templates=_templates(),
        auth=config.auth,
        accounts=config.accounts,
        oidc=oidc,
        sign_in=AccountSignIn(stores.access, oidc),
        flash_key=secrets.token_bytes(32),
        show_payloads=config.show_payloads,
        refresh_seconds=config.refresh_seconds,
        secure_cookies=config.secure_cookies,
        follower=OutputFollower(stores.runs, stores.outputs),
    )
    return app


def _routes() -> list[BaseRoute]:
    return [
        Route("/", routes.runs),
        Route("/runs", routes.runs),
        Route("/runs/{run_id}", routes.run),
        Route("/runs/{run_id}/output", routes.output, methods=["GET"]),
        Route("/attention", routes.attention),
        Route("/cluster", routes.cluster),
        Route("/signin", routes.signin_form, methods=["GET"]),
        Route("/signin", routes.signin, methods=["POST"]),
        Route("/signout", routes.signout, methods=["POST"]),
        Route("/signin/oidc", routes.oidc_start, methods=["GET"]),
        Route(CALLBACK_PATH, routes.oidc_callback, methods=["GET"], name="oidc_callback"),
        Route("/runs/{run_id}/effects/{effect_key:path}/resolve", routes.resolve, methods=["POST"]),
        Route("/runs/{run_id}/effects/{effect_key:path}/{verb}", routes.decide, methods=["POST"]),
        Route("/runs/{run_id}/{verb}", routes.operate, methods=["POST"]),
        Route("/healthz", routes.healthz),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]


def _middleware(config: ConsoleConfig) -> list[Middleware]:
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts))]
    if config.accounts is not None:
        # Signed, not encrypted: it holds a principal's name and the public id of their token.
        # SameSite=Lax, so the provider's redirect back carries the sign-in's state.
        middleware.append(
            Middleware(
                SessionMiddleware,
                secret_key=config.session_key or secrets.token_urlsafe(32),
                session_cookie=ACCOUNTS_COOKIE,
                max_age=int(config.accounts.session_seconds),
                same_site="lax",
                https_only=config.secure_cookies,
            )
        )
    return middleware
