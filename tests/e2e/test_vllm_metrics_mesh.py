"""vLLM's metric names on a running 1P+1D mesh (deltamesh/services/common/vllm_metrics.py; docs/serving.md, "vLLM's
metric names"): the router's /metrics and each worker's --metrics-port, scraped as Prometheus (or an endpoint picker)
scrapes them, after requests whose tokens the test knows, agree with the requests and with deltamesh's own series."""

import threading
import time

import httpx
import pytest
from harness import start_mesh
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.services.common.ports import free_port

pytestmark = pytest.mark.e2e

SERVED = "tiny-served"  # the router's --served-model-name: its vLLM series' model_name
WORKER_MODEL = SERVED  # the workers' --served-model-name (serve passes the router's on)
SYSTEM = "You answer questions about the Python language in short, precise sentences. " * 6
TOKENS = 8


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    ports = {"prefill": free_port(), "decode": free_port()}
    m = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path_factory.mktemp("vllm-metrics"),
        http=True,
        worker_args=["--prefix-cache", "--served-model-name", SERVED],
        router_args=["--served-model-name", SERVED],
        role_args={role: ["--metrics-port", str(port)] for role, port in ports.items()},
    )
    m.metrics_ports = ports
    try:
        yield m
    finally:
        m.stop()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}} of a Prometheus text page, parsed as Prometheus parses it."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def router(mesh):
    return scrape(f"http://127.0.0.1:{mesh.http_port}/metrics")


def worker(mesh, role: str):
    return scrape(f"http://127.0.0.1:{mesh.metrics_ports[role]}/metrics")


def one(page, name: str, **labels) -> float:
    """The value of `name` whose labels include `labels` (the only such sample)."""
    found = [v for k, v in page.get(name, {}).items() if set(labels.items()) <= set(k)]
    assert len(found) == 1, (name, labels, page.get(name))
    return found[0]


def own(page, name: str) -> float:
    """A deltamesh series' value (0 before its first observation)."""
    return sum(page.get(name, {}).values())


def complete(mesh, prompt: str, **body) -> dict:
    r = httpx.post(
        f"http://127.0.0.1:{mesh.http_port}/v1/completions",
        json={"model": SERVED, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_router_serves_vllms_request_series_in_agreement_with_its_own(mesh):
    before = router(mesh)
    prompts = [SYSTEM + "What is a list?", SYSTEM + "What is a list?", "A tuple is", "Dictionaries map"]
    usages = [complete(mesh, p) for p in prompts]  # the repeat hits the prefill worker's prefix cache
    after = router(mesh)
    n = len(prompts)

    def grew(name: str, **labels) -> float:
        return one(after, name, model_name=SERVED, **labels) - (
            one(before, name, model_name=SERVED, **labels) if name in before else 0.0
        )

    def own_grew(name: str) -> float:
        return own(after, name) - own(before, name)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0, usages
    assert grew("vllm:prompt_tokens_total") == prompt_tokens == own_grew("deltamesh_router_prompt_tokens_total")
    assert grew("vllm:prefix_cache_queries_total") == prompt_tokens
    assert grew("vllm:prefix_cache_hits_total") == cached == own_grew("deltamesh_router_prefix_cache_hits_total")
    assert grew("vllm:generation_tokens_total") == n * TOKENS == own_grew("deltamesh_router_generation_tokens_total")
    assert one(after, "vllm:generation_tokens_total", model_name=SERVED) == own(
        after, "deltamesh_router_generation_tokens_total"
    )
    # every request finished for its length (ignore_eos), and was counted once by each per-request series
    assert grew("vllm:request_success_total", finished_reason="length") == n
    assert grew("vllm:request_success_total", finished_reason="stop") == 0
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_prompt_tokens_count",
    ):
        assert grew(name) == n, name
    assert grew("vllm:request_generation_tokens_sum") == n * TOKENS
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:e2e_request_latency_seconds_count") == own_grew(
        "deltamesh_router_e2e_request_latency_seconds_count"
    )
    # the same first-token times as deltamesh's own histogram, in vLLM's buckets
    ttft = grew("vllm:time_to_first_token_seconds_sum")
    assert ttft == pytest.approx(own_grew("deltamesh_router_time_to_first_token_seconds_sum"), rel=1e-9, abs=1e-9)
    assert 0 < ttft < grew("vllm:e2e_request_latency_seconds_sum")
    # under P/D each request waited in the router's admission queue once (0 s when there was room)
    assert (
        grew("vllm:request_queue_time_seconds_count")
        == n
        == own_grew("deltamesh_router_request_queue_time_seconds_count")
    )
    # one inter-token gap per delta after the first: at least one per request, at most one per token after the first
    gaps = grew("vllm:inter_token_latency_seconds_count")
    assert n <= gaps <= n * (TOKENS - 1)
    assert grew("vllm:time_per_output_token_seconds_count") == gaps  # the old name of the same series
    assert one(after, "vllm:inter_token_latency_seconds_bucket", model_name=SERVED, le="+Inf") == one(
        after, "vllm:inter_token_latency_seconds_count", model_name=SERVED
    )


def test_router_counts_a_client_abort(mesh):
    key = {"model_name": SERVED, "finished_reason": "abort"}
    before = one(router(mesh), "vllm:request_success_total", **key)
    body = {"model": SERVED, "prompt": "A long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{mesh.http_port}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # a token came: the client goes away mid-stream
    deadline = time.monotonic() + 30
    while one(router(mesh), "vllm:request_success_total", **key) != before + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.1)
    assert not mesh.wait_idle()


def worker_agrees_with_its_engine(page) -> dict[str, float]:
    """A worker's vLLM gauges, each checked against the deltamesh_engine_* series of the same scrape (one engine
    read serves both)."""
    who = {"model_name": WORKER_MODEL, "engine": "0"}
    got = {
        name: one(page, f"vllm:{name}", **who)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc")
    }
    assert got["num_requests_running"] == own(page, "deltamesh_engine_requests_running")
    assert got["num_requests_waiting"] == own(page, "deltamesh_engine_requests_waiting")
    total = own(page, "deltamesh_engine_kv_pages_total")
    assert (
        got["kv_cache_usage_perc"] == got["gpu_cache_usage_perc"] == own(page, "deltamesh_engine_kv_pages_used") / total
    )
    assert 0.0 <= got["kv_cache_usage_perc"] <= 1.0
    assert one(page, "vllm:num_preemptions_total", **who) == own(page, "deltamesh_engine_preemptions_total")
    [(labels, value)] = page["vllm:cache_config_info"].items()
    info = dict(labels)
    assert value == 1 and info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
    assert float(info["num_gpu_blocks"]) == total
    return got


def test_workers_serve_an_endpoint_pickers_gauges(mesh):
    """While a long request decodes, the decode worker runs it and holds KV pages for it; once the mesh is idle
    both workers read no request running or waiting and no KV cache in use."""
    done = threading.Event()

    def long_request():
        try:
            with (
                mesh.client() as client,
                client.stream("A long story", max_tokens=1000, temperature=0, ignore_eos=True, timeout=120) as stream,
            ):
                for _ in stream:
                    if done.is_set():
                        break  # seen running: the rest of it is not needed
        finally:
            done.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    busy = None
    deadline = time.monotonic() + 60
    while busy is None and not done.is_set() and time.monotonic() < deadline:
        got = worker_agrees_with_its_engine(worker(mesh, "decode"))
        if got["num_requests_running"] >= 1:
            busy = got
        else:
            time.sleep(0.02)
    done.set()
    thread.join(120)
    assert busy is not None, "the decode worker never showed the request running"
    assert 0.0 < busy["kv_cache_usage_perc"] <= 1.0
    assert not mesh.wait_idle()
    for role in ("prefill", "decode"):
        idle = worker_agrees_with_its_engine(worker(mesh, role))
        assert idle == {
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": 0.0,
            "gpu_cache_usage_perc": 0.0,
        }, role
        # request-level series are the router's: a worker serves none of them (no double count across pods)
        assert "vllm:prompt_tokens_total" not in worker(mesh, role)
