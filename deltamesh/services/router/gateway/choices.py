"""A request as choices: one per prompt and per n, each with its request id and sampling parameters, and the
checks that /v1/completions and /v1/chat/completions share.

Cheap checks (model, unsupported fields, counts and sizes) run on the event loop and come first; the work that
grows with the input (tokenising, templating, scanning token ids) runs as one job per request in the frontend's
thread pool, so that no request can stall the other streams."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from deltamesh.protocol.sampling import UINT32, SamplingParams
from deltamesh.protocol.structured import StructuredOutputs
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
    echo: str | None = None  # completions' echo: the prompt's text, which the answer starts with
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is generated and left out)


def reply_id(prefix: str, body: oa._Sampling) -> str:
    """The answer's id: the prefix and the client's request_id (as vLLM's), else a random one. Its choices' ids in
    the mesh add their index; one already running there refuses the request (as the gRPC edge's ids do)."""
    return f"{prefix}-{body.request_id or uuid.uuid4().hex}"


def unknown_model(frontend: Frontend, model: str) -> ApiError:
    return ApiError(
        404,
        f"The model {model[:200]!r} does not exist (this server serves {frontend.model_id!r})",
        param="model",
        code="model_not_found",
    )


def check_model(frontend: Frontend, body: oa._Sampling) -> None:
    """The model named is served here; none named is the served one, which the reply then names (as vLLM)."""
    if not frontend.serves(body.model):
        raise unknown_model(frontend, body.model or "")  # (none named is the served one)
    body.model = body.model or frontend.model_id


def check_sizes(frontend: Frontend, prompt_count: int, body: oa._Sampling) -> None:
    limits = frontend.limits
    check_count(prompt_count, limits.max_prompts, "prompts", "prompt")
    check_count(prompt_count * body.n, limits.max_choices, "choices (prompts x n)", "n")


def check_sampling(frontend: Frontend, body: oa._Sampling, max_tokens: int | None, logprobs: int | None) -> None:
    """The sampling parameters by the rule the gRPC edge applies too (stop strings, stop token ids and logit_bias
    against the vocabulary: what the schema cannot bound), before anything is tokenised; each error names its
    parameter. Without max_tokens (a chat's is what the context leaves), min_tokens is checked once it is known."""
    with as_api_error(None):
        frontend.check_sampling(_params(body, max_tokens or UINT32 - 1, logprobs, 0, frontend.sampling_defaults))
    keep = body.truncate_prompt_tokens
    if keep is not None and not (keep == -1 or 0 < keep <= frontend.max_model_len):
        raise ApiError(
            400,
            f"truncate_prompt_tokens must be -1 or 1 to the maximum context length ({frontend.max_model_len}), "
            f"got {keep}",
            param="truncate_prompt_tokens",
        )


def truncated(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: as many as the context holds)."""
    if keep is None:
        return prompt_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


# request fields that are SamplingParams fields of the same name and meaning (None: the dataclass's default)
_SAME = (
    "temperature",
    "top_p",
    "min_p",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "top_k",
)


def _params(
    body: oa._Sampling,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    defaults: dict,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    """`defaults`: the model's recommended sampling (generation_defaults.py), for what the request leaves unset;
    `structured`: the output's structure when the caller sets it (a chat's forced tool calls), else the request's
    response_format / structured_outputs."""
    given = {k: v for k, v in defaults.items() if k != "max_tokens"}
    given |= {name: value for name in _SAME if (value := getattr(body, name)) is not None}
    if body.seed is not None:
        given["seed"] = (body.seed + choice) % 2**64  # n choices must differ
    return SamplingParams(
        **given,
        max_tokens=max_tokens,
        stop=body.stop_list(),
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
        structured_outputs=structured if structured is not None else body.structured,  # one for all choices
    )


def default_max_tokens(frontend: Frontend) -> int:
    """A completion's max_tokens when the request sets none: the model's recommended, else vLLM's 16."""
    return frontend.sampling_defaults.get("max_tokens", SamplingParams.max_tokens)


def _left(frontend: Frontend, prompt_tokens: int) -> int:
    """A chat's max_tokens when the request sets none: what the context leaves, at most the model's recommended."""
    left = frontend.max_model_len - prompt_tokens
    return min(left, frontend.sampling_defaults.get("max_tokens", left))


def build_choices(
    frontend: Frontend,
    rid: str,
    prompts: list[list[int]],
    body: oa._Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
) -> list[Choice]:
    """Each prompt is checked once (its n choices differ only in their seed). Runs off the loop: checking a
    prompt scans its token ids."""
    choices = []
    for p, prompt_ids in enumerate(prompts):
        prompt_ids = truncated(prompt_ids, body.truncate_prompt_tokens, frontend.max_model_len)
        mt = max_tokens if max_tokens is not None else _left(frontend, len(prompt_ids))
        for j in range(body.n):
            params = _params(body, max(mt, 1), logprobs, j, frontend.sampling_defaults, structured)
            if j == 0:
                frontend.check(prompt_ids, params)
            index = p * body.n + j
            choices.append(Choice(index, p, f"{rid}-{index}", prompt_ids, params))
    return choices
