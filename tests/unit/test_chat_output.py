"""The gateway's chat output parsers on hand-written model outputs: Qwen3.5's XML-style tool calls, Qwen3's JSON
ones, <think> reasoning, the forced forms of tool_choice required / named. Whatever the chunking of the text (a
stream's deltas), the parsed reply equals the one parsed from the whole text; malformed text stays content."""

import itertools
import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamesh.services.router.chat_output import OutputFormat, chat_output, named_schema, required_schema

pytestmark = pytest.mark.api

QWEN35 = OutputFormat("qwen3", "qwen3_coder")
QWEN3 = OutputFormat("qwen3", "hermes")
THINKING = "<|im_start|>assistant\n<think>\n"  # Qwen3.5's generation prompt, thinking on
NOT_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_PROMPT = "<|im_start|>assistant\n"  # Qwen3's: the model opens <think> itself
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "options": {"type": "object"},
        "hours": {"type": "array"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "limit": {"type": ["integer", "null"]},
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": {}}


def parse(chunks, fmt=QWEN35, prefix=THINKING, tools=TOOLS, **kw):
    """(reasoning, content, [(name, arguments)], the deltas) of a reply fed in `chunks`."""
    ids = itertools.count()
    out = chat_output(fmt, prefix, tools, new_id=lambda: f"call_{next(ids)}", **kw)
    deltas = [out.feed(c) for c in chunks] + [out.finish()]
    return out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls], deltas


def chunkings(text: str):
    for size in (1, 2, 3, 5, 7):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 8))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def parsed(text: str, **kw):
    """The reply parsed whole, after checking that every chunking parses to the same."""
    whole = parse([text], **kw)[:3]
    for chunks in chunkings(text):
        assert parse(chunks, **kw)[:3] == whole, chunks
    return whole


def call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen35_reasoning_content_and_calls_with_arguments_typed_by_the_schema():
    text = (
        "The user wants weather; I could write <tool_call> here and it stays reasoning.\n</think>\n\n"
        "Let me look.\n\n"
        + call(
            "get_weather",
            city="Paris",
            days="3",
            scale="1.5",
            metric="True",
            options='{"units": ["C"]}',
            hours="[1, 2]",
            note="None",
            limit="null",
            extra="42",
        )
        + "\n"
        + call("get_time")
    )
    reasoning, content, calls = parsed(text)
    assert reasoning == "The user wants weather; I could write <tool_call> here and it stays reasoning."
    assert content == "Let me look."
    assert calls[1] == ("get_time", "{}")
    assert calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {
        "city": "Paris",
        "days": 3,
        "scale": 1.5,
        "metric": True,
        "options": {"units": ["C"]},
        "hours": [1, 2],
        "note": None,
        "limit": None,
        "extra": "42",  # a parameter the schema does not declare stays text
    }


def test_values_keep_their_lines_and_a_closing_tag_they_contain():
    code = "def f():\n    return '</parameter>'\n</parameter> is text here"
    _, content, calls = parsed(call("get_weather", city=code, days="x3"), prefix=NOT_THINKING)
    assert content == "" and json.loads(calls[0][1]) == {"city": code, "days": "x3"}  # not an integer: text


def test_streamed_calls_send_the_header_first_then_argument_fragments():
    text = "</think>\n\n" + call("get_weather", city="Paris", days="3") + call("get_time")
    *_, deltas = parse([text[i : i + 4] for i in range(0, len(text), 4)])
    calls = [c for d in deltas for c in d.calls]
    assert [(c.index, c.id, c.name) for c in calls if c.id] == [(0, "call_0", "get_weather"), (1, "call_1", "get_time")]
    first = [c for c in calls if c.index == 0]
    assert first[0].arguments == "" and all(c.id is None and c.name is None for c in first[1:])
    assert first[1].arguments == '{"city": "Paris"' and len(first) >= 3  # each value as it ends
    assert "".join(c.arguments for c in first) == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call> is a tag I like",
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",  # no such tool
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",  # no <tool_call>
        "<tool_call>\n<function=get_weather oops\n",
        "a < b and <tool_call nope",
    ],
)
def test_text_that_is_not_a_call_of_the_tools_stays_content(text):
    reasoning, content, calls = parsed(text, prefix=NOT_THINKING)
    assert (reasoning, content, calls) == ("", text, [])


def test_a_call_cut_short_or_missing_closing_tags_is_closed_with_what_it_has():
    _, _, calls = parsed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", prefix=NOT_THINKING)
    assert calls == [("get_weather", '{"city": "Par"}')]
    missing = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>\nDone."
    _, content, calls = parsed(missing, prefix=NOT_THINKING)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == "Done."
    stray = "<tool_call>\n<function=get_weather>\nhmm\n<parameter=days>\n2\n</parameter>\n</tool_call>"
    assert parsed(stray, prefix=NOT_THINKING)[2] == [("get_weather", '{"days": 2}')]


def test_reasoning_starts_where_the_prompt_leaves_the_reply():
    assert parsed("Still thinking about it", prefix=THINKING) == ("Still thinking about it", "", [])
    assert parsed("\n\nAnswer. <think>x</think>", prefix=NOT_THINKING) == ("", "\n\nAnswer. <think>x</think>", [])
    assert parsed("<think>\nhmm\n</think>\n\nAnswer.", prefix=QWEN3_PROMPT, fmt=QWEN3) == ("hmm", "Answer.", [])
    assert parsed("Answer without thinking.", prefix=QWEN3_PROMPT, fmt=QWEN3) == ("", "Answer without thinking.", [])
    no_parser = OutputFormat("none", "qwen3_coder")
    assert parsed("a</think>b", fmt=no_parser) == ("", "a</think>b", [])


def test_qwen3_json_calls():
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
    )
    _, content, calls = parsed(text, fmt=QWEN3, prefix=NOT_THINKING)
    assert content == "Checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    for bad in ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<tool_call>\n{oops}\n</tool_call>"):
        assert parsed(bad, fmt=QWEN3, prefix=NOT_THINKING) == ("", bad, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = call("get_time") + call("get_weather", city="Rome")
    assert parsed(text, prefix=NOT_THINKING, parallel_tool_calls=False)[2] == [("get_time", "{}")]


def test_tool_choice_none_and_no_tools_leave_calls_in_the_content():
    text = call("get_time")
    assert parsed(text, prefix=NOT_THINKING, tool_choice="none")[1:] == (text, [])
    assert parsed(text, prefix=NOT_THINKING, tools={})[1:] == (text, [])


def test_a_reply_continuing_a_call_the_prompt_left_open_completes_it():
    prefix = NOT_THINKING + "<tool_call>\n<function=get_weather>\n<parameter=city>"
    _, content, calls = parsed("\nOslo\n</parameter>\n</function>\n</tool_call>", prefix=prefix)
    assert content == "" and calls == [("get_weather", '{"city": "Oslo"}')]


def test_required_and_named_tool_choice_outputs():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"parameters": {}, "name": "get_time"}]'
    _, content, calls = parsed(text, prefix=NOT_THINKING, tool_choice="required")
    assert content == "" and calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert parsed('[{"name": "get_weather", "param', tool_choice="required", prefix=NOT_THINKING)[2] == []
    named = parsed(' {"city": "Oslo"}', tool_choice={"name": "get_weather"}, prefix=NOT_THINKING)
    assert named == ("", "", [("get_weather", '{"city": "Oslo"}')])


def test_the_required_schema_takes_only_calls_of_the_tools():
    tools = {"get_weather": {**WEATHER, "$defs": {"unit": {"type": "string"}}}, "get_time": {}}
    schema = required_schema(tools, parallel=False)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": 3}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["$defs"] == {"unit": {"type": "string"}} and "maxItems" not in required_schema(tools, True)
    assert named_schema(None) == {"type": "object", "properties": {}}


PIECES = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=x>", "<parameter=city>", "</parameter>"]
PIECES += ["</function>", "<think>", "</think>", "\n", " ", "Paris", "{", "}", '"', "[", "]", ",", "<", ">", "/"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=30),
    st.sampled_from([QWEN35, QWEN3]),
    st.sampled_from([THINKING, NOT_THINKING, QWEN3_PROMPT]),
    st.sampled_from(["auto", "required"]),
    st.integers(1, 6),
)
def test_any_text_parses_the_same_in_any_chunking_and_arguments_are_json(pieces, fmt, prefix, choice, size):
    text = "".join(pieces)
    kw = dict(fmt=fmt, prefix=prefix, tool_choice=choice)
    whole = parse([text], **kw)
    assert parse([text[i : i + size] for i in range(0, len(text), size)], **kw)[:3] == whole[:3]
    for _, arguments in whole[2]:
        if fmt is QWEN35 and choice == "auto":  # Qwen3.5's form is rebuilt as JSON; the JSON forms are the model's
            assert isinstance(json.loads(arguments), dict)


MARKUP = (
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<think>",
    "</think>",
)


def leaks_markup(text: str) -> bool:
    """Whether `text` holds a markup tag, whole or cut off (a '<' followed by a prefix of a tag, to the end)."""
    return any(tag.startswith(text[i : i + len(tag)]) for i in range(len(text)) if text[i] == "<" for tag in MARKUP)


def streamed(text: str, **kw):
    """(reasoning, content, [(name, arguments)]) joined from the deltas of `take`, one character at a time."""
    ids = itertools.count()
    out = chat_output(kw.pop("fmt", QWEN35), kw.pop("prefix", THINKING), TOOLS, new_id=lambda: f"call_{next(ids)}")
    pieces = list(text) or [""]
    deltas = [out.take(piece, last=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    calls: dict[int, list[str]] = {}
    for call_delta in (c for d in deltas for c in d.calls):
        entry = calls.setdefault(call_delta.index, ["", ""])
        entry[0] += call_delta.name or ""
        entry[1] += call_delta.arguments
    reasoning, content = "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)
    return reasoning, content, [tuple(entry) for _, entry in sorted(calls.items())]


def assert_cut_replies_leak_no_markup(text: str, reasoning: str, content: str, calls: list, **kw):
    """Each prefix of `text` (a reply cut by max_tokens) parses, whole and streamed alike, to a prefix of the full
    reply's `reasoning`, `content` and `calls` ((name, {parameter: value as written}, arguments)), without markup;
    the whole text parses to them."""
    for cut in range(len(text) + 1):
        whole = parse([text[:cut]], **kw)[:3]
        assert streamed(text[:cut], **kw) == whole, cut
        got_reasoning, got_content, got_calls = whole
        assert reasoning.startswith(got_reasoning) and content.startswith(got_content), (cut, whole)
        assert not leaks_markup(got_reasoning) and not leaks_markup(got_content), (cut, whole)
        assert len(got_calls) <= len(calls), (cut, whole)
        for (name, got_arguments), (full_name, full_values, _) in zip(got_calls, calls):
            assert name == full_name and not leaks_markup(got_arguments), (cut, whole)
            values = json.loads(got_arguments)
            assert all(full_values[k].startswith(str(v)) for k, v in values.items()), (cut, whole)
    assert parse([text], **kw)[:3] == (reasoning, content.rstrip(), [(name, a) for name, _, a in calls])


def test_a_reply_cut_anywhere_in_its_xml_calls_leaks_no_markup():
    reasoning, content = "I should check.", "Let me check.\n\n"
    text = (
        f"{reasoning}\n</think>\n\n{content}"
        + call("get_weather", city="Paris", days="3")
        + "\n"
        + call("get_time", zone="UTC")
    )
    calls = [
        ("get_weather", {"city": "Paris", "days": "3"}, '{"city": "Paris", "days": 3}'),
        ("get_time", {"zone": "UTC"}, '{"zone": "UTC"}'),  # a tool without a schema: its values stay text
    ]
    assert_cut_replies_leak_no_markup(text, reasoning, content, calls)


def test_a_reply_cut_anywhere_in_its_json_calls_leaks_no_markup():
    content = "Let me check.\n\n"
    text = (
        f"<think>\nI should check.\n</think>\n\n{content}"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    for cut in range(len(text) + 1):
        whole = parse([text[:cut]], fmt=QWEN3, prefix=QWEN3_PROMPT)[:3]
        assert streamed(text[:cut], fmt=QWEN3, prefix=QWEN3_PROMPT) == whole, cut
        assert "I should check.".startswith(whole[0]) and content.startswith(whole[1]), (cut, whole)
        assert not any(leaks_markup(s) for s in (whole[0], whole[1], *(a for _, a in whole[2]))), (cut, whole)


PARIS = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Look: <tool_c", "Look:", []),  # cut inside the tag that opens a call
        ("Look:\n<tool_call>\n<function=get_wea", "Look:", []),  # before the call's header is whole
        (call("get_time") + "\n<tool_call>", "", [("get_time", "{}")]),  # right after the next call's first tag
        (call("get_time")[:-3], "", [("get_time", "{}")]),  # inside its closing </tool_call>
        (PARIS + "\n</paramet", "", [("get_weather", '{"city": "Paris"}')]),  # inside the value's closing tag
        (PARIS + "\n</parameter>\n</funct", "", [("get_weather", '{"city": "Paris"}')]),  # inside the next one
        (PARIS + "\n</function>\n</tool", "", [("get_weather", '{"city": "Paris"}')]),  # </parameter> missing
    ],
)
def test_markup_the_output_cuts_off_is_neither_content_nor_value(text, content, calls):
    assert parsed(text, prefix=NOT_THINKING) == ("", content, calls)


def test_reasoning_cut_inside_its_tags_leaks_no_markup():
    assert parsed("I should check.\n</thi", prefix=THINKING) == ("I should check.", "", [])
    assert parsed("<thi", prefix=QWEN3_PROMPT, fmt=QWEN3) == ("", "", [])
    assert parsed("<think>\nhmm\n</", prefix=QWEN3_PROMPT, fmt=QWEN3) == ("hmm", "", [])
