"""Typed results."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.v1 import common_pb2, router_pb2

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those a worker's prefix cache served (OpenAI's prompt_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Model:
    """A model the router serves (OpenAI's /v1/models entry)."""

    id: str  # the name requests give
    root: str  # the checkpoint it serves
    max_model_len: int | None  # None: the router does not know it
    vocab_size: int | None

    @classmethod
    def from_proto(cls, m: router_pb2.Model) -> Model:
        return cls(m.id, m.root, m.max_model_len or None, m.vocab_size or None)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # prompt logprobs: the token's rank in the vocabulary (1: the likeliest); else 0

    @classmethod
    def from_proto(cls, lp: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], lp.rank)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call of a chat reply: its first carries the call's id and name, each the next fragment of
    its JSON arguments."""

    index: int  # which call of the reply
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ChatDelta:
    """What a stream's new text adds to a chat reply, read as the REST API reads it: reasoning, content, tool calls."""

    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]

    @classmethod
    def from_proto(cls, d: router_pb2.ChatDelta) -> ChatDelta:
        calls = [ToolCallDelta(c.index, c.id or None, c.name or None, c.arguments) for c in d.tool_calls]
        return cls(d.reasoning, d.content, calls)


@dataclass
class ToolCall:
    """A call a chat reply made: `arguments` is a JSON object, as text (OpenAI's tool_calls[].function)."""

    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    """New tokens of a stream and the text they add; for a chat, `chat` too (what the text adds to the reply)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # stop | length | tool_calls | abort | error
    stop_reason: str | int | None
    usage: Usage
    chat: ChatDelta | None = None  # chat prompts only
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt_logprobs: the first delta's

    @classmethod
    def from_proto(
        cls,
        request_id: str,
        d: common_pb2.TokenDelta,
        chat: router_pb2.ChatDelta | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> Delta:
        """`stop_token_ids`: the request's. stop_reason is REST's (vLLM's): the stop string or the stop_token_ids
        entry that ended it; None for the end-of-sequence token, which the wire names too, and the length."""
        kind = d.WhichOneof("stop_reason")
        stop_reason = getattr(d, kind) if kind else None
        if kind == "stop_token_id" and stop_reason not in stop_token_ids:
            stop_reason = None
        return cls(
            request_id=request_id,
            token_ids=list(d.token_ids),
            text=d.text,
            logprobs=[TokenLogprob.from_proto(lp) for lp in d.logprobs],
            finished=d.finished,
            finish_reason=_FINISH.get(d.finish_reason),
            stop_reason=stop_reason,
            usage=Usage(d.usage.prompt_tokens, d.usage.completion_tokens, d.usage.cached_tokens),
            chat=ChatDelta.from_proto(chat) if chat is not None else None,
            prompt_logprobs=[TokenLogprob.from_proto(lp) for lp in d.prompt_logprobs],
        )


@dataclass
class Result:
    """A whole generation. A chat's reply is also read as the REST API reads it (its model family's parsers):
    `reasoning` (REST's reasoning_content), `content` and `tool_calls`; `text` stays the model's text. finish_reason
    is REST's: stop, length, tool_calls (a chat reply that stopped after tool calls), or abort / error."""

    request_id: str
    text: str = ""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage = field(default_factory=Usage)
    # prompt_logprobs: each prompt token's after the first (its logprob given the tokens before it, rank, top k)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.usage = delta.usage
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.chat is not None:
            self._add_chat(delta.chat)

    def _add_chat(self, chat: ChatDelta) -> None:
        self.reasoning += chat.reasoning
        self.content += chat.content
        for piece in chat.tool_calls:
            while len(self.tool_calls) <= piece.index:
                self.tool_calls.append(ToolCall())
            call = self.tool_calls[piece.index]
            call.id, call.name = piece.id or call.id, piece.name or call.name
            call.arguments += piece.arguments
