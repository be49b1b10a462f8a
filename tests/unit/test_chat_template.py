"""deltamesh-tiny's tokenizer and chat template in Qwen3.5's format, rendered by the engine's ChatTemplate: the
expected strings of each part of the format, and the same text and token ids as transformers' own
apply_chat_template on the same files."""

import pytest
from transformers import AutoTokenizer

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.tokenizer import TemplateError, Tokenizer

pytestmark = pytest.mark.api

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "I need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C"},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_MODEL)


def test_qwen35s_added_tokens_with_their_special_flags(tok):
    ids = {t: tok.token_id(t) for t in ("<|im_start|>", "<think>", "</think>", "<tool_call>", "<|vision_start|>")}
    assert None not in ids.values() and tok.vocab_size == 4126
    text = "<think>a</think><tool_call>b</tool_call><|vision_start|><|im_end|>"
    assert tok.decode(tok.encode(text)) == "<think>a</think><tool_call>b</tool_call>"  # markers of the format stay
    assert len(tok.encode("<tool_response>")) == 1


def test_thinking_is_on_unless_enable_thinking_is_false(tok):
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.render_chat(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = tok.render_chat(chat, variables={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_go_in_the_system_turn_and_calls_and_results_in_qwen35s_form(tok):
    text = tok.render_chat(ROUND_TRIP, tools=[WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n\nYou have access to these functions:\n\n<tools>\n")
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later"' in system
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>" in system
    assert system.endswith("</IMPORTANT>\n\nBe brief.")
    assert rest == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_reasoning_of_turns_before_the_latest_query_is_dropped(tok):
    chat = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello", "reasoning_content": None},
        {"role": "user", "content": "And?"},
    ]
    assert tok.render_chat(chat) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_continue_final_message_leaves_the_reply_open(tok):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]
    text = tok.render_chat(chat, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is")
    with pytest.raises(TemplateError, match="cannot both be true"):
        tok.render_chat(chat, True, continue_final_message=True)
    with pytest.raises(TemplateError, match="content to continue"):
        tok.render_chat([*chat[:1], {"role": "assistant", "content": ""}], False, continue_final_message=True)


def test_the_templates_own_errors(tok):
    with pytest.raises(TemplateError, match="No user query"):
        tok.render_chat([{"role": "system", "content": "x"}])
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        tok.render_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(TemplateError, match="cannot set messages"):
        tok.render_chat([{"role": "user", "content": "x"}], variables={"messages": []})


@pytest.mark.parametrize(
    "chat,options",
    [
        (ROUND_TRIP, dict(tools=[WEATHER])),
        (ROUND_TRIP[1:2], dict(enable_thinking=False)),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " partial "}],
            dict(continue_final_message=True),
        ),
    ],
)
def test_the_same_text_and_ids_as_transformers(tok, chat, options):
    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tools, cont = options.pop("tools", None), options.pop("continue_final_message", False)
    expected = hf.apply_chat_template(
        chat, tools=tools, add_generation_prompt=not cont, continue_final_message=cont, tokenize=False, **options
    )
    ours = dict(tools=tools, continue_final_message=cont, variables=options)
    assert tok.render_chat(chat, not cont, **ours) == expected
    assert tok.encode_chat(chat, not cont, **ours) == hf(expected, add_special_tokens=False)["input_ids"]
