"""Request and response bodies of the OpenAI-compatible API (the subset deltamesh serves), as pydantic
models: they validate input and make the served OpenAPI schema accurate. A parameter that neither OpenAI's API
nor the extensions below define is refused with 400, as OpenAI refuses unrecognized arguments (a typo must not
silently change nothing); OpenAI parameters that do not change the output here (user, store, metadata, ...) are
accepted, and those we do not support are refused when set to a non-default value. Chat messages keep ignoring
fields they do not use (a conversation echoed back with fields of OpenAI's newer replies still parses); a tool's
definition takes only OpenAI's fields."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from deltamesh.protocol.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, SamplingParams
from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router.chat_request import MAX_TOOLS
from deltamesh.services.router.limits import ChatRole, check_count, check_logit_bias_count

MAX_N = 16
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1  # integer bounds of the wire types (common.proto)
# Token ids must be JSON integers: strict, so that true/false and 2.0 are refused rather than read as 1 and 2.
TokenId = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]

# The serving router's limits, set for each request by the gateway's middleware. They are checked on the raw
# JSON before pydantic validates it: validating a huge list would itself hold the event loop.
LIMITS: ContextVar[RequestLimits] = ContextVar("LIMITS", default=RequestLimits())  # noqa: B039  (never mutated)


def _check_count(data, field: str, limit: int, what: str) -> None:
    """The router's count rule (limits.py) on a list in the raw JSON; the gateway answers its InvalidParam as is."""
    items = data.get(field) if isinstance(data, dict) else None
    if isinstance(items, list):
        check_count(len(items), limit, what, field)


def _only_with(name: str, needed: str):
    """A field validator: parameter `name` may be set only when parameter `needed` (declared before it) is true,
    as OpenAI's API requires."""

    def check(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get(needed):
            raise ValueError(f"{name} is only allowed when {needed} is true")
        return value

    return field_validator(name)(check)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling parameters both endpoints take. None (or null) is SamplingParams' default
    (deltamesh/protocol/sampling.py), which the gateway fills in; bounds the schema states are the engine's rule,
    whose message a bad value gets (errors.py)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="One of the served model names; omitted: the first (as vLLM)")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(
        None, ge=0, le=UINT64_MAX, description="makes sampling reproducible; choice i of n uses seed + i (mod 2**64)"
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Over the generated tokens")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Over the generated tokens")
    logit_bias: dict[int, float] | None = Field(
        None, description=f"Token id -> bias in [-100, 100] added to its logit; at most {MAX_LOGIT_BIAS} entries"
    )
    user: str | None = None
    # vLLM's extensions, with vLLM's meanings
    top_k: StrictInt | None = Field(None, ge=-1, le=UINT32_MAX, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        None, gt=0, description="Over the prompt and generated tokens (transformers' definition); 1: off"
    )
    min_tokens: StrictInt | None = Field(
        None, ge=0, le=UINT32_MAX, description="No end-of-sequence, stop token or stop string before this many"
    )
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = Field(
        None, description="Accepted; as in vLLM it changes nothing with a fast tokenizer (the only kind served here)"
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's API takes null for any optional parameter (clients that send every field send it): null
        where this schema has a default other than None means that default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data

    _stream_options_need_stream = _only_with("stream_options", "stream")

    @model_validator(mode="before")
    @classmethod
    def _few_enough_stop_strings_and_biases(cls, data):
        _check_count(data, "stop", MAX_STOP_STRINGS, "stop strings")
        bias = data.get("logit_bias") if isinstance(data, dict) else None
        if isinstance(bias, dict):
            check_logit_bias_count(len(bias))
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(None, ge=1, le=UINT32_MAX, description=f"default {SamplingParams.max_tokens}")
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, description="Not supported (must be false)")
    suffix: str | None = Field(None, description="Not supported")
    best_of: int | None = Field(None, description="Only best_of == n is supported")

    @model_validator(mode="before")
    @classmethod
    def _few_enough_prompts(cls, data):
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch, not token ids
            _check_count(data, "prompt", LIMITS.get().max_prompts, "prompts")
        return data


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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(
        None, ge=1, le=UINT32_MAX, description="Deprecated by OpenAI; max_completion_tokens wins"
    )
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without"
    )
    parallel_tool_calls: bool = Field(True, description="False: at most one tool call")
    response_format: dict | None = Field(None, description="Only {'type': 'text'}")
    # extensions (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat template variables, e.g. {'enable_thinking': false}"
    )
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opened")
    continue_final_message: bool = Field(
        False, description="Leave the final message open and continue it (with add_generation_prompt false)"
    )
    include_reasoning: bool = Field(True, description="False: leave reasoning_content out of the reply")
    # OpenAI parameters about the service, not the output: accepted and not used
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _few_enough_messages(cls, data):
        _check_count(data, "messages", LIMITS.get().max_messages, "chat messages")
        _check_count(data, "tools", MAX_TOOLS, "tools")
        return data

    _top_logprobs_need_logprobs = _only_with("top_logprobs", "logprobs")

    def tool_choice_value(self) -> str | dict:
        """none | auto | required | {"name": NAME}, OpenAI's default filled in."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else {"name": self.tool_choice.function.name}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


ChatFinish = Literal["stop", "length", "abort", "tool_calls"]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class _WithoutNulls(BaseModel):
    """Serialised without its unset (None) fields, as OpenAI's deltas are."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A tool call's first delta carries its id, type and name; the next ones fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(_WithoutNulls):
    """What a chunk adds: the first carries the role, the others leave it out (as OpenAI sends them)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deltamesh"
    root: str  # the checkpoint it serves, as vLLM's model card has it (vllm bench serve reads it)
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
