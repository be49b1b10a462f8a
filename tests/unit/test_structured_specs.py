"""Structured-output specs as the edges read them, without processes: the torch-free StructuredOutputs' checks, its
protobuf form both ways, REST's response_format / structured_outputs and the SDK's keywords (the same message for
the same ask), and logprobs JSON can carry."""

import pytest
from pydantic import ValidationError

from deltamesh.client import InvalidRequest
from deltamesh.client.client import build_request
from deltamesh.engine import SamplingParams
from deltamesh.protocol.structured import MAX_SPEC_BYTES, StructuredOutputs
from deltamesh.services.common.convert import sampling_from_proto, sampling_to_proto, structured_to_proto
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.limits import InvalidParam

pytestmark = pytest.mark.api
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
SPECS = [
    StructuredOutputs(json=SCHEMA),
    StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"\d{3}-[a-z]+"),
    StructuredOutputs(choice=["yes", "no", 'ünï "q"']),
    StructuredOutputs(grammar='root ::= "a" | "b"'),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_a_spec_survives_the_wire_and_keeps_its_schema_order(spec):
    spec.validate()
    params = SamplingParams(max_tokens=5, structured_outputs=spec)
    back = sampling_from_proto(*sampling_to_proto(params)).structured_outputs
    assert back == spec and back.key == spec.key
    if spec.kind == "json":
        assert list(back.json["properties"]) == ["b", "a"]  # properties come out in the schema's order


@pytest.mark.parametrize(
    "spec,message",
    [
        (StructuredOutputs(), "exactly one of .* \\(given: none\\)"),
        (StructuredOutputs(regex="a", choice=["a"]), "given: regex, choice"),
        (StructuredOutputs(json=[1]), "must be a JSON object"),
        (StructuredOutputs(choice=[]), "non-empty list of strings"),
        (StructuredOutputs(choice=["a", 2]), "non-empty list of strings"),
        (StructuredOutputs(regex="\ud800"), "not valid Unicode"),
        (StructuredOutputs(grammar="x" * (MAX_SPEC_BYTES + 1)), "over the limit"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()


def chat(**fields) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_rest_response_format_and_structured_outputs_make_the_specs():
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    assert chat(response_format=fmt).structured == StructuredOutputs(json=SCHEMA)
    assert chat(response_format={"type": "json_object"}).structured == StructuredOutputs(json_object=True)
    assert chat(response_format={"type": "text"}).structured is None
    assert chat().structured is None
    completion = oa.CompletionRequest(model="m", prompt="p", structured_outputs={"regex": "[a-z]+"})
    assert completion.structured == StructuredOutputs(regex="[a-z]+")
    as_text = chat(structured_outputs={"json": '{"type": "object"}', "disable_any_whitespace": True}).structured
    assert as_text == StructuredOutputs(json={"type": "object"}, disable_any_whitespace=True)
    assert chat(structured_outputs={"choice": ["a", "b"], "disable_fallback": True}).structured.choice == ["a", "b"]


@pytest.mark.parametrize(
    "fields,param,message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", "given: regex, grammar"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, None, None),
    ],
)
def test_rest_refuses_a_bad_ask_naming_the_parameter(fields, param, message):
    try:
        body = chat(**fields)
    except ValidationError:  # the schema's own types (a list where a schema goes)
        assert param is None
        return
    with pytest.raises(InvalidParam, match=message) as e:
        _ = body.structured
    assert e.value.param == param


def test_vllms_removed_guided_names_are_refused_with_their_new_name():
    with pytest.raises(ValidationError, match=r'guided_json .* removed it: use structured_outputs: \{"json": ...\}'):
        chat(guided_json=SCHEMA)
    with pytest.raises(ValidationError, match="guided_decoding_backend .* leave it out"):
        chat(guided_decoding_backend="xgrammar")


def test_the_sdk_sends_what_rest_reads():
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}, SPECS[0]),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, SPECS[1]),
        ({"response_format": {"type": "json_object"}}, SPECS[2]),
        ({"structured_outputs": {"regex": SPECS[3].regex}}, SPECS[3]),
        ({"structured_outputs": {"choice": SPECS[4].choice}}, SPECS[4]),
        ({"structured_outputs": {"grammar": SPECS[5].grammar}}, SPECS[5]),
    ]
    for keywords, spec in cases:
        sent = build_request("hi", **keywords).sampling.structured_outputs
        assert sent == structured_to_proto(spec)
    assert not build_request("hi", response_format={"type": "text"}).sampling.HasField("structured_outputs")
    for bad in (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"structured_outputs": {"jsn": {}}},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    ):
        with pytest.raises(InvalidRequest, match="invalid request"):
            build_request("hi", **bad)


def test_masked_tokens_logprobs_are_floored_as_vllm_reports_them():
    assert oa.TopLogprob(token="x", logprob=float("-inf"), bytes=None).logprob == -9999.0
    logprobs = oa.CompletionLogprobs(
        tokens=["x"], token_logprobs=[-0.5], top_logprobs=[{"x": -0.5, "y": float("-inf")}], text_offset=[0]
    )
    assert logprobs.top_logprobs == [{"x": -0.5, "y": -9999.0}]
    assert "Infinity" not in logprobs.model_dump_json()


def test_the_serving_benchmark_sends_a_schema_that_outlasts_its_output_length():
    from bench.serve import LONG_SCHEMA, OpenAIBackend, SampleRequest, parse_args, validate_args

    args = parse_args(["--json-schema", "long", "--output-len", "64"])
    validate_args(args)
    body = OpenAIBackend(args).payload(SampleRequest([1, 2, 3], 3, 64), args)
    assert body["response_format"]["json_schema"]["schema"] == LONG_SCHEMA
    assert StructuredOutputs(json=LONG_SCHEMA).validate() is None
