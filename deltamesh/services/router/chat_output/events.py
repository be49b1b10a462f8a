"""What the chat output parsers make of the model's text, piece by piece: reasoning, content, and tool calls (a
header with the call's id and name, then fragments of its JSON arguments, in order). A parser is fed the text as
it arrives and finished when the output ends; the pieces it returns are final (nothing is taken back), so a
stream sends them as they come and a whole answer is their sum."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class Text:
    kind: Literal["reasoning", "content"]
    text: str


@dataclass(frozen=True)
class CallHeader:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next fragment of the call's arguments (a JSON object, once all fragments are joined)


Event = Text | CallHeader | CallArguments


class StreamParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers` (and must wait for more text)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ContentSpacing:
    """Content around tool calls without the blank lines that separate it from them: whitespace before a call,
    right after one, and left at the end once a call was made, is dropped (held back until the next text decides)."""

    def __init__(self):
        self._pending = ""
        self._after_call = False

    def text(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body) :]
        return [Text("content", body)] if body else []

    def call_starts(self) -> None:
        self._pending = ""

    def call_ends(self) -> None:
        self._after_call = True

    def finish(self, any_calls: bool) -> list[Event]:
        pending, self._pending = self._pending, ""
        return [Text("content", pending)] if pending and not any_calls else []
