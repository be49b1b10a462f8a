"""Qwen3.5's (and Qwen3-Coder's) XML-style tool calls, `--tool-call-parser qwen3_coder`:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

A call is recognised once `<tool_call>` and `<function=NAME>` name one of the request's tools; until then (and
whenever the text turns out otherwise) the text is content. The header (id, name) goes out at once; each parameter
goes out as a fragment of the JSON arguments when its value ends, read as the type its schema gives it
(arguments.py), so the fragments join to `json.dumps` of the parameters. A value ends at a `</parameter>` that is
followed by the next parameter, `</function>` or `</tool_call>` (a `</parameter>` inside a value, in code say, is
text), or at the end of the output. Past the header the call is committed: stray text inside it is skipped, a
missing closing tag is tolerated, and a call the output leaves open is closed with what it has.

An output cut short (max_tokens) may end inside the markup. What it cut off is no content and no value: a
`<tool_call>` or a header cut before it names a tool is dropped (with the blank lines before it, as before a call),
so is a closing tag cut short after a value or a call, and a value loses the start of its closing tags. A header
already out cannot be taken back, so a call cut short past it stays, closed with what it has, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Callable

from deltamesh.services.router.chat_output.arguments import convert
from deltamesh.services.router.chat_output.events import (
    CallArguments,
    CallHeader,
    ContentSpacing,
    Event,
    held_prefix,
    new_call_id,
)

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
BODY_MARKERS = (PARAMETER, END_FUNCTION, END_TOOL_CALL)
# what must follow each closing tag (after whitespace) for it to close the value rather than be part of it
_CLOSES_VALUE_BEFORE = {END_PARAMETER: BODY_MARKERS, END_FUNCTION: (END_TOOL_CALL,), END_TOOL_CALL: (TOOL_CALL,)}
_VALUE_CLOSERS = tuple(_CLOSES_VALUE_BEFORE)
MAX_NAME_CHARS = 256


class XmlToolCalls:
    def __init__(self, tools: dict[str, dict], new_id: Callable[[], str] = new_call_id):
        self._tools = tools  # name -> the function's parameters schema
        self._new_id = new_id
        self._spacing = ContentSpacing()
        self._mode = "text"  # text | header | body | value | after
        self._buf = ""
        self.calls = 0
        self._properties: dict = {}
        self._first_argument = True
        self._parameter = ""
        self._value_started = False
        self._search_from = 0  # where the search for the value's end resumes

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._mode in ("body", "value"):
            self._close(out)
        return out + self._spacing.finish(self.calls > 0)

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when the mode changed and the rest needs another look."""
        return {
            "text": self._text,
            "header": self._header,
            "body": self._body,
            "value": self._value,
            "after": self._after,
        }[self._mode](out, final)

    def _text(self, out: list[Event], final: bool) -> bool:
        at = self._buf.find(TOOL_CALL)
        if at < 0:
            # what may begin <tool_call> waits for more text; at the end it is a call the output cut off in its tag
            ready = len(self._buf) - held_prefix(self._buf, (TOOL_CALL,))
            out += self._spacing.text(self._buf[:ready])
            self._buf = self._buf[ready:]
            if final and self._buf:
                self._drop_cut_call()
            return False
        out += self._spacing.text(self._buf[:at])
        self._buf, self._mode = self._buf[at + len(TOOL_CALL) :], "header"
        return True

    def _header(self, out: list[Event], final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(FUNCTION):
            close = head.find(">", len(FUNCTION))
            name = head[len(FUNCTION) : close if close >= 0 else None]
            if close >= 0 and name in self._tools:
                self._start(out, name)
                self._buf = head[close + 1 :]
                return True
            cut = close < 0 and len(name) <= MAX_NAME_CHARS and any(t.startswith(name) for t in self._tools)
        else:
            cut = FUNCTION.startswith(head)
        if cut:  # may still name one of the tools: waits for more text, or at the end was cut off
            if final:
                self._drop_cut_call()
            return False
        out += self._spacing.text(TOOL_CALL)  # not a call of one of the tools: the tag is text
        self._mode = "text"
        return True

    def _drop_cut_call(self) -> None:
        """The output ended inside the markup that opens a call: that markup, and the space before it, is dropped."""
        self._spacing.call_starts()
        self._buf, self._mode = "", "text"

    def _start(self, out: list[Event], name: str) -> None:
        self._spacing.call_starts()
        out.append(CallHeader(self.calls, self._new_id(), name))
        self.calls += 1
        schema = self._tools[name]
        properties = schema.get("properties") if isinstance(schema, dict) else None
        self._properties = properties if isinstance(properties, dict) else {}
        self._first_argument, self._mode = True, "body"

    def _body(self, out: list[Event], final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(PARAMETER):
            close = head.find(">", len(PARAMETER))
            if close < 0:
                if not final and len(head) - len(PARAMETER) <= MAX_NAME_CHARS and "\n" not in head:
                    self._buf = head
                    return False
                self._buf = head[len(PARAMETER) :]  # not a parameter tag after all: skipped as stray text
                return True
            self._parameter, self._buf = head[len(PARAMETER) : close], head[close + 1 :]
            self._mode, self._value_started, self._search_from = "value", False, 0
            return True
        if head.startswith(END_FUNCTION):
            self._close(out)
            self._buf, self._mode = head[len(END_FUNCTION) :], "after"
            return True
        if head.startswith(END_TOOL_CALL):  # </function> missing
            self._close(out)
            self._buf, self._mode = head[len(END_TOOL_CALL) :], "text"
            return True
        if not final and any(marker.startswith(head) for marker in BODY_MARKERS):
            self._buf = head
            return False
        found = [i for i in (head.find(marker) for marker in BODY_MARKERS) if i >= 0]
        if found:  # stray text between parameters is skipped
            self._buf = head[min(found) :]
            return True
        self._buf = "" if final else head[len(head) - held_prefix(head, BODY_MARKERS) :]
        return False

    def _value(self, out: list[Event], final: bool) -> bool:
        if not self._value_started:  # the newline after <parameter=NAME> is the tag's, not the value's
            if not self._buf and not final:
                return False
            self._buf = self._buf.removeprefix("\n")
            self._value_started = True
        end = self._value_end(final)
        if end is None:
            return False
        value, rest = self._buf[: end[0]], self._buf[end[1] :]
        self._argument(out, self._parameter, value.removesuffix("\n"))
        self._buf, self._mode = rest, "body"
        return True

    def _value_end(self, final: bool) -> tuple[int, int] | None:
        """(end of the value, start of what follows it), or None until more text decides."""
        buf, pos = self._buf, self._search_from
        while True:
            hits = [(i, tag) for tag in _CLOSES_VALUE_BEFORE if (i := buf.find(tag, pos)) >= 0]
            if not hits:
                if final:  # the value ends with the output, less what starts a closing tag the output cut off
                    return len(buf) - held_prefix(buf, _VALUE_CLOSERS), len(buf)
                self._search_from = max(pos, len(buf) - len(END_PARAMETER))
                return None
            at, tag = min(hits)
            after = buf[at + len(tag) :].lstrip()
            follows = _CLOSES_VALUE_BEFORE[tag]
            if after.startswith(follows) or (final and any(f.startswith(after) for f in follows)):
                # (at the end, a tag the output cut off may follow.) </parameter> is consumed; a </function> or
                # </tool_call> standing for a missing one is left to the body
                return at, at + len(tag) if tag == END_PARAMETER else at
            if any(f.startswith(after) for f in follows):
                self._search_from = at
                return None
            pos = at + 1  # a closing tag inside the value: text

    def _argument(self, out: list[Event], name: str, value: str) -> None:
        converted = convert(value, self._properties.get(name))
        opening = "{" if self._first_argument else ", "
        out.append(
            CallArguments(
                self.calls - 1,
                f"{opening}{json.dumps(name, ensure_ascii=False)}: {json.dumps(converted, ensure_ascii=False)}",
            )
        )
        self._first_argument = False

    def _close(self, out: list[Event]) -> None:
        out.append(CallArguments(self.calls - 1, "{}" if self._first_argument else "}"))
        self._spacing.call_ends()
        self._mode = "text"

    def _after(self, out: list[Event], final: bool) -> bool:
        head = self._buf.lstrip()
        if END_TOOL_CALL.startswith(head):  # waits for the rest of </tool_call>; at the end, the output cut it off
            self._buf = "" if final else head
            return False
        self._buf, self._mode = head.removeprefix(END_TOOL_CALL), "text"  # a missing </tool_call> is tolerated
        return True
