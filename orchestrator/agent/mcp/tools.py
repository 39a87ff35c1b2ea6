"""MCP servers as tool sources for ``ToolAgent``, classified by the operator.

A classification (a JSON or TOML file, or the same document as a dict) lists, per server, how
to reach it and each tool the model may be offered::

    {"servers": {"tickets": {
        "url": "http://127.0.0.1:8000/mcp",
        "effect_kind": "tickets",
        "tools": {
            "order_status": {"class": "read_only", "timeout_seconds": 10},
            "open_ticket": {"class": "effect", "policy": "irreversible"},
            "refund": {"class": "effect", "approve": true}}}}}

A ``read_only`` tool is called by the worker inside the turn (it may run again if the worker
dies before the turn commits). An ``effect`` tool is never called by the worker: the call is
recorded in the turn's commit as an effect of ``effect_kind`` (payload ``{"server", "tool",
"arguments"}``), and the dispatcher's ``mcp`` adapter for that kind calls it, once. A tool the
server lists but the classification does not is never offered to the model, and a call to it is
refused to the model as denied. The server's own annotations (``readOnlyHint`` and the rest) only
pre-fill the draft ``orchestrator mcp import`` prints; they never decide.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from orchestrator.agent.mcp.client import (
    McpConnection,
    McpServerSpec,
    result_json,
    result_text,
)
from orchestrator.agent.tools import (
    _TOOL_NAME,
    DEFAULT_TOOL_TIMEOUT_SECONDS,
    EffectTool,
    ReadOnlyTool,
    Tool,
    ToolArgumentsInvalid,
    ToolContext,
)
from orchestrator.agent.turns import default_result
from orchestrator.effect_model import (
    DEFAULT_APPROVAL_SECONDS,
    MAX_APPROVAL_SECONDS,
    EffectPolicy,
    validate_effect_key,
)
from orchestrator.errors import InvalidInput
from orchestrator.models import JSON

LIST_SECONDS = 30.0
_CONNECTION_KEYS = ("url", "command", "args", "env", "cwd", "token_env", "connect_seconds")


@dataclass(frozen=True)
class ToolRule:
    """The operator's word on one MCP tool."""

    name: str
    read_only: bool
    timeout_seconds: float = DEFAULT_TOOL_TIMEOUT_SECONDS
    policy: EffectPolicy = EffectPolicy.IRREVERSIBLE
    approve: bool | tuple[str, float] = False
    """True: every call waits for a person; (ARGUMENT, LIMIT): calls whose numeric ARGUMENT is
    above LIMIT (or not a number) do."""
    approval_seconds: float = DEFAULT_APPROVAL_SECONDS

    def approval(self) -> bool | Callable[..., bool]:
        """``approve=`` as ``EffectTool`` takes it."""
        if isinstance(self.approve, bool):
            return self.approve
        argument, limit = self.approve

        def above(**arguments: Any) -> bool:
            value = arguments.get(argument)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return True  # when unsure, a person decides
            return value > limit

        return above


def _rule(server: str, name: str, options: Any) -> ToolRule:
    where = f"MCP server {server!r}, tool {name!r}"
    if not isinstance(options, dict):
        raise InvalidInput(f'{where}: give {{"class": "read_only"}} or {{"class": "effect", ...}}')
    cls = options.get("class")
    allowed = {"class", "timeout_seconds"} if cls == "read_only" else set()
    if cls == "effect":
        allowed = {"class", "policy", "approve", "approval_seconds"}
    if cls not in ("read_only", "effect"):
        raise InvalidInput(f'{where}: class must be "read_only" or "effect", not {cls!r}')
    unknown = set(options) - allowed
    if unknown:
        raise InvalidInput(f"{where}: unknown option(s) {', '.join(sorted(unknown))} for {cls}")
    if not _TOOL_NAME.fullmatch(name):
        raise InvalidInput(f"{where}: the model API takes 1-64 letters, digits, _ and - as a name")
    timeout = options.get("timeout_seconds", DEFAULT_TOOL_TIMEOUT_SECONDS)
    if not (isinstance(timeout, int | float) and timeout > 0):
        raise InvalidInput(f"{where}: timeout_seconds must be above 0")
    try:
        policy = EffectPolicy(options.get("policy", "irreversible"))
    except ValueError:
        raise InvalidInput(f"{where}: policy must be irreversible or replaceable") from None
    raw = options.get("approve", False)
    approve: bool | tuple[str, float]
    if isinstance(raw, bool):
        approve = raw
    elif (
        isinstance(raw, dict)
        and set(raw) == {"argument", "above"}
        and isinstance(raw["argument"], str)
        and isinstance(raw["above"], int | float)
        and not isinstance(raw["above"], bool)
    ):
        approve = (raw["argument"], float(raw["above"]))
    else:
        raise InvalidInput(
            f'{where}: approve must be true, false or {{"argument": NAME, "above": NUMBER}}'
        )
    seconds = options.get("approval_seconds", DEFAULT_APPROVAL_SECONDS)
    if not (isinstance(seconds, int | float) and 0 < seconds <= MAX_APPROVAL_SECONDS):
        raise InvalidInput(f"{where}: approval_seconds must be above 0, at most a year")
    return ToolRule(name, cls == "read_only", float(timeout), policy, approve, float(seconds))


def load_classification(source: str | Path | dict[str, Any]) -> list[McpToolSource]:
    """The tool sources of a classification: a file (``.json`` or ``.toml``) or its document."""
    where = "MCP classification"
    if isinstance(source, dict):
        document: Any = source
    else:
        path = Path(source)
        where = f"MCP classification {path}"
        try:
            text = path.read_text("utf-8")
        except OSError as error:
            raise InvalidInput(f"cannot read {where}: {error.strerror}") from None
        try:
            document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
            raise InvalidInput(
                f"{where} is not valid {path.suffix[1:] or 'JSON'}: {error}"
            ) from None
    servers = document.get("servers") if isinstance(document, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise InvalidInput(f'{where} must be {{"servers": {{NAME: {{...}}}}}}')
    sources = []
    for name, options in servers.items():
        if not isinstance(options, dict):
            raise InvalidInput(f"{where}: server {name!r} must be an object")
        unknown = set(options) - {*_CONNECTION_KEYS, "effect_kind", "tools"}
        if unknown:
            raise InvalidInput(
                f"{where}: server {name!r}: unknown option(s) {', '.join(sorted(unknown))}"
            )
        tools = options.get("tools")
        if not isinstance(tools, dict) or not tools:
            raise InvalidInput(
                f"{where}: server {name!r} lists no tools: a tool not listed is never offered"
            )
        kind = str(options.get("effect_kind", name))
        try:
            validate_effect_key(kind)
        except InvalidInput:
            raise InvalidInput(
                f"{where}: server {name!r}: malformed effect_kind {kind!r}"
            ) from None
        spec = McpServerSpec.from_config(
            name, {k: v for k, v in options.items() if k in _CONNECTION_KEYS}
        )
        rules = {tool: _rule(name, tool, rule) for tool, rule in tools.items()}
        sources.append(McpToolSource(spec, rules, effect_kind=kind))
    return sources


class McpToolSource:
    """One MCP server's classified tools, listed from the server on first use in a process.

    Give it to ``ToolAgent(tools=[...])`` beside ``@tool`` functions.
    """

    def __init__(self, spec: McpServerSpec, rules: dict[str, ToolRule], *, effect_kind: str):
        self.name = spec.name
        self.spec = spec
        self.rules = dict(rules)
        self.effect_kind = effect_kind
        self.connection = McpConnection(spec)
        self.unlisted: frozenset[str] = frozenset()

    async def load(self) -> Sequence[Tool]:
        """The classified tools, with the descriptions and schemas the server lists; a
        classified tool the server does not list is an error (the classification is stale)."""
        listed = {t.name: t for t in await self.connection.list_tools(seconds=LIST_SECONDS)}
        missing = sorted(set(self.rules) - set(listed))
        if missing:
            raise InvalidInput(
                f"MCP server {self.name!r} does not list the classified tool(s) "
                f"{', '.join(missing)}: update the classification"
            )
        self.unlisted = frozenset(set(listed) - set(self.rules))
        tools: list[Tool] = []
        for name, rule in self.rules.items():
            found = listed[name]
            description = found.description or found.title or f"{name} (MCP server {self.name})"
            schema = dict(found.input_schema or {"type": "object"})
            schema.pop("title", None)
            if rule.read_only:
                tools.append(McpReadOnlyTool(self, name, description, schema, rule))
            else:
                tools.append(McpEffectTool(self, name, description, schema, rule))
        return tools

    def refusal(self, name: str) -> str | None:
        """Why a call to ``name`` is refused, when this server lists it unclassified."""
        if name in self.unlisted:
            return (
                f"denied: {name} (MCP server {self.name}) is not allowed by the operator's "
                "classification"
            )
        return None

    async def aclose(self) -> None:
        await self.connection.aclose()


def _validator(schema: dict[str, Any], where: str) -> Any:
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise InvalidInput(
            f"{where}: the server's input schema is invalid: {error.message}"
        ) from None
    return cls(schema)


class _ListedTool(Tool):
    """A tool as its MCP server lists it: description and JSON schema from the listing, the
    model's arguments checked against that schema (there is no local function)."""

    def __init__(
        self,
        source: McpToolSource,
        name: str,
        description: str,
        schema: dict[str, Any],
        rule: ToolRule,
    ) -> None:
        # Not Tool.__init__: it builds the schema from a Python function's signature.
        self.function = _no_function
        self.name = name
        self.description = description
        self.parameters = schema
        self.takes_context = False
        self.source = source
        self.validator = _validator(schema, f"MCP tool {name}")
        self.classified(rule)

    def classified(self, rule: ToolRule) -> None:
        """Take what the operator's classification says of this tool."""

    def parse(self, arguments: str) -> dict[str, Any]:
        try:
            value = json.loads(arguments.strip() or "{}")
        except ValueError as error:
            raise ToolArgumentsInvalid(f"arguments: not JSON ({error})") from None
        if not isinstance(value, dict):
            raise ToolArgumentsInvalid("arguments: must be a JSON object")
        problems = [
            f"{'.'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}"
            for e in list(self.validator.iter_errors(value))[:10]
        ]
        if problems:
            raise ToolArgumentsInvalid("; ".join(problems))
        return value


def _no_function(**arguments: Any) -> JSON:
    raise AssertionError("an MCP tool has no local function")


class McpReadOnlyTool(_ListedTool, ReadOnlyTool):
    """A classified read-only MCP tool: the worker calls it during the turn."""

    def classified(self, rule: ToolRule) -> None:
        self.timeout = rule.timeout_seconds

    async def call(self, ctx: ToolContext, arguments: dict[str, Any]) -> JSON:
        result = await self.source.connection.call_tool(
            self.name, arguments, meta=None, seconds=self.timeout + 1
        )
        if result.is_error:
            raise RuntimeError(result_text(result) or "the tool answered with an error")
        return result_json(result)


class McpEffectTool(_ListedTool, EffectTool):
    """A classified effectful MCP tool: the call becomes a fenced effect the dispatcher sends."""

    def classified(self, rule: ToolRule) -> None:
        self.kind = self.source.effect_kind
        self.policy = rule.policy
        self.result = default_result
        self.approve = rule.approval()
        self.approval_seconds = rule.approval_seconds

    async def payload(self, arguments: dict[str, Any]) -> JSON:
        return {"server": self.source.name, "tool": self.name, "arguments": arguments}


async def draft_classification(spec: McpServerSpec) -> dict[str, Any]:
    """A draft classification of every tool ``spec``'s server lists, pre-filled from its
    annotations (hints only: an operator reviews and edits it before it is used)."""
    connection = McpConnection(spec)
    try:
        listed = await connection.list_tools(seconds=LIST_SECONDS)
    finally:
        with anyio.CancelScope(shield=True):
            await connection.aclose()
    tools: dict[str, Any] = {}
    for found in listed:
        hints = found.annotations
        if hints is not None and hints.read_only_hint is True:
            tools[found.name] = {"class": "read_only"}
        else:
            # Unmarked, or marked as acting: an effect, approved by a person unless the server
            # says it is not destructive. Idempotent ones may be replaceable.
            replaceable = hints is not None and hints.idempotent_hint is True
            tools[found.name] = {
                "class": "effect",
                "policy": "replaceable" if replaceable else "irreversible",
                "approve": not (hints is not None and hints.destructive_hint is False),
            }
    connection_options: dict[str, Any] = (
        {"url": spec.url}
        if spec.url is not None
        else {"command": spec.command, "args": list(spec.args)}
    )
    return {
        "servers": {spec.name: {**connection_options, "effect_kind": spec.name, "tools": tools}}
    }


__all__ = [
    "McpEffectTool",
    "McpReadOnlyTool",
    "McpToolSource",
    "ToolRule",
    "draft_classification",
    "load_classification",
]
