"""What every command shares: the consoles, one-line errors, the --json flag, listings, running
a command's body."""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import click

from orchestrator.cli.consoles import print_error, stderr, stdout
from orchestrator.errors import InvalidInput, OrchestratorError, PermissionDenied
from orchestrator.settings import Settings
from orchestrator.storable import check_text, parse_document

if TYPE_CHECKING:
    from rich.console import RenderableType

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")


def json_option(help: str | None = None) -> Callable[[F], F]:
    """``--json``, the same flag (``as_json``) on every command that prints data; only its help
    says what the JSON holds."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def input_option(help: str) -> Callable[[F], F]:
    """``--input``: a JSON object inline, from a file or from standard input (``read_input``)."""
    return click.option("--input", "input_", default="{}", show_default=True, help=help)


def after_option(help: str) -> Callable[[F], F]:
    """``--after N``: where a page or a stream starts (0: from the beginning)."""
    return click.option("--after", type=click.IntRange(0), default=0, show_default=True, help=help)


def limit_option(default: int = 100) -> Callable[[F], F]:
    """``--limit N``, the same bound (1 to 10,000 rows) on every list command."""
    return click.option(
        "--limit",
        type=click.IntRange(1, 10_000),
        default=default,
        show_default=True,
        help="The most rows to print.",
    )


def run_option(rows: str) -> Callable[[F], F]:
    """``--run RUN_ID``: only that run's ``rows``."""
    return click.option("--run", "run_id", help=f"Only this run's {rows}.")


def wait_for_standby_option(what: str) -> Callable[[F], F]:
    """``--wait-for-standby`` on the commands whose answer a failover could take back."""
    return click.option(
        "--wait-for-standby",
        is_flag=True,
        help=f"Answer only once a streaming standby holds the {what} (at most 30 s), so a "
        "failover cannot take it back. Off by default: on an asynchronous standby the last "
        "commits before a failover may be lost (docs/high-availability.md).",
    )


def effect_arguments(command: F) -> F:
    """RUN_ID and EFFECT_KEY, the two arguments naming one effect record."""
    return click.argument("run_id")(click.argument("effect_key")(command))


def print_found(
    found: Sequence[T],
    as_json: bool,
    table: Callable[[Sequence[T]], RenderableType],
    nothing: str,
    document: Callable[[T], Any] | None = None,
) -> None:
    """A listing: a JSON array (empty too) with ``--json``, else a table, else ``nothing`` on
    stderr, so that a script reading stdout never reads a sentence as data. ``document``: each
    item's JSON, where it is not the item's own fields."""
    from orchestrator.cli.presentation import dump_json

    if as_json:
        stdout.print_json(dump_json(found if document is None else [document(x) for x in found]))
    elif found:
        stdout.print(table(found))
    else:
        stderr.print(nothing)


def print_done(document: Any, as_json: bool, line: str) -> None:
    """What a command changed: its record as JSON with ``--json``, else one line."""
    from orchestrator.cli.presentation import dump_json

    if as_json:
        stdout.print_json(dump_json(document))
    else:
        stdout.print(line, markup=False)


def settings_of(ctx: click.Context) -> Settings:
    settings = ctx.find_object(Settings)
    assert settings is not None
    return settings


def run_async(function: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine, turning user errors into one line on stderr and exit code 1."""
    import anyio
    import asyncpg

    from orchestrator.db.connections import database_failed

    try:
        return anyio.run(function)
    except OrchestratorError as error:
        print_error(_named(error))
        sys.exit(1)
    except BaseExceptionGroup as group:  # a task group's (serve's): a user error inside?
        matched, rest = group.split(OrchestratorError)
        if matched is None or rest is not None:
            raise
        print_error(_named(_first_leaf(matched)))
        sys.exit(1)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as error:
        # The database went away or refused mid-command (a restart, a statement timeout, a
        # privilege the role lacks).
        print_error(_named(database_failed(error)))
        sys.exit(1)
    except KeyboardInterrupt:
        stderr.print("interrupted")
        sys.exit(130)


def _named(error: BaseException) -> BaseException:
    """A privilege refusal names the login ORCHESTRATOR_DATABASE_URL connects as."""
    if not isinstance(error, PermissionDenied):
        return error
    context = click.get_current_context(silent=True)
    settings = None if context is None else context.find_object(Settings)
    if settings is None or not settings.database_url:
        return error
    from orchestrator.db.connections import dsn_user

    return error.naming(dsn_user(settings.database_url))


def async_command(
    function: Callable[Concatenate[Settings, P], Awaitable[None]],
) -> Callable[P, None]:
    """A command written as one coroutine taking the root group's settings, then its options:
    every command finds its settings and reports errors the same way, through ``run_async``."""

    @functools.wraps(function)
    def command(*args: P.args, **kwargs: P.kwargs) -> None:
        settings = settings_of(click.get_current_context())
        run_async(lambda: function(settings, *args, **kwargs))

    return command


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def read_input(raw: str) -> Any:
    """``--input`` as inline JSON, ``@path`` for a file, or ``@-`` for standard input."""
    return read_json_option(
        raw, "--input", example='pass an object such as \'{"topic": "leases"}\' or @file.json'
    )


def read_json_option(
    raw: str, option: str, *, example: str = "give JSON, @file.json or @- for standard input"
) -> Any:
    """An option's JSON: inline, ``@path`` for a file, or ``@-`` for standard input."""
    if not raw.startswith("@"):
        check_text(raw, option)
        try:
            return parse_document(raw, option)
        except InvalidInput as error:
            raise InvalidInput(f"{error}; {example}") from None
    path, noun = raw[1:], option.lstrip("-")
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise InvalidInput(f"cannot read {noun} file {path!r}: {error.strerror}") from None
    return parse_document(data, "standard input" if path == "-" else f"{noun} file {path!r}")


BY_NOTE_HELP = (
    "A note of who you say you are (a name, a ticket). The principal recorded is the database "
    "role you connected as: a typed name is never trusted as one."
)


def decided_as(principal: str | None, typed_by: str | None) -> str:
    """Who a decision is recorded as, with the typed note beside it."""
    who = principal or "the database role you connected as"
    return who if typed_by is None else f"{who} (note: {typed_by})"
