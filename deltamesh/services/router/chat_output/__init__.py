"""A chat reply's text as OpenAI's API returns it: reasoning (`reasoning_content`), content and tool calls, for
the model families deltamesh serves (Qwen3.5's XML-style calls, Qwen3's JSON ones, `<think>` reasoning), streamed
and whole alike. The parsers live in the router, never in the engine: REST's gateway and the gRPC servicer read a
reply with them alike (chat_reply.py)."""

from deltamesh.services.router.chat_output.forced import named_schema, required_schema
from deltamesh.services.router.chat_output.output import (
    CallDelta,
    ChatOutput,
    OutputDelta,
    OutputFormat,
    ToolCall,
    chat_output,
)

__all__ = [
    "CallDelta",
    "ChatOutput",
    "OutputDelta",
    "OutputFormat",
    "ToolCall",
    "chat_output",
    "named_schema",
    "required_schema",
]
