"""Router-side admission: a request that needs a decode worker waits here, before its prefill, until one has room
for it, so that no request fails (or dies mid-stream after its first token) because a decode worker was full.

A decode worker takes a transferred request only if it can reserve a state slot and the prompt's KV pages at once;
past its --admission-timeout it refuses. The router therefore binds each request to a decode worker with room before
the prefill starts (a `Ticket`), and the request keeps that room until it ends: the slots and pages that prefills in
flight will need are counted from the moment they are admitted. A worker has room for a request when

    its slots:  admitted here + held by others  <  its state slots
    its pages:  admitted here + held by others + the request's  <=  its KV pages

where a request counts the most KV pages it can hold (prompt + max_tokens, within the context), so an admitted
request never waits for pages nor gets preempted on its decode worker, and "held by others" is what the worker's last
load report shows beyond this router's own admissions at that moment (another router's requests; 0 with one router).
The loads come from the workers' reports; this router's own counts change as it admits and releases, so a burst
between two reports cannot oversubscribe a worker. "Admitted here" is the whole router's: the processes of a router
of --api-server-count N count their admissions in memory they share (shared_counts.py), so each sees what the
others admitted the moment they do. A process takes its siblings' releases in at the worker's next report (or its
own next admission or release), so a sibling's freed room may reach it a report interval late.

Waiting requests are served first come, first served: a request is placed as soon as a worker it may use has room,
and none placed after it takes a worker it is waiting for. A request for a given worker (the P/D decider sends a
conversation's next turn to the decode worker holding it) blocks only that worker; one for any worker blocks all.
The queue is bounded: a request that finds it full is refused at once (RESOURCE_EXHAUSTED, REST 429), before any
work is done; one that waits longer than the worker-call deadline is refused too (UNAVAILABLE when no decode worker
is left). Colocated workers are not gated here: they queue requests in their own engine, as vLLM and SGLang do. A
decode call that the mesh retries on another decode worker (the first failed before streaming) goes there without a
ticket of its own, so that worker's --admission-timeout may still refuse it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from deltamesh.services.router import metrics
from deltamesh.services.router.legs import MeshError
from deltamesh.services.router.load_order import Pool
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.services.router.shared_counts import SharedCounts


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued: int = 1024  # requests that may wait at once (--max-queued-requests)
    page_size: int = 16  # the workers' KV page size (--page-size)
    max_model_len: int = 32768  # the workers' context (--max-model-len)
    shared: SharedCounts | None = None  # the admissions of this router's processes (--api-server-count > 1)


@dataclass
class Ticket:
    """Room held on one decode worker for one request, from its admission until it ends."""

    worker: WorkerHandle
    pages: int


@dataclass
class _Waiter:
    pages: int
    only: WorkerHandle | None  # this worker or none; None: any decode worker
    since: float
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Account:
    """This process's admissions to one worker, and the router's (every process's) as they stood at its last load
    report."""

    slots: int = 0
    pages: int = 0
    slots_at_report: int = 0
    pages_at_report: int = 0


class Admission:
    def __init__(
        self,
        registry: WorkerRegistry,
        pick: Callable[[Pool], WorkerHandle | None],
        max_queued: int,
        max_wait_s: float,
        page_size: int,
        max_model_len: int,
        shared: SharedCounts | None = None,
    ):
        """`pick`: the routing policy's choice among the decode workers with room (None: none has room).
        `max_queued`: requests that may wait at once (0: none; a request no worker has room for is refused).
        `max_wait_s`: the longest a request waits before it is refused. `page_size`, `max_model_len`: the workers' (a
        request's pages). `shared`: where the router's processes count their admissions (None: this process is the
        router)."""
        self.registry, self.pick = registry, pick
        self.max_queued, self.max_wait_s = max_queued, max_wait_s
        self.page_size, self.max_model_len = page_size, max_model_len
        self.shared = shared
        self._queue: deque[_Waiter] = deque()
        self._accounts: dict[str, _Account] = {}
        registry.listeners.append(self.on_report)

    async def admit(self, prompt_tokens: int, max_tokens: int, only: WorkerHandle | None = None) -> Ticket | None:
        """A ticket on a decode worker (on `only`, if given) with room for a request of this many prompt and output
        tokens, once one has room and every request that came before has been placed. None when `only` stops being
        healthy while the request waits (it may go elsewhere). Raises MeshError RESOURCE_EXHAUSTED when the queue is
        full or the wait passes `max_wait_s`."""
        pages = -(-min(prompt_tokens + max_tokens, self.max_model_len) // self.page_size)  # the most it can hold
        waiter = _Waiter(pages, only, time.monotonic())
        self._queue.append(waiter)
        self._dispatch()
        if waiter.granted.done():
            return self._granted(waiter)
        if len(self._queue) > self.max_queued:
            self._queue.remove(waiter)
            metrics.ADMISSION_REJECTED.labels("queue_full").inc()
            raise MeshError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router's admission queue is full ({self.max_queued} requests waiting for a decode worker, "
                "--max-queued-requests); retry shortly",
            )
        metrics.QUEUE_LENGTH.set(len(self._queue))
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.max_wait_s)
        except TimeoutError:
            self._leave(waiter)
            metrics.ADMISSION_REJECTED.labels("timeout").inc()
            if not self.registry.healthy("decode"):
                raise MeshError(
                    grpc.StatusCode.UNAVAILABLE, f"no healthy decode worker for {self.max_wait_s:g} s; retry shortly"
                ) from None
            raise MeshError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode worker had room for the request within {self.max_wait_s:g} s; retry shortly",
            ) from None
        except asyncio.CancelledError:  # the client went away while it waited
            self._leave(waiter)
            raise
        return self._granted(waiter)

    def release(self, ticket: Ticket | None) -> None:
        """The request ended: its room goes to the next in the queue."""
        if ticket is None:
            return
        account = self._accounts[ticket.worker.address]
        account.slots -= 1
        account.pages -= ticket.pages
        if self.shared is not None:
            self.shared.add(ticket.worker.address, -1, -ticket.pages)
        ticket.worker.admitted -= 1
        metrics.ADMITTED.dec()
        self._dispatch()

    def on_report(self, w: WorkerHandle) -> None:
        """A worker's load report arrived (or it failed): take it in and place whoever it makes room for."""
        account = self._accounts.setdefault(w.address, _Account())
        siblings_slots, siblings_pages = self._siblings(w.address)
        account.slots_at_report = account.slots + siblings_slots
        account.pages_at_report = account.pages + siblings_pages
        self._dispatch()

    def _siblings(self, address: str) -> tuple[int, int]:
        """(slots, pages) that the router's other processes hold admitted on the worker now."""
        return self.shared.others(address) if self.shared is not None else (0, 0)

    def _granted(self, waiter: _Waiter) -> Ticket | None:
        ticket = waiter.granted.result()
        waited = time.monotonic() - waiter.since
        metrics.QUEUE_TIME.observe(waited)
        metrics.VLLM.queue.observe(waited)  # vLLM's name for it (common/vllm_metrics.py)
        return ticket

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that stops waiting; a ticket granted meanwhile goes back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            metrics.QUEUE_LENGTH.set(len(self._queue))
        elif waiter.granted.done():
            self.release(waiter.granted.result())

    def _room(self, w: WorkerHandle, pages: int) -> bool:
        load = w.load
        if load is None or not load.state_slots_total:
            return False
        account = self._accounts.setdefault(w.address, _Account())
        other_slots = max(0, load.state_slots_used + load.waiting - account.slots_at_report)
        other_pages = max(0, load.kv_pages_used - account.pages_at_report)
        siblings_slots, siblings_pages = self._siblings(w.address)
        # a request longer than the whole pool still runs alone, as it would without admission
        pages = min(pages, load.kv_pages_total)
        return (
            account.slots + siblings_slots + other_slots < load.state_slots_total
            and account.pages + siblings_pages + other_pages + pages <= load.kv_pages_total
        )

    def _dispatch(self) -> None:
        """Place waiting requests in arrival order, each where it may go and there is room."""
        blocked: set[str] = set()  # workers a request ahead was refused by: no request behind it jumps onto them
        for waiter in list(self._queue):
            only = waiter.only
            if only is not None and not only.healthy:
                self._grant(waiter, None)  # its worker is gone: the caller sends it elsewhere
                continue
            if only is not None:
                fits = only.address not in blocked and self._room(only, waiter.pages)
                w = self.pick(Pool.of([only])) if fits else None
            else:  # the least loaded decode worker with room, found in load order (router/load_order.py)
                pages = waiter.pages
                w = self.pick(self.registry.pool("decode", lambda w: w.address not in blocked and self._room(w, pages)))
            if w is not None:
                self._grant(waiter, w)
                continue
            if only is None:
                break  # it may go anywhere: whoever is behind it waits too
            blocked.add(only.address)
        metrics.QUEUE_LENGTH.set(len(self._queue))

    def _grant(self, waiter: _Waiter, w: WorkerHandle | None) -> None:
        self._queue.remove(waiter)
        ticket = None
        if w is not None:
            account = self._accounts.setdefault(w.address, _Account())
            account.slots += 1
            account.pages += waiter.pages
            if self.shared is not None:
                self.shared.add(w.address, 1, waiter.pages)
            w.admitted += 1
            metrics.ADMITTED.inc()
            ticket = Ticket(w, waiter.pages)
        waiter.granted.set_result(ticket)
