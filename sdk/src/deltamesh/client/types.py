"""Typed results."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.v1 import common_pb2, router_pb2

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
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


@dataclass(frozen=True)
class Delta:
    """New tokens of a stream and the text they add."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    stop_reason: str | int | None
    usage: Usage

    @classmethod
    def from_proto(cls, request_id: str, d: common_pb2.TokenDelta) -> Delta:
        kind = d.WhichOneof("stop_reason")
        return cls(
            request_id=request_id,
            token_ids=list(d.token_ids),
            text=d.text,
            logprobs=[
                TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in d.logprobs
            ],
            finished=d.finished,
            finish_reason=_FINISH.get(d.finish_reason),
            stop_reason=getattr(d, kind) if kind else None,
            usage=Usage(d.usage.prompt_tokens, d.usage.completion_tokens, d.usage.cached_tokens),
        )


@dataclass
class Result:
    """A whole generation."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage = field(default_factory=Usage)

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.usage = delta.usage
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
