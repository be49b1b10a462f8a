"""Request and response bodies of the OpenAI-compatible API (the subset deltamesh serves), as pydantic
models: they validate input and make the served OpenAPI schema accurate. A parameter that neither OpenAI's API
nor the extensions below define is refused with 400, as OpenAI refuses unrecognized arguments (a typo must not
silently change nothing); OpenAI parameters that do not change the output here (user, store, metadata, ...) are
accepted, and those we do not support are refused when set to a non-default value. A chat's messages and tools
are in openai_chat_messages.py (messages keep ignoring fields they do not use; a tool's definition takes only
OpenAI's fields)."""

from __future__ import annotations

import json
from contextvars import ContextVar
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from deltamesh.protocol.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams
from deltamesh.protocol.structured import StructuredOutputs
from deltamesh.services.common.logs import MAX_REQUEST_ID_CHARS
from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router import unsupported_params
from deltamesh.services.router.chat_request import MAX_TOOLS
from deltamesh.services.router.limits import InvalidParam, check_count, check_logit_bias_count, check_request_id
from deltamesh.services.router.openai_chat_messages import (  # noqa: F401 (oa.ChatMessage and the rest, as before)
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionDefinition,
    MessageFunctionCall,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
)
from deltamesh.services.router.openai_responses import (  # noqa: F401 (oa.Completion and the rest, as before)
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatDelta,
    ChatFinish,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatToolCall,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunction,
    DeltaToolCall,
    Logprob,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    StopReason,
    ToolCallFunction,
    TopLogprob,
    Usage,
)

# a REST request_id becomes the mesh's "chatcmpl-<id>-<choice>", which must keep to MAX_REQUEST_ID_CHARS
MAX_REST_REQUEST_ID = MAX_REQUEST_ID_CHARS - len("chatcmpl--9999")
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


def check_chat_counts(data):
    """A chat's messages and tools counted in the raw JSON (a schema validator's, for every route that takes a chat)."""
    _check_count(data, "messages", LIMITS.get().max_messages, "chat messages")
    _check_count(data, "tools", MAX_TOOLS, "tools")
    return data


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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk carries its choice's usage so far"
    )


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="A JSON schema (required here)")
    strict: bool | None = Field(None, description="The output always follows the schema, strict or not")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs extension: exactly one of json (a schema, as an object or JSON text), regex,
    choice, grammar (EBNF, xgrammar's dialect), json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # vLLM's options that change nothing here: one backend (no fallback), and xgrammar already refuses properties
    # a schema does not name
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = Field(None, description="Not supported (xgrammar has no whitespace pattern)")
    structural_tag: str | None = Field(None, description="Not supported")


# vLLM's names from before structured_outputs, removed in its 0.12: a client that still sends one is told the new one
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": None,
}


def _structured(body: _Sampling) -> StructuredOutputs | None:
    """What response_format or structured_outputs asks of the output; InvalidParam naming the one that is wrong."""
    fmt, so = body.response_format, body.structured_outputs
    constrained = fmt is not None and fmt.type != "text"
    if constrained and so is not None:
        raise InvalidParam("structured_outputs", "set response_format or structured_outputs, not both")
    if fmt is not None and constrained:
        if fmt.type == "json_object":
            spec = StructuredOutputs(json_object=True)
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidParam("response_format", "response_format json_schema needs json_schema.schema")
        else:
            spec = StructuredOutputs(json=fmt.json_schema.schema_)
        return _checked(spec, "response_format")
    if so is None:
        return None
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) is not None:
            raise InvalidParam("structured_outputs", f"structured_outputs.{name} is not supported")
    schema = so.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise InvalidParam("structured_outputs", f"structured_outputs.json is not valid JSON: {e}") from None
    spec = StructuredOutputs(
        json=schema,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        disable_any_whitespace=so.disable_any_whitespace,
    )
    return _checked(spec, "structured_outputs")


def _checked(spec: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        spec.validate()
    except ValueError as e:
        raise InvalidParam(param, f"{param}: {e}") from None
    return spec


class _Sampling(BaseModel):
    """The sampling parameters both endpoints take. None (or null) is SamplingParams' default
    (deltamesh/protocol/sampling.py), which the gateway fills in; bounds the schema states are the engine's rule,
    whose message a bad value gets (errors.py)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="One of the served model names; omitted: the first (as vLLM)")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # as vLLM, no bound of its own: the router's --max-choices bounds prompts x n (RL rollouts ask for dozens)
    n: StrictInt = Field(1, ge=1, le=UINT32_MAX)
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extension
    truncate_prompt_tokens: StrictInt | None = Field(
        None,
        ge=-1,
        le=UINT32_MAX,
        description="Keep only the prompt's last k tokens (-1: as many as the context holds)",
    )
    add_special_tokens: bool | None = Field(
        None, description="The tokenizer's special tokens around a text prompt (default: true; chat: false)"
    )
    return_token_ids: bool = Field(
        False, description="The prompt's and each choice's token ids in the answer (a stream: each chunk's new ones)"
    )
    prompt_logprobs: StrictInt | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Each prompt token's logprob and rank, and the k most likely there (not with stream; the "
        "prompt is then computed whole, not taken from the prefix cache)",
    )
    request_id: str | None = Field(
        None,
        description=f"The answer's id: cmpl-/chatcmpl- and this (as vLLM's); at most {MAX_REST_REQUEST_ID} characters",
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

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("stream"):  # as vLLM: a stream has no place for them
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("request_id")
    @classmethod
    def _request_id_as_grpc_takes_it(cls, value: str | None) -> str | None:
        """The gRPC edge's rule, with room for the answer's prefix and a choice's index (the mesh's ids)."""
        if value is not None:
            if len(value) > MAX_REST_REQUEST_ID:
                raise InvalidParam(
                    "request_id", f"request_id has {len(value)} characters; at most {MAX_REST_REQUEST_ID}"
                )
            check_request_id(value)
        return value

    _unsupported: ClassVar[dict[str, tuple[Any, str]]] = unsupported_params.BOTH

    @model_validator(mode="before")
    @classmethod
    def _unsupported_at_defaults_only(cls, data):
        return unsupported_params.at_defaults_only(data, cls._unsupported)

    @model_validator(mode="before")
    @classmethod
    def _no_guided_names(cls, data):
        for name in data if isinstance(data, dict) else ():
            if name in _GUIDED:
                new = _GUIDED[name]
                advice = f'use structured_outputs: {{"{new}": ...}}' if new else "leave it out"
                raise InvalidParam(name, f"{name} is vLLM's name from before 0.12, which removed it: {advice}")
        return data

    @cached_property
    def structured(self) -> StructuredOutputs | None:
        """What the output must follow (response_format, structured_outputs), checked once for all choices."""
        return _structured(self)

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
    # token ids first: pydantic's smart union validates a long id list several times faster so, CPU the gateway
    # spends on every request before it reaches a worker (bench/RESULTS.md, "A burst's arrivals")
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str]
    max_tokens: StrictInt | None = Field(
        None,
        ge=0,
        le=UINT32_MAX,
        description=f"default {SamplingParams.max_tokens}; 0 only with echo (the prompt only)",
    )
    logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="The sampled token's logprob and the k most likely (vLLM's limit)"
    )
    echo: bool = Field(
        False, description="The prompt before the completion; with logprobs, the prompt tokens' too (the first null)"
    )
    suffix: str | None = Field(None, description="Not supported")
    best_of: int | None = Field(None, description="Only best_of == n is supported")
    _unsupported = unsupported_params.COMPLETIONS

    @model_validator(mode="before")
    @classmethod
    def _few_enough_prompts(cls, data):
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch, not token ids
            _check_count(data, "prompt", LIMITS.get().max_prompts, "prompts")
        return data


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
    # extensions (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat template variables, e.g. {'enable_thinking': false}"
    )
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opened")
    continue_final_message: bool = Field(
        False, description="Leave the final message open and continue it (with add_generation_prompt false)"
    )
    include_reasoning: bool = Field(True, description="False: leave the reasoning out of the reply")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="A chat template variable, as vLLM passes it (Qwen3.5's template: enable_thinking instead)"
    )
    # OpenAI parameters about the service, not the output: accepted and not used
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = Field(None, description="Accepted; the prefix cache needs no key")
    safety_identifier: str | None = None
    _unsupported = unsupported_params.CHAT

    @model_validator(mode="before")
    @classmethod
    def _few_enough_messages(cls, data):
        return check_chat_counts(data)

    _top_logprobs_need_logprobs = _only_with("top_logprobs", "logprobs")

    def tool_choice_value(self) -> str | dict:
        """none | auto | required | {"name": NAME}, OpenAI's default filled in."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else {"name": self.tool_choice.function.name}
