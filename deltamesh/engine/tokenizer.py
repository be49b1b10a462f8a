"""Tokenizer (HF `tokenizers`), the checkpoint's chat template (chat_template.py), and incremental
detokenization with stop strings for streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer

from deltamesh.engine.chat_template import ChatTemplate, TemplateError

if TYPE_CHECKING:
    from deltamesh.protocol.sampling import SamplingParams


__all__ = ["IncrementalDetokenizer", "TemplateError", "Tokenizer"]


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        """`chat_template`: a template that renders chats instead of the checkpoint's (the router's
        --chat-template)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = chat_template or (
            template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        )
        self.special_tokens = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        gen = _read_json(model_dir / "generation_config.json")
        eos = gen.get("eos_token_id", _read_json(model_dir / "config.json").get("eos_token_id"))
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.special_tokens["eos_token"]:
            eos_id = self._tok.token_to_id(self.special_tokens["eos_token"])
            if eos_id is not None:
                ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._template: ChatTemplate | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer itself (its vocabulary: structured outputs, grammar.py)."""
        return self._tok

    @property
    def max_token_chars(self) -> int:
        """The longest token's length in characters, as the vocabulary spells it (a byte-level vocabulary
        spells one character per byte, so no token decodes to more)."""
        return max(len(token) for token in self._tok.get_vocab(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it (e.g. a special token), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        # The batch call releases the GIL while it works (a single `encode` holds it), so a long text
        # tokenised in a thread does not stop the calling process's event loop.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **options) -> str:
        """The chat as the chat template (the checkpoint's, or the one given) writes it; `options` are
        ChatTemplate.render's (continue_final_message, tools, variables)."""
        if not self.chat_template:
            raise TemplateError("this model has no chat template; use the completions API")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template, self.special_tokens)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **options)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **options) -> list[int]:
        # The rendered text already carries the template's special tokens.
        return self.encode(self.render_chat(messages, add_generation_prompt, **options), add_special_tokens=False)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas.

    Decoding a short window (the last few tokens before the unread ones) and emitting only what it adds
    keeps byte-level BPE merges and multi-byte characters right; a delta ending in U+FFFD is held back until
    the character completes. Text that could still become a stop string is held back too, and a stop string
    ends the text before it (or after it: `include_stop`), once more than `min_tokens` tokens have come (vLLM's
    rule: a stop string the first `min_tokens` tokens complete does not count).
    """

    CONTEXT = 5  # tokens of already-read context decoded with each new token

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._include_stop, self._min_tokens, self._added = include_stop, min_tokens, 0
        self._ids = list(prompt_ids[-self.CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (stop-truncated once a stop string is seen)
        self._emitted = 0
        self.stopped_on: str | None = None

    @classmethod
    def for_params(cls, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            params.min_tokens,
        )

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that may be shown now (call `flush` when the request ends)."""
        self._ids.append(token_id)
        self._added += 1
        before = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        after = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = len(self.text)
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._ids = self._ids[self._prefix_offset :]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
            if self._stop and self._added > self._min_tokens:
                self._find_stop(max(0, start - self._hold))
        return self.flush() if self.stopped_on else self._release(len(self.text) - self._hold)

    def flush(self) -> str:
        """All text not returned yet; the request has ended. Tokens held back as an unfinished multi-byte
        character come out as the tokenizer decodes them (U+FFFD), so the whole text equals a decode of the
        output ids (up to a stop string)."""
        if not self.stopped_on and self._read_offset < len(self._ids):
            before = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            self.text += self._tok.decode(self._ids[self._prefix_offset :], self._skip)[len(before) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(len(self.text))

    def _find_stop(self, search_from: int) -> None:
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            index, self.stopped_on = min(hits)
            self.text = self.text[: index + (len(self.stopped_on) if self._include_stop else 0)]

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
