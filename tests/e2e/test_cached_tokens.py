"""Prefix-cache hits as a client and an operator see them (#48 item 7): usage.prompt_tokens_details.cached_tokens
in REST (completions and chat, streamed and not) and usage.cached_tokens over gRPC, under 1P+1D, where the decode
worker pulled the prompt's state and the hit was the prefill worker's; the router's own hit counters; and the
typed answers of the SDK's list_models and of `deltamesh loads` (#48 item 10)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from harness import start_mesh

from deltamesh.client import Model
from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = DEFAULT_MODEL.name
# long enough for several full pages, so a repeat of it hits the prefill worker's cache
SYSTEM = "You answer questions about the Python language in short, precise sentences. " * 6


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("cached"), worker_args=["--prefix-cache"], http=True)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)


def prefill_hits(mesh) -> int:
    [prefill] = mesh.workers("prefill")
    return prefill.load().prefix_cache_hit_tokens


def router_metric(mesh, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.http_port}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def cached_in(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def streamed_usage(stream):
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def test_cached_tokens_are_the_prefill_workers_hit_in_every_answer_shape(mesh, client):
    """A prompt's first request has no cached token; its repeats report exactly what the prefill worker's
    cache served them (its counter's growth), in each of REST's four shapes and over gRPC; the router counts the
    same hits."""
    hits_before = router_metric(mesh, "deltamesh_router_prefix_cache_hits_total")
    prompt = SYSTEM + "What is a list?"
    first = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0)
    assert cached_in(first.usage) == 0

    seen = []

    def repeat(call) -> int:
        """The cached tokens `call` reports; checked against the prefill worker's counter."""
        before = prefill_hits(mesh)
        cached = call()
        assert 0 < cached == prefill_hits(mesh) - before
        seen.append(cached)
        return cached

    repeat(lambda: cached_in(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4).usage))
    repeat(
        lambda: cached_in(
            streamed_usage(
                client.completions.create(
                    model=MODEL_ID, prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}
                )
            )
        )
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And a tuple?"}]
    chat = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0  # its system prompt may be the completion's prefix
    repeat(lambda: cached_in(client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4).usage))
    repeat(
        lambda: cached_in(
            streamed_usage(
                client.chat.completions.create(
                    model=MODEL_ID,
                    messages=messages,
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
        )
    )
    with mesh.client() as sdk:
        repeat(lambda: sdk.generate(prompt, max_tokens=4).usage.cached_tokens)
        streamed = list(sdk.stream(prompt, max_tokens=4))
        assert {d.usage.cached_tokens for d in streamed} == {seen[-1]}  # every delta, the decode worker's included
    hits = router_metric(mesh, "deltamesh_router_prefix_cache_hits_total") - hits_before
    assert hits >= sum(seen) + seen[-1]  # the chat's first request may have hit too
    assert router_metric(mesh, "deltamesh_router_prefix_cache_hit_requests_total") >= len(seen) + 1


def test_list_models_and_loads_answer_in_plain_types(mesh):
    with mesh.client() as sdk:
        [model] = sdk.list_models()
    assert isinstance(model, Model) and model.id == MODEL_ID and isinstance(model.max_model_len, int)
    env = {**os.environ, "DELTAMESH_MESH_SECRET": mesh.secret}
    cli = [sys.executable, "-m", "deltamesh.services.cli", "loads", mesh.control_address]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    loads = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted(load["role"] for load in loads) == ["decode", "prefill"]
    for load in loads:
        assert type(load["prefix_cache_hit_tokens"]) is int and type(load["running"]) is int


def test_n_choices_of_a_prompt_compute_it_once(mesh, client):
    """engine/shared_prefill.py through the mesh: n choices of one prompt reach the prefill worker together; the
    first computes the prompt, the others wait for its checkpoint and compute only its last page."""
    prompt = "Name four uses of a Python tuple, one per line. " * 5
    url = f"http://127.0.0.1:{mesh.http_port}"
    prompt_len = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=30).json()["count"]
    before = prefill_hits(mesh)
    answer = client.completions.create(
        model=MODEL_ID, prompt=prompt, n=4, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert prefill_hits(mesh) - before == 3 * ((prompt_len - 1) // 16 * 16)  # each choice after the first
    assert len({c.text for c in answer.choices}) == 1  # greedy: a cached prefill gives the same tokens
