"""Response bodies of the OpenAI-compatible API (completions, chat completions and their stream chunks, the model
list), as pydantic models: they make the served OpenAPI schema accurate. Fields beyond OpenAI's are vLLM's, with
vLLM's names and meanings (reasoning, stop_reason)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, model_serializer

# vLLM's answer to return_token_ids: present only when asked for, so that every other answer and stream chunk
# stays as OpenAI's
_TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")

# A token a grammar masks has logprob -inf, which JSON cannot carry: floored at vLLM's -9999.0, as vLLM reports it.
Logprob = Annotated[float, AfterValidator(lambda v: max(v, -9999.0))]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # of prompt_tokens, those a worker's prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Logprob]
    top_logprobs: list[dict[str, Logprob]] | None
    text_offset: list[int]


class _TokenIdsWhenAsked(BaseModel):
    """Serialised without its token id lists (_TOKEN_ID_FIELDS) unless they are set."""

    @model_serializer(mode="wrap")
    def _token_ids_when_asked(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None or k not in _TOKEN_ID_FIELDS}


# vLLM's stop_reason: the stop string or the stop_token_ids entry that ended a choice; null for the end-of-sequence
# token, the length, or a choice not finished yet
StopReason = str | int | None


class CompletionChoice(_TokenIdsWhenAsked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: StopReason = None
    prompt_token_ids: list[int] | None = None  # a stream's first chunk of the choice
    token_ids: list[int] | None = None  # a stream chunk's new tokens


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # a stream's chunks: with stream_options.continuous_usage_stats, the choice's so far


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
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
    # the reasoning under both names clients read: `reasoning` (vLLM's today, OpenRouter's) and `reasoning_content`
    # (DeepSeek's, SGLang's, and vLLM's until it renamed it)
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(_TokenIdsWhenAsked):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None


class ChatCompletion(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


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
    reasoning: str | None = None  # under both names, as ChatCompletionMessage
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_TokenIdsWhenAsked):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # as Completion's
    prompt_token_ids: list[int] | None = None  # in the first chunk (the role's), with return_token_ids


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
