"""vLLM's server flags on a real mesh (one colocated worker): --default-chat-template-kwargs fills the template
variables a chat leaves unset (its own override them), --max-logprobs caps logprobs and prompt_logprobs on both
edges, --disable-log-requests drops the router's line per request, --uvicorn-log-level lets uvicorn's own lines
through. (--disable-log-stats, the engine's periodic line: tests/unit/test_engine_log_stats.py.)"""

import json

import httpx
import pytest
from harness import start_mesh

from deltamesh.client import InvalidRequest
from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.api]
MODEL_ID = DEFAULT_MODEL.name
CHAT = [{"role": "user", "content": "What is a tuple?"}]
ROUTER_FLAGS = [
    "--default-chat-template-kwargs",
    '{"enable_thinking": false}',
    "--max-logprobs",
    "2",
    "--disable-log-requests",
    "--uvicorn-log-level",
    "info",
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path_factory.mktemp("vllm-flags"),
        prefill=0,
        decode=0,
        colocated=1,
        router_args=ROUTER_FLAGS,
        http=True,
    )
    yield m
    m.stop()


def post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{mesh.http_port}{path}", json={"model": MODEL_ID, **body}, timeout=60)


def templated(mesh, **body) -> str:
    tokens = post(mesh, "/tokenize", {"messages": CHAT, **body}).json()["tokens"]
    return post(mesh, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_a_chat_takes_the_servers_template_variables_unless_it_sets_them(mesh):
    tok = Tokenizer(DEFAULT_MODEL)
    off = tok.render_chat(CHAT, True, variables={"enable_thinking": False})
    on = tok.render_chat(CHAT, True)
    assert off != on  # the default model's template reads the variable
    assert templated(mesh) == off
    assert templated(mesh, chat_template_kwargs={"enable_thinking": True}) == on
    # a chat completion renders the same prompt: its prompt token count is the thinking-off one's
    r = post(mesh, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(off)), r.text


def test_logprobs_past_max_logprobs_are_refused_on_both_edges(mesh):
    for path, body, param in (
        ("/v1/completions", {"prompt": "Hi", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 3}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3}, "logprobs"),
    ):
        r = post(mesh, path, {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--max-logprobs 2" in r.json()["error"]["message"]
    ok = post(mesh, "/v1/completions", {"prompt": "Hi", "logprobs": 2, "prompt_logprobs": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2, ok.text
    with mesh.client() as client:
        with pytest.raises(InvalidRequest, match="max-logprobs"):
            client.generate("Hi", max_tokens=2, logprobs=3)
        assert len(client.generate("Hi", max_tokens=2, logprobs=2).logprobs) == 2


def test_the_router_logs_no_request_lines_and_uvicorns_own(mesh):
    assert post(mesh, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    events = []
    for line in mesh.procs[0].log.read_text().splitlines():
        try:
            events.append(json.loads(line).get("event"))
        except ValueError:
            events.append(line)  # the standard library's lines (uvicorn's) are not JSON
    assert "request" not in events
    assert any("Uvicorn running on" in str(e) for e in events), events[-20:]
