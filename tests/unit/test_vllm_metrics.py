"""vLLM's metric names as deltamesh serves them (deltamesh/services/common/vllm_metrics.py), without processes: a
worker's gauges from an engine read, the router's request series with the served model's name, their aliases and
buckets, and the router's RequestTimer feeding them (tests/e2e/test_vllm_metrics_mesh.py scrapes a running mesh)."""

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.services.common import vllm_metrics
from deltamesh.services.common.vllm_metrics import RouterRequests, one_two_five, worker_families
from deltamesh.services.router import metrics as router_metrics
from deltamesh.v1 import common_pb2

LOADS = {"running": 3, "waiting": 2, "kv_pages_used": 25, "kv_pages_cached": 40, "kv_pages_total": 100}


def samples(collector) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of what `collector` serves, read back through the text format as a
    scraper reads it."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Families:
    def __init__(self, make):
        self.make = make

    def collect(self):
        return self.make()


def test_worker_gauges_are_the_engine_read_under_vllms_names():
    got = samples(Families(lambda: worker_families("m", LOADS, 7, 16, True)))
    who = (("engine", "0"), ("model_name", "m"))
    assert got[("vllm:num_requests_running", who)] == 3
    assert got[("vllm:num_requests_waiting", who)] == 2
    # pages only the prefix cache holds are free on demand: not in use, as vLLM's cached free blocks
    assert got[("vllm:kv_cache_usage_perc", who)] == 0.25
    assert got[("vllm:gpu_cache_usage_perc", who)] == 0.25
    assert got[("vllm:num_preemptions_total", who)] == 7
    info = (("block_size", "16"), ("enable_prefix_caching", "True"), ("engine", "0"), ("num_gpu_blocks", "100"))
    assert got[("vllm:cache_config_info", info)] == 1


def test_kv_usage_of_an_empty_pool_is_zero():
    loads = {**LOADS, "kv_pages_used": 0, "kv_pages_total": 0}
    got = samples(Families(lambda: worker_families("m", loads, 0, 16, False)))
    assert got[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "m")))] == 0.0


def test_token_count_buckets_are_vllms_1_2_5_series():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_router_series_carry_the_served_name_once_named():
    r = RouterRequests(lambda: 42)
    r.first_token(0.03, prompt_tokens=300, cached_tokens=256)
    r.finished("length", e2e=1.2, prompt_tokens=300, output_tokens=5, decode_seconds=0.4)
    assert samples(r) == {}  # no scrape of the gateway yet: the name is unknown
    r.name("served", 512)
    got = samples(r)
    m = (("model_name", "served"),)
    assert got[("vllm:prompt_tokens_total", m)] == 300
    assert got[("vllm:prefix_cache_queries_total", m)] == 300
    assert got[("vllm:prefix_cache_hits_total", m)] == 256
    assert got[("vllm:generation_tokens_total", m)] == 42
    assert got[("vllm:time_to_first_token_seconds_count", m)] == 1
    assert got[("vllm:time_to_first_token_seconds_sum", m)] == 0.03
    assert got[("vllm:e2e_request_latency_seconds_sum", m)] == 1.2
    assert got[("vllm:request_decode_time_seconds_sum", m)] == 0.4
    assert abs(got[("vllm:request_time_per_output_token_seconds_sum", m)] - 0.1) < 1e-12  # 0.4 s / 4 tokens
    # every reason from the start, as vLLM exports them
    for reason in ("stop", "length", "abort", "error"):
        assert got[("vllm:request_success_total", (("finished_reason", reason), ("model_name", "served")))] == (
            reason == "length"
        )
    # token counts: vLLM's 1-2-5 buckets up to the context length (512), then +Inf
    les = sorted(float(dict(k[1])["le"]) for k in got if k[0] == "vllm:request_prompt_tokens_bucket")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")]
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "500.0"), ("model_name", "served")))] == 1
    assert got[("vllm:request_prompt_tokens_bucket", (("le", "200.0"), ("model_name", "served")))] == 0
    # vLLM's buckets for latencies
    ttft_les = {float(dict(k[1])["le"]) for k in got if k[0] == "vllm:time_to_first_token_seconds_bucket"}
    assert ttft_les == {*vllm_metrics.TTFT_BUCKETS, float("inf")}


def test_a_single_token_request_has_vllms_zero_time_per_output_token():
    r = RouterRequests(lambda: 0)
    r.name("m", 100)
    r.finished("stop", e2e=0.5, prompt_tokens=3, output_tokens=1, decode_seconds=0.0)
    got = samples(r)
    assert got[("vllm:request_time_per_output_token_seconds_count", (("model_name", "m"),))] == 1
    assert got[("vllm:request_time_per_output_token_seconds_sum", (("model_name", "m"),))] == 0


def test_the_inter_token_latency_is_also_served_under_its_old_name():
    r = RouterRequests(lambda: 0)
    r.name("m", 100)
    for gap in (0.02, 0.03, 0.2):
        r.itl.observe(gap)
    got = samples(r)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert got[(f"{name}_count", (("model_name", "m"),))] == 3
        assert got[(f"{name}_bucket", (("le", "0.025"), ("model_name", "m")))] == 1


def usage(prompt: int, cached: int = 0) -> SimpleNamespace:
    return SimpleNamespace(prompt_tokens=prompt, cached_tokens=cached)


def router_samples() -> dict:
    router_metrics.VLLM.name("timer-test", 4096)
    return samples(router_metrics.VLLM)


def test_the_request_timer_feeds_vllms_series():
    """Deltas of 1, 2 and 1 tokens, the last one finishing for length: one first token, two inter-token gaps, one
    request finished for length with 4 output tokens; a request the router failed is not counted as finished."""
    m = (("model_name", "timer-test"),)
    length = ("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "timer-test")))
    before = router_samples()
    timer = router_metrics.RequestTimer()
    timer.delta(1, usage(10, 4))
    timer.delta(2, usage(10, 4))
    timer.delta(1, usage(10, 4), common_pb2.FINISH_REASON_LENGTH)
    timer.end("completed")
    failed = router_metrics.RequestTimer()
    failed.delta(1, usage(7))
    failed.end("error")
    after = router_samples()

    def grew(key) -> float:
        return after[key] - before.get(key, 0.0)

    assert grew(("vllm:time_to_first_token_seconds_count", m)) == 2
    assert grew(("vllm:inter_token_latency_seconds_count", m)) == 2
    assert grew(("vllm:prompt_tokens_total", m)) == 17  # counted at the first token, as vLLM counts them
    assert grew(("vllm:prefix_cache_hits_total", m)) == 4
    assert grew(length) == 1
    assert grew(("vllm:e2e_request_latency_seconds_count", m)) == 1
    assert grew(("vllm:request_generation_tokens_sum", m)) == 4
    assert grew(("vllm:request_prompt_tokens_sum", m)) == 10
    assert grew(("vllm:generation_tokens_total", m)) == 5  # deltamesh_router_generation_tokens_total's count


def test_a_client_abort_counts_as_abort():
    key = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "timer-test")))
    before = router_samples().get(key, 0.0)
    timer = router_metrics.RequestTimer()
    timer.delta(1, usage(5))
    timer.end("aborted")  # the client went away: no finishing delta came
    assert router_samples()[key] == before + 1
