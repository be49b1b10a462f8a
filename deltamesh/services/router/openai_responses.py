"""Response bodies of the OpenAI-compatible API (completions, chat completions and their stream chunks, the model
list), as pydantic models: they make the served OpenAPI schema accurate. Fields beyond OpenAI's are vLLM's, with
vLLM's names and meanings (reasoning, stop_reason)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field


def _omitted_while_none() -> Any:
    """A field left out of the JSON while it is None: OpenAI's deltas leave out what they do not carry, and vLLM's
    token ids (return_token_ids) appear only when asked for, so every other answer stays as OpenAI's. Per field, in
    pydantic's own serializer: a chunk is serialised for every streamed token, and a model-wide wrap serializer in
    Python nearly doubled that cost."""
    return Field(None, exclude_if=lambda value: value is None)


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
    token_logprobs: list[Logprob | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, Logprob] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of prompt_logprobs: a token's logprob at one prompt position, its rank there, its text."""

    logprob: Logprob
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token, {token id: its entry} for the token and the k most likely (the first
# token's is null: nothing comes before it)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# vLLM's stop_reason: the stop string or the stop_token_ids entry that ended a choice; null for the end-of-sequence
# token, the length, or a choice not finished yet
StopReason = str | int | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: StopReason = None
    prompt_token_ids: list[int] | None = _omitted_while_none()  # a stream's first chunk of the choice
    token_ids: list[int] | None = _omitted_while_none()  # a stream chunk's new tokens
    prompt_logprobs: PromptLogprobs | None = _omitted_while_none()


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


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = _omitted_while_none()


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = _omitted_while_none()
    prompt_logprobs: PromptLogprobs | None = _omitted_while_none()  # the prompt's (vLLM's place for them)


class DeltaFunction(BaseModel):
    name: str | None = _omitted_while_none()
    arguments: str | None = _omitted_while_none()


class DeltaToolCall(BaseModel):
    """A tool call's first delta carries its id, type and name; the next ones fragments of its arguments."""

    index: int
    id: str | None = _omitted_while_none()
    type: Literal["function"] | None = _omitted_while_none()
    function: DeltaFunction


class ChatDelta(BaseModel):
    """What a chunk adds: the first carries the role, the others leave it out (as OpenAI sends them)."""

    role: Literal["assistant"] | None = _omitted_while_none()
    content: str | None = _omitted_while_none()
    reasoning: str | None = _omitted_while_none()  # under both names, as ChatCompletionMessage
    reasoning_content: str | None = _omitted_while_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_while_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = _omitted_while_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # as Completion's
    prompt_token_ids: list[int] | None = _omitted_while_none()  # in the first chunk (the role's), with return_token_ids


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
