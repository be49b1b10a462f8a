"""A chat reply as OpenAI returns it: the model's text split into reasoning, content and tool calls, for one choice,
piece by piece as its text arrives (a stream's deltas) and in total (a whole answer). The reply's start is read off
the prompt's assistant prefix (what the template wrote of the reply before the model's first token): the think
block it leaves open or closed, and a tool call it leaves open (a reply continued with continue_final_message),
whose header and arguments so far belong to the call the output completes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from deltamesh.services.router.chat_output.events import (
    CallArguments,
    CallHeader,
    Event,
    StreamParser,
    Text,
    new_call_id,
)
from deltamesh.services.router.chat_output.forced import NamedToolCall, RequiredToolCalls
from deltamesh.services.router.chat_output.json_calls import HermesToolCalls
from deltamesh.services.router.chat_output.reasoning import ReasoningSplitter, think_state
from deltamesh.services.router.chat_output.xml_calls import TOOL_CALL, XmlToolCalls

ReasoningParser = Literal["qwen3", "none"]
ToolCallParser = Literal["qwen3_coder", "hermes", "none"]
END_TOOL_CALL = "</tool_call>"


@dataclass(frozen=True)
class OutputFormat:
    """How a model writes reasoning and tool calls: set by flags, or (auto) read off its chat template."""

    reasoning: ReasoningParser = "none"
    tool_calls: ToolCallParser = "none"

    @classmethod
    def resolve(
        cls,
        template: str | None,
        reasoning: ReasoningParser | Literal["auto"] = "auto",
        tool_calls: ToolCallParser | Literal["auto"] = "auto",
    ) -> OutputFormat:
        template = template or ""
        if reasoning == "auto":
            reasoning = "qwen3" if "<think>" in template else "none"
        if tool_calls == "auto":
            tool_calls = "qwen3_coder" if "<function=" in template else "hermes" if TOOL_CALL in template else "none"
        return cls(reasoning, tool_calls)


@dataclass
class CallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


class ChatOutput:
    def __init__(self, reasoning: ReasoningSplitter | None, calls: StreamParser | None, max_calls: int | None = None):
        self._splitter, self._calls, self._max_calls = reasoning, calls, max_calls
        self.reasoning, self.content = "", ""
        self.tool_calls: list[ToolCall] = []
        self._primed: list[Event] = []

    def prime(self, open_call: str) -> None:
        """The start of a tool call that the prompt leaves open: its header and arguments so far go out with the
        first delta (the prompt's text itself is not part of the reply)."""
        if self._calls is not None and open_call:
            self._primed = [e for e in self._calls.feed(open_call) if not isinstance(e, Text)]

    def feed(self, text: str) -> OutputDelta:
        return self._deliver(self._route(self._splitter.feed(text) if self._splitter else [Text("content", text)]))

    def take(self, text: str, last: bool) -> OutputDelta:
        """What a stream's next text adds to the reply; with `last` (the output ended), all that was held back too."""
        part = self.feed(text)
        if not last:
            return part
        rest = self.finish()
        return OutputDelta(part.reasoning + rest.reasoning, part.content + rest.content, part.calls + rest.calls)

    def finish_reason(self, finish: str | None) -> str | None:
        """The reply's finish reason given the generation's ("stop", "length", ...): "tool_calls" for a reply that
        stopped after tool calls, but "stop" for one forced to call a named function (as OpenAI answers)."""
        named = isinstance(self._calls, NamedToolCall)
        return "tool_calls" if finish == "stop" and self.tool_calls and not named else finish

    def finish(self) -> OutputDelta:
        events = self._route(self._splitter.finish()) if self._splitter else []
        if self._calls is not None:
            events += self._calls.finish()
        return self._deliver(events)

    def _route(self, events: list[Event]) -> list[Event]:
        """Content goes through the tool-call parser (reasoning does not: a call written while thinking is none)."""
        if self._calls is None:
            return events
        out: list[Event] = []
        for event in events:
            # (the reasoning parser's events are all Text)
            out += self._calls.feed(event.text) if isinstance(event, Text) and event.kind == "content" else [event]
        return out

    def _deliver(self, events: list[Event]) -> OutputDelta:
        events, self._primed = self._primed + events, []
        delta = OutputDelta()
        for event in events:
            if isinstance(event, Text):
                setattr(delta, event.kind, getattr(delta, event.kind) + event.text)
            elif self._max_calls is None or event.index < self._max_calls:
                self._add_call(delta, event)
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def _add_call(self, delta: OutputDelta, event: CallHeader | CallArguments) -> None:
        if not delta.calls or delta.calls[-1].index != event.index:
            delta.calls.append(CallDelta(event.index))
        if isinstance(event, CallHeader):
            delta.calls[-1].id, delta.calls[-1].name = event.id, event.name
            self.tool_calls.append(ToolCall(event.id, event.name, ""))
        else:
            delta.calls[-1].arguments += event.text
            self.tool_calls[event.index].arguments += event.text


def chat_output(
    fmt: OutputFormat,
    assistant_prefix: str,
    tools: dict[str, dict],
    tool_choice: str | dict = "auto",
    parallel_tool_calls: bool = True,
    reasoning: bool = True,
    new_id: Callable[[], str] = new_call_id,
) -> ChatOutput:
    """The parser of one choice's reply. `tools` maps each tool's name to its parameters schema; `tool_choice` is
    none, auto, required or {"name": ...} (a named function); `reasoning` False reads the whole reply as the answer
    (a reply whose grammar starts at its first token)."""
    state = think_state(assistant_prefix)
    splitter = ReasoningSplitter(state) if fmt.reasoning == "qwen3" and reasoning else None
    calls: StreamParser | None = None
    if isinstance(tool_choice, dict):
        calls = NamedToolCall(tool_choice["name"], new_id)
    elif tool_choice == "required":
        calls = RequiredToolCalls(tools, new_id)
    elif tool_choice == "auto" and tools and fmt.tool_calls != "none":
        calls = (XmlToolCalls if fmt.tool_calls == "qwen3_coder" else HermesToolCalls)(tools, new_id)
    output = ChatOutput(splitter, calls, None if parallel_tool_calls else 1)
    if tool_choice == "auto" and (splitter is None or state != "open"):
        opened = assistant_prefix.rfind(TOOL_CALL)
        if opened > assistant_prefix.rfind(END_TOOL_CALL):
            output.prime(assistant_prefix[opened:])
    return output
