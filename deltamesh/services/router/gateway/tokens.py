"""vLLM's utility routes, outside /v1 as vLLM serves them, for the tooling written against vLLM's server:
POST /tokenize (a prompt, or a chat as /v1/chat/completions templates it), POST /detokenize and GET /version, with
vLLM's request and response shapes. Tokenising, templating and scanning token ids run in the frontend's pool."""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from deltamesh.engine.tokenizer import Tokenizer
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.gateway.choices import unknown_model
from deltamesh.services.router.gateway.dependencies import GatewayDep
from deltamesh.services.router.gateway.errors import ApiError, as_api_error
from deltamesh.services.router.limits import InvalidParam


def _package_version() -> str:
    """The installed package's version; a source tree run without installing it (the GPU hosts) has none."""
    try:
        return importlib.metadata.version("deltamesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (run from a source tree)"


PACKAGE_VERSION = _package_version()

router = APIRouter()


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="One of the served model names; omitted: the first (as vLLM)")
    prompt: str
    add_special_tokens: bool = Field(
        True, description="Add the tokenizer's special tokens (e.g. BOS), as a prompt gets"
    )
    return_token_strs: bool | None = Field(False, description="Also answer each token as the vocabulary spells it")


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="One of the served model names; omitted: the first (as vLLM)")
    messages: list[oa.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opened")
    continue_final_message: bool = Field(
        False, description="Leave the final message open (with add_generation_prompt false)"
    )
    add_special_tokens: bool = Field(
        False, description="The tokenizer's special tokens around the templated chat too (its template writes its own)"
    )
    return_token_strs: bool | None = Field(False, description="Also answer each token as the vocabulary spells it")
    chat_template: str | None = Field(
        None,
        description="Not supported: the server's template (the checkpoint's or --chat-template's) renders the chat",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat template variables, e.g. {'enable_thinking': false}"
    )
    tools: list[oa.ChatTool] | None = None

    @model_validator(mode="before")
    @classmethod
    def _few_enough_messages(cls, data):
        return oa.check_chat_counts(data)

    def chat(self) -> ChatRequest:
        """The chat as /v1/chat/completions builds it from the same fields (tool_choice and parallel_tool_calls
        change what the model may write, not the prompt)."""
        return ChatRequest(
            messages=[m.for_template() for m in self.messages],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template_kwargs=self.chat_template_kwargs or {},
        )


def _form(data: Any) -> str:
    return "chat" if isinstance(data, dict) and "messages" in data else "prompt"


def _without_form(data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A tagged union puts its tag first in each error's location: dropped, so that an error names the parameter
    itself ("prompt", not "prompt.prompt"), as the other routes' errors do."""
    try:
        return handler(data)
    except ValidationError as e:
        errors = [
            InitErrorDetails(type=err["type"], loc=err["loc"][1:], input=err["input"], ctx=err.get("ctx", {}))
            for err in e.errors()
        ]
        raise ValidationError.from_exception_data(e.title, errors) from None


# vLLM's two forms of one body, told apart by `messages` rather than by trying both: an error is then about the
# form the client meant
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_form),
    WrapValidator(_without_form),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="One of the served model names; omitted: the first (as vLLM)")
    tokens: list[oa.TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


@router.post("/tokenize", response_model=TokenizeResponse, summary="Token ids of a prompt or of a templated chat")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> TokenizeResponse:
    frontend = gateway.frontend
    tokenizer = _tokenizer(frontend, body.model)
    if isinstance(body, TokenizeChatRequest):
        if body.chat_template is not None:
            raise ApiError(400, "chat_template is not supported", param="chat_template")
        chat = body.chat()
        with as_api_error("messages"):
            frontend.check_chat(chat)
            ids = (await frontend.off_loop(frontend.encode_chat, chat, False, body.add_special_tokens)).ids
    else:
        with as_api_error("prompt"):
            frontend.check_text(body.prompt)
            ids = (await frontend.off_loop(frontend.encode_texts, [body.prompt], body.add_special_tokens))[0]
    strs = await frontend.off_loop(_spellings, tokenizer, ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=frontend.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, summary="The text of token ids")
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep) -> DetokenizeResponse:
    frontend = gateway.frontend
    tokenizer = _tokenizer(frontend, body.model)
    with as_api_error("tokens"):
        frontend.check_token_count(len(body.tokens))
        text = await frontend.off_loop(_decode, tokenizer, body.tokens, frontend.vocab_size)
    return DetokenizeResponse(prompt=text)


@router.get("/version", response_model=VersionResponse, summary="deltamesh's version")
async def version() -> VersionResponse:
    return VersionResponse(version=PACKAGE_VERSION)


def _tokenizer(frontend: Frontend, model: str | None) -> Tokenizer:
    if not frontend.serves(model):
        raise unknown_model(frontend, model or "")
    if frontend.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return frontend.tokenizer


def _spellings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token as the vocabulary spells it (vLLM's convert_ids_to_tokens: "Ġword" for " word" in a byte-level
    vocabulary), not its decoded text."""
    spell = tokenizer.backend.id_to_token
    return [spell(i) or "" for i in ids]


def _decode(tokenizer: Tokenizer, ids: list[int], vocab_size: int) -> str:
    """Ids by the bound /v1/completions puts on a prompt's; the text with its special tokens, as vLLM decodes."""
    if any(i >= vocab_size for i in ids):
        raise InvalidParam("tokens", f"token ids must be integers in [0, {vocab_size})")
    return tokenizer.decode(ids, skip_special_tokens=False)
