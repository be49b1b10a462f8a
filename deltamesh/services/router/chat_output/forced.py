"""`tool_choice: "required"` and a named function, enforced by structured decoding (as vLLM does): the model must
write, for "required", a JSON array of calls `[{"name": ..., "parameters": {...}}, ...]` under a schema built from
the tools, and for a named function that function's arguments object under its parameters schema. Here: those
schemas, and the parsing of that output into tool calls, streamed as it is written."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deltamesh.services.router.chat_output.events import (
    CallArguments,
    CallHeader,
    Event,
    new_call_id,
)
from deltamesh.services.router.chat_output.json_calls import JsonCallObject, JsonCallStream

NO_PARAMETERS = {"type": "object", "properties": {}}


def parameters_schema(parameters: dict | None) -> dict:
    return parameters if parameters else NO_PARAMETERS


def named_schema(parameters: dict | None) -> dict:
    """What a named tool_choice makes the model write: the function's arguments."""
    return parameters_schema(parameters)


def required_schema(tools: Mapping[str, dict | None], parallel: bool) -> dict:
    """What tool_choice "required" makes the model write: one call or more (one only without parallel calls), each
    naming a tool and giving arguments under its schema. The tools' `$defs` move to the top, where their `$ref`s
    ("#/$defs/...") point from there."""
    defs, options = {}, []
    for name, parameters in tools.items():
        parameters = dict(parameters_schema(parameters))
        defs.update(parameters.pop("$defs", {}))
        options.append(
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolCalls(JsonCallStream):
    """The array of calls; whatever is not a call (output cut short before one, say) is content."""

    def __init__(self, tools: dict[str, dict], new_id: Callable[[], str] = new_call_id):
        super().__init__(tools, new_id, "open")  # open | element | between | call | rest

    def _run(self, out: list[Event], text: str, final: bool) -> None:
        self._buf += text
        while True:
            head = self._buf.lstrip()
            if self._mode == "call":
                call = self._call
                assert call is not None, "set with the call mode"
                events = call.feed(self._buf, final)
                self._buf = ""
                if events and isinstance(events[0], CallHeader):
                    self._spacing.call_starts()
                    self.calls += 1
                out += events
                if call.mode in ("rejected", "cut"):
                    self._buf, self._mode = call.raw, "rest"
                elif call.mode == "done":
                    self._spacing.call_ends()
                    self._buf, self._mode = call.rest, "between"
                else:
                    return
            elif self._mode == "rest":
                out += self._spacing.text(self._buf)
                self._buf = ""
                return
            elif not head and not final:
                return
            elif self._mode == "open":
                self._buf, self._mode = (head[1:], "element") if head.startswith("[") else (self._buf, "rest")
            elif self._mode == "element":
                if head.startswith("]"):
                    self._buf, self._mode = head[1:], "rest"
                else:
                    self._buf, self._mode = head, "call"
                    self._call = JsonCallObject("parameters", self._tools, self.calls, self._new_id)
                    if not head:
                        self._mode = "rest"
            else:  # between: the next element, or the end of the array
                if head.startswith(","):
                    self._buf, self._mode = head[1:], "element"
                else:
                    self._buf, self._mode = head.removeprefix("]"), "rest"


class NamedToolCall:
    """The whole output is the named function's arguments."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id):
        self._header: list[Event] = [CallHeader(0, new_id(), name)]
        self._started = False
        self.calls = 1

    def feed(self, text: str) -> list[Event]:
        out, self._header = self._header, []
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return out + ([CallArguments(0, text)] if text else [])

    def finish(self) -> list[Event]:
        return self.feed("")
