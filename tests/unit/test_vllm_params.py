"""vLLM's and OpenAI's request parameters that the REST schema takes at their defaults only, and those it passes on:
reasoning_effort to the chat template, truncate_prompt_tokens to the prompt."""

import pytest
from pydantic import ValidationError

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.chat import chat_request
from deltamesh.services.router.gateway.choices import truncated
from deltamesh.services.router.limits import InvalidParam
from deltamesh.services.router.unsupported_params import CHAT, COMPLETIONS, at_defaults_only

MESSAGES = [{"role": "user", "content": "hi"}]


def refused_param(err: ValidationError) -> str:
    refused = err.errors()[0]["ctx"]["error"]
    assert isinstance(refused, InvalidParam)
    return refused.param


@pytest.mark.parametrize("table", [CHAT, COMPLETIONS])
def test_every_parameter_passes_at_its_default_and_null_and_is_refused_otherwise(table):
    for name, (default, _) in table.items():
        assert at_defaults_only({name: default, "n": 1}, table) == {"n": 1}
        assert at_defaults_only({name: None}, table) == {}
        with pytest.raises(InvalidParam) as e:
            at_defaults_only({name: "something else"}, table)
        assert e.value.param == name and name in str(e.value)


def test_the_tables_differ_where_the_endpoints_do():
    oa.CompletionRequest.model_validate({"prompt": "x", "prompt_embeds": None, "priority": 0})
    with pytest.raises(ValidationError, match="Extra inputs"):  # a chat parameter on completions: unknown there
        oa.CompletionRequest.model_validate({"prompt": "x", "chat_template": None})
    with pytest.raises(ValidationError) as e:
        oa.ChatCompletionRequest.model_validate({"messages": MESSAGES, "function_call": "auto"})
    assert refused_param(e.value) == "function_call" and "tool_choice" in str(e.value)


def test_reasoning_effort_is_a_template_variable_that_chat_template_kwargs_may_override():
    body = oa.ChatCompletionRequest.model_validate({"messages": MESSAGES, "reasoning_effort": "high"})
    assert chat_request(body).template_kwargs == {"reasoning_effort": "high"}
    both = oa.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    )
    assert chat_request(both).template_kwargs == {"reasoning_effort": "low"}
    assert chat_request(oa.ChatCompletionRequest.model_validate({"messages": MESSAGES})).template_kwargs == {}


def test_truncation_keeps_the_prompts_end():
    ids = list(range(10))
    assert truncated(ids, None, 8) == ids
    assert truncated(ids, 3, 8) == [7, 8, 9]
    assert truncated(ids, 30, 8) == ids
    assert truncated(ids, -1, 8) == ids[2:]  # -1: as many as the context holds


def test_request_id_takes_the_grpc_rule_with_room_for_the_prefix():
    assert oa.CompletionRequest.model_validate({"prompt": "x", "request_id": "a.b:c-1"}).request_id == "a.b:c-1"
    for bad in ("", "a b", "é", "x" * (oa.MAX_REST_REQUEST_ID + 1)):
        with pytest.raises(ValidationError) as e:
            oa.CompletionRequest.model_validate({"prompt": "x", "request_id": bad})
        assert refused_param(e.value) == "request_id"


def test_version_of_a_source_tree_that_is_not_installed(monkeypatch):
    """The GPU hosts run the tree without installing it: /version must not stop the router there (it did)."""
    import importlib.metadata

    from deltamesh.services.router.gateway import tokens

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert tokens._package_version().startswith("unknown")
