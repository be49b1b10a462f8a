"""The engine core: model, pools, scheduler and sampler, stepped by one thread.

Other threads talk to it through a command queue (`submit`, `abort`, ...), which the stepping thread drains at
the start of every step; pool allocation is internally locked, so a decode worker can reserve space for an
incoming transfer from any thread. Outputs go to one sink (callback) per request, on the stepping thread.

Disaggregation hooks:
- prefill side: a request submitted with `hold_state=True` finishes after its first token, but its KV pages
  and GDN slot stay allocated ("held") until `release_held`; `held_regions` names the bytes to ship.
- decode side: `reserve` allocates a slot and pages for an incoming state and names the bytes to receive
  into; `submit_transferred` then starts decoding from the first token not yet consumed.
- the reverse direction (a conversation's next turn on a prefill worker): the decode worker pins a cached
  prefix (`pin_prefix`: its pages and checkpoint, read in place); the prefill worker reserves space, pulls it
  and `submit_pulled` starts the prompt from there, computing only the rest.
- parallel engines: a held state stays where the ranks keep it when the transport reads their memory
  (`rank_memory`, `RankBytes`): each tensor-parallel rank's part, or a data-parallel state whole on its rank;
  else it is gathered into the one-rank layout in the leader's hand-off area (tp_handoff.py). An arriving state
  (one-rank layout, or the sender's rank parts: reservations.RankParts) goes to the ranks before the request's
  first step.

With `prefix_cache` on, prompt prefills fill a PrefixCache (shared KV pages + GDN checkpoints) that later
admissions start from; a held state's pages may be shared with it (the transfer only reads them).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from deltamesh.engine import data_parallel
from deltamesh.engine.cache import PoolExhausted, RankBytes, Region, pool_views
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.parallel import shard_config
from deltamesh.engine.prefix_cache import TURN_START, PrefixCache
from deltamesh.engine.rank import build_rank
from deltamesh.engine.request import FinishReason, Request, RequestError, RequestOutput, Status, validate_request
from deltamesh.engine.reservations import Reservation, Reservations
from deltamesh.engine.sampling import SampledTokens, SamplingParams, sample_async
from deltamesh.engine.scheduler import ScheduledItem
from deltamesh.engine.state_shards import merge
from deltamesh.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deltamesh.engine.tp_handoff import store_rank_state
from deltamesh.engine.tp_workers import Followers, exports_rank_memory

log = structlog.get_logger("deltamesh.engine")

Sink = Callable[[RequestOutput], None]


@dataclass
class _InFlight:
    """A launched step: the requests that sample in it (in row order) and their tokens on the way; on CUDA, events
    around its forward pass (the GPU's time on it: step_report.py)."""

    requests: list[Request]
    sampled: SampledTokens
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    taken: bool = False  # its tokens went into their requests during the next step's launch (EngineCore._take_early)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    mixed_steps: int = 0  # steps that carried prompt tokens (eager, or piecewise CUDA graphs: cuda_graphs.py)
    finished: dict[str, int] = field(default_factory=dict)
    prefix_cache_hits: int = 0  # admissions that started from a cached prefix
    prefix_cache_hit_tokens: int = 0  # prompt tokens those admissions did not compute
    checkpoints_saved: int = 0
    checkpoints_evicted: int = 0
    pulled_prefix_tokens: int = 0  # prompt tokens whose state was pulled from another worker, not computed
    # CUDA: the GPU's time from the start to the end of each step's forward pass, summed. Steps queue behind each
    # other, so wall time minus this is time the GPU had no step to run (host work not hidden behind the GPU).
    gpu_step_ms: float = 0.0
    # Requests the engine prefilled itself (not transferred in): from arrival to their first scheduled step (queue)
    # and to their first token on the host, summed, and how many of each
    queue_seconds: float = 0.0
    queued: int = 0
    first_token_seconds: float = 0.0
    first_tokens: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = config.torch_device()
        self.gpu_timed = self.device.type == "cuda"  # each step's GPU time (EngineStats.gpu_step_ms)
        self.dtype = config.torch_dtype()
        model_dir = Path(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset(mc.eos_token_ids)
        self.max_model_len = config.resolved_max_model_len(mc.max_position_embeddings)

        # tensor parallelism and data-parallel attention: this process is rank 0, the followers are processes of
        # their own (tp_workers.py); a model that cannot be split fails here, before any rank starts
        self.data_parallel = config.data_parallel_size > 1
        shard_config(mc, config.num_ranks, config.enable_expert_parallel, data_parallel=self.data_parallel)
        self.followers = Followers(config, mc) if config.num_ranks > 1 else None
        tp = self.followers.group if self.followers else None
        rank = build_rank(config, mc, self.max_model_len, self.device, tp)
        # a parallel engine whose transport reads other ranks' memory: what each follower made readable
        self.rank_memory = self.followers.collect_rank_memory() if exports_rank_memory(config) else {}
        self.model, self.kernels, self.runner = rank.runner.model, rank.kernels, rank.runner
        self.state_pool, self.checkpoint_pool, self.kv_pool = rank.state_pool, rank.checkpoint_pool, rank.kv_pool
        self.scheduler, self.handoff = data_parallel.leader_scheduling(config, self.followers, rank)
        self.reservations = Reservations(self.scheduler, self.handoff, self.kv_pool, self.state_pool, self.device, mc)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self._sinks: dict[str, Sink] = {}
        self._held: dict[str, Request] = {}
        self._held_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._in_flight: _InFlight | None = None  # the launched step whose tokens the host has not read yet
        # during a launch: requests ended meanwhile, whose state is freed once the launch (which may write it) is
        # queued (_take_early), and their last outputs, sent only then: a client that sees its reply end may send
        # the next turn at once, and that turn should find this one in the prefix cache
        self._deferred: list[tuple[Request, FinishReason]] | None = None
        self._ended_early: list[RequestOutput] = []
        self._waiting_holds: deque[tuple[Request, RequestOutput]] = deque()  # for room in the hand-off area
        self.stats = EngineStats()
        self.prefix_cache: PrefixCache | None = None  # data parallel: data_parallel.RankPrefixCaches
        if self.device.type == "cuda":
            self._warm_up()
        if self.device.type == "cuda" and config.cuda_graphs:
            if self.data_parallel:
                log.warning("CUDA graphs off: data-parallel steps gather a varying number of tokens")
            elif self.kernels.chosen["paged_attention"] == "torch":
                log.warning("CUDA graphs off: the torch attention reference reads host lengths")
            else:
                if self.followers:
                    self.followers.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
                self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
                piecewise = config.resolved_piecewise_max_tokens()
                if piecewise and self.followers:
                    log.warning("piecewise CUDA graphs off: not built for tensor-parallel workers")
                elif piecewise:
                    self.runner.capture_piecewise_graphs(piecewise)
        # Made after the warm-up, whose repeated prompts must run (and compile) every step shape in full.
        if self.checkpoint_pool is not None:
            turn_start = self.tokenizer.token_id(TURN_START) if self.tokenizer else None
            make = lambda kv, states, checkpoints: PrefixCache(  # noqa: E731
                kv,
                states,
                checkpoints,
                self.stats,
                config.prefix_cache_pages,
                config.state_checkpoint_interval,
                turn_start,
                config.prefix_cache_memory_bytes(),
            )
            if self.data_parallel:
                self.prefix_cache = self.scheduler.attach_prefix_caches(make)
            else:
                self.prefix_cache = self.scheduler.prefix_cache = make(
                    self.kv_pool, self.state_pool, self.checkpoint_pool
                )
        log.info(
            "engine ready",
            model=str(model_dir),
            family=mc.family,
            device=str(self.device),
            dtype=str(self.dtype),
            kv_pages=self.kv_pool.num_pages,
            page_size=config.page_size,
            state_slots=config.max_num_seqs,
            max_model_len=self.max_model_len,
            kernels=self.kernels.chosen,
        )

    def _warm_up(self) -> None:
        """Run each kind of step once: a prefill, then a mixed step (that request's decode next to four prefills,
        one a 2-token tail, two taking their checkpoints in passing: the scratch slot's and a free slot's, their
        tails in a pass of their own), then decodes, so that kernel compilation (CuTe DSL, Triton) and autotuning
        happen before the worker serves, not inside a client's request (a first use of a step shape can cost
        seconds; a colocated worker meets the mixed shape with its first concurrent requests)."""
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        longest = self.max_model_len - params.max_tokens  # a tiny max_model_len only shortens the prompts
        n = 2 * self.config.page_size + 1
        for lengths in ([n], [n - 1, n + 3, 2, n + 5]):
            for token, k in enumerate(lengths, start=1):  # no two share a prefix: none starts from the cache
                prompt = [token] * max(1, min(k, longest))
                self.submit(self.make_request(prompt, params, f"warm-up-{next(self._ids)}"), lambda out: None)
            self.process_commands()
            self.step()
        while self.has_work:
            self.step()
        if self.prefix_cache is not None:  # nothing a client sent
            self.prefix_cache.clear()
        self.stats = EngineStats()

    # ---- building requests (any thread; validation only, no engine state touched) ------------------
    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_state: bool = False,
    ) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        self.validate(prompt_ids, params)
        detok = (
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
            if self.tokenizer
            else None
        )
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            detokenizer=detok,
            eos_token_ids=self.eos_token_ids,
            hold_state=hold_state,
        )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        n = len(prompt_ids)
        pages = self.kv_pool.pages_for(n + params.max_tokens)
        if pages > self.kv_pool.num_pages:
            raise RequestError(
                f"request needs {pages} KV pages but this worker's pool has {self.kv_pool.num_pages}; "
                "lower max_tokens or shorten the prompt"
            )

    # ---- commands (any thread) ------------------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        self._commands.put(("add", request, sink))

    def submit_transferred(self, request: Request, first_token: int, reservation: Reservation, sink: Sink) -> None:
        """Start decoding a request whose prompt state arrived in `reservation`; `first_token` was sampled
        by the prefill worker and is the first input not yet consumed."""
        request.output_ids = [first_token]
        request.num_computed = len(request.prompt_ids)
        request.slot, request.pages, request.dp_rank = reservation.slot, reservation.pages, reservation.rank
        request.staged, request.parts = reservation.staged, reservation.parts
        if request.detokenizer is not None:
            request.detokenizer.add(first_token)  # replays what the prefill worker already streamed
        self._commands.put(("add_running", request, sink))

    def submit_pulled(self, request: Request, num_tokens: int, reservation: Reservation, sink: Sink) -> None:
        """Start a prompt whose first `num_tokens` tokens' state arrived in `reservation` (pulled from another
        worker's prefix cache): only the rest is computed. A preempted request starts over from nothing."""
        request.num_computed = num_tokens
        request.slot, request.pages, request.dp_rank = reservation.slot, reservation.pages, reservation.rank
        self.stats.pulled_prefix_tokens += num_tokens
        self._commands.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def process_commands(self) -> list[RequestOutput]:
        outputs = self._retry_holds() if self._waiting_holds else []
        while True:
            try:
                kind, arg, sink = self._commands.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "abort":
                outputs.extend(self._abort(arg))
            elif arg.request_id in self.requests or self.held_request(arg.request_id) is not None:
                sink(
                    RequestOutput(
                        arg.request_id,
                        [],
                        "",
                        finished=True,
                        finish_reason=FinishReason.ERROR,
                        error=f"duplicate request id {arg.request_id!r}",
                    )
                )
                self.reservations.unstage(arg)
                self.scheduler.free(arg)  # the state it arrived with, if any, is not used
            else:
                self.requests[arg.request_id] = arg
                self._sinks[arg.request_id] = sink
                if kind == "add":
                    arg.arrival_time = time.monotonic()
                    self.scheduler.add(arg)
                elif (failed := self._place_arrived(arg)) is None:
                    self.scheduler.add_running(arg)
                else:
                    outputs.append(failed)

    def _place_arrived(self, req: Request) -> RequestOutput | None:
        """Before the request's first step: a state that arrived as its sender's rank parts goes to the ranks as
        it is when they are this engine's own ranks' parts, else is merged into the one-rank layout (in the
        pools, or a parallel engine's hand-off area); a parallel engine's goes from the area to its rank or
        ranks. When they could not take it, the request ends (its space freed): its last output."""
        if self.handoff is None and req.parts is None:
            return None
        try:
            if req.parts is not None:
                parts, req.parts = req.parts.unpacked(), None
                if self.handoff is not None and self.handoff.takes_parts(len(parts)):
                    self.handoff.hand_out(req.pages, req.slot, parts)  # its own ranks' parts: as they came
                    return None
                whole = merge(parts, self.model_config)
                if self.handoff is None:
                    store_rank_state(self.kv_pool, self.state_pool, req.pages, req.slot, whole)
                    return None
                self.handoff.area.write(req.staged, whole)
            self.handoff.scatter(req.pages, req.slot, req.dp_rank, req.staged)
            return None
        except Exception as e:
            log.exception("scattering an arrived state to the ranks failed", request_id=req.request_id)
            return self._finish(
                req, FinishReason.ERROR, error=f"the engine's ranks could not take the arrived state: {e}"
            )
        finally:
            self.reservations.unstage(req)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        if self.release_held(request_id):
            return []
        req = self.requests.get(request_id)
        return [self._finish(req, FinishReason.ABORT)] if req is not None else []

    # ---- the step (stepping thread) -----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one before it, and return that one's outputs (those a long
        launch already dispatched between its layers, `_take_early`, excepted: it leaves only the last outputs of
        the requests it ended).

        With async scheduling (the default) the host reads step N-1's tokens, checks stops, detokenises and
        streams them while the device runs step N, which was scheduled before those tokens were known (see the
        scheduler). Without it, each step is finished before this returns."""
        if self.failure:
            return self._fail_all(self.failure)
        previous, self._in_flight = self._in_flight, None
        items = self.scheduler.schedule()
        failed: list[tuple[Request, str]] = []
        if items:
            self._deferred = []
            try:
                self._in_flight = self._launch(items, previous)
            except Exception as e:  # a failed step must not take down other requests' bookkeeping
                log.exception("step failed", requests=[it.request.request_id for it in items])
                if self.followers is not None and (reason := self.followers.failure_within(1.0)):
                    return self._fail_all(reason)
                failed = [(it.request, f"engine step failed: {e}") for it in items]
            finally:
                deferred, self._deferred = self._deferred, None
                for req, reason in deferred:
                    self._release_state(req, reason)
        outputs, self._ended_early = self._ended_early, []
        if previous is not None and not previous.taken:
            outputs += self._complete(previous)
        outputs += [self._finish(r, FinishReason.ERROR, error=m) for r, m in failed if r.status != Status.FINISHED]
        if self._in_flight is not None and not self.config.async_scheduling:
            outputs += self._complete(self._in_flight)
            self._in_flight = None
        return outputs

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        """The engine cannot step any more (a tensor-parallel rank is gone): end every request with the reason."""
        self._in_flight = None
        return [self._finish(r, FinishReason.ERROR, error=reason) for r in list(self.requests.values())]

    @property
    def failure(self) -> str | None:
        """Why this engine cannot serve any more, or None."""
        return self.followers.failure if self.followers is not None else None

    def close(self) -> None:
        if self.followers is not None:
            self.followers.close()

    def _launch(self, items: list[ScheduledItem], previous: _InFlight | None) -> _InFlight:
        # decode-first, as kernels expect; the chunks that take a state in passing last (runner.host_step)
        items.sort(key=lambda it: (it.request.dp_rank, it.num_tokens != 1, it.snapshot_at is not None))
        started = time.monotonic()
        pending = previous.sampled.tokens if previous is not None else None
        span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.gpu_timed else None
        if span:
            span[0].record()
        if self.data_parallel:
            logits = data_parallel.execute(self.runner, self.followers, items, pending)
        else:
            # not with tensor-parallel followers: handing a held state over there is a collective, which must not
            # come between a forward pass's own
            early = None
            if previous is not None and self.followers is None:
                early = lambda: self._take_early(previous)  # noqa: E731
            logits = self.runner.execute(items, pending, between_layers=early)
        if span:
            span[1].record()
        sampling = [it.request for it in items if it.samples]
        mixed = False
        for it in items:
            req = it.request
            if req.scheduled_time is None and req.arrival_time is not None:
                req.scheduled_time = started
                self.stats.queue_seconds += started - req.arrival_time
                self.stats.queued += 1
            in_prompt = req.num_computed < len(req.prompt_ids)
            mixed |= in_prompt
            req.num_computed += it.num_tokens
            if req.num_computed <= len(req.prompt_ids):
                self.stats.prompt_tokens += it.num_tokens
            if in_prompt and self.prefix_cache is not None:  # queued after the step: it reads what the step wrote
                self.prefix_cache.register(req, it.snapshot_at, it.snapshot_slot)
        self.scheduler.release_snapshot_slots(items)
        self.stats.mixed_steps += mixed
        sampled = sample_async(
            logits,
            [r.params for r in sampling],
            [len(r.output_ids) + r.num_pending for r in sampling],
            self.generator,
        )
        for row, req in enumerate(sampling):
            req.num_pending += 1
            req.pending_row = row
        self.stats.steps += 1
        return _InFlight(sampling, sampled, span)

    def _take_early(self, step: _InFlight) -> None:
        """Called between the layers of the next step's launch. A long launch (a step with prompt tokens) blocks
        whenever the GPU's queue is full, so the GPU finishes `step` well before the launch is done: once `step`'s
        tokens are on the host, stream them then, not after the launch. A request they end keeps its state until
        the launch, which may still write it, is queued (`_deferred`), and its last output waits until then."""
        if not step.taken and step.sampled.ready():
            step.taken = True
            outputs = self._complete(step)
            ended = {req.request_id for req, _ in self._deferred}
            self.dispatch([out for out in outputs if out.request_id not in ended])
            self._ended_early += [out for out in outputs if out.request_id in ended]

    def _complete(self, step: _InFlight) -> list[RequestOutput]:
        """Take a launched step's tokens to the host and into its requests (skipping requests that ended
        meanwhile: aborted, or stopped by the token of the step before)."""
        tokens, logprobs = step.sampled.result()
        if step.span is not None:
            step.span[1].synchronize()  # returns at once: both events precede the tokens' copy on the stream
            self.stats.gpu_step_ms += step.span[0].elapsed_time(step.span[1])
        now = time.monotonic()
        outputs = []
        for req, tok, lp in zip(step.requests, tokens, logprobs):
            req.num_pending -= 1
            if req.status != Status.FINISHED and (out := self._append_token(req, tok, lp, now)) is not None:
                outputs.append(out)
        return outputs

    def _append_token(self, req: Request, token: int, lp, now: float) -> RequestOutput:
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
            if req.arrival_time is not None:
                self.stats.first_token_seconds += now - req.arrival_time
                self.stats.first_tokens += 1
        self.stats.generation_tokens += 1
        # A stop token ends the text without adding its own.
        stop_token = (not req.params.ignore_eos and token in req.eos_token_ids) or token in req.params.stop_token_ids
        detok = req.detokenizer
        text = detok.add(token) if detok is not None and not stop_token else ""
        req.check_stop(token, self.max_model_len)
        if req.finish_reason is not None and detok is not None:
            text += detok.flush()
        out = RequestOutput(
            req.request_id,
            [token],
            text,
            [lp] if lp else [],
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
        )
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason, out=out)
        elif req.hold_state and not self._hold(req, out):
            self.scheduler.remove(req)  # waits for room in the hand-off area, its output held back
            self._waiting_holds.append((req, out))
            return None
        return out

    def _retry_holds(self) -> list[RequestOutput]:
        """The outputs of waiting prefill-only requests whose states found room in the hand-off area."""
        done = []
        while self._waiting_holds and self._hold(*self._waiting_holds[0]):
            done.append(self._waiting_holds.popleft()[1])
        return done

    def _hold(self, req: Request, out: RequestOutput) -> bool:
        """Prefill-only request: done here, state kept for a decode worker to pull. A parallel engine moves the
        state into its hand-off area, and frees the ranks' space; False (nothing done) while the area is full.
        A parallel engine whose ranks' memory the transport reads keeps it where its ranks hold it instead."""
        if self.handoff is not None and not self.rank_memory:
            try:
                req.staged = self.handoff.gather(req.pages, req.slot, req.dp_rank)
            except PoolExhausted:
                return False
            except Exception as e:
                log.exception("gathering a held state from the ranks failed", request_id=req.request_id)
                self._finish(
                    req, FinishReason.ERROR, out=out, error=f"the engine's ranks could not hand over the state: {e}"
                )
                return True
            self.scheduler.free(req)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        del self.requests[req.request_id]
        with self._held_lock:
            self._held[req.request_id] = req
        out.finished = True
        return True

    def _finish(self, req: Request, reason: FinishReason, out: RequestOutput | None = None, error: str | None = None):
        self.scheduler.remove(req)
        if any(r is req for r, _ in self._waiting_holds):  # aborted while waiting for the hand-off area
            self._waiting_holds = deque(w for w in self._waiting_holds if w[0] is not req)
        if self._deferred is not None:  # a launch in progress may still write its state
            self._deferred.append((req, reason))
        else:
            self._release_state(req, reason)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        if out is None:
            out = RequestOutput(
                req.request_id, [], "", num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids)
            )
        out.finished, out.finish_reason, out.stop_reason, out.error = True, reason, req.stop_reason, error
        return out

    def _release_state(self, req: Request, reason: FinishReason) -> None:
        if self.prefix_cache is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.prefix_cache.register_finished(req)  # the next turn of a conversation starts from here
        self.scheduler.free(req)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's sink (stepping thread); a finished request's sink is dropped."""
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # a gone consumer must not stop the engine
                    log.exception("output sink failed", request_id=out.request_id)

    # ---- held states (prefill side; any thread) ---------------------------------------------------------
    def held_request(self, request_id: str) -> Request | None:
        with self._held_lock:
            return self._held.get(request_id)

    def held_regions(self, request_id: str) -> list[Region]:
        req = self.held_request(request_id)
        if req is None:
            raise KeyError(request_id)
        if req.staged is not None:  # a parallel engine's: in its hand-off area
            return self.handoff.staged_regions(req.staged)
        own = self.kv_pool.regions(req.pages) + self.state_pool.regions(req.slot)
        if not self.rank_memory:
            return own
        if self.data_parallel:  # where its rank keeps it, whole
            if not req.dp_rank:
                return own
            pools = self.scheduler.pools[req.dp_rank]
            return self._rank_bytes(req.dp_rank, pools.kv.regions(req.pages) + pools.states.regions(req.slot))
        # tensor parallel: every rank's part, in rank order (StateLayout.rank_parts)
        return own + [b for rank in sorted(self.rank_memory) for b in self._rank_bytes(rank, own)]

    def _rank_bytes(self, rank: int, regions: list[Region]) -> list[RankBytes]:
        """`regions` (kv runs, conv, recurrent) of pools shaped as rank `rank`'s (the leader's own, or its
        bookkeeping copy of a data-parallel rank's), at the same offsets in that rank's pools."""
        (kv, _), (conv, _), (recurrent, _) = self.rank_memory[rank].pools
        starts = [kv] * (len(regions) - 2) + [conv, recurrent]
        return [RankBytes(rank, start + r.tensor.storage_offset(), r.nbytes) for start, r in zip(starts, regions)]

    def pool_views(self) -> list[torch.Tensor | RankBytes]:
        """What a holder lets peers read: each pool's whole memory (of a parallel engine: its hand-off area's, or
        every rank's pools when the transport reads the ranks' memory)."""
        if self.rank_memory:
            return pool_views(self.kv_pool, self.state_pool) + [
                RankBytes(rank, start, size)
                for rank, memory in sorted(self.rank_memory.items())
                for start, size in memory.pools
            ]
        return self.handoff.views() if self.handoff is not None else pool_views(self.kv_pool, self.state_pool)

    def release_held(self, request_id: str) -> bool:
        with self._held_lock:
            req = self._held.pop(request_id, None)
        if req is None:
            return False
        self.reservations.unstage(req)
        self.scheduler.free(req)
        return True

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- reservations (decode side; any thread) ----------------------------------------------------------
    def reserve(self, num_tokens: int, sender_parts: int = 0) -> Reservation:
        return self.reservations.reserve(num_tokens, sender_parts)

    def cancel_reservation(self, reservation: Reservation) -> None:
        self.reservations.cancel(reservation)

    # ---- observability ----------------------------------------------------------------------------------------
    def loads(self) -> dict:
        cached_only = self.prefix_cache.reclaimable() if self.prefix_cache is not None else 0
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "held": self.num_held,
            # pages requests hold; pages only the prefix cache holds are free on demand, so they count apart
            "kv_pages_used": self.scheduler.kv_pool.num_used - cached_only,
            "kv_pages_cached": cached_only,
            "kv_pages_total": self.scheduler.kv_pool.num_pages,
            "state_slots_used": self.scheduler.state_pool.num_used,
            "state_slots_total": self.scheduler.state_pool.num_slots,
            "prefix_cache_pages": self.prefix_cache.num_pages if self.prefix_cache is not None else 0,
            "prefix_cache_checkpoints": self.prefix_cache.num_checkpoints if self.prefix_cache is not None else 0,
            "prefix_cache_bytes": self.prefix_cache.num_bytes if self.prefix_cache is not None else 0,  # vs the budget
            "prefix_cache_hits": self.stats.prefix_cache_hits,
            "prefix_cache_hit_tokens": self.stats.prefix_cache_hit_tokens,
            "checkpoints_saved": self.stats.checkpoints_saved,
            "checkpoints_evicted": self.stats.checkpoints_evicted,
        }
