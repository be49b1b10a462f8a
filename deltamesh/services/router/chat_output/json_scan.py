"""Reading JSON as it arrives: whether a text so far begins with a given shape (`{"name": "f", "arguments": `),
may still become it, or cannot; and where a JSON object or array written piece by piece ends."""

from __future__ import annotations

import json
from dataclasses import dataclass

WS, STRING = object(), object()  # steps of a shape besides literal text
MAX_STRING_CHARS = 1024


@dataclass(frozen=True)
class Matched:
    end: int  # where the shape ends in the text
    strings: list[str]  # the values of its STRING steps


PARTIAL = "partial"  # the text so far may still become the shape


def match_shape(text: str, steps: tuple) -> Matched | str | None:
    """`steps` are literal text, WS (any whitespace, possibly none) and STRING (one JSON string). Matched, PARTIAL,
    or None when the text cannot begin with the shape."""
    pos, strings = 0, []
    for step in steps:
        if step is WS:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            continue
        if pos == len(text):
            return PARTIAL
        if step is STRING:
            end = string_end(text, pos)
            if end is None:
                return PARTIAL if len(text) - pos <= MAX_STRING_CHARS and text[pos] == '"' else None
            try:
                strings.append(json.loads(text[pos:end]))
            except ValueError:
                return None
            pos = end
            continue
        piece = text[pos : pos + len(step)]
        if not step.startswith(piece):
            return None
        if len(piece) < len(step):
            return PARTIAL
        pos += len(step)
    return Matched(pos, strings)


def string_end(text: str, start: int) -> int | None:
    """Just past the JSON string that starts at `start` (a quote), or None if it is not closed yet."""
    if text[start] != '"':
        return None
    escaped = False
    for i in range(start + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


class ValueEnd:
    """Where a JSON object or array, fed piece by piece from its opening bracket, closes."""

    def __init__(self):
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the closing bracket, or None if the value goes on."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None
