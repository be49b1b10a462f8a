"""vLLM's Prometheus names, served beside deltamesh's own (docs/serving.md, "vLLM's metric names"): what Grafana
dashboards, alerts, autoscalers and the Gateway API Inference Extension's endpoint picker (llm-d's inference
scheduler) read from a vLLM server. Only names whose meaning deltamesh answers as vLLM does are served; the
others, and why, are listed in the docs.

- Workers (their --metrics-port): the per-engine gauges an endpoint picker reads (running, waiting, KV cache usage,
  cache_config_info) and the preemption counter, built at scrape time from the same engine read as the
  deltamesh_engine_* series (common/metrics.py): nothing on the serving path.
- Router (the REST gateway's /metrics): the request-level histograms and counters, observed where its
  deltamesh_router_* series are (router/metrics.py). The places that observe them do not know the served model's
  name, so they are kept unlabelled and labelled with it (`model_name`) when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read the same
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
# the finish reasons vLLM counts requests by (vllm:request_success_total{finished_reason}), every one exported from
# the start, as vLLM does
FINISHED_REASONS = ("stop", "length", "abort", "error")
# the deprecated names older dashboards and endpoint pickers read, served beside the current ones: same series
ROUTER_ALIASES = {"vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds"}
KV_CACHE_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# per-request token counts: vLLM's 1-2-5 buckets up to the model's context length. That length is known when the
# router is scraped, not when it starts observing, so requests are counted in the 1-2-5 buckets up to this bound and
# the ones past the context length are left out of what is served (buckets are cumulative: the +Inf bucket holds them)
_TOKEN_COUNT_BOUND = 10**9
TOKEN_COUNT_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens")


def one_two_five(bound: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `bound` (vLLM's buckets for token counts, to the context length)."""
    buckets, scale = [], 1
    while scale <= bound:
        buckets += [m * scale for m in (1, 2, 5) if m * scale <= bound]
        scale *= 10
    return tuple(buckets)


def worker_families(
    model_name: str, loads: dict, preemptions: int, page_size: int, prefix_caching: bool
) -> Iterator[Metric]:
    """A worker's vLLM gauges from one read of its engine (`loads`: Engine.loads(), as deltamesh_engine_* read it).
    A worker is one engine to its callers, whatever its ranks: `engine="0"`, as a one-engine vLLM server labels it.
    KV cache usage is vLLM's: pages that requests hold over the pool (pages only the prefix cache holds are free on
    demand, as vLLM's cached free blocks are); GDN state slots are a pool of their own, bounded by --max-num-seqs."""
    labels, values = ["model_name", "engine"], [model_name, "0"]
    total = loads["kv_pages_total"]
    usage = loads["kv_pages_used"] / total if total else 0.0
    for name, value, doc in (
        ("vllm:num_requests_running", loads["running"], "Number of requests in model execution batches."),
        ("vllm:num_requests_waiting", loads["waiting"], "Number of requests waiting to be processed."),
        (KV_CACHE_USAGE_NAMES[0], usage, "KV-cache usage. 1 means 100 percent usage."),
        (
            KV_CACHE_USAGE_NAMES[1],
            usage,
            "KV-cache usage. 1 means 100 percent usage (vllm:kv_cache_usage_perc's old name).",
        ),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        gauge.add_metric(values, value)
        yield gauge
    preempted = CounterMetricFamily(
        "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=labels
    )
    preempted.add_metric(values, preemptions)
    yield preempted
    # an info gauge (value 1) as vLLM's: the endpoint picker's prefix scorer reads block_size and num_gpu_blocks
    config = {
        "block_size": str(page_size),
        "num_gpu_blocks": str(total),
        "enable_prefix_caching": str(prefix_caching),
        "engine": "0",
    }
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(config))
    info.add_metric(list(config.values()), 1)
    yield info


class RouterRequests:
    """vLLM's request-level series as the router sees each request (router/metrics.py's RequestTimer and the
    admission queue observe them), served by `collect` with the served model's name once `name` has told it."""

    def __init__(self, generation_tokens: Callable[[], float]):
        """`generation_tokens`: the tokens streamed to clients so far (deltamesh_router_generation_tokens_total,
        which counts what vllm:generation_tokens_total counts: read when scraped, nothing added per token)."""
        self._generation_tokens = generation_tokens
        self.model_name: str | None = None
        self.max_model_len = 0
        self._registry = r = CollectorRegistry(auto_describe=True)  # served only through collect, relabelled
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = self._latency("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue = self._latency(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."
        )
        self.decode = self._latency(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."
        )
        counts = one_two_five(_TOKEN_COUNT_BOUND)
        self.prompt_lengths = Histogram(
            TOKEN_COUNT_HISTOGRAMS[0], "Number of prefill tokens processed.", buckets=counts, registry=r
        )
        self.generation_lengths = Histogram(
            TOKEN_COUNT_HISTOGRAMS[1], "Number of generation tokens processed.", buckets=counts, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", registry=r)
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", registry=r
        )
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", registry=r
        )
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"], registry=r
        )
        self.success = {reason: success.labels(reason) for reason in FINISHED_REASONS}

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=REQUEST_LATENCY_BUCKETS, registry=self._registry)

    def name(self, model_name: str, max_model_len: int) -> None:
        """The served model's name (its first --served-model-name, as vLLM labels by) and context length."""
        self.model_name, self.max_model_len = model_name, max_model_len

    # ---- observations (the router's event loop) --------------------------------------------------------------
    def first_token(self, seconds: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first token, `seconds` after it arrived: its prompt has been prefilled (vLLM counts prompt
        tokens and prefix-cache lookups then), `cached_tokens` of it from a worker's prefix cache."""
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_queries.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)

    def finished(self, reason: str, e2e: float, prompt_tokens: int, output_tokens: int, decode_seconds: float) -> None:
        """A request that ended with `reason` (one of FINISHED_REASONS); `decode_seconds`: its first token to its
        last. vLLM's per-request time per output token leaves the first token out, and is 0 with no token after it."""
        self.success[reason].inc()
        self.e2e.observe(e2e)
        self.decode.observe(decode_seconds)
        self.tpot.observe(decode_seconds / (output_tokens - 1) if output_tokens > 1 else 0.0)
        if prompt_tokens:  # unknown (0) for a request that ended before its first answer
            self.prompt_lengths.observe(prompt_tokens)
        self.generation_lengths.observe(output_tokens)

    # ---- the scrape --------------------------------------------------------------------------------------------
    def describe(self) -> list[Metric]:
        return []  # named at scrape time: nothing for the registry to check at registration

    def collect(self) -> Iterator[Metric]:
        model = self.model_name
        if model is None:  # not named yet: no scrape of the gateway came
            return
        for family in self._registry.collect():
            yield _labelled(family, family.name, model, self.max_model_len)
            if alias := ROUTER_ALIASES.get(family.name):
                yield _labelled(family, alias, model, self.max_model_len)
        tokens = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=["model_name"]
        )
        tokens.add_metric([model], self._generation_tokens())
        yield tokens


def _labelled(family: Metric, name: str, model: str, max_model_len: int) -> Metric:
    """`family` under `name` with every sample labelled model_name=`model`; a token-count histogram keeps only the
    buckets up to the context length (and +Inf), as vLLM builds them."""
    out = Metric(name, family.documentation, family.type)
    cut = family.name in TOKEN_COUNT_HISTOGRAMS and max_model_len > 0
    for s in family.samples:
        le = s.labels.get("le")
        if cut and le is not None and le != "+Inf" and float(le) > max_model_len:
            continue
        out.add_sample(name + s.name[len(family.name) :], {"model_name": model, **s.labels}, s.value, s.timestamp)
    return out
