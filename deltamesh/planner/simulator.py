"""A discrete-event simulation of a mesh serving a traffic: the router, each worker's queue and engine steps, and
the state hand-off between prefill and decode workers.

Each simulated worker schedules its steps by the engine's own rules (engine/scheduler.py): every running request's
next tokens first (one for a decode, a chunk for a prompt in progress), then new requests from its queue, all under
the step's token budget; a request is admitted when a state slot and KV pages for its whole prompt are free; a
running request that cannot grow its KV preempts the most recently admitted one, which is recomputed later. A step
lasts what the worker's profile says a step of those tokens takes (profile.py); the tokens it samples are out when
it ends, and the next step starts at once while there is work.

The router (sim_router.py) sends each request to the least loaded worker (requests it has sent there and not seen
end: what `--policy cache_aware` does for prompts with nothing in common). Colocated, a worker prefills and decodes
its own requests. Disaggregated, the router first admits the request to a decode worker with room for it, as the
real router does (sim_router.py), and sends it to a prefill worker; that worker holds the state after the first
token (its slot and pages stay taken), the router hands the request to its decode worker, which takes a slot and
pages for the prompt, pulls the state (the profile's transfer time) and decodes; the prefill worker's state is
freed when the pull ends.

The serving path (the REST gateway, the router, the network: `path_ms`, measured by bench/plan_check.py from the
client's and the workers' TTFT) takes that long each way: a request reaches its worker `path_ms` after it is sent,
and its tokens reach the client `path_ms` after its worker made them, so a closed-loop client sends its next
request only then. The gateway and the router each handle a request on one event loop, so requests sent together
pass one after another, `path_ms` apart: a worker with nothing to do starts a step with the first (as the engine
does), and the others join a later step. A hand-off from prefill to decode is left at the transfer's time.

Workers on one GPU (`Layout.one_gpu`: 1P+1D in two shares of a GPU) take turns on it: processes without MPS do
not run kernels at the same time, so while k of them have a step to run each advances at 1/k of its own speed
(processor sharing, `SharedGpu`); a worker alone on it runs at full speed.

What is left out: the host time the engine overlaps with the device (async scheduling is modelled as steps back to
back), prefix-cache hits, and transfers slowing each other down.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deltamesh.planner.layouts import Layout, Role
from deltamesh.planner.sim_router import Router
from deltamesh.planner.traffic import Traffic

MAX_STEPS = 5_000_000  # a guard: a simulation this long is a mistake (a layout far too small for its traffic)


class SimulationError(RuntimeError):
    """A traffic this layout cannot serve at all (a request larger than a worker's KV pool), or a runaway run."""


@dataclass(eq=False)
class SimRequest:
    index: int
    prompt_len: int
    output_len: int
    arrival: float | None  # None: closed loop, sent when a client is free
    sent: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    computed: int = 0  # tokens whose state is in a worker's pools (reset by a preemption)
    generated: int = 0
    pages: int = 0
    has_slot: bool = False
    done: bool = False  # left its worker's running list in the step that just ended

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated


class SharedGpu:
    """One GPU that several workers' steps share (module docstring): each running step's remaining time alone
    shrinks at 1/k while k steps run; the first to reach zero ends, the others go on at their new share."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.steps: dict[Worker, list] = {}  # worker -> [seconds alone left, when it ends: callback, args, internal]
        self.since = 0.0  # when the remaining times were last brought up to date
        self.version = 0  # the end event scheduled last; earlier ones are stale

    def run(self, worker: Worker, seconds: float, done: Callable, args: tuple, internal: bool) -> None:
        self._advance()
        self.steps[worker] = [seconds, done, args, internal]
        self._schedule_next_end()

    def _advance(self) -> None:
        if self.steps:
            share = (self.sim.now - self.since) / len(self.steps)
            for step in self.steps.values():
                step[0] -= share
        self.since = self.sim.now

    def _schedule_next_end(self) -> None:
        self.version += 1
        if self.steps:
            left, _, _, internal = min(self.steps.values(), key=lambda step: step[0])
            when = self.sim.now + max(left, 0.0) * len(self.steps)
            self.sim.at(when, self._end, self.version, internal=internal)

    def _end(self, version: int) -> None:
        if version != self.version:
            return  # the shares changed after this end was scheduled
        self._advance()
        worker = min(self.steps, key=lambda w: self.steps[w][0])
        _, done, args, _ = self.steps.pop(worker)
        self._schedule_next_end()
        done(*args)


class Worker:
    """One worker's engine: a queue, a running batch and pools (slots = max_num_seqs, pages from its memory)."""

    def __init__(self, sim: Simulation, name: str, kind: str, role: Role, kv_tokens: int):
        self.sim, self.name, self.kind = sim, name, kind  # kind: colocated | prefill | decode
        self.profile = role.profile
        self.max_num_seqs, self.budget = role.max_num_seqs, role.max_num_batched_tokens
        self.page_size = self.profile.memory.page_size
        self.pages_total = kv_tokens // self.page_size
        self.pages_used = self.slots_used = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.handoffs: deque[tuple[SimRequest, Worker]] = deque()  # decode: states waiting for room here
        self.held: dict[int, int] = {}  # prefill: request index -> pages of a state held for a decode worker
        self.busy = False
        self._poked = False  # a wake-up is queued for this instant
        self.inflight = 0  # what the router has sent here and not seen end
        self.busy_seconds = 0.0
        self.steps = self.preemptions = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ---- arrivals ---------------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.wake()

    def hand_off(self, req: SimRequest, holder: Worker) -> None:
        """Decode: a prefilled request to reserve room for, pull and decode."""
        self.handoffs.append((req, holder))
        self.take_handoffs()

    def take_handoffs(self) -> None:
        while self.handoffs:
            req, holder = self.handoffs[0]
            need = self.pages_for(req.prompt_len)
            if self.slots_used >= self.max_num_seqs or self.pages_total - self.pages_used < need:
                return
            self.handoffs.popleft()
            self.slots_used += 1
            self.pages_used += need
            req.has_slot, req.pages = True, need
            self.sim.at(self.sim.now + self.profile.transfer_ms(req.prompt_len) / 1e3, self._pulled, req, holder)

    def _pulled(self, req: SimRequest, holder: Worker) -> None:
        holder.release(req)
        req.computed = req.prompt_len
        self.running.append(req)
        self.wake()

    def _hold(self, req: SimRequest) -> None:
        """Prefill: the request leaves the batch, its slot and pages stay taken until `release`."""
        self.held[req.index] = req.pages
        req.has_slot, req.pages = False, 0

    def release(self, req: SimRequest) -> None:
        """Prefill: a held state is freed (pulled, or its request ended after one token)."""
        self.pages_used -= self.held.pop(req.index)
        self.slots_used -= 1
        self.wake()

    # ---- steps ----------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Start a step once everything else of this instant has happened (requests arriving together are
        scheduled together, as the engine takes every command queued before a step)."""
        if not self.busy and not self._poked:
            self._poked = True
            self.sim.at(self.sim.now, self._start_step, internal=True)

    def _start_step(self) -> None:
        self._poked = False
        if self.busy:
            return
        items = self._schedule()
        if not items:
            return
        decodes = prompt_tokens = 0
        context = pairs = 0.0
        for _, n, start in items:
            if n == 1:
                decodes += 1
                context += start
            else:
                prompt_tokens += n
                pairs += n * (start + n / 2)
        context = context / decodes if decodes else 0.0
        seconds = self.profile.step_ms(decodes, context, prompt_tokens, pairs) / 1e3
        steps = 1
        # (not on a shared GPU: how long a run of steps lasts there depends on what the other workers do meanwhile)
        alone = self.sim.shared_gpu is None
        # (nor on a prefill worker, whose one-token prompts look like decodes but end there after one step)
        steady = decodes == len(items) == len(self.running) and not self.waiting and not self.handoffs
        if alone and self.kind != "prefill" and steady:
            steps, seconds = self._stretch(items, context, seconds)
        self.busy = True
        self.busy_seconds += seconds
        self.steps += steps
        self.sim.steps += steps
        internal = not self._ends_any(items, steps)
        if self.sim.shared_gpu:
            self.sim.shared_gpu.run(self, seconds, self._end_step, (items, steps), internal)
        else:
            self.sim.at(self.sim.now + seconds, self._end_step, items, steps, internal=internal)

    def _ends_any(self, items: list[tuple[SimRequest, int, int]], steps: int) -> bool:
        """Whether these steps end a request's time here (its last token; a prefill worker's first): only such
        an end reaches the router, and through it other workers."""
        for req, n, _ in items:
            if req.computed + n * steps >= req.num_tokens and (
                self.kind == "prefill" or req.generated + steps >= req.output_len
            ):
                return True
        return False

    def _stretch(self, items: list[tuple[SimRequest, int, int]], context: float, first: float) -> tuple[int, float]:
        """A batch of decodes alone steps the same way until one of them ends or something else happens: its
        steps up to then as one event ((steps, seconds)), an event's worth of Python instead of one per step and
        request. It stops at the first step that ends at or after the next event of the simulation (anything that
        event brings joins the step after, as it would step by step) and where the pool has no page for a token."""
        most = min(req.output_len - req.generated for req, _, _ in items)
        next_event = self.sim.next_event_time()
        steps, seconds, batch = 1, first, len(items)
        while steps < most and self.sim.now + seconds < next_event:
            seconds += self.profile.step_ms(batch, context + steps, 0, 0.0) / 1e3
            steps += 1
        while steps > 1:  # pages for the tokens of the steps after the first (that one's were taken)
            need = sum(self.pages_for(req.computed + steps) - req.pages for req, _, _ in items)
            if need <= self.pages_total - self.pages_used:
                for req, _, _ in items:
                    grow = self.pages_for(req.computed + steps) - req.pages
                    req.pages += grow
                    self.pages_used += grow
                return steps, seconds
            steps -= 1
            seconds -= self.profile.step_ms(batch, context + steps, 0, 0.0) / 1e3
        return 1, first

    def _schedule(self) -> list[tuple[SimRequest, int, int]]:
        budget, items = self.budget, []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.computed, budget)
            if not self._grow(req, req.computed + n):
                continue  # req itself was preempted; running[i] is now the next one
            items.append((req, n, req.computed))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self.pages_for(req.num_tokens)
            if self.slots_used >= self.max_num_seqs or self.pages_total - self.pages_used < need:
                break
            self.waiting.popleft()
            self.slots_used += 1
            self.pages_used += need
            req.has_slot, req.pages = True, need
            self.running.append(req)
            n = min(req.num_tokens - req.computed, budget)
            items.append((req, n, req.computed))
            budget -= n
        return items

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        need = self.pages_for(tokens) - req.pages
        while need > self.pages_total - self.pages_used:
            victim = self.running.pop()
            self._free(victim)
            victim.computed = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
            if victim is req:
                return False
        if need > 0:
            self.pages_used += need
            req.pages += need
        return True

    def _free(self, req: SimRequest) -> None:
        if req.has_slot:
            self.slots_used -= 1
            req.has_slot = False
        self.pages_used -= req.pages
        req.pages = 0

    def _end_step(self, items: list[tuple[SimRequest, int, int]], steps: int) -> None:
        """The end of `steps` steps of `items` (several only for decodes, one token each a step: `_stretch`)."""
        now, ended = self.sim.now, False
        for req, n, _ in items:  # still busy: what this calls back (a new request, a freed state) waits for the end
            req.computed += n * steps
            if req.computed < req.num_tokens:
                continue  # a prompt chunk that does not reach the prompt's end samples nothing
            req.generated += steps
            if math.isnan(req.first_token):
                req.first_token = now + self.sim.router.path  # on the client, the way back later
            if self.kind == "prefill":
                req.done = ended = True  # held until its state is pulled (or freed, for a one-token request)
                self._hold(req)
                self.sim.router.prefilled(req, self)
            elif req.generated >= req.output_len:
                req.done = ended = True
                self._free(req)
                self.sim.router.finished(req, self)
        if ended:
            self.running = [r for r in self.running if not r.done]
            for req, _, _ in items:
                req.done = False
            if self.kind == "decode":
                self.take_handoffs()
        self.busy = False
        self.wake()


@dataclass
class SimResult:
    layout: Layout
    requests: list[SimRequest]
    duration: float  # first send to last end, seconds
    busy: dict[str, float] = field(default_factory=dict)  # worker -> fraction of the duration it stepped
    preemptions: int = 0
    steps: int = 0


class Simulation:
    """One run of `traffic` on `layout`; `run()` returns what every request saw."""

    def __init__(self, layout: Layout, traffic: Traffic, path_ms: float = 0.0):
        if path_ms < 0:
            raise ValueError(f"the serving path's time must be >= 0 ms, got {path_ms}")
        self.layout, self.traffic = layout, traffic
        self.now = 0.0
        self.steps = 0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        # (time, seq) of the events that may change what a worker runs next (not a worker's own step that ends
        # no request): how far a batch of decodes alone may run as one event (Worker._stretch)
        self._external: list[tuple[float, int]] = []
        self._seq = 0
        self.requests = [SimRequest(i, p, o, a) for i, (a, p, o) in enumerate(traffic.requests())]
        self.workers: dict[str, list[Worker]] = {}
        self.shared_gpu = SharedGpu(self) if layout.one_gpu else None
        for kind, role in self._roles():
            kv_tokens = role.kv_tokens or role.profile.memory.kv_capacity_tokens(
                role.max_num_seqs, layout.max_model_len
            )
            self._check_fits(kind, role, kv_tokens)
            self.workers[kind] = [Worker(self, f"{kind}-{i}", kind, role, kv_tokens) for i in range(role.workers)]
        self.router = Router(self, layout, self.workers, path_ms)
        self._unsent: deque[SimRequest] = deque()

    def _roles(self) -> list[tuple[str, Role]]:
        lay = self.layout
        if lay.colocated:
            return [("colocated", lay.colocated)]
        prefill, decode = lay.prefill_decode()
        return [("prefill", prefill), ("decode", decode)]

    def _check_fits(self, kind: str, role: Role, kv_tokens: int) -> None:
        if role.workers < 1 or role.max_num_seqs < 1:
            raise SimulationError(f"a {kind} role needs a worker and a slot (got {role.workers} x {role.max_num_seqs})")
        page = role.profile.memory.page_size
        longest = max(p + o for _, p, o in ((r.arrival, r.prompt_len, r.output_len) for r in self.requests))
        need = -(-longest // page) * page
        if longest > self.layout.max_model_len or need > kv_tokens:
            raise SimulationError(
                f"a request of {longest} tokens does not fit a {kind} worker (context {self.layout.max_model_len}, "
                f"KV pool of {kv_tokens} tokens at --max-num-seqs {role.max_num_seqs})"
            )

    def at(self, when: float, fn: Callable, *args, internal: bool = False) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, fn, args))
        if not internal:
            heapq.heappush(self._external, (when, self._seq))

    def next_event_time(self) -> float:
        """When the next event that may change another worker's next step happens."""
        return self._external[0][0] if self._external else math.inf

    def request_ended(self) -> None:
        if self._unsent:
            self.router.send(self._unsent.popleft())

    def run(self) -> SimResult:
        if self.traffic.concurrency is None:
            for req in self.requests:
                assert req.arrival is not None, "an open loop's requests arrive at their times (Traffic.requests)"
                self.at(req.arrival, self.router.send, req)
        else:
            self._unsent.extend(self.requests)
            for _ in range(min(self.traffic.concurrency, len(self.requests))):
                self.router.send(self._unsent.popleft())
        while self._events:
            self.now, seq, fn, args = heapq.heappop(self._events)
            if self._external and self._external[0][1] == seq:
                heapq.heappop(self._external)
            fn(*args)
            if self.steps > MAX_STEPS:
                raise SimulationError(f"more than {MAX_STEPS} engine steps: is the layout far too small?")
        duration = max((r.finished for r in self.requests if not math.isnan(r.finished)), default=0.0)
        everyone = [w for ws in self.workers.values() for w in ws]
        return SimResult(
            self.layout,
            self.requests,
            duration,
            {w.name: w.busy_seconds / duration if duration else 0.0 for w in everyone},
            sum(w.preemptions for w in everyone),
            self.steps,
        )


def simulate(layout: Layout, traffic: Traffic, path_ms: float = 0.0) -> SimResult:
    """`path_ms`: the serving path's time each way, client to worker and back (module docstring)."""
    return Simulation(layout, traffic, path_ms).run()
