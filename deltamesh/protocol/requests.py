"""A request the engine cannot serve, and the checks of a request that need only the model's shape (vocabulary,
context length): the router runs them before any worker sees the request, the engine again when it takes it."""

from __future__ import annotations

from deltamesh.protocol.sampling import SamplingParams, is_int


class RequestError(ValueError):
    """A request the engine cannot serve as given (bad parameters, too long, ...)."""


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    n = len(prompt_ids)
    if n + params.max_tokens > max_model_len:  # first: it bounds the scan below
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {n} tokens "
            f"and max_tokens is {params.max_tokens} ({n + params.max_tokens} in total)"
        )
    if any(not is_int(t) or not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")
