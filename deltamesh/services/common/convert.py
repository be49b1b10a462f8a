"""Protobuf messages <-> engine objects."""

from __future__ import annotations

import json
from typing import Any

from deltamesh.engine.request import FinishReason, RequestOutput
from deltamesh.protocol.sampling import SamplingParams
from deltamesh.protocol.structured import StructuredOutputs
from deltamesh.v1 import common_pb2

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


# SamplingParams fields on the wire (common.proto): optional ones take a default when unset, plain ones are sent
# always, their zero value being the default (tests/unit/test_protocol.py checks that it is)
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "repetition_penalty",
)
_PLAIN = ("ignore_eos", "presence_penalty", "frequency_penalty", "min_tokens")


def sampling_from_proto(
    sp: common_pb2.SamplingParams, stop: common_pb2.StopConditions, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """The parameters as sent (the caller validates them); unset fields take `defaults` (the router's: the model's
    recommended sampling, generation_defaults.py), else SamplingParams' own."""
    values = {name: getattr(sp, name) for name in _PLAIN}
    values.update({name: value for name, value in (defaults or {}).items() if not sp.HasField(name)})
    values.update({name: getattr(sp, name) for name in _OPTIONAL if sp.HasField(name)})
    return SamplingParams(
        **values,
        logit_bias=dict(sp.logit_bias),
        stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        include_stop_str_in_output=stop.include_stop_str_in_output,
        structured_outputs=structured_from_proto(sp.structured_outputs) if sp.HasField("structured_outputs") else None,
    )


def structured_from_proto(so: common_pb2.StructuredOutputs) -> StructuredOutputs:
    """Raises ValueError for a message without a kind or a schema that is not JSON (StructuredOutputs.validate
    checks the rest)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs needs one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_schema":
        try:
            schema = json.loads(so.json_schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured_outputs.json_schema is not valid JSON: {e}") from None
        return StructuredOutputs(json=schema, disable_any_whitespace=so.disable_any_whitespace)
    fields: dict[str, Any] = {kind: list(so.choice.choices) if kind == "choice" else getattr(so, kind)}
    return StructuredOutputs(**fields, disable_any_whitespace=so.disable_any_whitespace)


def structured_to_proto(s: StructuredOutputs) -> common_pb2.StructuredOutputs:
    so = common_pb2.StructuredOutputs(disable_any_whitespace=s.disable_any_whitespace)
    if s.kind == "json":
        so.json_schema = json.dumps(s.json, ensure_ascii=False)
    elif s.kind == "choice":
        so.choice.SetInParent()
        so.choice.choices.extend(s.choice)
    else:
        setattr(so, s.kind, s.value)
    return so


def sampling_to_proto(p: SamplingParams) -> tuple[common_pb2.SamplingParams, common_pb2.StopConditions]:
    sp = common_pb2.SamplingParams(**{name: getattr(p, name) for name in _PLAIN}, logit_bias=p.logit_bias)
    for name in _OPTIONAL:
        if (value := getattr(p, name)) is not None:
            setattr(sp, name, max(value, 0) if name == "top_k" else value)  # vLLM's -1 (off) is 0 here
    stop = common_pb2.StopConditions(
        stop=p.stop, stop_token_ids=p.stop_token_ids, include_stop_str_in_output=p.include_stop_str_in_output
    )
    if p.structured_outputs is not None:
        sp.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return sp, stop


def delta_from_output(out: RequestOutput, delta: common_pb2.TokenDelta | None = None) -> common_pb2.TokenDelta:
    """`delta`: an empty message to fill (a token feed's, in its batch: no copy), else a new one."""
    if delta is None:
        delta = common_pb2.TokenDelta()
    delta.token_ids.extend(out.new_token_ids)
    delta.text = out.new_text
    delta.finished = out.finished and out.finish_reason is not None
    delta.finish_reason = FINISH_TO_PROTO[out.finish_reason]
    usage = delta.usage
    usage.SetInParent()  # present even when all zero, as it always was
    usage.prompt_tokens, usage.completion_tokens = out.num_prompt_tokens, out.num_output_tokens
    usage.cached_tokens = out.num_cached_tokens
    for lp in out.logprobs:
        delta.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    for lp in out.prompt_logprobs or ():
        delta.prompt_logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank or 0,
        )
    if isinstance(out.stop_reason, str):
        delta.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        delta.stop_token_id = out.stop_reason
    return delta
