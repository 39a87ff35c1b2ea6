"""Where commands print: data to stdout, messages and errors to stderr, each made on first use
so that a command that prints nothing (``--help``) never imports the terminal library."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


class _OnFirstUse:
    """A ``rich`` console built the first time it is used."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            self._console = self._make()
        return getattr(self._console, name)


def _stdout() -> Console:
    from rich.console import Console

    # Piped output is read by people too (CI logs, less): do not squeeze tables into 80 columns.
    # Data is printed as it is: no markup, no :emoji: codes (a worker id such as host:1234:ab
    # holds one).
    return Console(
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
        width=None if sys.stdout.isatty() else 200,
    )


def _stderr() -> Console:
    from rich.console import Console

    # Messages are never wrapped: a script reading stderr's first line gets the whole sentence.
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


stdout: Console = _OnFirstUse(_stdout)  # type: ignore[assignment]
stderr: Console = _OnFirstUse(_stderr)  # type: ignore[assignment]


def print_error(error: BaseException) -> None:
    """``error`` as one line on stderr: its text with any line breaks folded into spaces."""
    from rich.text import Text

    line = " ".join(str(error).split())
    stderr.print(Text.assemble(("error:", "red"), " ", line))
