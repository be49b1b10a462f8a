"""The sampling parameters of a request: one dataclass with its defaults and its checks, read by the REST gateway,
the gRPC edge, the protobuf converter and the engine alike (no other place writes a default).

Meanings follow vLLM's where OpenAI is silent: `repetition_penalty` is transformers' (over prompt and output
tokens: a seen token's positive logit divided by it, a negative one multiplied), `presence_penalty` and
`frequency_penalty` are OpenAI's (over the output tokens: minus the penalty once if the token appeared, minus the
penalty times its count), `logit_bias` is added to the logits, `min_tokens` holds back end-of-sequence, stop tokens
and stop strings until that many tokens have been generated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltamesh.protocol.structured import StructuredOutputs

UINT32, UINT64 = 2**32, 2**64  # the wire types' bounds (common.proto)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024  # a generous cap: each one is checked on every generated token
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_BIAS = 100.0  # OpenAI's bound on one bias, either sign
MAX_OPENAI_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: chosen + top k
    # the prompt's tokens' logprobs (each from the model's raw logits given the tokens before it), as `logprobs`;
    # a request that asks computes its whole prompt (no prefix-cache hit: those positions have no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text, included
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None  # the output follows a grammar (engine/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Needs the counts of the tokens seen so far (the engine keeps them on the device for such requests)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Changes the logits before sampling (penalties, logit_bias, min_tokens): requests that do not cost the
        step nothing."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message a user can act on. Integer bounds follow the wire types
        (common.proto: uint32 max_tokens/top_k/stop_token_ids, uint64 seed), so that a value accepted at one
        edge can always be sent on to the workers."""
        _check_int("max_tokens", self.max_tokens, 1, UINT32)
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 2.0:  # OpenAI's range
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, UINT32, "(0 or -1 disables it)")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, UINT64)
        check_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be integers in [0, {vocab_size}) (the vocabulary), got {bad[:8]}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS + 1)
        self._validate_adjustments(vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def _validate_adjustments(self, vocab_size: int) -> None:
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            value = self.repetition_penalty
            raise ValueError(f"repetition_penalty must be a finite number greater than 0 (1 is off), got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        check_logit_bias(self.logit_bias, vocab_size)
        _check_int("min_tokens", self.min_tokens, 0, UINT32)
        if is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")


def check_logit_bias(bias: dict, vocab_size: int) -> None:
    """At most MAX_LOGIT_BIAS entries, each a token id of the vocabulary mapped to a bias in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    bad = [t for t in bias if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}) (the vocabulary), got {bad[:8]}")
    off = [v for v in bias.values() if not _number(v) or not -MAX_BIAS <= v <= MAX_BIAS]
    if off:
        raise ValueError(f"logit_bias values must be in [-100, 100], got {off[:8]}")


def check_stop_strings(stop) -> None:
    """Raise ValueError unless `stop` is a short enough list of non-empty, well-formed strings (also checked by
    the REST gateway before anything is tokenised, so that its error names the parameter)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    for s in stop:
        check_text(s, "a stop string")


def is_int(x) -> bool:
    """An integer proper: JSON's true/false arrive as Python bools, which are ints too."""
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    """A real number (an int or a float; not a bool, not NaN: NaN fails every range check silently)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _check_int(name: str, value, low: int, end: int, note: str = "") -> None:
    if not is_int(value) or not low <= value < end:
        shown = value if is_int(value) and abs(value) < 10**30 else f"{type(value).__name__} {str(value)[:30]}"
        raise ValueError(f"{name} must be an integer in [{low}, {end - 1}]{' ' + note if note else ''}, got {shown}")


def check_text(text: str, what: str) -> None:
    """Text must be encodable as UTF-8: JSON can carry a lone surrogate ("\\ud800"), which neither the
    tokenizer nor protobuf can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate at character {e.start}") from None
