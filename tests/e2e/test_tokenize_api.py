"""vLLM's utility routes on the REST gateway (POST /tokenize, POST /detokenize, GET /version): the ids a real mesh
counts as a request's prompt, in vLLM's shapes; bad input refused in OpenAI's error shape; and, in process, the API
key and the request limits, which cover these routes as they cover /v1."""

import json
import tomllib
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from harness import start_mesh

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.tokenizer import Tokenizer
from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.gateway import Gateway, create_app
from deltamesh.services.router.limits import MAX_REQUEST_BYTES

pytestmark = [pytest.mark.e2e, pytest.mark.api]
MODEL_ID = DEFAULT_MODEL.name
VOCAB = ModelConfig.from_dir(DEFAULT_MODEL).vocab_size
TEXT = "Tokens of a wörld, 你好 🙂"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tuple?"}]
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The default model with a tokenizer that puts a BOS token before a text, as many checkpoints' do (the default
    model's adds nothing, so add_special_tokens would change nothing)."""
    model = tmp_path_factory.mktemp("bos") / DEFAULT_MODEL.name
    model.mkdir()
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "tokenizer.json":
            (model / f.name).symlink_to(f)
    spec = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == BOS)
    bos, text = {"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, text],
        "pair": [bos, text, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return model


@pytest.fixture(scope="module")
def mesh(model, tmp_path_factory):
    m = start_mesh(str(model), tmp_path_factory.mktemp("tokenize"), http=True)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def tokenizer(model):
    return Tokenizer(model)


def post(base_url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=30)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int, param: str | None) -> dict:
    """An error in OpenAI's shape, naming `param`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    return error


def test_tokenize_then_detokenize_gives_the_text_back(base_url, client, tokenizer):
    answer = ok(post(base_url, "/tokenize", {"model": MODEL_ID, "prompt": TEXT}))
    assert answer["tokens"] == tokenizer.encode(TEXT) and answer["tokens"][0] == tokenizer.token_id(BOS)
    assert answer["count"] == len(answer["tokens"]) > 1
    assert answer["max_model_len"] == client.models.list().data[0].max_model_len
    assert answer["token_strs"] is None  # asked for only with return_token_strs
    # the special tokens are decoded too, as vLLM's /detokenize does
    assert ok(post(base_url, "/detokenize", {"model": MODEL_ID, "tokens": answer["tokens"]})) == {"prompt": BOS + TEXT}

    bare = ok(post(base_url, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}))  # no model: the served one
    assert bare["tokens"] == answer["tokens"][1:]
    assert ok(post(base_url, "/detokenize", {"tokens": bare["tokens"]})) == {"prompt": TEXT}
    assert ok(post(base_url, "/detokenize", {"tokens": []})) == {"prompt": ""}

    spelled = ok(post(base_url, "/tokenize", {"prompt": TEXT, "return_token_strs": True}))
    assert spelled["tokens"] == answer["tokens"]
    # as the vocabulary spells each token (vLLM's convert_ids_to_tokens), which is not the text's own spelling
    assert spelled["token_strs"] == [tokenizer.backend.id_to_token(i) for i in answer["tokens"]]
    assert "".join(spelled["token_strs"]) != BOS + TEXT


@pytest.mark.parametrize(
    "prompt, options",
    [(TEXT, {}), ("The Python language", {}), (" leading space and\ttab\n", {}), (TEXT, {"add_special_tokens": False})],
)
def test_token_ids_are_the_prompt_completions_count(base_url, client, prompt, options):
    ids = ok(post(base_url, "/tokenize", {"prompt": prompt, **options}))["tokens"]
    greedy = dict(model=MODEL_ID, max_tokens=4, temperature=0)
    by_text = client.completions.create(prompt=prompt, **greedy, extra_body={"ignore_eos": True, **options})
    by_ids = client.completions.create(prompt=ids, **greedy, extra_body={"ignore_eos": True})
    assert by_text.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text  # the same prompt, greedily continued


@pytest.mark.parametrize(
    "messages, options",
    [
        (CHAT, {}),
        (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}),
        (CHAT, {"tools": [TOOL]}),
        (CHAT, {"add_special_tokens": True}),
        (
            [*CHAT, {"role": "assistant", "content": "A tuple is"}],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
    ids=["plain", "thinking-off", "tools", "special-tokens", "continue-final-message"],
)
def test_the_chat_form_is_the_prompt_chat_completions_count(base_url, client, tokenizer, messages, options):
    answer = ok(post(base_url, "/tokenize", {"model": MODEL_ID, "messages": messages, **options}))
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=1,
        temperature=0,
        **({"tools": options["tools"]} if "tools" in options else {}),
        extra_body={k: v for k, v in options.items() if k != "tools"},
    )
    assert answer["count"] == len(answer["tokens"]) == reply.usage.prompt_tokens
    template = dict(
        tools=options.get("tools"),
        variables=options.get("chat_template_kwargs", {}),
        continue_final_message=options.get("continue_final_message", False),
    )
    rendered = tokenizer.render_chat(messages, options.get("add_generation_prompt", True), **template)
    assert answer["tokens"] == tokenizer.encode(rendered, options.get("add_special_tokens", False))
    # detokenized with the special tokens, as vLLM answers
    bos = BOS if options.get("add_special_tokens") else ""
    assert ok(post(base_url, "/detokenize", {"tokens": answer["tokens"]})) == {"prompt": bos + rendered}


def test_the_chat_options_change_the_prompt(base_url):
    """Each option reaches the template (the counts above would agree if both sides ignored one)."""
    counts = {
        name: ok(post(base_url, "/tokenize", {"messages": CHAT, **options}))["count"]
        for name, options in {
            "default": {},
            "no generation prompt": {"add_generation_prompt": False},
            "thinking off": {"chat_template_kwargs": {"enable_thinking": False}},
            "tools": {"tools": [TOOL]},
            "special tokens": {"add_special_tokens": True},
        }.items()
    }
    assert len(set(counts.values())) == len(counts), counts


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "temperature"),
        ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": "What is a tuple?"}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": CHAT, "model": "no-such-model"}, 404, "model"),
        ("/tokenize", [TEXT], 400, None),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [1, 2.5]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_input_is_refused_in_openais_error_shape(base_url, path, body, status, param):
    error = refused(post(base_url, path, body), status, param)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


def test_token_ids_are_checked_against_the_vocabulary_and_the_context(base_url, client):
    assert ok(post(base_url, "/detokenize", {"tokens": [0, VOCAB - 1]}))["prompt"]  # the last id is in
    error = refused(post(base_url, "/detokenize", {"tokens": [VOCAB]}), 400, "tokens")
    assert str(VOCAB) in error["message"]
    too_many = client.models.list().data[0].max_model_len + 1
    error = refused(post(base_url, "/detokenize", {"tokens": [0] * too_many}), 400, "tokens")
    assert error["code"] == "context_length_exceeded"


def test_a_body_that_is_not_json_is_refused(base_url):
    r = httpx.post(f"{base_url}/tokenize", content=b"prompt=x", headers={"content-type": "application/json"})
    assert "not valid JSON" in refused(r, 400, None)["message"]


def test_version_is_the_package_version(base_url):
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert ok(httpx.get(f"{base_url}/version")) == {"version": pyproject["project"]["version"]}


KEY = "tokenize-test-key"


@pytest.fixture
def keyed():
    """The gateway's app in process, with an API key and a low message limit; no workers (the token routes never
    reach the mesh)."""
    frontend = Frontend(str(DEFAULT_MODEL), limits=RequestLimits(max_messages=2))
    with TestClient(create_app(Gateway(frontend=frontend, mesh=None, api_key=KEY))) as app:
        yield app
    frontend.close()


def test_the_api_key_guards_the_token_routes(keyed):
    bodies = {"/tokenize": {"prompt": TEXT}, "/detokenize": {"tokens": [1, 2]}}
    for path, body in bodies.items():
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = refused(keyed.post(path, json=body, headers=headers), 401, None)
            assert error["code"] == "invalid_api_key"
        assert keyed.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # as in vLLM, what only describes the server needs no key
    assert keyed.get("/version").status_code == 200 and keyed.get("/health").status_code == 200


def test_the_request_limits_cover_the_token_routes(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "x"}] * 3
    error = refused(keyed.post("/tokenize", json={"messages": messages}, headers=auth), 400, "messages")
    assert "at most 2" in error["message"]
    big = {"prompt": "x" * MAX_REQUEST_BYTES}
    for path in ("/tokenize", "/detokenize"):
        refused(keyed.post(path, json=big, headers=auth), 413, None)
