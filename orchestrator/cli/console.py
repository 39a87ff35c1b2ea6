"""``orchestrator console``: serve the web console until SIGTERM or Ctrl-C."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import click
import uvicorn

from orchestrator.access import Role
from orchestrator.cli.consoles import stderr
from orchestrator.cli.process_options import defaulted_option, log_format_option
from orchestrator.cli.support import async_command
from orchestrator.console.auth import TOKEN_ENV, read_token
from orchestrator.errors import InvalidInput
from orchestrator.settings import Settings
from orchestrator.worker.metrics_endpoint import parse_listen

if TYPE_CHECKING:
    from orchestrator.console.oidc import OidcConfig

OIDC_SECRET_ENV = "ORCHESTRATOR_OIDC_CLIENT_SECRET"
SESSION_KEY_ENV = "ORCHESTRATOR_CONSOLE_SESSION_KEY"


@click.command("console")
@defaulted_option("--listen", default="127.0.0.1:8790", help="HOST:PORT to serve on.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"A file holding the token that allows actions (or set {TOKEN_ENV}). "
    "Without a token the console is read-only.",
)
@click.option(
    "--show-payloads",
    is_flag=True,
    help="Show run inputs, results, messages and effect payloads (each capped at 4 KiB). "
    "By default only their sizes are shown.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="A Host name browsers use to reach the console (repeatable; '*' for any). Always "
    "allowed: the --listen host, localhost, 127.0.0.1, ::1 (and this machine's names when "
    "listening on every address). Others are refused, against DNS rebinding.",
)
@defaulted_option(
    "--refresh-seconds",
    type=click.FloatRange(0.5, 600),
    default=3.0,
    help="How often live pages re-fetch themselves.",
)
@click.option(
    "--allow-public-read-only",
    is_flag=True,
    help="Serve a non-loopback --listen address without a token: anyone who reaches it reads "
    "every run (and, with --show-payloads, its contents). Refused without this flag.",
)
@click.option(
    "--accounts",
    is_flag=True,
    help="People sign in as themselves (a personal token from `orchestrator users token "
    "create`, or --oidc-issuer, or behind --trusted-proxy) and their role decides what they "
    "may see and do. Implied by --oidc-issuer and --trusted-proxy.",
)
@click.option(
    "--secure-cookies",
    is_flag=True,
    help="Mark the session cookies Secure (browsers reach the console over https, for example "
    "through a TLS-terminating proxy: the console believes no X-Forwarded-Proto header).",
)
@click.option(
    "--oidc-issuer", help="Sign in through this OpenID Connect provider (its issuer URL)."
)
@click.option("--oidc-client-id", help="This console's client id at the provider.")
@click.option(
    "--oidc-client-secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"A file holding the client secret (or set {OIDC_SECRET_ENV}).",
)
@defaulted_option(
    "--oidc-claim", default="email", help="The ID token claim naming the person (as added)."
)
@click.option(
    "--oidc-redirect-url",
    help="The callback URL registered at the provider (default: this console's "
    "/signin/oidc/callback as the browser reached it).",
)
@click.option(
    "--oidc-group",
    "oidc_groups",
    multiple=True,
    metavar="GROUP=ROLE",
    help="Give members of the provider's GROUP this role (repeatable; the first listed group a "
    "person is in decides). With any, people need not be added first: their sign-in adds them.",
)
@defaulted_option(
    "--oidc-groups-claim", default="groups", help="The ID token claim listing a person's groups."
)
@click.option(
    "--trusted-proxy",
    "trusted_proxies",
    multiple=True,
    help="An address or network (repeatable) of a reverse proxy that signs people in and names "
    "them in --user-header; the header from any other address is refused.",
)
@defaulted_option(
    "--user-header",
    default="X-Forwarded-Email",
    help="The header a --trusted-proxy names people in.",
)
@log_format_option
@async_command
async def console(
    settings: Settings,
    listen: str,
    token_file: Path | None,
    show_payloads: bool,
    refresh_seconds: float,
    allowed_hosts: tuple[str, ...],
    allow_public_read_only: bool,
    accounts: bool,
    secure_cookies: bool,
    oidc_issuer: str | None,
    oidc_client_id: str | None,
    oidc_client_secret_file: Path | None,
    oidc_claim: str,
    oidc_redirect_url: str | None,
    oidc_groups: tuple[str, ...],
    oidc_groups_claim: str,
    trusted_proxies: tuple[str, ...],
    user_header: str,
    log_json: bool | None,
) -> None:
    """Serve the web console: runs, attempts, timelines, effects, approvals, workers, queue."""
    import structlog

    from orchestrator.console.app import ConsoleConfig, create_app
    from orchestrator.console.auth import Auth
    from orchestrator.console.identity import Accounts, TrustedProxy, parse_networks
    from orchestrator.db.bootstrap import open_store
    from orchestrator.db.outages import watch
    from orchestrator.telemetry import configure_logging

    host, port = parse_listen(listen, "--listen")
    auth = Auth(read_token(os.environ.get(TOKEN_ENV), token_file))
    oidc = _oidc(
        oidc_issuer,
        oidc_client_id,
        oidc_client_secret_file,
        oidc_claim,
        oidc_redirect_url,
        group_roles(oidc_groups),
        oidc_groups_claim,
    )
    proxy = TrustedProxy(parse_networks(trusted_proxies), user_header) if trusted_proxies else None
    people = Accounts(trusted_proxy=proxy) if accounts or oidc or proxy else None
    if people is not None and auth.enabled:
        raise InvalidInput(
            f"choose one: accounts (people sign in as themselves) or the shared token "
            f"({TOKEN_ENV} / --token-file), not both"
        )
    configure_logging(json_logs=log_json)
    sock = bind(host, port, listen)
    if not (auth.enabled or people or allow_public_read_only or is_loopback(host)):
        sock.close()
        raise public_without_token(listen, show_payloads)
    async with open_store(settings, application_name="orchestrator-console", max_size=5) as store:
        app = create_app(
            store.pool,
            ConsoleConfig(
                auth=auth,
                accounts=people,
                oidc=oidc,
                session_key=os.environ.get(SESSION_KEY_ENV, ""),
                secure_cookies=secure_cookies,
                show_payloads=show_payloads,
                schema=settings.schema,
                refresh_seconds=refresh_seconds,
                allowed_hosts=hosts_allowed(host, allowed_hosts),
            ),
        )
        # log_config=None: uvicorn's records go through configure_logging's handler.
        # proxy_headers=False: uvicorn would believe X-Forwarded-For from loopback and rewrite
        # the client's address, which --trusted-proxy must compare as the peer that connected.
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", log_config=None, proxy_headers=False
        )
        server = _Server(config)
        shown = f"[{host}]" if ":" in host else host
        mode = "actions allowed with the token" if auth.enabled else "read-only (no token)"
        if people is not None:
            mode = "accounts: people sign in as themselves" + (" (OpenID Connect)" if oidc else "")
        if show_payloads and people is None:
            mode += "; contents shown (--show-payloads)"
        stderr.print(f"console listening on http://{shown}:{port}/ ({mode})", markup=False)
        with sock:
            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signals, server, app.state.console.follower.stop)
                group.start_soon(watch, store.pool, structlog.get_logger("orchestrator.console"))
                await server.serve(sockets=[sock])
                group.cancel_scope.cancel()
        # The live output's listener holds a pool connection; the pool waits for it to close.
        await app.state.console.follower.close()
    stderr.print("console stopped")


def _oidc(
    issuer: str | None,
    client_id: str | None,
    secret_file: Path | None,
    claim: str,
    redirect_url: str | None,
    groups: tuple[tuple[str, Role], ...],
    groups_claim: str,
) -> OidcConfig | None:
    from orchestrator.console.oidc import OidcConfig

    if issuer is None:
        if client_id or secret_file or redirect_url or groups:
            raise InvalidInput("--oidc-client-id and the other --oidc-* options need --oidc-issuer")
        return None
    secret = os.environ.get(OIDC_SECRET_ENV, "")
    if secret_file is not None:
        try:
            secret = secret_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidInput(f"cannot read --oidc-client-secret-file: {reason}") from None
    return OidcConfig(
        issuer,
        client_id or "",
        secret,
        claim=claim,
        redirect_url=redirect_url,
        group_roles=groups,
        groups_claim=groups_claim,
    )


def group_roles(values: tuple[str, ...]) -> tuple[tuple[str, Role], ...]:
    """``--oidc-group approvers=approver`` values, in the order given."""
    pairs = []
    for value in values:
        group, _, role = value.rpartition("=")
        if not group or role not in {role.value for role in Role}:
            raise InvalidInput(
                f"--oidc-group takes GROUP=ROLE with ROLE one of viewer, approver, operator, "
                f"admin, such as approvers=approver, not {value!r}"
            )
        pairs.append((group, Role(role)))
    return tuple(pairs)


def hosts_allowed(listen_host: str, extra: tuple[str, ...]) -> list[str]:
    """The Host headers the console answers: its own names, and what ``--allowed-host`` adds."""
    hosts = {listen_host, "localhost", "127.0.0.1", "::1", "[::1]", *extra}
    if listen_host in ("0.0.0.0", "::", ""):
        hosts.update({socket.gethostname(), socket.getfqdn()})
    return sorted(hosts)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback (no other host reaches
    it); a name that does not resolve is not."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in found)
    except (OSError, ValueError):
        return False


def public_without_token(listen: str, show_payloads: bool) -> InvalidInput:
    exposed = "runs, inputs and payloads" if show_payloads else "runs"
    return InvalidInput(
        f"--listen {listen} is reachable from other machines and no token is set, so anyone "
        f"who reaches it reads the {exposed}: set {TOKEN_ENV} or --token-file, listen on "
        "127.0.0.1, or pass --allow-public-read-only"
    )


def bind(host: str, port: int, listen: str) -> socket.socket:
    """The listening socket, bound before the server starts, so that a port in use or a host
    that is not this machine's is a one-line error rather than a server's traceback."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise InvalidInput(f"cannot listen on {listen}: {error.strerror or error}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise InvalidInput(f"cannot listen on {listen}: {error.strerror or error}") from None
    return sock


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The command handles SIGTERM/SIGINT itself (_stop_on_signals): uvicorn's own handling
        # re-raises the signal after shutting down, which would end the process by the signal
        # instead of with exit code 0.
        yield


async def _stop_on_signals(server: uvicorn.Server, stopping: Callable[[], None]) -> None:
    """The first SIGTERM/SIGINT finishes the requests in flight and stops; a second stops now.
    ``stopping`` ends what would not finish by itself (live output streams)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for received in signals:
            name = signal.Signals(received).name
            if server.should_exit:
                server.force_exit = True
                stderr.print(f"second {name}: stopping now")
            else:
                server.should_exit = True
                stopping()
                stderr.print(f"{name}: stopping (send again to stop at once)")
