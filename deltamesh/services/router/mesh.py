"""Runs one request through the mesh: prefill on one worker, decode on another, with the hybrid state
moving between them over the workers' transport under a lease. Shared by the gRPC front door and the REST gateway.
Before its prefill a request waits for room on a decode worker, which it keeps to its end (admission.py).

Failure rules: a prefill worker found unavailable is replaced (up to `prefill_retries` times); a decode
worker found unavailable before it streamed anything is replaced too; any other failure of either leg ends
the request at once with an error, cancels the other leg and releases the lease so the prefill worker's
memory is freed. A client that goes away cancels both legs; `abort` does the same on request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import AsyncGenerator

import grpc
import structlog

from deltamesh.protocol.sampling import SamplingParams
from deltamesh.services.common.convert import sampling_to_proto
from deltamesh.services.router import metrics
from deltamesh.services.router.admission import Admission, AdmissionLimits, Ticket
from deltamesh.services.router.legs import Inflight, Legs, MeshError, NotHeld
from deltamesh.services.router.pd_decider import PdDecider
from deltamesh.services.router.policies import Policy
from deltamesh.services.router.registry import WorkerRegistry
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2

log = structlog.get_logger("deltamesh.mesh")


class Mesh:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        prefill_retries: int = 2,
        timeout_s: float = 600.0,
        ready_timeout_s: float = 10.0,
        pd: PdDecider | None = None,
        admission: AdmissionLimits | None = None,
        log_requests: bool = True,
    ):
        """`ready_timeout_s`: how long a request waits for the mesh to have workers (just started, or all
        restarting) before it fails as UNAVAILABLE. `pd`: which requests skip the prefill worker (None: none).
        `admission`: the router's admission queue (default: AdmissionLimits()); a request waits in it at most
        `timeout_s`, the deadline of a worker call. `log_requests`: a line per request at its end."""
        self.registry, self.pd = registry, pd
        self.log_requests = log_requests
        self.ready_timeout_s = ready_timeout_s
        self.legs = Legs(registry, policy, pd, prefill_retries, timeout_s)
        limits = admission or AdmissionLimits()
        self.admission = Admission(
            registry,
            lambda pool: policy.pick(pool, ()),  # as a decode pick always was: no prompt, by load
            limits.max_queued,
            timeout_s,
            limits.page_size,
            limits.max_model_len,
            limits.shared,
        )
        self._inflight: dict[str, Inflight] = {}

    @property
    def colocated(self) -> bool:
        return self.registry.has_healthy("colocated") and not self.registry.has_healthy("prefill")

    def missing(self) -> str:
        """What the mesh lacks to serve a request ("" when nothing): a user told only "no healthy workers" while
        the prefill workers are up would look in the wrong place."""
        r = self.registry
        if r.has_healthy("colocated") or (r.has_healthy("prefill") and r.has_healthy("decode")):
            return ""
        lacking = [role for role in ("prefill", "decode") if not r.has_healthy(role)]
        if len(lacking) == 2:
            return "no healthy workers to serve requests"
        return f"no healthy {lacking[0]} worker (and no colocated one) to serve requests"

    async def _until_ready(self) -> None:
        """Hold a request while no worker can serve it, as a server that is still starting would; bounded."""
        deadline = time.monotonic() + self.ready_timeout_s
        while missing := self.missing():
            if time.monotonic() >= deadline:
                raise MeshError(
                    grpc.StatusCode.UNAVAILABLE, f"{missing} (waited {self.ready_timeout_s:g} s); retry shortly"
                )
            await asyncio.sleep(0.05)

    def abort(self, request_id: str, owner: bytes) -> bool:
        """Abort the running request `request_id` if `owner` is what it was started with (see generate)."""
        inflight = self._inflight.get(request_id)
        if inflight is None or not inflight.owner or not hmac.compare_digest(inflight.owner, owner):
            return False
        inflight.abort()
        return True

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, owner: bytes = b""
    ) -> AsyncGenerator[common_pb2.TokenDelta, None]:
        """The request's token deltas, first token first; raises MeshError when it cannot be served. `owner`: a
        secret of this run of the request that `abort` must be given (empty: it is aborted by closing the stream)."""
        timer = metrics.RequestTimer()
        outcome = "aborted"  # unless it finishes or fails: the client went away
        try:
            # closed explicitly: a client gone mid-stream releases what its request holds at once, not at GC
            async with contextlib.aclosing(self._generate(request_id, prompt_ids, params, owner)) as deltas:
                async for delta in deltas:
                    timer.delta(len(delta.token_ids), delta.usage, delta.finish_reason)
                    if delta.finished:
                        outcome = "aborted" if delta.finish_reason == common_pb2.FINISH_REASON_ABORT else "completed"
                    yield delta
        except MeshError:
            outcome = "error"
            raise
        finally:
            timer.end(outcome)
            if self.log_requests:
                ttft = None if timer.first is None else round(timer.first - timer.start, 4)
                log.info(
                    "request",
                    request_id=request_id,
                    outcome=outcome,
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=timer.tokens,
                    ttft_s=ttft,
                    seconds=round(time.monotonic() - timer.start, 4),
                )

    async def _generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, owner: bytes):
        if request_id in self._inflight:
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        inflight = self._inflight[request_id] = Inflight(owner)
        sampling, stop = sampling_to_proto(params)
        ticket = None
        try:
            await self._until_ready()
            if self.colocated:  # a colocated worker queues what it has no room for in its own engine
                req = decode_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, stop=stop
                )
                async for delta in self.legs.decode(req, "colocated", inflight):
                    yield delta
                return
            # a prompt's logprobs need its every position computed: no decode worker's cached conversation
            pd = self.pd if params.prompt_logprobs is None else None
            direct = pd.direct(self.registry.pool("decode"), prompt_ids) if pd else None
            # room on a decode worker, held from before the prefill to the end (None: the holder went away)
            ticket = await self.admission.admit(len(prompt_ids), params.max_tokens, direct)
            if pd and direct is not None and ticket is not None:  # it holds the conversation: it prefills the new one
                req = decode_pb2.DecodeRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids,
                    sampling=sampling,
                    stop=stop,
                    max_uncached_tokens=pd.max_suffix,
                )
                try:
                    async for delta in self.legs.remembered(
                        self.legs.decode(req, "decode", inflight, ticket.worker), prompt_ids, inflight
                    ):
                        yield delta
                    return
                except NotHeld:  # its cache no longer holds the conversation: through a prefill worker after all
                    pd.refused()
            if ticket is None:
                ticket = await self.admission.admit(len(prompt_ids), params.max_tokens)
                assert ticket is not None, "admit without `only` waits for a ticket or raises"
            async for delta in self._through_prefill(request_id, prompt_ids, sampling, stop, inflight, ticket):
                yield delta
        except MeshError as e:
            if not inflight.aborted:
                raise
            log.info("aborted", request_id=request_id, during=e.message)
            yield common_pb2.TokenDelta(finished=True, finish_reason=common_pb2.FINISH_REASON_ABORT)
        finally:
            self.admission.release(ticket)
            del self._inflight[request_id]

    async def _through_prefill(self, request_id, prompt_ids, sampling, stop, inflight: Inflight, ticket: Ticket):
        """Prefill on a prefill worker, then decode on the ticket's decode worker, the state pulled between them."""
        # the lease's token is ours from the start: a request that goes away while its prefill answer is on the
        # wire can still end the lease it will never see
        prefill_req = prefill_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            stop=stop,
            lease_token=secrets.token_bytes(16),
        )
        wants_all = sampling.HasField("prompt_logprobs")  # every position computed: no cached prefix to pull
        offer = await self.legs.offer_prefix(prompt_ids) if self.pd is not None and not wants_all else None
        if offer is not None:
            prefill_req.prefix.CopyFrom(offer[1])
        try:
            first, pw = await self.legs.prefill(prefill_req, inflight)
        finally:  # a no-op once the prefill worker pulled it; else the decode worker's pages are free at once
            if offer is not None:
                self.legs.release_later(offer[0], offer[1].lease)
        try:
            yield first.first
            if first.first.finished:
                return
            source = decode_pb2.TransferSource(  # the transport descriptor goes on unread
                lease=first.lease,
                transport=first.transport,
                layout=first.layout,
                first_token_id=first.first.token_ids[0],
                draft_token_ids=first.draft_token_ids,  # speculative decoding: verified in the decode's first step
            )
            req = decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, stop=stop, source=source
            )
            deltas = self.legs.decode(req, "decode", inflight, ticket.worker, holder=pw)
            if self.pd is not None:
                deltas = self.legs.remembered(deltas, prompt_ids, inflight, first.first)
            cached = first.first.usage.cached_tokens  # the prompt's cache hit was the prefill worker's
            async for delta in deltas:
                delta.usage.cached_tokens = cached
                yield delta
        finally:  # never let the lease outlive the request (a no-op once decode pulled the state)
            if first.HasField("lease"):
                self.legs.release_later(pw, first.lease)
