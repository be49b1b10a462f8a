"""Chat prompts in OpenAI's shape as the router's ChatMessages: messages with an assistant's `tool_calls`, a tool
result's `tool_call_id` and `reasoning_content`; function tools, tool_choice and parallel_tool_calls; the chat
template's options."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from google.protobuf import struct_pb2

from deltamesh.v1 import router_pb2


def chat_messages(
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] = (),
    tool_choice: str | Mapping | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: Mapping | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> router_pb2.ChatMessages:
    """`messages` as OpenAI's API takes them (content as text); `tools` as OpenAI's function tools
    ({"type": "function", "function": {"name", "description", "parameters"}}); `tool_choice` as OpenAI's (None:
    the router's default, auto with tools and none without)."""
    chat = router_pb2.ChatMessages(
        messages=[_message(m) for m in messages],
        tools=[_tool(t) for t in tools],
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    if tool_choice is not None:
        chat.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    if chat_template_kwargs:
        kwargs = struct_pb2.Struct()
        kwargs.update(dict(chat_template_kwargs))
        chat.chat_template_kwargs.CopyFrom(kwargs)
    return chat


def _message(m: Mapping) -> router_pb2.ChatMessage:
    message = router_pb2.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        name=m.get("name") or "",
        tool_call_id=m.get("tool_call_id") or "",
    )
    for call in m.get("tool_calls") or ():
        function = call["function"]
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        message.tool_calls.add(id=call.get("id") or "", name=function["name"], arguments=arguments)
    if m.get("reasoning_content") is not None:
        message.reasoning_content = m["reasoning_content"]
    return message


def _tool(t: Mapping) -> router_pb2.Tool:
    function = t["function"]
    parameters = function.get("parameters")
    return router_pb2.Tool(
        name=function["name"],
        description=function.get("description") or "",
        parameters=json.dumps(parameters) if parameters is not None else "",
    )


_MODES = {
    "none": router_pb2.ToolChoice.MODE_NONE,
    "auto": router_pb2.ToolChoice.MODE_AUTO,
    "required": router_pb2.ToolChoice.MODE_REQUIRED,
}


def _tool_choice(choice: str | Mapping) -> router_pb2.ToolChoice:
    """OpenAI's shapes only; whether a named function is one of the tools is the router's check."""
    if isinstance(choice, str) and choice in _MODES:
        return router_pb2.ToolChoice(mode=_MODES[choice])
    function = None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return router_pb2.ToolChoice(function=name)
