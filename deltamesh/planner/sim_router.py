"""The simulated router (simulator.py): where each request goes, and for prefill/decode its admission.

Colocated, a request goes to the least loaded worker (requests sent there and not seen end) at once; the worker
queues it in its engine. Disaggregated, the request first waits here until a decode worker has room for it, as the
real router's admission does (services/router/admission.py): a state slot and the KV pages of its prompt and output
(within the context), counted from its admission until it ends, so prefills in flight hold the room they will need.
Waiting requests are admitted first come, first served, each to the least loaded decode worker with room; then it
goes to the least loaded prefill worker, and after its first token to its decode worker.

The serving path takes `path_ms` each way; requests pass the way in one after another (simulator.py's docstring).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltamesh.planner.layouts import Layout
    from deltamesh.planner.simulator import SimRequest, Simulation, Worker


class Router:
    def __init__(self, sim: Simulation, layout: Layout, workers: dict[str, list[Worker]], path_ms: float = 0.0):
        self.sim = sim
        self.path = path_ms / 1e3  # seconds each way between the client and a worker (module docstring)
        self._way_in_free = 0.0  # when the way in has handled every request sent so far
        self.front = workers["colocated"] if layout.colocated else workers["prefill"]
        self.decoders = workers.get("decode", [])
        self.max_model_len = layout.max_model_len
        self.waiting: deque[SimRequest] = deque()  # disaggregated: not yet admitted to a decode worker
        self.tickets: dict[int, tuple[Worker, int]] = {}  # request index -> (its decode worker, pages held there)
        # decode worker -> pages its tickets hold; its slots held are its `inflight` (a ticket's from admission)
        self.admitted_pages = {w: 0 for w in self.decoders}

    @staticmethod
    def _least_loaded(workers: list[Worker]) -> Worker:
        return min(workers, key=lambda w: w.inflight)

    def send(self, req: SimRequest) -> None:
        req.sent = self.sim.now
        if not self.decoders:
            self._forward(req)
            return
        self.waiting.append(req)
        self._admit()

    def _admit(self) -> None:
        """Waiting requests, first come first served, each to the least loaded decode worker with room."""
        while self.waiting:
            req = self.waiting[0]
            pages = self.decoders[0].pages_for(min(req.prompt_len + req.output_len, self.max_model_len))
            roomy = [
                w
                for w in self.decoders
                if w.inflight < w.max_num_seqs and self.admitted_pages[w] + pages <= w.pages_total
            ]
            if not roomy:
                return
            self.waiting.popleft()
            decode = self._least_loaded(roomy)
            decode.inflight += 1  # from its admission: its slot, and the load the next admission balances by
            self.admitted_pages[decode] += pages
            self.tickets[req.index] = (decode, pages)
            self._forward(req)

    def _forward(self, req: SimRequest) -> None:
        worker = self._least_loaded(self.front)
        worker.inflight += 1
        if not self.path:
            worker.submit(req)
            return
        # one request at a time on the way in (module docstring)
        self._way_in_free = max(self.sim.now, self._way_in_free) + self.path
        self.sim.at(self._way_in_free, worker.submit, req)

    def prefilled(self, req: SimRequest, prefill: Worker) -> None:
        prefill.inflight -= 1
        if req.generated >= req.output_len:
            prefill.release(req)
            self._end(req)
            return
        self.tickets[req.index][0].hand_off(req, prefill)

    def finished(self, req: SimRequest, worker: Worker) -> None:
        if req.index not in self.tickets:  # a colocated worker's (a decode worker's load is its tickets')
            worker.inflight -= 1
        self._end(req)

    def _end(self, req: SimRequest) -> None:
        ticket = self.tickets.pop(req.index, None)
        if ticket is not None:
            decode, pages = ticket
            decode.inflight -= 1
            self.admitted_pages[decode] -= pages
            self._admit()
        req.finished = self.sim.now + self.path
        if self.path:
            self.sim.at(req.finished, self.sim.request_ended)
        else:
            self.sim.request_ended()
