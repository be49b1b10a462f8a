"""Qwen3's reasoning format (`--reasoning-parser qwen3`): the model thinks inside <think>...</think>, then answers.
Qwen3.5's template opens the block in the generation prompt (`<think>\\n`), so its output starts inside it and
only closes it; Qwen3's model writes the opening tag itself; with thinking off the prompt holds an empty, closed
block and the whole output is the answer. Which of these applies is read off the prompt's assistant prefix.
The reasoning and the answer come out trimmed, as the template writes them back (`<think>\\nREASONING\\n</think>
\\n\\nANSWER`). A tool call written inside the reasoning is reasoning. Of an output cut short (max_tokens) inside
`<think>` or `</think>`, what it wrote of the tag is neither reasoning nor answer."""

from __future__ import annotations

from typing import Literal

from deltamesh.services.router.chat_output.events import Event, Text, held_prefix

THINK, END_THINK = "<think>", "</think>"

ThinkState = Literal["open", "closed", "none"]


def think_state(assistant_prefix: str) -> ThinkState:
    """Where the prompt leaves the reply: inside a think block the prompt opened, after one it closed, or with
    none (the model may open one itself)."""
    opened, closed = assistant_prefix.rfind(THINK), assistant_prefix.rfind(END_THINK)
    if opened > closed:
        return "open"
    return "closed" if closed >= 0 else "none"


class ReasoningSplitter:
    def __init__(self, state: ThinkState):
        self._mode = {"open": "reasoning", "closed": "answer", "none": "start"}[state]
        self._buf = ""
        self._trim_start = self._mode == "reasoning"  # leading whitespace of the reasoning, then of the answer

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
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when the mode changed and the rest needs another look."""
        if self._trim_start:
            self._buf = self._buf.lstrip()
            if not self._buf and not final:
                return False
            self._trim_start = False
        if self._mode == "start":  # a reply that may begin with <think>
            head = self._buf.lstrip()
            if head.startswith(THINK):
                self._buf, self._mode, self._trim_start = head[len(THINK) :], "reasoning", True
                return True
            if THINK.startswith(head):  # waits for the rest of the tag; at the end, the output cut it off
                if final:
                    self._buf = ""
                return False
            self._mode = "answer"
        if self._mode == "answer":
            if self._buf:
                out.append(Text("content", self._buf))
            self._buf = ""
            return False
        end = self._buf.find(END_THINK)
        if end >= 0:
            self._emit_reasoning(out, self._buf[:end].rstrip())
            self._buf, self._mode, self._trim_start = self._buf[end + len(END_THINK) :], "answer", True
            return True
        # hold back what may start </think> (at the end, a tag the output cut off: dropped), and trailing whitespace
        # (the reasoning is trimmed at its end)
        keep = len(self._buf) - held_prefix(self._buf, (END_THINK,))
        ready = self._buf[:keep].rstrip()
        self._emit_reasoning(out, ready)
        self._buf = "" if final else self._buf[len(ready) :]
        return False

    @staticmethod
    def _emit_reasoning(out: list[Event], text: str) -> None:
        if text:
            out.append(Text("reasoning", text))
