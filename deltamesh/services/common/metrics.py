"""Prometheus metrics of a worker process (prefill, decode or colocated), served on --metrics-port.

Engine counters and gauges are read from the engine at scrape time (no work on the hot path); latencies and
transfer figures are observed by the servicers."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from deltamesh.services.common.vllm_metrics import worker_families

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BYTES = tuple(2**i for i in range(10, 36, 2))

TTFT = Histogram(
    "deltamesh_worker_time_to_first_token_seconds",
    "Prefill/colocated: from request arrival to the first token",
    buckets=_LATENCY,
)
TPOT = Histogram(
    "deltamesh_worker_time_per_output_token_seconds",
    "Decode/colocated: time between output tokens of a request",
    buckets=_LATENCY,
)


class TokenTimes:
    """When a request's tokens came, observed as TTFT (its first token, where this worker made it: colocated) and
    TPOT (the time since its last delta, per token of this one); the same on a token feed and on a Decode stream."""

    __slots__ = ("colocated", "last", "started")

    def __init__(self, colocated: bool):
        self.colocated = colocated
        self.started = self.last = time.monotonic()

    def observe(self, new_tokens: int, output_tokens: int, now: float) -> None:
        if not new_tokens:
            return
        if self.colocated and output_tokens == new_tokens:
            TTFT.observe(now - self.started)
        else:
            TPOT.observe((now - self.last) / new_tokens)
        self.last = now


TRANSFER_BYTES = Histogram("deltamesh_transfer_bytes", "Decode: bytes of state pulled per request", buckets=_BYTES)
TRANSFER_SECONDS = Histogram("deltamesh_transfer_seconds", "Decode: duration of one state pull", buckets=_LATENCY)
TRANSFER_BUFFERS = Histogram(
    "deltamesh_transfer_buffers", "Decode: reads (segments) per state pull", buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64)
)
TRANSFERS = Counter("deltamesh_transfers", "Decode: state pulls by outcome", ["outcome"])
PREFIX_OFFERS = Counter(
    "deltamesh_prefix_offers", "Decode: cached prefixes asked for by the router (offered | none)", ["outcome"]
)
REVERSE_PULLS = Counter(
    "deltamesh_reverse_pulls",
    "Prefill: prefixes pulled from a decode worker's prefix cache, "
    "by outcome (ok | failed: computed instead | skipped: own cache as long)",
    ["outcome"],
)


class EngineCollector:
    """Engine pool usage, queue depth and token counters, read at scrape time."""

    def __init__(self, worker, leases=None):
        self.worker, self.leases = worker, leases

    def collect(self):
        engine = self.worker.engine
        loads, stats, role = engine.loads(), engine.stats, self.worker.settings.role
        for name, value, doc in (
            ("requests_running", loads["running"], "Requests in the running batch"),
            ("requests_waiting", loads["waiting"], "Requests queued for admission (queue depth)"),
            ("kv_pages_used", loads["kv_pages_used"], "KV cache pages in use by requests"),
            (
                "kv_pages_cached",
                loads["kv_pages_cached"],
                "KV cache pages only the prefix cache holds (free on demand)",
            ),
            (
                "prefix_cache_checkpoints",
                loads["prefix_cache_checkpoints"],
                "GDN state checkpoints in the prefix cache",
            ),
            (
                "prefix_cache_bytes",
                loads["prefix_cache_bytes"],
                "Bytes of KV pages and GDN checkpoints the prefix cache holds (--prefix-cache-memory bounds them)",
            ),
            ("kv_pages_total", loads["kv_pages_total"], "KV cache pages in the pool"),
            ("state_slots_used", loads["state_slots_used"], "GDN state slots in use"),
            ("state_slots_total", loads["state_slots_total"], "GDN state slots in the pool"),
            ("held_states", loads["held"], "Prefill: request states held for a decode worker"),
            ("reservations", self.worker.reservations, "Decode: pool space reserved for incoming transfers"),
        ):
            g = GaugeMetricFamily(f"deltamesh_engine_{name}", doc, labels=["role"])
            g.add_metric([role], value)
            yield g
        for name, value, doc in (
            ("prompt_tokens", stats.prompt_tokens, "Prompt tokens prefilled (rate = prefill tokens/s)"),
            ("generation_tokens", stats.generation_tokens, "Tokens sampled (rate = decode tokens/s)"),
            ("steps", stats.steps, "Engine steps run"),
            ("mixed_steps", stats.mixed_steps, "Steps that carried prompt tokens"),
            ("graph_steps", engine.graph_steps, "Decode-only steps replayed from a CUDA graph"),
            (
                "piecewise_graph_steps",
                engine.piecewise_graph_steps,
                "Steps with prompt tokens replayed from CUDA graphs piece by piece",
            ),
            ("preemptions", engine.num_preemptions, "Requests preempted for lack of KV pages"),
            ("prefix_cache_hits", stats.prefix_cache_hits, "Requests started from a cached prefix"),
            ("prefix_cache_hit_tokens", stats.prefix_cache_hit_tokens, "Prompt tokens served from the prefix cache"),
            ("prefix_cache_checkpoints_saved", stats.checkpoints_saved, "GDN state checkpoints saved"),
            ("prefix_cache_checkpoints_evicted", stats.checkpoints_evicted, "GDN state checkpoints evicted"),
            ("reverse_pull_tokens", stats.pulled_prefix_tokens, "Prompt tokens pulled from a decode worker"),
        ):
            c = CounterMetricFamily(f"deltamesh_engine_{name}", doc, labels=["role"])
            c.add_metric([role], value)
            yield c
        for name, total, count, doc in (
            (
                "request_queue_seconds",
                stats.queue_seconds,
                stats.queued,
                "Requests this worker prefills: from arrival in the engine to their first scheduled step",
            ),
            (
                "time_to_first_token_seconds",
                stats.first_token_seconds,
                stats.first_tokens,
                "Requests this worker prefills: from arrival in the engine to their first token on the host",
            ),
            (
                "grammar_mask_seconds",
                stats.grammar_mask_seconds,
                stats.grammar_mask_steps,
                "Steps that sampled under a grammar (structured outputs): the host's time on their token bitmasks",
            ),
        ):
            s = SummaryMetricFamily(f"deltamesh_engine_{name}", doc, labels=["role"])
            s.add_metric([role], count_value=count, sum_value=total)
            yield s
        yield from _spec_counters(stats, role)
        finished = CounterMetricFamily(
            "deltamesh_engine_requests_finished", "Requests finished by reason", labels=["role", "reason"]
        )
        for reason, n in stats.finished.items():
            finished.add_metric([role, reason], n)
        yield finished
        # vLLM's names for the same engine read (common/vllm_metrics.py): what an endpoint picker reads from a pod
        settings = self.worker.settings.engine
        yield from worker_families(
            self.worker.served_name, loads, engine.num_preemptions, settings.page_size, engine.has_prefix_cache
        )
        if self.leases is not None:
            active = GaugeMetricFamily("deltamesh_prefill_leases_active", "Leases held or being pulled")
            active.add_metric([], len(self.leases))
            yield active
            ended = CounterMetricFamily(
                "deltamesh_prefill_leases_ended",
                "Leases ended, by reason (expired = never pulled in time)",
                labels=["reason"],
            )
            for reason, n in self.leases.counts.items():
                ended.add_metric([reason], n)
            yield ended


def _spec_counters(stats, role: str):
    """Speculative decoding (--speculative-tokens): drafts verified, of them accepted, and accepted by position (a
    draft is accepted at position j only if those before it were: the acceptance rate of position j is
    accepted_by_position{j} / (drafted / K))."""
    for name, value, doc in (
        ("draft_tokens", stats.spec_drafts, "Tokens drafted by the MTP module and verified"),
        ("accepted_tokens", stats.spec_accepted, "Drafted tokens the target model accepted"),
    ):
        c = CounterMetricFamily(f"deltamesh_spec_{name}", doc, labels=["role"])
        c.add_metric([role], value)
        yield c
    by_position = CounterMetricFamily(
        "deltamesh_spec_accepted_tokens_by_position",
        "Drafted tokens accepted, by draft position (0: the first draft after the last token)",
        labels=["role", "position"],
    )
    for position, n in enumerate(stats.spec_accepted_at):
        by_position.add_metric([role, str(position)], n)
    yield by_position


def serve_worker_metrics(worker, host: str, port: int | None, leases=None) -> None:
    REGISTRY.register(EngineCollector(worker, leases))
    if port is not None:
        start_http_server(port, addr=host)
