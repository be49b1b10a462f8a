"""How a chat request's reply is generated and read, by one rule on both of the router's edges (REST's
/v1/chat/completions and gRPC's Generate with ChatMessages): a forced tool_choice ("required" or a named function)
becomes the JSON schema the reply is decoded under (chat_output/forced.py), any grammar turns the template's
thinking off, and each reply's text is split into reasoning, content and tool calls by the model family's parsers
(chat_output/)."""

from __future__ import annotations

from dataclasses import dataclass

from deltamesh.protocol.structured import StructuredOutputs
from deltamesh.services.router.chat_output import ChatOutput, OutputFormat, chat_output, named_schema, required_schema
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.limits import InvalidParam


@dataclass(frozen=True)
class ChatReplyPlan:
    fmt: OutputFormat
    tools: dict[str, dict]  # each tool's name -> its parameters schema
    tool_choice: str | dict
    parallel_tool_calls: bool
    forced: StructuredOutputs | None  # the forced calls' schema, which the reply is decoded under
    grammar: bool  # the reply is decoded under a grammar from its first token (forced calls or structured outputs)

    @property
    def parsed(self) -> bool:
        """Whether a parser reads the reply's start off the prompt (its assistant prefix): only then is it worth
        rendering the chat a second time to find it."""
        return self.fmt.reasoning != "none" or bool(self.tools and self.tool_choice != "none")

    def new_output(self, assistant_prefix: str) -> ChatOutput:
        """The parser of one reply (a reply under a grammar holds no reasoning: the grammar starts at its first token)."""
        return chat_output(
            self.fmt,
            assistant_prefix,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            reasoning=not self.grammar,
        )


def plan_chat_reply(chat: ChatRequest, fmt: OutputFormat, structured: bool) -> ChatReplyPlan:
    """After the chat's own checks (ChatRequest.check). `structured`: whether the request sets the output's
    structure itself (REST's response_format or structured_outputs, gRPC's SamplingParams.structured_outputs).
    Turns the chat's thinking off when a grammar holds (ChatRequest.think_not_before_a_grammar)."""
    forced = forced_calls(chat, structured)
    grammar = forced is not None or structured
    if grammar:
        chat.think_not_before_a_grammar()
    return ChatReplyPlan(fmt, chat.tool_parameters, chat.tool_choice, chat.parallel_tool_calls, forced, grammar)


def forced_calls(chat: ChatRequest, structured: bool) -> StructuredOutputs | None:
    """tool_choice "required" or a named function, enforced as vLLM enforces it: the reply is written under a JSON
    schema built from the tools (chat_output/forced.py), so its calls always parse and match the tools' schemas."""
    choice = chat.tool_choice
    if choice == "required":
        schema = required_schema(chat.tool_parameters, chat.parallel_tool_calls)
    elif isinstance(choice, dict):
        schema = named_schema(chat.tool_parameters[choice["name"]])
    else:
        return None
    if structured:
        raise InvalidParam(
            "tool_choice",
            'tool_choice "required" or a named function sets the output\'s structure: leave out response_format and '
            "structured_outputs",
        )
    # laid out as json.dumps writes it: whitespace in the calls carries nothing, and a model that drifts into it
    # (up to the grammar's 32 characters per gap) can spend its max_tokens before the calls are complete
    forced = StructuredOutputs(json=schema, disable_any_whitespace=True)
    try:
        forced.validate()
    except ValueError as e:  # too large: the tools' schemas, put together
        raise InvalidParam("tools", f"tool_choice {choice!r} cannot be enforced for these tools: {e}") from None
    return forced
