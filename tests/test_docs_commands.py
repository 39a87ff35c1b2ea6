"""Every ``orchestrator`` command the README and docs/ show parses with the real command line.

Each ``orchestrator ...`` command in a fenced shell block (``sh``, ``bash``, ``shell``, ``zsh``;
in ``console`` blocks, the lines after a ``$`` prompt) of README.md and docs/**/*.md is resolved
through click, level by level from ``orchestrator.cli.main`` (the lazily loading group imports
each command's module), and its options and arguments are parsed by click's own parser, exactly
as the command line parses them before it runs anything. Nothing runs: no command callback is
invoked, no database is opened, no process is started. So a renamed command or option, a removed
choice, a value of the wrong type or a missing argument in the docs fails here.

How a shell line is read: lines ending in ``\\`` continue on the next; ``#`` starts a comment;
``;``, ``&&``, ``||``, ``|``, ``&`` and ``$(...)`` separate commands; ``VAR=value`` before a
command is set in the environment while it is parsed (other ``ORCHESTRATOR_*`` variables are
cleared, so the machine's own settings change nothing); a redirection (``> file``) is dropped
with its target. The command is the first word, ``orchestrator`` or a path ending in
``/orchestrator`` (``.venv/bin/orchestrator``).

Placeholders: ``RUN_ID`` and the like are ordinary arguments and parse as written. A word
``...`` stands for arguments left out: it is dropped, and a required argument missing from such
a command is not an error (what is written must still parse). Lines holding a placeholder click
cannot parse are skipped, and only these (``SKIPPED``; at most ``MAX_SKIPPED`` lines in all):

- ``<name>`` (to a shell, a redirection);
- ``[--option ...]``, a synopsis' optional part.

Write a synopsis in a plain block (no language), and a concrete command in a shell block.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import click
import pytest

from orchestrator.cli import main

ROOT = Path(__file__).parent.parent
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "zsh", "console"})
SKIPPED = {
    "a <placeholder>": re.compile(r"<[A-Za-z][\w.-]*>"),
    "a [--synopsis] part": re.compile(r"\[--?\w"),
}
"""Placeholders click cannot parse: a line holding one is skipped (see the module docstring)."""
MAX_SKIPPED = 5
"""Skipped lines are checked by no one: a few, or the docs drift from the command line."""
_FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = frozenset({";", "&", "&&", "|", "||", "(", ")", ";;", "|&"})
_REDIRECTIONS = frozenset({">", ">>", "<", "<<", "<<<", ">&", "<&", "&>", "&>>", ">|"})
_FD_BEFORE_REDIRECTION = re.compile(r"(?<![\w/.=-])\d(?=>)")


@dataclass(frozen=True)
class DocCommand:
    """One ``orchestrator`` command as a page shows it."""

    where: str
    """``path:line`` of the line the command starts on."""
    text: str
    """The shell line it came from (continuations joined)."""
    argv: tuple[str, ...]
    """Its arguments after ``orchestrator``."""
    env: tuple[tuple[str, str], ...] = ()
    """``VAR=value`` assignments written before it."""
    elided: bool = False
    """It holds a ``...``: arguments were left out."""


@dataclass(frozen=True)
class DocLines:
    commands: list[DocCommand]
    skipped: list[str]
    """``where: line`` of each line skipped for a placeholder."""


def shell_lines(markdown: str) -> Iterator[tuple[int, str]]:
    """(line number, command line) for each command line in the shell blocks of ``markdown``."""
    fence = ""  # the open block's fence, "" outside one
    shell = console = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(markdown.splitlines(), 1):
        stripped = line.strip()
        if not fence:
            opened = _FENCE.match(line)
            if opened is not None:
                fence = opened["fence"]
                language = opened["info"].lower()
                shell, console = language in SHELL_LANGUAGES, language == "console"
            continue
        if stripped.startswith(fence) and not stripped.strip(fence[0]):
            fence, pending = "", None
            continue
        if not shell:
            continue
        if pending is not None:
            start, text = pending[0], f"{pending[1]} {stripped}"
        elif stripped.startswith("$ "):
            start, text = number, stripped[2:]
        elif console:  # output, not a command
            continue
        else:
            start, text = number, stripped
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        if text:
            yield start, text


def commands_in(line: str) -> Iterator[DocCommand]:
    """Each ``orchestrator`` command in one shell line (``where`` left empty)."""
    lexer = shlex.shlex(_FD_BEFORE_REDIRECTION.sub("", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token not in _SEPARATORS:
            segment.append(token)
            continue
        words: list[str] = []
        redirected = False
        for word in segment:
            if redirected:
                redirected = False
            elif word in _REDIRECTIONS:
                redirected = True
            else:
                words.append(word)
        segment = []
        assignments: list[tuple[str, str]] = []
        while words and _ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            assignments.append((name, value))
        if words and (words[0] == "orchestrator" or words[0].endswith("/orchestrator")):
            argv = tuple(word for word in words[1:] if word != "...")
            yield DocCommand("", line, argv, tuple(assignments), len(argv) < len(words) - 1)


def doc_commands(markdown: str, name: str) -> DocLines:
    commands: list[DocCommand] = []
    skipped: list[str] = []
    for number, line in shell_lines(markdown):
        where = f"{name}:{number}"
        if not re.search(r"(^|[\s;&|(/])orchestrator(\s|$)", line):
            continue
        if any(pattern.search(line) for pattern in SKIPPED.values()):
            skipped.append(f"{where}: {line}")
            continue
        commands += [replace(command, where=where) for command in commands_in(line)]
    return DocLines(commands, skipped)


def documentation() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def all_doc_lines() -> DocLines:
    commands: list[DocCommand] = []
    skipped: list[str] = []
    for path in documentation():
        found = doc_commands(path.read_text(), str(path.relative_to(ROOT)))
        commands += found.commands
        skipped += found.skipped
    return DocLines(commands, skipped)


DOCS = all_doc_lines()


def remaining_arguments(ctx: click.Context) -> list[str]:
    """What a group's parse left for its subcommand. click 8.2+ keeps the subcommand's name in
    ``_protected_args`` (its ``protected_args`` property warns), 8.1 in ``protected_args``; its
    own shell completion reads them the same way."""
    held = vars(ctx)
    protected: list[str] = held.get("_protected_args", held.get("protected_args", []))
    return [*protected, *ctx.args]


def parse(argv: Sequence[str]) -> list[str]:
    """Parse ``orchestrator ARGV`` as the command line would, invoking nothing; return the
    command's path. Raises ``click.UsageError`` (a subclass) when click would refuse it."""
    command: click.Command = main
    name = "orchestrator"
    path = [name]
    arguments = list(argv)
    with contextlib.ExitStack() as contexts:
        parent: click.Context | None = None
        while True:
            try:
                ctx = contexts.enter_context(
                    command.make_context(name, arguments, parent=parent, resilient_parsing=False)
                )
            except click.exceptions.Exit as done:  # --help or --version: parsed, printed
                if done.exit_code != 0:
                    raise
                return path
            if not isinstance(command, click.Group):
                return path
            rest = remaining_arguments(ctx)
            if not rest:
                raise click.UsageError("Missing command.", ctx)
            found, subcommand, arguments = command.resolve_command(ctx, rest)
            assert found is not None and subcommand is not None  # or it raised NoSuchCommand
            name, command, parent = found, subcommand, ctx
            path.append(name)


@pytest.fixture(autouse=True)
def no_orchestrator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options that read ``ORCHESTRATOR_*`` variables parse the docs' values, not this machine's."""
    for variable in [name for name in os.environ if name.startswith("ORCHESTRATOR_")]:
        monkeypatch.delenv(variable)


@pytest.mark.parametrize("command", DOCS.commands, ids=lambda command: command.where)
def test_the_command_parses(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, value in command.env:
        monkeypatch.setenv(variable, value)
    try:
        parse(command.argv)
    except click.UsageError as refused:
        if command.elided and isinstance(refused, click.MissingParameter):
            return  # the `...` may stand for it
        pytest.fail(
            f"{command.where}: `{command.text}` is refused by the command line: "
            f"{refused.format_message()}",
            pytrace=False,
        )


def test_the_docs_commands_are_found() -> None:
    """The extraction finds the commands: the README's demo command and its tour's, and the
    pages' (an extractor that found nothing would pass every check above)."""
    found = {command.where.split(":")[0] for command in DOCS.commands}
    assert {"README.md", "docs/cli.md", "docs/chaos.md", "docs/console.md"} <= found
    readme = [command.argv for command in DOCS.commands if command.where.startswith("README")]
    assert ("demo",) in readme
    assert ("serve", "--agents", "countdown", "--lease-seconds", "5") in readme
    assert len(DOCS.commands) >= 60


def test_few_lines_are_skipped() -> None:
    assert len(DOCS.skipped) <= MAX_SKIPPED, "\n".join(DOCS.skipped)


WRONG = """
Deliberately wrong, each in its own way:

```sh
orchestrator runs lst                                   # a command renamed
orchestrator submit sleepy --inptu '{"steps": 1}'       # an option renamed
orchestrator runs list --state sleeping                 # a choice that does not exist
ORCHESTRATOR_HOME=/tmp/o orchestrator serve --agents x --concurrency many  # not a number
orchestrator runs show                                  # an argument missing
orchestrator queue stats extra                          # an argument too many
echo ready && orchestrator db mgirate > /dev/null       # after &&, redirected
RUN=$(orchestrator submit --json)                       # inside $( ): AGENT missing
orchestrator effects resolve RUN_ID KEY --sent \\
    --by ana --not-a-flag                               # on a continuation line
```

```console
$ orchestrator approvals approve RUN_ID KEY --fence three
error: ...
```
"""


def test_a_wrong_command_is_reported() -> None:
    """The check can fail: every line of a page of wrong commands is found and refused."""
    found = doc_commands(WRONG, "wrong.md")
    assert found.skipped == []
    assert len(found.commands) == 10
    for command in found.commands:
        with pytest.raises(click.UsageError):
            parse(command.argv)


def test_commands_are_read_as_a_shell_reads_them() -> None:
    page = """
```bash
$ ORCHESTRATOR_PROXY_TOKENS=a,b orchestrator effects serve --listen 127.0.0.1:8787 &
orchestrator runs list --json | jq .  # a comment: orchestrator runs nothing
orchestrator chaos --seed 7 \\
    --duration 60 --json > report.json
.venv/bin/orchestrator db grant ... --dry-run
pip install 'fenced-orchestrator[mcp]'
orchestrator runs show <run-id>
orchestrator audit list [--json]
```

```python
orchestrator = "not a command"
```

```
orchestrator users list [--json]
```
"""
    found = doc_commands(page, "page.md")
    assert [(c.where, c.argv, c.env) for c in found.commands] == [
        (
            "page.md:3",
            ("effects", "serve", "--listen", "127.0.0.1:8787"),
            (("ORCHESTRATOR_PROXY_TOKENS", "a,b"),),
        ),
        ("page.md:4", ("runs", "list", "--json"), ()),
        ("page.md:5", ("chaos", "--seed", "7", "--duration", "60", "--json"), ()),
        ("page.md:7", ("db", "grant", "--dry-run"), ()),
    ]
    assert found.skipped == [
        "page.md:9: orchestrator runs show <run-id>",
        "page.md:10: orchestrator audit list [--json]",
    ]
    assert [parse(c.argv) for c in found.commands] == [
        ["orchestrator", "effects", "serve"],
        ["orchestrator", "runs", "list"],
        ["orchestrator", "chaos"],
        ["orchestrator", "db", "grant"],
    ]


def test_help_parses_and_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["runs", "list", "--help"]) == ["orchestrator", "runs", "list"]
    assert "--state" in capsys.readouterr().out
