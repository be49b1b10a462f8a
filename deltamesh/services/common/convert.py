"""Protobuf messages <-> engine objects."""

from __future__ import annotations

import json

from deltamesh.engine import FinishReason, RequestOutput, SamplingParams
from deltamesh.protocol.structured import StructuredOutputs
from deltamesh.v1 import common_pb2

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_from_proto(sp: common_pb2.SamplingParams, stop: common_pb2.StopConditions) -> SamplingParams:
    """Raises ValueError for values that are wrong whatever the model (the engine checks the rest)."""
    params = SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
    )
    if sp.HasField("structured_outputs"):
        params.structured_outputs = structured_from_proto(sp.structured_outputs)
    return params


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
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return StructuredOutputs(**{kind: value}, disable_any_whitespace=so.disable_any_whitespace)


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
    sp = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        sp.seed = p.seed
    if p.logprobs is not None:
        sp.logprobs = p.logprobs
    if p.structured_outputs is not None:
        sp.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return sp, common_pb2.StopConditions(stop=p.stop, stop_token_ids=p.stop_token_ids)


def delta_from_output(out: RequestOutput) -> common_pb2.TokenDelta:
    delta = common_pb2.TokenDelta(
        token_ids=out.new_token_ids,
        text=out.new_text,
        finished=out.finished and out.finish_reason is not None,
        finish_reason=FINISH_TO_PROTO[out.finish_reason],
        usage=common_pb2.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens),
    )
    for lp in out.logprobs:
        delta.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    if isinstance(out.stop_reason, str):
        delta.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        delta.stop_token_id = out.stop_reason
    return delta
