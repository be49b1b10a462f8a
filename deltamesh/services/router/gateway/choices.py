"""A request as choices: one per prompt and per n, each with its request id and sampling parameters, and the
checks that /v1/completions and /v1/chat/completions share.

Cheap checks (model, unsupported fields, counts and sizes) run on the event loop and come first; the work that
grows with the input (tokenising, templating, scanning token ids) runs as one job per request in the frontend's
thread pool, so that no request can stall the other streams."""

from __future__ import annotations

from dataclasses import dataclass

from deltamesh.engine import SamplingParams
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.gateway.errors import ApiError, as_api_error
from deltamesh.services.router.limits import check_count


@dataclass
class Choice:
    """One generation of a request (a prompt x one of n)."""

    index: int
    prompt_index: int  # which prompt of the request (n choices share one)
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def unknown_model(frontend: Frontend, model: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model[:200]!r} does not exist (this server serves {frontend.model_id!r})",
        param="model",
        code="model_not_found",
    )


def check_model_and_sampling(frontend: Frontend, body: oa._Sampling) -> None:
    if body.model != frontend.model_id:
        raise unknown_model(frontend, body.model)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")


def check_sizes(frontend: Frontend, prompt_count: int, body: oa._Sampling) -> None:
    limits = frontend.limits
    check_count(prompt_count, limits.max_prompts, "prompts", "prompt")
    check_count(prompt_count * body.n, limits.max_choices, "choices (prompts x n)", "n")


def check_sampling(frontend: Frontend, body: oa._Sampling, max_tokens: int | None, logprobs: int | None) -> None:
    """The sampling parameters by the rule the gRPC edge applies too (stop strings, stop token ids against the
    vocabulary: what the schema cannot bound), before anything is tokenised; each error names its parameter."""
    with as_api_error(None):
        frontend.check_sampling(_params(body, max_tokens or 1, logprobs, 0))


def _params(body: oa._Sampling, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=None if body.seed is None else (body.seed + choice) % 2**64,  # n choices must differ
        stop=body.stop_list(),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        structured_outputs=body.structured,  # response_format / structured_outputs, one object for all choices
    )


def build_choices(
    frontend: Frontend,
    rid: str,
    prompts: list[list[int]],
    body: oa._Sampling,
    max_tokens: int | None,
    logprobs: int | None,
) -> list[Choice]:
    """Each prompt is checked once (its n choices differ only in their seed). Runs off the loop: checking a
    prompt scans its token ids."""
    choices = []
    for p, prompt_ids in enumerate(prompts):
        mt = max_tokens if max_tokens is not None else frontend.max_model_len - len(prompt_ids)
        for j in range(body.n):
            params = _params(body, max(mt, 1), logprobs, j)
            if j == 0:
                frontend.check(prompt_ids, params)
            index = p * body.n + j
            choices.append(Choice(index, p, f"{rid}-{index}", prompt_ids, params))
    return choices
