"""The engine core: the step loop around a model, its pools, a scheduler and the sampler, run by one thread.

Other threads talk to it through a command queue (`submit`, `abort`, ...), which the stepping thread drains at
the start of every step; pool allocation is internally locked, so a decode worker can reserve space for an
incoming transfer from any thread. Outputs go to one sink (callback) per request, on the stepping thread.

The loop (`step`): take the commands; schedule; launch the step on the device (step.py: forward pass, the
requests' progress, sampling, in stages); then, while the device runs it, read the previous step's tokens on the
host (`_complete`), append each to its request, which checks for a stop and detokenises (Request.add_token),
and end, hold or stream the requests (`_finish`, `_hold`, `dispatch`).

Async scheduling (the default): step N+1 is scheduled and launched before step N's tokens reach the host; the
scheduler counts those tokens as pending (scheduler.py), the runner takes them from the device. A long launch
streams the previous step's tokens between its layers (`_take_early`). A request that ends meanwhile keeps its
state until the launch, which may still write it, is queued (`_deferred`), and a pull into space it freed waits
for the launch too (reservations.Reservation.ready).

Its parts: assembly.py builds them (and warms the engine up); held_states.py keeps the states of prefill-only
requests for a puller, and reservations.py the space of arriving ones and their placement before their first
step (the hand-off with a parallel engine's ranks: tp_handoff.py); stats.py counts; the scheduler and the
prefix cache are used through their interfaces (interfaces.py), which data_parallel.py implements for several
ranks.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from deltamesh.engine.assembly import assemble, get_ready
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.grammar import Grammars
from deltamesh.engine.interfaces import PrefixCacheInterface
from deltamesh.engine.request import FinishReason, Request, RequestOutput, Status
from deltamesh.engine.reservations import Reservation
from deltamesh.engine.scheduler import ScheduledItem
from deltamesh.engine.spec.tokens import state_known
from deltamesh.engine.stats import EngineStats, loads
from deltamesh.engine.step import LaunchedStep, StepLauncher
from deltamesh.protocol.sampling import SamplingParams

log = structlog.get_logger("deltamesh.engine")

Sink = Callable[[RequestOutput], None]


class EngineCore:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.device = config.torch_device()
        parts = assemble(config, self.device)
        self.model_config, self.tokenizer, self.max_model_len = parts.model_config, parts.tokenizer, parts.max_model_len
        self.followers, self.rank_memory, self.handoff = parts.followers, parts.rank_memory, parts.handoff
        self.data_parallel = config.data_parallel_size > 1
        rank = parts.rank
        self.model, self.kernels, self.runner = rank.runner.model, rank.kernels, rank.runner
        self.kv_pool, self.state_pool, self.checkpoint_pool = rank.kv_pool, rank.state_pool, rank.checkpoint_pool
        self.scheduler, self.request_builder = parts.scheduler, parts.request_builder
        self.reservations, self.held = parts.reservations, parts.held
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.request_builder.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._sinks: dict[str, Sink] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = EngineStats()
        self.launcher = StepLauncher(
            self.runner, self.followers, self.scheduler, self.stats, self.device, config.seed, self.data_parallel
        )
        self.launcher.max_model_len = self.max_model_len
        self._in_flight: LaunchedStep | None = None  # the launched step whose tokens the host has not read yet
        self.idle = False  # the last `step` launched nothing and had nothing in flight: every request waits
        # during a launch: requests ended meanwhile, whose state is freed once the launch (which may write it) is
        # queued (_take_early), and their last outputs, sent only then: a client that sees its reply end may send
        # the next turn at once, and that turn should find this one in the prefix cache
        self._deferred: list[tuple[Request, FinishReason]] | None = None
        self._ended_early: list[RequestOutput] = []
        self.prefix_cache: PrefixCacheInterface | None = None  # made by get_ready, before the warm-up
        get_ready(self, config, parts)

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, hold_state: bool = False
    ) -> Request:
        """A request for `submit` (any thread; RequestBuilder.build), its grammar's compile started."""
        request = self.request_builder.build(prompt, params, request_id, hold_state)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.start(params.structured_outputs)
        return request

    # ---- commands (any thread) ------------------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> None:
        self._commands.put(("add", request, sink))

    def submit_transferred(
        self, request: Request, first_token: int, reservation: Reservation, sink: Sink, drafts: Sequence[int] = ()
    ) -> None:
        """Start decoding a request whose prompt state arrived in `reservation`; `first_token` was sampled
        by the prefill worker and is the first input not yet consumed; `drafts`: the tokens its MTP module drafted
        after it (speculative decoding), verified in the first step."""
        request.output_ids = [first_token]
        request.draft_ids = list(drafts)
        request.num_computed = len(request.prompt_ids)
        reservation.hand_to(request)
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
        outputs = self._retry_holds() if self.held.waiting else []
        while True:
            try:
                kind, arg, sink = self._commands.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "abort":
                if not self.held.release(arg) and (req := self.requests.get(arg)) is not None:
                    outputs.append(self._finish(req, FinishReason.ABORT))
            elif arg.request_id in self.requests or self.held.get(arg.request_id) is not None:
                error = f"duplicate request id {arg.request_id!r}"
                sink(
                    RequestOutput(arg.request_id, [], "", finished=True, finish_reason=FinishReason.ERROR, error=error)
                )
                self.reservations.discard(arg)  # the state it arrived with, if any, is not used
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
        """An arrived state to the ranks that run it (Reservations.place); when they could not take it, the
        request ends (its space freed): its last output."""
        try:
            self.reservations.place(req)
            return None
        except Exception as e:
            log.exception("scattering an arrived state to the ranks failed", request_id=req.request_id)
            error = f"the engine's ranks could not take the arrived state: {e}"
            return self._finish(req, FinishReason.ERROR, error=error)

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
        self.idle = not items and previous is None
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
        self.grammars.close()
        if self.followers is not None:
            self.followers.close()

    def _launch(self, items: list[ScheduledItem], previous: LaunchedStep | None) -> LaunchedStep:
        # not with tensor-parallel followers: handing a held state over there is a collective, which must not
        # come between a forward pass's own; data parallel: not between its ranks' collectives either
        early = None
        if previous is not None and self.followers is None:
            early = lambda: self._take_early(previous)  # noqa: E731
        return self.launcher.launch(items, previous, early, lambda sampling: self._feed_grammars(previous, sampling))

    def _take_early(self, step: LaunchedStep, wait: bool = False) -> None:
        """Called between the layers of the next step's launch. A long launch (a step with prompt tokens) blocks
        whenever the GPU's queue is full, so the GPU finishes `step` well before the launch is done: once `step`'s
        tokens are on the host, stream them then, not after the launch. A request they end keeps its state until
        the launch, which may still write it, is queued (`_deferred`), and its last output waits until then.
        `wait`: take them even if that means waiting for the device (`_feed_grammars`)."""
        if not step.taken and (wait or step.sampled.ready()):
            step.taken = True
            outputs = self._complete(step)
            assert self._deferred is not None, "called between the layers of a launch, which defers endings"
            ended = {req.request_id for req, _ in self._deferred}
            self.dispatch([out for out in outputs if out.request_id not in ended])
            self._ended_early += [out for out in outputs if out.request_id in ended]

    def _feed_grammars(self, previous: LaunchedStep | None, sampling: list[Request]) -> None:
        """Before the launched step's rows sample under their grammars (step.py), once its forward pass is queued:
        the previous step's tokens into their requests, so into their matchers (waiting for them: the device made
        them before this forward pass, which it runs meanwhile); a matcher made only now (a request transferred
        with its first token) fed the tokens before it; a request whose grammar failed to compile ended."""
        if previous is not None:
            self._take_early(previous, wait=True)
        for req in sampling:
            grammar = req.grammar
            if grammar is not None and req.status != Status.FINISHED:
                grammar.advance(req.output_ids)
                if grammar.error is not None:
                    self._ended_early.append(self._finish(req, FinishReason.ERROR, error=grammar.error))

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Take a launched step's tokens to the host and into its requests (skipping requests that ended
        meanwhile: aborted, or stopped by the token of the step before)."""
        rows = step.read(self.stats)
        now = time.monotonic()
        outputs = []
        for req, (tokens, logprobs) in zip(step.requests, rows):
            req.num_pending -= 1
            if (out := _append_run(self._append_token, req, tokens, logprobs, now)) is not None:
                outputs.append(out)
        return outputs

    def _append_token(self, req: Request, token: int, lp, now: float) -> RequestOutput | None:
        if req.first_token_time is None:
            req.first_token_time = now
            if req.arrival_time is not None:
                self.stats.first_token_seconds += now - req.arrival_time
                self.stats.first_tokens += 1
        self.stats.generation_tokens += 1
        out = req.add_token(token, lp, self.max_model_len)
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason, out=out, error=req.grammar.error if req.grammar else None)
        elif req.hold_state and not self._hold(req, out):
            self.scheduler.remove(req)  # waits for room in the hand-off area, its output held back
            self.held.waiting.append((req, out))
            return None
        return out

    def _retry_holds(self) -> list[RequestOutput]:
        """The outputs of waiting prefill-only requests whose states found room in the hand-off area."""
        done = []
        while self.held.waiting and self._hold(*self.held.waiting[0]):
            done.append(self.held.waiting.popleft()[1])
        return done

    def _hold(self, req: Request, out: RequestOutput) -> bool:
        """Prefill-only request: done here, its state kept for a decode worker to pull (HeldStates.keep); False,
        nothing done, while a parallel engine's hand-off area has no room for it."""
        try:
            if not self.held.keep(req):
                return False
        except Exception as e:
            log.exception("gathering a held state from the ranks failed", request_id=req.request_id)
            self._finish(
                req, FinishReason.ERROR, out=out, error=f"the engine's ranks could not hand over the state: {e}"
            )
            return True
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        del self.requests[req.request_id]
        out.finished = True
        return True

    def _finish(self, req: Request, reason: FinishReason, out: RequestOutput | None = None, error: str | None = None):
        self.scheduler.remove(req)
        self.held.forget_waiting(req)  # aborted while waiting for the hand-off area
        if self._deferred is not None:  # a launch in progress may still write its state
            self._deferred.append((req, reason))
        else:
            self._release_state(req, reason)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        if out is None:
            out = RequestOutput(
                req.request_id,
                [],
                "",
                num_prompt_tokens=len(req.prompt_ids),
                num_output_tokens=len(req.output_ids),
                num_cached_tokens=req.num_cached_tokens or 0,
            )
        out.finished, out.finish_reason, out.stop_reason, out.error = True, reason, req.stop_reason, error
        return out

    def _release_state(self, req: Request, reason: FinishReason) -> None:
        if self.prefix_cache is not None and reason in (FinishReason.STOP, FinishReason.LENGTH) and state_known(req):
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

    def loads(self) -> dict:
        return loads(self.scheduler, self.prefix_cache, len(self.held), self.stats)


def _append_run(append, req: Request, tokens, logprobs, now: float) -> RequestOutput | None:
    """A step's tokens of `req` (one, or one to K+1 from a speculative step) appended in turn until one ends it,
    as one output (None if the request had ended before the first)."""
    out = None
    for tok, lp in zip(tokens, logprobs):
        if req.status == Status.FINISHED or (piece := append(req, tok, lp, now)) is None:
            break
        out = piece if out is None else out.then(piece)
    return out
