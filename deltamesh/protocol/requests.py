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
    if not _token_ids_in_range(prompt_ids, vocab_size):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")


def _token_ids_in_range(ids, vocab_size: int) -> bool:
    """Every id an integer proper (not a bool) in [0, vocab_size). In C passes (types, then min and max), not a
    Python test per item: the router checks every prompt on its way in (bench/RESULTS.md, "A burst's arrivals")."""
    if set(map(type, ids)) - {int} and not all(map(is_int, ids)):  # int subclasses other than bool pass
        return False
    return min(ids) >= 0 and max(ids) < vocab_size
