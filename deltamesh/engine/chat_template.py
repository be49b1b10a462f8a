"""A chat template (jinja2: the checkpoint's, or the router's --chat-template), rendered as Hugging Face
transformers renders it: the same sandboxed environment and helpers (`raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML, loop controls), so that a template written for transformers gives the same text here, and
the same meaning of `add_generation_prompt`, `continue_final_message`, `tools` and extra template variables
(`enable_thinking`...)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a request says through its own fields; template variables (chat_template_kwargs) must not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


class TemplateError(ValueError):
    """The chat template rejected the messages (or the request's options)."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes <, > and & for HTML; chat templates expect plain JSON (transformers' filter)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], loader=jinja2.BaseLoader()
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_chat_template(value: str) -> str:
    """The template a --chat-template value gives, read as vLLM reads it: the file at that path, else the value
    itself, its backslash escapes (\\n) read as the characters they stand for so that a template fits on a command
    line. Compiled here, so that a template that does not parse stops the server at start, not at its first chat."""
    try:
        text = Path(value).read_text()
    except OSError as e:
        if not any(c in value for c in "{}\n"):  # nothing of a template: a file that is not there
            raise ValueError(f"cannot read the chat template file: {e.strerror}") from None
        try:  # non-Latin-1 characters kept as they are, through their own escapes
            text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as e:
            raise ValueError(f"the chat template has a broken escape: {e.reason}") from None
    try:
        _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
    return text


def _final_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: the last text part is what continues
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        content = texts[-1] if texts else ""
    return content if isinstance(content, str) else ""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        self.source = source
        self._special_tokens = special_tokens
        self._template = _environment().from_string(source)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> str:
        """The prompt text. `continue_final_message` leaves the final message open, so that generation continues
        its content (the template's end-of-turn after it is cut off, as transformers does it); it cannot be
        combined with `add_generation_prompt`. `variables` are extra template variables (chat_template_kwargs)."""
        if add_generation_prompt and continue_final_message:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be true")
        reserved = RESERVED_VARIABLES.intersection(variables or {})
        if reserved:
            raise TemplateError(
                f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}: the request's own fields set them"
            )
        try:
            text = self._template.render(
                {
                    **self._special_tokens,
                    **(variables or {}),
                    "messages": messages,
                    "tools": tools or None,
                    "add_generation_prompt": add_generation_prompt,
                },
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        return self._left_open(text, messages[-1]) if continue_final_message else text

    @staticmethod
    def _left_open(text: str, final: dict) -> str:
        """`text` cut right after the final message's content (its last occurrence; a template may trim it)."""
        content = _final_text(final)
        if not content.strip():
            raise TemplateError("continue_final_message needs a final message with content to continue")
        at = text.rfind(content.strip())
        if at < 0:
            raise TemplateError("continue_final_message: the chat template does not write the final message's content")
        if text.startswith(content.lstrip(), at):  # the template kept its trailing whitespace
            return text[: at + len(content.lstrip())]
        return text[: at + len(content.strip())]
