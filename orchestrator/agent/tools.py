"""Tools a model may call, each labelled where it is defined: read-only, or an effect.

``@tool.read_only`` runs in the worker while the turn is in progress; it may run again if the
worker dies before the turn commits, and its result is committed with the turn. ``@tool.effect``
never acts: its function only builds the payload, which becomes a fenced ``Effect`` recorded in
the turn's commit and sent once by the dispatcher; the model is told the settled record.
``@tool.agent`` runs another agent as a child run started by the turn's commit; the model is told
how it ended. There is no unlabelled tool. The argument schema comes from the function's type
hints and docstring (``Args:`` lines describe the parameters) and calls are validated with
pydantic::

    @tool.read_only(timeout=10)
    async def find_invoice(ctx: ToolContext, invoice_id: str) -> dict:
        \"\"\"Look up an invoice by id.\"\"\"

    @tool.effect("email")
    def reply_to_customer(to: str, subject: str, body: str) -> dict:
        \"\"\"Email the customer.\"\"\"
        return {"to": to, "subject": subject, "body": body}

    @tool.effect("payments", approve=lambda amount, **_: amount > 100)
    def refund(order_id: str, amount: float) -> dict:
        \"\"\"Refund an order (a person approves refunds above 100).\"\"\"
        return {"order_id": order_id, "amount": amount}
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload, runtime_checkable

import anyio
import pydantic
from pydantic_core import to_jsonable_python

from orchestrator.agent.budgets import Budget
from orchestrator.agent.children import Child, ChildOutcome
from orchestrator.agent.turns import EffectSpec, check_effect_spec, default_result
from orchestrator.effect_model import (
    DEFAULT_APPROVAL_SECONDS,
    EffectPolicy,
    EffectRecord,
)
from orchestrator.errors import InvalidInput
from orchestrator.ids import validate_agent_name
from orchestrator.models import JSON
from orchestrator.telemetry import RunLogger

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEFAULT_TOOL_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a read-only tool may read about the call it serves."""

    run_id: str
    fence: int
    attempt: int
    turn: int
    call_id: str
    input: JSON
    log: RunLogger


class ToolArgumentsInvalid(Exception):
    """The model's arguments do not fit the tool's schema (told back to the model)."""


def _description_and_args(function: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The docstring's first paragraph, and the ``name: text`` lines under ``Args:``."""
    text = inspect.getdoc(function) or ""
    head, _, rest = text.partition("\nArgs:")
    described: dict[str, str] = {}
    name = None
    for line in rest.splitlines():
        match = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if match:
            name = match[1]
            described[name] = match[2].strip()
        elif name and line.strip() and line.startswith("        "):
            described[name] += " " + line.strip()
        elif not line.strip():
            name = None
    return " ".join(head.strip().split("\n\n")[0].split()), described


class Tool:
    """A tool's definition: its name, description and argument schema (built from the function)."""

    kind_label: str = ""

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        name: str | None,
        description: str | None,
        takes_context: bool,
    ) -> None:
        self.function = function
        self.name = name or function.__name__
        if not _TOOL_NAME.fullmatch(self.name):
            raise InvalidInput(
                f"tool name {self.name!r}: 1-64 letters, digits, _ and - (the model API's rule)"
            )
        doc, arg_docs = _description_and_args(function)
        self.description = description or doc
        if not self.description:
            raise InvalidInput(
                f"tool {self.name}: give it a docstring (or description=): the model reads it "
                "to decide when to call the tool"
            )
        hints = typing.get_type_hints(function, include_extras=True)
        parameters = list(inspect.signature(function).parameters.values())
        if takes_context and parameters and hints.get(parameters[0].name) is ToolContext:
            parameters = parameters[1:]
            self.takes_context = True
        else:
            self.takes_context = False
        fields: dict[str, Any] = {}
        for parameter in parameters:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise InvalidInput(f"tool {self.name}: *args and **kwargs cannot be described")
            if parameter.name not in hints:
                raise InvalidInput(
                    f"tool {self.name}: parameter {parameter.name!r} has no type hint (the "
                    "model's arguments are validated against the hints)"
                )
            default = ... if parameter.default is parameter.empty else parameter.default
            fields[parameter.name] = (
                hints[parameter.name],
                pydantic.Field(default, description=arg_docs.get(parameter.name)),
            )
        self.arguments: type[pydantic.BaseModel] = pydantic.create_model(
            f"{self.name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
        schema = self.arguments.model_json_schema()
        schema.pop("title", None)
        self.parameters: dict[str, Any] = schema

    def definition(self) -> dict[str, Any]:
        """The tool as the chat completions API takes it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def parse(self, arguments: str) -> dict[str, Any]:
        """The model's raw JSON arguments, validated (``ToolArgumentsInvalid``: what is wrong)."""
        try:
            model = self.arguments.model_validate_json(arguments.strip() or "{}")
        except pydantic.ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
                for e in error.errors(include_url=False)[:10]
            )
            raise ToolArgumentsInvalid(problems) from None
        return {name: getattr(model, name) for name in type(model).model_fields}


class ReadOnlyTool(Tool):
    """Runs in the worker, may run again after a crash; its result is committed with the turn."""

    kind_label = "read_only"

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        timeout: float,
        name: str | None = None,
        description: str | None = None,
    ) -> None:
        if not timeout > 0:
            raise InvalidInput("a read-only tool's timeout must be above 0 seconds")
        super().__init__(function, name=name, description=description, takes_context=True)
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(function)

    async def call(self, ctx: ToolContext, arguments: dict[str, Any]) -> JSON:
        """Await an async function; run a plain one in a worker thread, so that a blocking
        client neither starves the heartbeat (a slow tool is not a dead worker) nor outlives its
        timeout (past it the thread is abandoned, left to finish, its result discarded)."""
        call = functools.partial(self.function, ctx) if self.takes_context else self.function
        if self.is_async:
            result = await call(**arguments)
        else:
            result = await anyio.to_thread.run_sync(
                functools.partial(call, **arguments), abandon_on_cancel=True
            )
        if inspect.isawaitable(result):  # a plain callable that returned a coroutine
            result = await result
        return to_jsonable_python(result)


class EffectTool(Tool, EffectSpec):
    """Builds an effect's payload; the dispatcher sends it, once, after the turn commits."""

    kind_label = "effect"

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        kind: str,
        policy: EffectPolicy,
        result: Callable[[EffectRecord], JSON] | None = None,
        name: str | None = None,
        description: str | None = None,
        approve: Callable[..., bool] | bool = False,
        approval_seconds: float = DEFAULT_APPROVAL_SECONDS,
    ) -> None:
        super().__init__(function, name=name, description=description, takes_context=False)
        check_effect_spec(f"tool {self.name}:", kind, approve, approval_seconds)
        self.kind = kind
        self.policy = policy
        self.result = result or default_result
        self.approve = approve
        self.approval_seconds = approval_seconds

    async def payload(self, arguments: dict[str, Any]) -> JSON:
        value = self.function(**arguments)
        if inspect.isawaitable(value):
            value = await value
        return to_jsonable_python(value)


class AgentTool(Tool):
    """Runs another agent as a child run (docs/child-runs.md): its function builds the child's
    input; the turn's commit starts the child under the run's fence; the run waits for it
    without its lease, and the model is told how it ended (its result, or its error)."""

    kind_label = "agent"

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        agent: str,
        name: str | None = None,
        description: str | None = None,
        budget: Budget | None = None,
    ) -> None:
        super().__init__(function, name=name, description=description, takes_context=False)
        self.agent = validate_agent_name(agent)
        if budget is not None and not isinstance(budget, Budget):
            raise InvalidInput(f"tool {self.name}: a budget is a Budget, not {budget!r}")
        self.budget = budget

    async def child(self, key: str, arguments: dict[str, Any]) -> Child:
        value = self.function(**arguments)
        if inspect.isawaitable(value):
            value = await value
        return Child(self.agent, to_jsonable_python(value), key, budget=self.budget)

    @staticmethod
    def told(outcome: ChildOutcome | None) -> JSON:
        """What the model reads of the child: how it ended, and its result or its error."""
        if outcome is None:  # not found: spawned by a commit a failover took back
            return {"state": "unknown", "error": "the child run was not found"}
        if outcome.succeeded:
            return {"state": outcome.state.value, "result": outcome.result}
        return {"state": outcome.state.value, "error": outcome.error}


@runtime_checkable
class ToolSource(Protocol):
    """Tools that are known only once a process asks for them (an MCP server's, see
    ``orchestrator.agent.mcp.tools``): loaded before a tool loop's first turn in each process."""

    name: str

    async def load(self) -> Sequence[Tool]:
        """The tools to offer the model."""
        ...

    def refusal(self, name: str) -> str | None:
        """Why a call to ``name`` (a tool this source knows but does not offer) is refused."""
        ...


class _ToolDecorators:
    """``tool.read_only`` and ``tool.effect``."""

    @overload
    def read_only(self, function: Callable[..., Any], /) -> ReadOnlyTool: ...

    @overload
    def read_only(
        self,
        function: None = None,
        /,
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_SECONDS,
        name: str | None = None,
        description: str | None = None,
    ) -> Callable[[Callable[..., Any]], ReadOnlyTool]: ...

    def read_only(
        self,
        function: Callable[..., Any] | None = None,
        /,
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_SECONDS,
        name: str | None = None,
        description: str | None = None,
    ) -> ReadOnlyTool | Callable[[Callable[..., Any]], ReadOnlyTool]:
        """A tool without side effects, run by the worker (it may run more than once)."""

        def wrap(f: Callable[..., Any]) -> ReadOnlyTool:
            return ReadOnlyTool(f, timeout=timeout, name=name, description=description)

        return wrap(function) if function is not None else wrap

    def effect(
        self,
        kind: str,
        *,
        policy: EffectPolicy = EffectPolicy.IRREVERSIBLE,
        result: Callable[[EffectRecord], JSON] | None = None,
        name: str | None = None,
        description: str | None = None,
        approve: Callable[..., bool] | bool = False,
        approval_seconds: float = DEFAULT_APPROVAL_SECONDS,
    ) -> Callable[[Callable[..., Awaitable[JSON] | JSON]], EffectTool]:
        """A tool that changes the world: its function builds the payload of a fenced effect
        of ``kind`` (a vendor in the dispatcher's configuration), sent once after the turn
        commits; ``result`` turns the settled record into what the model is told. ``approve``
        (``True``, or a predicate called with the call's arguments) makes a call wait for a
        person's approval of its payload, denied by expiry after ``approval_seconds``."""

        def wrap(f: Callable[..., Any]) -> EffectTool:
            return EffectTool(
                f,
                kind=kind,
                policy=policy,
                result=result,
                name=name,
                description=description,
                approve=approve,
                approval_seconds=approval_seconds,
            )

        return wrap

    def agent(
        self,
        agent: str,
        *,
        name: str | None = None,
        description: str | None = None,
        budget: Budget | None = None,
    ) -> Callable[[Callable[..., Awaitable[JSON] | JSON]], AgentTool]:
        """A tool that runs ``agent`` as a child run: its function builds the child's input
        from the call's arguments; the model is told the child's result once it ended.
        ``budget`` is carved from the run's own (needed when the run's agent has one)."""

        def wrap(f: Callable[..., Any]) -> AgentTool:
            return AgentTool(f, agent=agent, name=name, description=description, budget=budget)

        return wrap


tool = _ToolDecorators()
