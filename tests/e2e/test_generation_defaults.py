"""The checkpoint's recommended sampling (generation_config.json) for what a request leaves unset, as vLLM's
--generation-config auto: on the REST and gRPC edges alike, a request's own values winning, and `vllm` leaving the
file's recommendations out."""

import json
from pathlib import Path

import httpx
import pytest
from harness import start_mesh

from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e
RECOMMENDED_MAX_TOKENS = 7
PROMPT = "The first line of the file"


def recommending_model(directory: Path) -> Path:
    """The default model with a generation_config.json that recommends greedy decoding, top_k 20 and 7 new tokens
    (its stop tokens kept); the other files linked."""
    model = directory / DEFAULT_MODEL.name
    model.mkdir()
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL / "generation_config.json").read_text())
    config |= {"temperature": 0.0, "top_k": 20, "top_p": 1.0, "max_new_tokens": RECOMMENDED_MAX_TOKENS}
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = recommending_model(tmp_path_factory.mktemp("recommending"))
    m = start_mesh(str(model), tmp_path_factory.mktemp("gen-defaults"), colocated=1, prefill=0, decode=0, http=True)
    yield m
    m.stop()


def complete(base_url: str, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_unset_parameters_take_the_checkpoints_recommendation(mesh, base_url):
    recommended = complete(base_url)
    greedy = complete(base_url, temperature=0, max_tokens=RECOMMENDED_MAX_TOKENS)
    assert recommended["usage"]["completion_tokens"] == RECOMMENDED_MAX_TOKENS
    assert recommended["choices"][0]["text"] == greedy["choices"][0]["text"]
    # the request's own values win
    assert complete(base_url, max_tokens=3)["usage"]["completion_tokens"] == 3
    sampled = {complete(base_url, temperature=1.0, top_k=0, seed=s)["choices"][0]["text"] for s in range(4)}
    assert sampled != {greedy["choices"][0]["text"]}
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True},
        timeout=60,
    ).json()
    assert chat["usage"]["completion_tokens"] == RECOMMENDED_MAX_TOKENS, chat

    with mesh.client() as client:  # gRPC: the fields a request leaves unset, likewise
        result = client.generate(PROMPT, ignore_eos=True)
        assert result.text == greedy["choices"][0]["text"] and len(result.token_ids) == RECOMMENDED_MAX_TOKENS
        assert len(client.generate(PROMPT, ignore_eos=True, max_tokens=2).token_ids) == 2


@pytest.mark.parametrize(
    "router_args,max_tokens",
    [
        (["--generation-config", "vllm"], 16),  # deltamesh's (and vLLM's) own default
        (["--generation-config", "vllm", "--override-generation-config", '{"max_new_tokens": 5}'], 5),
        (["--override-generation-config", '{"max_new_tokens": 4}'], 4),  # over the file's 7
    ],
)
def test_vllm_leaves_the_recommendation_out_and_overrides_go_over_either(tmp_path, router_args, max_tokens):
    model = recommending_model(tmp_path)
    m = start_mesh(str(model), tmp_path, colocated=1, prefill=0, decode=0, http=True, router_args=router_args)
    try:
        r = httpx.post(
            f"http://127.0.0.1:{m.http_port}/v1/completions",
            json={"prompt": PROMPT, "ignore_eos": True},
            timeout=60,
        )
        assert r.json()["usage"]["completion_tokens"] == max_tokens, r.text
    finally:
        m.stop()
