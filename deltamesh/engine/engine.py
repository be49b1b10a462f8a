"""The monolithic engine: `EngineCore` stepped by a background thread, with a blocking `generate` and an
asyncio streaming `generate_stream`. This is the reference the disaggregated path is compared against."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from deltamesh.engine.cache import RankBytes, Region
from deltamesh.engine.core import EngineCore
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.handoff import check_layouts, compat_hash
from deltamesh.engine.prefix_cache import PinnedPrefix, PrefixCache
from deltamesh.engine.request import FinishReason, Request, RequestError, RequestOutput, TokenLogprobs
from deltamesh.engine.reservations import Reservation
from deltamesh.engine.step_report import StepReport
from deltamesh.protocol.sampling import SamplingParams

log = structlog.get_logger("deltamesh.engine")

# How long the stepping thread sleeps when it has requests but none could run, unless woken sooner (a command, a
# grammar compiled): what they wait for may also come from a thread that does not wake it (pages freed).
IDLE_WAIT_S = 0.005


@dataclass
class Completion:
    """A finished request, all steps merged."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # SamplingParams.prompt_logprobs: prompt tokens 1..n-1's

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error


class _Mailbox:
    """One request's outputs on their way from the stepping thread to the coroutine that streams them. Outputs it
    has not taken yet merge into one (RequestOutput.then): the event loop is woken once per request per step at
    most, and a consumer that falls behind (a slow client, a loop busy with many streams) takes what piled up in
    one go, its cost per step, not per token, so a backlog cannot grow (as vLLM's RequestOutputCollector)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._out: RequestOutput | None = None
        self._ready = asyncio.Event()  # set (on the loop) once an output waits

    def put(self, out: RequestOutput) -> None:
        """The stepping thread's sink."""
        with self._lock:
            waiting = self._out
            first = waiting is None
            self._out = out if waiting is None else waiting.then(out)
        if first:
            self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        with self._lock:
            out, self._out = self._out, None
            self._ready.clear()
        assert out is not None, "_ready is set only while an output waits"
        return out


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig(**overrides)
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self._wake = threading.Event()
        self.core.grammars.on_compiled = self._wake.set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- the stepping thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        report = StepReport(core)
        log_stats = core.config.log_stats
        while not self._stop.is_set():
            core.dispatch(core.process_commands())
            if core.has_work:
                started = time.perf_counter()
                core.dispatch(core.step())
                report.step_seconds += time.perf_counter() - started
                if core.idle:  # every request waits (for a grammar to compile, for pool space): no spinning meanwhile
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            if log_stats:
                report.maybe_log()
        report.close()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- submitting -----------------------------------------------------------------------------------
    def submit(self, request: Request, sink) -> None:
        self.core.submit(request, sink)
        self._wake.set()

    def submit_transferred(
        self, request: Request, first_token: int, reservation: Reservation, sink, drafts: Sequence[int] = ()
    ) -> None:
        self.core.submit_transferred(request, first_token, reservation, sink, drafts)
        self._wake.set()

    def submit_pulled(self, request: Request, num_tokens: int, reservation: Reservation, sink) -> None:
        self.core.submit_pulled(request, num_tokens, reservation, sink)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._wake.set()

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None, hold_state: bool = False):
        return self.core.make_request(prompt, params, request_id, hold_state)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.core.requests

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many tokens of this prompt the prefix cache would serve now (0 without a cache); any thread."""
        cache = self.core.prefix_cache
        return cache.cached_tokens(prompt_ids) if cache is not None else 0

    def prefix_resume_keys(self) -> set[int]:
        """The keys of the cached prefixes a request can resume after (empty without a cache); any thread."""
        cache = self.core.prefix_cache
        return cache.resume_keys() if cache is not None else set()

    # ---- state hand-off (disaggregation): what the services use, with the layout the engine owns ---------------
    @functools.cached_property
    def compat_hash(self) -> str:
        """Equal on two engines exactly when one's held state can be pulled into the other's pools."""
        return compat_hash(self.core.config, self.core.model_config)

    @property
    def tensor_parallel_size(self) -> int:
        return self.core.config.tensor_parallel_size

    def check_sender_layout(self, tensor_parallel_size: int) -> None:
        """Raise handoff.LayoutMismatch unless state computed on `tensor_parallel_size` ranks (of a worker with
        this engine's compat hash) can be split onto this engine's ranks."""
        check_layouts(self.core.model_config, tensor_parallel_size, self.tensor_parallel_size)

    def held_buffers(self, request_id: str) -> list[torch.Tensor | RankBytes]:
        """A held request's state (KeyError if not held) as 1-D byte views of the pools (of a parallel engine: of
        its hand-off area; with `rank_memory`, other ranks' bytes where they hold it), in hand-off order."""
        return [r.tensor if isinstance(r, Region) else r for r in self.core.held.regions(request_id)]

    def pool_buffers(self) -> list[torch.Tensor | RankBytes]:
        """Each pool's whole memory as a 1-D byte view (of a parallel engine: its hand-off area's, made now; of
        one with `rank_memory`, every rank's pools): what a holder lets peers read."""
        return list(self.core.held.pool_views())

    @property
    def rank_memory(self) -> dict[int, bytes]:
        """What each of a parallel engine's other ranks made readable of its pools through the engine's
        `rank_exporter` (rank -> the exporter's bytes); empty without one."""
        return {rank: memory.exported for rank, memory in self.core.rank_memory.items()}

    def held_drafts(self, request_id: str) -> list[int]:
        """The tokens a held request's MTP module drafted after its first token (speculative decoding; none
        without): the decode worker verifies them in its first step."""
        return self.core.held.drafts(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a held state; False if it was not held. Wakes the stepping thread: a prefill may be waiting for
        the room this frees in a parallel engine's hand-off area."""
        released = self.core.held.release(request_id)
        self._wake.set()
        return released

    def reserve(self, num_tokens: int, sender_parts: int = 0) -> Reservation:
        """Pool space for an incoming state of `num_tokens` prompt tokens; raises PoolExhausted when full. Its
        `regions` are what a pull fills; then `submit_transferred`, or `cancel_reservation`. `sender_parts`: the
        state comes as that many tensor-parallel ranks' parts (StateLayout.rank_parts), 0 in the one-rank layout."""
        return self.core.reservations.reserve(num_tokens, sender_parts)

    @property
    def holds_rank_parts(self) -> bool:
        """Whether a held state is offered as each tensor-parallel rank's part where it is (StateLayout.rank_parts),
        not merged into the one-rank layout first."""
        return bool(self.core.rank_memory) and self.tensor_parallel_size > 1

    def pin_prefix(self, prompt_ids: list[int]) -> tuple[PinnedPrefix, list[torch.Tensor]] | None:
        """The longest cached prefix of this prompt that ends at a checkpoint, kept from eviction until
        `unpin_prefix` (PrefixCache.pin), and its state as 1-D byte views in the order a reservation of its length
        is filled (`reserve`): its pages, then the checkpoint. None without a hit, or on a parallel engine (its
        pools are across ranks; its hand-off area holds only what is being handed off)."""
        cache = self.core.prefix_cache
        if cache is None or self.core.handoff is not None:
            return None
        assert isinstance(cache, PrefixCache), "a one-rank engine's (a data-parallel one has a hand-off area)"
        pinned = cache.pin(prompt_ids)
        return None if pinned is None else (pinned, [r.tensor for r in cache.regions(pinned)])

    def synchronize(self) -> None:
        """Block until every step and copy queued on the engine's stream so far has run (CUDA; blocking)."""
        torch.cuda.default_stream(self.device).synchronize()

    def unpin_prefix(self, pinned: PinnedPrefix) -> None:
        cache = self.core.prefix_cache
        assert isinstance(cache, PrefixCache), "pinned by pin_prefix, on a one-rank engine's cache"
        cache.unpin(pinned)

    def cancel_reservation(self, reservation: Reservation) -> None:
        self.core.reservations.cancel(reservation)

    def loads(self) -> dict:
        return self.core.loads()

    @property
    def stats(self):
        """Token, step and finish counters (EngineStats); `num_preemptions` beside them."""
        return self.core.stats

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions

    @property
    def graph_steps(self) -> int:
        """Decode-only steps replayed from a CUDA graph."""
        return self.core.runner.graph_steps

    @property
    def piecewise_graph_steps(self) -> int:
        """Steps with prompt tokens replayed from CUDA graphs piece by piece."""
        return self.core.runner.piecewise_steps

    @property
    def failure(self) -> str | None:
        """Why this engine cannot serve any more (a parallel engine's rank is gone), or None."""
        return self.core.failure

    @property
    def has_prefix_cache(self) -> bool:
        return self.core.prefix_cache is not None

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def num_state_slots(self) -> int:
        return self.core.scheduler.usage().state_slots_total

    # ---- blocking API -------------------------------------------------------------------------------------
    def generate(
        self, prompts: str | list[int] | list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run prompts to completion, together in one continuous batch. Returns one Completion per prompt."""
        params = params or SamplingParams()
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        requests = [self.make_request(p, params) for p in batch]
        results = {r.request_id: Completion(r.request_id, r.prompt_ids) for r in requests}
        done = threading.Semaphore(0)

        def sink(out: RequestOutput) -> None:
            results[out.request_id].add(out)
            if out.finished:
                done.release()

        for r in requests:
            self.submit(r, sink)
        for _ in requests:
            done.acquire()
        return [results[r.request_id] for r in requests]

    # ---- streaming API -------------------------------------------------------------------------------------
    async def generate_stream(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; leaving the loop early aborts the request."""
        request = self.make_request(prompt, params, request_id)
        async for out in self.stream(request):
            yield out

    async def stream(self, request: Request, submit=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; those that arrive while the consumer is busy come merged as one."""
        mailbox = _Mailbox(asyncio.get_running_loop())
        (submit or self.submit)(request, mailbox.put)
        finished = False
        try:
            while not finished:
                out = await mailbox.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)


__all__ = ["Completion", "Engine", "EngineConfig", "RequestError", "SamplingParams"]
