"""The chat request's messages and tools in OpenAI's shape (the chat part of openai_schema.py's bodies): messages
carry what the chat template renders (an assistant's tool calls and reasoning, a tool result's call id) and ignore
fields they do not use, so a conversation echoed back with fields of OpenAI's newer replies still parses; a tool's
definition takes only OpenAI's fields (a typo in it must not silently change nothing)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltamesh.services.router.limits import ChatRole


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class MessageFunctionCall(BaseModel):
    name: str
    arguments: str = Field("", description="The call's arguments, a JSON object as a string")


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant's calls")
    tool_call_id: str | None = Field(None, description="The call a tool message answers")
    reasoning_content: str | None = Field(
        None, description="An assistant's reasoning (the chat template decides whether to show it to the model again)"
    )
    reasoning: str | None = Field(None, description="vLLM's newer name for reasoning_content")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message in OpenAI's shape, as the chat template reads it (chat_request.py)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of type object")
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction
