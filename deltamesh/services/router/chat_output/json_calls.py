"""Tool calls written as JSON objects `{"name": NAME, "arguments": {...}}`: Qwen3's form (and Hermes'), each inside
`<tool_call>...</tool_call>` (`--tool-call-parser hermes`), and the JSON array of `{"name", "parameters"}` objects
that `tool_choice: "required"` makes the model write (forced.py).

A call's header goes out once its name (one of the request's tools) and the opening brace of its arguments are
written; the arguments then stream as the model writes them, up to the brace that closes them. An object in
another key order is read whole when it closes. Text that turns out not to be a call is content. Of an output cut
short (max_tokens) inside a `<tool_call>` block before its call could be read, or inside the tag itself, nothing is
content (a call cut short once its header is out stays, its arguments as written)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable

from deltamesh.services.router.chat_output.events import (
    CallArguments,
    CallHeader,
    ContentSpacing,
    Event,
    held_prefix,
    new_call_id,
)
from deltamesh.services.router.chat_output.json_scan import PARTIAL, STRING, WS, Matched, ValueEnd, match_shape

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"


class JsonCallObject:
    """One call object, fed from just before its opening brace; `mode` ends "done" (`rest` is the text after the
    object), "rejected" (`raw`, all it was fed, is no call) or "cut" (the output ended before it could be read)."""

    def __init__(self, key: str, tools: dict[str, dict], index: int, new_id: Callable[[], str]):
        self._shape = (WS, "{", WS, '"name"', WS, ":", WS, STRING, WS, ",", WS, json.dumps(key), WS, ":", WS, "{")
        self._key, self._tools, self._index, self._new_id = key, tools, index, new_id
        self.raw, self.rest, self.mode = "", "", "header"  # header | arguments | whole | done | rejected | cut
        self._object, self._arguments = ValueEnd(), ValueEnd()
        self._object_at = self._object_fed = self._arguments_fed = self._sent = 0
        self._arguments_closed = False

    def feed(self, text: str, final: bool) -> list[Event]:
        self.raw += text
        out: list[Event] = []
        if self.mode == "header" and not self._read_header(out, final):
            return out
        object_end = self._feed_object()
        if self.mode == "arguments":
            self._stream_arguments(out)
        if object_end is not None:
            self._close(out, object_end, complete=True)
        elif final:
            self._close(out, len(self.raw), complete=False)
        return out

    def _read_header(self, out: list[Event], final: bool) -> bool:
        """False while the header may still come (or once the text is known to be no call)."""
        shape = match_shape(self.raw, self._shape)
        if shape == PARTIAL and not final:
            return False
        if not self.raw.strip():  # (final) the output ended before the object
            self.mode = "cut"
            return False
        if not self.raw.lstrip().startswith("{"):
            self.mode = "rejected"
            return False
        self._object_at = self._object_fed = self.raw.find("{")
        if isinstance(shape, Matched) and shape.strings[0] in self._tools:
            out.append(CallHeader(self._index, self._new_id(), shape.strings[0]))
            self.mode, self._arguments_fed = "arguments", shape.end - 1
            self._sent = self._arguments_fed
        else:
            self.mode = "whole"  # another key order, perhaps: read whole when it closes
        return True

    def _feed_object(self) -> int | None:
        closed = self._object.feed(self.raw[self._object_fed :])
        end = None if closed is None else self._object_fed + closed
        self._object_fed = len(self.raw)
        return end

    def _stream_arguments(self, out: list[Event]) -> None:
        if self._arguments_closed:
            return
        closed = self._arguments.feed(self.raw[self._arguments_fed :])
        upto = len(self.raw) if closed is None else self._arguments_fed + closed
        self._arguments_fed, self._arguments_closed = len(self.raw), closed is not None
        if upto > self._sent:
            out.append(CallArguments(self._index, self.raw[self._sent : upto]))
            self._sent = upto

    def _close(self, out: list[Event], end: int, complete: bool) -> None:
        self.rest = self.raw[end:]
        if self.mode == "arguments":  # committed: arguments cut short by the end of the output stay as written
            self.mode = "done"
            return
        try:
            call = json.loads(self.raw[self._object_at : end]) if complete else None
        except ValueError:
            call = None
        arguments = call.get(self._key) if isinstance(call, dict) else None
        if isinstance(call, dict) and isinstance(arguments, dict) and call.get("name") in self._tools:
            out.append(CallHeader(self._index, self._new_id(), call["name"]))
            out.append(CallArguments(self._index, json.dumps(arguments, ensure_ascii=False)))
            self.mode = "done"
        else:
            self.mode = "rejected" if complete else "cut"


class JsonCallStream(ABC):
    """What the parsers of JSON call objects share: the text held back, a mode, the calls so far, the content's
    spacing around them; `_run` reads what it can of the held text (all of it when `final`)."""

    def __init__(self, tools: dict[str, dict], new_id: Callable[[], str], mode: str):
        self._tools, self._new_id = tools, new_id
        self._spacing = ContentSpacing()
        self._buf, self._mode, self.calls = "", mode, 0
        self._call: JsonCallObject | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._run(out, text, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._run(out, "", final=True)
        return out + self._spacing.finish(self.calls > 0)

    @abstractmethod
    def _run(self, out: list[Event], text: str, final: bool) -> None:
        """Read what can be read of `self._buf` plus `text` into `out` (all of it when `final`)."""


class HermesToolCalls(JsonCallStream):
    """Content with calls in `<tool_call>` blocks of JSON call objects."""

    def __init__(self, tools: dict[str, dict], new_id: Callable[[], str] = new_call_id):
        super().__init__(tools, new_id, "text")  # text | call | after

    def _run(self, out: list[Event], text: str, final: bool) -> None:
        self._buf += text
        while True:
            if self._mode == "text":
                at = self._buf.find(TOOL_CALL)
                if at < 0:
                    # what may begin <tool_call> waits for more text; at the end, a tag the output cut off
                    ready = len(self._buf) - held_prefix(self._buf, (TOOL_CALL,))
                    out += self._spacing.text(self._buf[:ready])
                    self._buf = self._buf[ready:]
                    if final and self._buf:
                        self._drop_cut_call()
                    return
                out += self._spacing.text(self._buf[:at])
                self._buf, self._mode = self._buf[at + len(TOOL_CALL) :], "call"
                self._call = JsonCallObject("arguments", self._tools, self.calls, self._new_id)
            elif self._mode == "call":
                call = self._call
                assert call is not None, "set with the call mode"
                events = call.feed(self._buf, final)
                self._buf = ""
                if events and isinstance(events[0], CallHeader):
                    self._spacing.call_starts()
                    self.calls += 1
                out += events
                if call.mode == "rejected":
                    out += self._spacing.text(TOOL_CALL)
                    self._buf, self._mode = call.raw, "text"
                elif call.mode == "cut":
                    self._drop_cut_call()
                    return
                elif call.mode == "done":
                    self._spacing.call_ends()
                    self._buf, self._mode = call.rest, "after"
                else:
                    return
            else:  # after a call object: its </tool_call> (a missing one is tolerated; one cut off, dropped)
                head = self._buf.lstrip()
                if END_TOOL_CALL.startswith(head):
                    self._buf = "" if final else head
                    return
                self._buf, self._mode = head.removeprefix(END_TOOL_CALL), "text"

    def _drop_cut_call(self) -> None:
        """The output ended inside a call's block before the call could be read: that text, and the space before
        it, is dropped."""
        self._spacing.call_starts()
        self._buf, self._mode = "", "text"
