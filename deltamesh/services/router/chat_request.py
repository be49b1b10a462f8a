"""A chat request as both of the router's edges take it (REST's body, gRPC's ChatMessages), checked by one rule and
made ready for the chat template: messages in OpenAI's shape (an assistant's `tool_calls` with their arguments as
a JSON string, a tool result's `tool_call_id`, `reasoning_content`), function tools, tool_choice and
parallel_tool_calls, and the template options (chat_template_kwargs, add_generation_prompt, continue_final_message).

The checks that cost O(count) run on the event loop; the JSON schemas of the tools' parameters and the assistants'
JSON arguments are read in `prepare`, off the loop, beside templating."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from google.protobuf import json_format

from deltamesh.engine.chat_template import RESERVED_VARIABLES
from deltamesh.services.router.limits import InvalidParam, check_count
from deltamesh.v1 import router_pb2

# OpenAI's rule for a function's name (its API refuses others)
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 1024  # a request's function tools: far above OpenAI's 128
TOOL_CHOICES = ("none", "auto", "required")
_TOOL_CHOICE_MODES = {  # gRPC's ToolChoice.Mode -> REST's word
    router_pb2.ToolChoice.MODE_NONE: "none",
    router_pb2.ToolChoice.MODE_AUTO: "auto",
    router_pb2.ToolChoice.MODE_REQUIRED: "required",
}


@dataclass
class ChatRequest:
    messages: list[dict]  # OpenAI's shape: role, content (text), name, tool_calls, tool_call_id, reasoning_content
    tools: list[dict] | None = None  # OpenAI's function tools: {"type": "function", "function": {name, ...}}
    tool_choice: str | dict = "auto"  # none | auto | required | {"name": NAME}
    parallel_tool_calls: bool = True  # False: at most one tool call
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, chat: router_pb2.ChatMessages) -> ChatRequest:
        """gRPC's ChatMessages in REST's shape: the same fields, the same rules."""
        check_count(len(chat.tools), MAX_TOOLS, "tools", "tools")
        return cls(
            messages=[_message_from_proto(m) for m in chat.messages],
            tools=[_tool_from_proto(t) for t in chat.tools] or None,
            tool_choice=_tool_choice_from_proto(chat),
            parallel_tool_calls=chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True,
            add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
            continue_final_message=chat.continue_final_message,
            template_kwargs=json_format.MessageToDict(chat.chat_template_kwargs),
        )

    def think_not_before_a_grammar(self) -> None:
        """A reply under structured outputs: its grammar holds from the first token (the engine cannot let a model
        think first, as vLLM's reasoning parsers can), so the template's thinking is off unless the request sets
        enable_thinking. Both edges apply it."""
        self.template_kwargs = {"enable_thinking": False, **self.template_kwargs}

    @property
    def tool_parameters(self) -> dict[str, dict]:
        """Each tool's name -> its parameters schema ({} when it takes none)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools or ()}

    def check(self) -> None:
        """The cheap rules, on the event loop; each error names its parameter."""
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidParam(
                "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true"
            )
        reserved = RESERVED_VARIABLES.intersection(self.template_kwargs)
        if reserved:
            raise InvalidParam(
                "chat_template_kwargs",
                f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}: the request's own fields set them",
            )
        check_count(len(self.tools or ()), MAX_TOOLS, "tools", "tools")
        names = [_tool_name(tool) for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise InvalidParam("tools", "two tools have the same name")
        self._check_tool_choice(names)
        for message in self.messages:
            for call in message.get("tool_calls") or ():
                _check_call_shape(call)

    def _check_tool_choice(self, names: list[str]) -> None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if not names:
                raise InvalidParam("tool_choice", "tool_choice names a function, but the request has no tools")
            if choice.get("name") not in names:
                raise InvalidParam(
                    "tool_choice", f"tool_choice names the function {str(choice.get('name'))[:100]!r}, not in tools"
                )
        elif choice not in TOOL_CHOICES:
            raise InvalidParam("tool_choice", "tool_choice must be none, auto, required or a named function")
        elif choice == "required" and not names:
            raise InvalidParam("tool_choice", 'tool_choice "required" needs tools')

    def prepare(self) -> tuple[list[dict], list[dict] | None]:
        """Off the loop: the tools' parameter schemas checked; the messages and tools as the template reads them
        (an assistant's tool-call arguments as a mapping, as transformers' templates expect)."""
        for tool in self.tools or ():
            _check_parameters(tool["function"])
        return [_for_template(i, m) for i, m in enumerate(self.messages)], self.tools


def _message_from_proto(m: router_pb2.ChatMessage) -> dict:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.HasField("reasoning_content"):
        message["reasoning_content"] = m.reasoning_content
    return message


def _tool_from_proto(t: router_pb2.Tool) -> dict:
    function: dict[str, Any] = {"name": t.name}
    if t.description:
        function["description"] = t.description
    if t.parameters:
        try:
            parameters = json.loads(t.parameters)
        except (ValueError, RecursionError):
            raise InvalidParam("tools", f"tool {t.name[:100]!r}: parameters is not JSON") from None
        if not isinstance(parameters, dict):  # REST's body takes an object only; a forced choice's schema needs one
            raise InvalidParam("tools", f"tool {t.name[:100]!r}: parameters must be a JSON Schema object")
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _tool_choice_from_proto(chat: router_pb2.ChatMessages) -> str | dict:
    """ToolChoice in REST's terms; unset, OpenAI's default (auto with tools, none without). A mode this router does
    not know (a newer client's) is passed on as its number, for check() to refuse in REST's words."""
    choice = chat.tool_choice
    if choice.WhichOneof("choice") == "function":
        return {"name": choice.function}
    if choice.mode == router_pb2.ToolChoice.MODE_UNSPECIFIED:
        return "auto" if chat.tools else "none"
    return _TOOL_CHOICE_MODES.get(choice.mode, f"mode {choice.mode}")


def _tool_name(tool: dict) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidParam("tools", 'a tool must be {"type": "function", "function": {"name": ..., ...}}')
    if not FUNCTION_NAME.fullmatch(name):
        raise InvalidParam(
            "tools", f"tool name {name[:100]!r}: 1 to 64 letters, digits, underscores or dashes (OpenAI's rule)"
        )
    return name


def _check_parameters(function: dict) -> None:
    parameters = function.get("parameters")
    if parameters is None:
        return
    where = f"tool {function['name']!r}"
    if not isinstance(parameters, dict):
        raise InvalidParam("tools", f"{where}: parameters must be a JSON Schema object")
    if parameters.get("type", "object") != "object":
        raise InvalidParam(
            "tools", f"{where}: parameters must be a schema of type 'object', not {parameters['type']!r}"
        )
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.path)
        raise InvalidParam(
            "tools", f"{where}: parameters is not a valid JSON Schema: {e.message[:300]} (at /{path})"
        ) from None
    except RecursionError:
        raise InvalidParam("tools", f"{where}: parameters is nested too deeply") from None


def _check_call_shape(call: Any) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParam("messages", "a tool call must be {'function': {'name': ..., 'arguments': ...}}")
    if not isinstance(function.get("arguments", ""), str):
        raise InvalidParam("messages", "a tool call's arguments must be a JSON string")


def _for_template(index: int, message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidParam("messages", f"messages[{index}]: a tool call's arguments must be a JSON object")
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": converted}
