"""What the router knows of the model without loading it: tokenizer, chat template, vocabulary and context
length. Requests are size-checked, tokenized and checked here, before any worker sees them.

The router's event loop serves every stream, so nothing here that grows with the input runs on it: the size
checks are O(1) per text and come first; tokenising and chat templating run in a small thread pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog

from deltamesh.engine.chat_template import load_chat_template
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.tokenizer import TemplateError, Tokenizer
from deltamesh.protocol.generation_defaults import GenerationConfigSource, sampling_defaults
from deltamesh.protocol.requests import RequestError, validate_request
from deltamesh.protocol.sampling import MAX_LOGPROBS, SamplingParams, check_text
from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.limits import InvalidParam, check_count, check_roles, check_stop

T = TypeVar("T")
log = structlog.get_logger("deltamesh.frontend")
# SamplingParams fields checked one by one, so that an error names its parameter: each with the fields its rule
# reads besides its own (stop strings have a check of their own below)
_CHECKED_ALONE = {
    "max_tokens": (),
    "temperature": (),
    "top_p": (),
    "top_k": (),
    "min_p": (),
    "seed": (),
    "logprobs": (),
    "stop_token_ids": (),
    "repetition_penalty": (),
    "presence_penalty": (),
    "frequency_penalty": (),
    "logit_bias": (),
    "min_tokens": ("max_tokens",),
    "structured_outputs": (),  # its shape; whether it parses is the worker's check
}
# Tokenising is CPU work and the tokenizer's batch encode already spreads one request over the cores; two
# threads let a small request pass a big one without letting many requests crowd out the event loop's core.
TOKENIZER_THREADS = 2


@dataclass
class ChatPrompt:
    ids: list[int]
    # what the template wrote of the reply before the model's first token (the generation prompt, or the final
    # message that continue_final_message leaves open): where the reply starts, for the gateway's parsers
    assistant_prefix: str = ""


class Frontend:
    def __init__(
        self,
        model_dir: str,
        max_model_len: int | None = None,
        limits: RequestLimits | None = None,
        served_model_names: list[str] | None = None,
        chat_template: str | None = None,
        generation_config: GenerationConfigSource = "auto",
        generation_overrides: dict | None = None,
        template_defaults: dict | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        """`chat_template`: the router's --chat-template (a file, or the template), rendering chats instead of the
        checkpoint's template; `generation_config`, `generation_overrides`: where a request's unset sampling parameters
        come from (generation_defaults.py); `template_defaults`: the template variables a chat leaves unset take
        (--default-chat-template-kwargs); `max_logprobs`: the most (prompt) logprobs a request may ask for."""
        path = Path(model_dir)
        self.model_config = ModelConfig.from_dir(path)
        template = load_chat_template(chat_template) if chat_template else None
        self.tokenizer = Tokenizer(path, template) if (path / "tokenizer.json").is_file() else None
        self.checkpoint_name = path.name  # what the workers register as serving
        # the names a request may give (the first is the model's id in the model list); its checkpoint path too, as
        # vLLM takes it (as given and resolved)
        self.served_model_names = list(served_model_names or [path.name])
        self.model_id = self.served_model_names[0]
        self.model_path = model_dir
        self._names = {*self.served_model_names, model_dir, str(path.resolve())}
        self.max_model_len = EngineConfig(max_model_len=max_model_len).resolved_max_model_len(
            self.model_config.max_position_embeddings
        )
        self.limits = limits or RequestLimits()
        self.template_defaults = dict(template_defaults or {})
        self.max_logprobs = max_logprobs
        # what a request leaves unset takes (checked when the router's settings were made: RouterSettings)
        self.sampling_defaults = sampling_defaults(path, generation_config, generation_overrides)
        if self.sampling_defaults:
            log.info("sampling defaults (generation_config.json, overrides)", **self.sampling_defaults)
        # Each token covers at most this many characters, so a longer text cannot fit the context whatever
        # it holds: refuse it without tokenising it.
        self.max_text_chars = self.max_model_len * (self.tokenizer.max_token_chars if self.tokenizer else 1)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def serves(self, model: str | None) -> bool:
        """Whether a request for `model` is for this model (none named: the served one, as vLLM takes it)."""
        return not model or model in self._names

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` in the tokenizer pool: work that grows with the input never blocks the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- cheap checks, on the loop, before any tokenising ------------------------------------------------
    def _check_length(self, chars: int, what: str) -> None:
        if chars > self.max_text_chars:
            raise RequestError(
                f"{what} has {chars} characters, more than can fit this model's context of "
                f"{self.max_model_len} tokens (at most {self.max_text_chars} characters)"
            )

    def check_text(self, text: str, what: str = "the prompt") -> None:
        self._check_length(len(text), what)
        try:
            check_text(text, what)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def check_token_count(self, n: int) -> None:
        """Before a token-id list is copied or scanned."""
        if n > self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's maximum context length is {self.max_model_len} tokens"
            )

    def check_chat(self, chat: ChatRequest) -> None:
        messages = chat.messages
        if not messages:
            raise RequestError("a chat needs at least one message")
        check_count(len(messages), self.limits.max_messages, "chat messages", "messages")
        check_roles([m["role"] for m in messages])
        texts = [t for m in messages for t in (m["content"], m.get("reasoning_content") or "")]
        self._check_length(sum(map(len, texts)), "the chat")
        for text in texts:
            self.check_text(text, "a chat message")
        chat.check()

    def check_sampling(self, params: SamplingParams) -> None:
        """The sampling parameters, each refused under its own name; on the loop (bounded work)."""
        check_stop(params.stop)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise InvalidParam(
                    name, f"{name} {asked} is more than this server's --max-logprobs {self.max_logprobs}"
                )
        for name, also in _CHECKED_ALONE.items():
            try:  # the engine's own rule for the field, on its own
                SamplingParams(**{f: getattr(params, f) for f in (name, *also)}).validate(self.vocab_size)
            except ValueError as e:
                raise InvalidParam(name, str(e)) from None

    # ---- tokenising: call through off_loop ------------------------------------------------------------
    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send token ids")
        return self.tokenizer

    def encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """All of a request's prompts in one batch (the tokenizer releases the GIL while it works)."""
        return self._need_tokenizer().encode_batch(texts, add_special_tokens)

    def encode_chat(self, chat: ChatRequest, with_prefix: bool = False, add_special_tokens: bool = False) -> ChatPrompt:
        """The chat templated and tokenised (its tools' schemas checked first); with its assistant prefix if asked.
        The template writes the special tokens itself, hence vLLM's default add_special_tokens false."""
        tokenizer = self._need_tokenizer()
        messages, tools = chat.prepare()
        options = dict(tools=tools, variables=self.template_defaults | chat.template_kwargs)
        try:
            text = tokenizer.render_chat(
                messages, chat.add_generation_prompt, continue_final_message=chat.continue_final_message, **options
            )
        except TemplateError as e:
            raise RequestError(str(e)) from None
        self.check_text(text, "the templated chat")  # tool-call arguments and names included
        prefix = ""
        if with_prefix and (chat.add_generation_prompt or chat.continue_final_message):
            try:  # the chat up to the reply, rendered alone: the prompt past it is the reply's start
                before = tokenizer.render_chat(
                    messages[:-1] if chat.continue_final_message else messages, False, **options
                )
            except TemplateError:
                before = None
            prefix = text[len(before) :] if before is not None and text.startswith(before) else ""
        return ChatPrompt(tokenizer.encode(text, add_special_tokens=add_special_tokens), prefix)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The prompt against the model (check_sampling has passed): its length with max_tokens, its token ids."""
        validate_request(prompt_ids, params, self.vocab_size, self.max_model_len)
