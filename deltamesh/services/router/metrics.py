"""Prometheus metrics of the router (served at the REST gateway's /metrics)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from deltamesh.services.common.vllm_metrics import RouterRequests
from deltamesh.v1 import common_pb2

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("deltamesh_router_requests", "Requests by outcome", ["outcome"])
TTFT = Histogram(
    "deltamesh_router_time_to_first_token_seconds", "From request arrival to the first token", buckets=_LATENCY
)
TPOT = Histogram(
    "deltamesh_router_time_per_output_token_seconds",
    "Per request: (end - first token) / (output tokens - 1)",
    buckets=_LATENCY,
)
E2E = Histogram("deltamesh_router_e2e_request_latency_seconds", "From arrival to the last token", buckets=_LATENCY)
RUNNING = Gauge("deltamesh_router_requests_running", "Requests in flight through the mesh")
PROMPT_TOKENS = Counter("deltamesh_router_prompt_tokens", "Prompt tokens of finished requests")
# the workers' prefix-cache hits as the router's clients got them (usage's cached_tokens), across every worker;
# the hit rate is _prefix_cache_hits / _prompt_tokens
PREFIX_CACHE_HITS = Counter(
    "deltamesh_router_prefix_cache_hits", "Prompt tokens of finished requests served from a worker's prefix cache"
)
PREFIX_CACHE_HIT_REQUESTS = Counter(
    "deltamesh_router_prefix_cache_hit_requests", "Finished requests that started from a cached prefix"
)
GENERATION_TOKENS = Counter("deltamesh_router_generation_tokens", "Output tokens streamed to clients")
RETRIES = Counter("deltamesh_router_retries", "Requests re-sent to another worker", ["leg"])
DECODE_CALLS = Counter(
    "deltamesh_router_decode_calls",
    "Decode calls by how their tokens came: on the worker's token feed (feed) or on their own stream (stream)",
    ["via"],
)
ROUTING_DECISIONS = Counter(
    "deltamesh_router_cache_aware_decisions",
    "cache_aware policy: sent where the prompt's prefix went before (cache) or by load",
    ["choice"],
)
PD_DECISIONS = Counter(
    "deltamesh_router_pd_decisions",
    "--pd-direct-max-tokens: sent straight to the decode worker holding the conversation (direct) "
    "or through a prefill worker (prefill; refused: the decode worker no longer held it); for the "
    "latter, the holder's prefix offered to the prefill worker (offered, offer_none, offer_failed)",
    ["path"],
)

# router/admission.py: requests waiting at the router for a decode worker with room
QUEUE_LENGTH = Gauge("deltamesh_router_requests_waiting", "Requests waiting in the router's admission queue")
QUEUE_TIME = Histogram(
    "deltamesh_router_request_queue_time_seconds",
    "Per admitted request: time in the router's admission queue (0 when a decode worker had room at once)",
    buckets=(0, *_LATENCY),
)
ADMITTED = Gauge(
    "deltamesh_router_requests_admitted", "Requests holding room on a decode worker (prefilling or decoding)"
)
ADMISSION_REJECTED = Counter(
    "deltamesh_router_admission_rejected",
    "Requests refused by admission: queue_full (--max-queued-requests) or timeout (no room in time)",
    ["reason"],
)


def _counted(counter: Counter) -> float:
    """A counter's value, as a scrape reads it."""
    return next(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


# vLLM's names for the same requests (common/vllm_metrics.py), labelled with the served model's name when the
# gateway's /metrics is scraped (gateway/health.py names it); its generated tokens are GENERATION_TOKENS
VLLM = RouterRequests(lambda: _counted(GENERATION_TOKENS))
REGISTRY.register(VLLM)
# how vLLM names a request's finish reason (vllm:request_success_total{finished_reason}); a reply that stopped after
# tool calls stopped, to vLLM's engine
_VLLM_FINISHED: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_TOOL_CALLS: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class RequestTimer:
    """Observes one request's latency figures as its deltas pass by."""

    def __init__(self):
        self.start = time.monotonic()
        self.first: float | None = None
        self.last = 0.0  # when its last token came
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish: int = common_pb2.FINISH_REASON_UNSPECIFIED  # its last delta's (common_pb2.FinishReason)
        RUNNING.inc()

    def delta(self, n_tokens: int, usage, finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> None:
        """A delta of `n_tokens` tokens with its `usage` (common_pb2.Usage: running totals, 0 where unknown) and
        its `finish_reason` (common_pb2.FinishReason)."""
        now = time.monotonic()
        first = self.first is None and n_tokens > 0
        if first:
            self.first = now
            TTFT.observe(now - self.start)
        elif n_tokens:  # vLLM's inter-token latency: the time since the request's last tokens came
            VLLM.itl.observe(now - self.last)
        if n_tokens:
            self.last = now
        self.tokens += n_tokens
        self.prompt_tokens = usage.prompt_tokens or self.prompt_tokens
        self.cached_tokens = usage.cached_tokens or self.cached_tokens
        self.finish = finish_reason
        GENERATION_TOKENS.inc(n_tokens)
        if first:
            VLLM.first_token(now - self.start, self.prompt_tokens, self.cached_tokens)

    def end(self, outcome: str) -> None:
        now = time.monotonic()
        RUNNING.dec()
        REQUESTS.labels(outcome).inc()
        if outcome == "completed":
            E2E.observe(now - self.start)
            PROMPT_TOKENS.inc(self.prompt_tokens)
            PREFIX_CACHE_HITS.inc(self.cached_tokens)
            PREFIX_CACHE_HIT_REQUESTS.inc(self.cached_tokens > 0)
            if self.first is not None and self.tokens > 1:
                TPOT.observe((now - self.first) / (self.tokens - 1))
        # vLLM counts the requests its engine finished, by reason, a client's abort included; not the ones refused
        # or failed by the router (outcome "error": no room, no worker, a worker lost), which never had one
        reason = "abort" if outcome == "aborted" else _VLLM_FINISHED.get(self.finish)
        if outcome != "error" and reason is not None:
            decode = self.last - self.first if self.first is not None else 0.0
            VLLM.finished(reason, now - self.start, self.prompt_tokens, self.tokens, decode)


class WorkerCollector:
    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        g = GaugeMetricFamily(
            "deltamesh_router_workers", "Known workers by role and health", labels=["role", "healthy"]
        )
        counts: dict[tuple[str, str], int] = {}
        for w in self.registry.workers.values():
            key = (w.role, str(w.healthy).lower())
            counts[key] = counts.get(key, 0) + 1
        for (role, healthy), n in counts.items():
            g.add_metric([role, healthy], n)
        yield g


def register_worker_gauge(registry) -> None:
    REGISTRY.register(WorkerCollector(registry))
