"""``LiveOutput``: a turn's model text, published to the step's live output as Pydantic AI
streams it (``PydanticAIAgent(..., stream=True)``; docs/streaming.md).

A capability that listens to the run's events makes ``AgentRun.next`` stream each node, so the
turn's model request is streamed and its ``PartStartEvent`` / ``PartDeltaEvent`` text reaches
``ctx.output`` as it comes, nothing parsed by hand. What one response streamed goes through its
own ``OutputPart``: a response that another attempt at the same request step supersedes (a
capability that asked the model again, or replaced the response, per ``ModelResponseOrigin``) is
withdrawn, so readers never show both. A response that fails midway fails the turn's step (Pydantic
AI retries a streamed request only before any of it was streamed): its attempt's output is
retracted for every reader like any lost attempt's.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability, on_event
from pydantic_ai.messages import (
    AgentStreamEvent,
    ModelRequestAttempt,
    ModelResponseOrigin,
    ModelResponseRejectedEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
)

from orchestrator.agent.output import OutputPart, StepOutput
from orchestrator.storable import storable_text


class LiveOutput(AbstractCapability[Any]):
    """Publishes the text of a turn's streamed model responses to ``output``."""

    def __init__(self, output: StepOutput) -> None:
        self.output = output
        self.responses: dict[tuple[str, int], tuple[ModelResponseOrigin | None, OutputPart]] = {}
        """Each request step's latest response: its origin and the part its text went to."""

    @on_event(PartStartEvent, PartDeltaEvent, ModelResponseRejectedEvent)
    async def _publish(self, ctx: RunContext[Any], event: AgentStreamEvent) -> None:
        if isinstance(event, ModelResponseRejectedEvent):
            if isinstance(event.reason, ModelRequestAttempt):  # replaced: not in the history
                key = (ctx.run_id or "", event.run_step)
                latest = self.responses.get(key)
                if latest is not None and _attempt(latest[0]) == event.attempt:
                    latest[1].withdraw("the model's response was replaced")
            return
        text = ""
        if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
            text = event.part.content
        elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
            text = event.delta.content_delta
        if text and isinstance(event, PartStartEvent | PartDeltaEvent):
            part = self._part(ctx, event.origin)
            if part is not None:
                part.text(storable_text(text))

    def _part(self, ctx: RunContext[Any], origin: ModelResponseOrigin | None) -> OutputPart | None:
        """The part of ``origin``'s response (``None``: a response superseded already)."""
        key = (origin.run_id, origin.run_step) if origin is not None else (ctx.run_id or "", -1)
        latest = self.responses.get(key)
        if latest is not None:
            seen, part = latest
            if seen is None or origin is None or seen == origin:
                return part
            if seen.supersedes(origin):
                return None  # a late event of a response already replaced
            if not origin.supersedes(seen):
                return part
            part.withdraw(f"attempt {origin.attempt} at the model request replaced it")
        part = self.output.part()
        self.responses[key] = (origin, part)
        return part


def _attempt(origin: ModelResponseOrigin | None) -> int:
    return origin.attempt if origin is not None else 1


__all__ = ["LiveOutput"]
