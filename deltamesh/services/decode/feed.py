"""The worker's side of the token feed (decode.proto `Feed`, #45): one stream per router process carrying the deltas
of every Decode that names it, one FeedBatch per engine step.

Why: a router pays gRPC's per-message cost (~65 µs of CPU on a loaded 2-core VM, bench/RESULTS.md) for every
message it receives; one message per step for all of a feed's requests pays it once per step. The engine's
stepping thread hands each feed request's output to the feed's one mailbox (not to a mailbox per request): the
event loop is woken once per step per feed, and the Feed call's coroutine turns all that is ready into one message.

Backpressure is the per-request mailbox's (engine.py `_Mailbox`): while the Feed's write waits (the router reads
slowly), a request's later outputs merge into one (RequestOutput.then), so the engine never waits and what waits
is at most one delta per request. A slow client does not slow the feed: the router buffers per request
(router/feeds.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc

from deltamesh.engine.request import Request, RequestOutput
from deltamesh.services.common import metrics
from deltamesh.services.common.convert import delta_from_output
from deltamesh.v1 import decode_pb2


class _Entry:
    """A request on the feed: when its tokens came (TTFT/TPOT, as Decode observes them without a feed), and the
    future its Decode call waits on: True once its final delta is written, False if the feed closed first."""

    __slots__ = ("done", "times")

    def __init__(self, times: metrics.TokenTimes, done: asyncio.Future):
        self.times, self.done = times, done


class WorkerFeed:
    def __init__(self, feed_id: str, loop: asyncio.AbstractEventLoop):
        self.feed_id, self._loop = feed_id, loop
        self._lock = threading.Lock()  # the stepping thread puts, the event loop takes
        self._pending: dict[int, RequestOutput] = {}
        self._ready = asyncio.Event()  # set (on the loop) once an output waits
        self.entries: dict[int, _Entry] = {}
        self.closed = False

    def add(self, key: int, times: metrics.TokenTimes) -> asyncio.Future:
        """A Decode's request joins the feed, with its Decode's token times; the future tells how it left (see
        _Entry)."""
        done = self._loop.create_future()
        if self.closed:
            done.set_result(False)
        self.entries[key] = _Entry(times, done)
        return done

    def sink(self, key: int) -> Callable[[RequestOutput], None]:
        """The engine's sink for the request `key` (called on the stepping thread)."""

        def put(out: RequestOutput) -> None:
            with self._lock:
                first = not self._pending
                waiting = self._pending.get(key)
                self._pending[key] = out if waiting is None else waiting.then(out)
            if first:  # one wake-up of the loop per step for the whole feed, not one per request
                self._loop.call_soon_threadsafe(self._ready.set)

        return put

    async def _take(self) -> dict[int, RequestOutput]:
        await self._ready.wait()
        with self._lock:
            outs, self._pending = self._pending, {}
            self._ready.clear()
        return outs

    def batch(self, outs: dict[int, RequestOutput]) -> tuple[decode_pb2.FeedBatch, list[_Entry]]:
        """One message of what is ready, and the entries whose final delta it carries."""
        batch, ended = decode_pb2.FeedBatch(), []
        now = time.monotonic()
        for key, out in outs.items():
            entry = self.entries.get(key)
            if entry is None:  # its Decode ended already (cancelled): the engine's last word goes nowhere
                continue
            entry.times.observe(len(out.new_token_ids), out.num_output_tokens, now)
            delta_from_output(out, batch.deltas.add(key=key).delta)
            if out.finished:
                ended.append(entry)
        return batch, ended

    async def messages(self):
        """The Feed call's messages: an empty one (open), then one per step with anything ready."""
        yield decode_pb2.FeedBatch()
        while True:
            batch, ended = self.batch(await self._take())
            if batch.deltas:
                yield batch  # returns once gRPC took the message: its final deltas are on their way
            for entry in ended:
                if not entry.done.done():
                    entry.done.set_result(True)

    def close(self) -> None:
        """The Feed call ended (the router closed it or went away): its requests' Decodes end (UNAVAILABLE)."""
        self.closed = True
        for entry in self.entries.values():
            if not entry.done.done():
                entry.done.set_result(False)


class Feeds:
    """The open feeds of a worker, by id."""

    def __init__(self):
        self.open: dict[str, WorkerFeed] = {}

    async def serve(self, feed_id: str, context):
        """The Feed call: its messages while it is open; its requests' Decodes end with it."""
        if not feed_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "feed_id is required")
        if feed_id in self.open:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "a feed of this id is open")
        feed = self.open[feed_id] = WorkerFeed(feed_id, asyncio.get_running_loop())
        try:
            async for batch in feed.messages():
                yield batch
        finally:
            del self.open[feed_id]
            feed.close()

    @staticmethod
    async def decode(
        feed: WorkerFeed, key: int, req: Request, submit, times: metrics.TokenTimes, engine, context
    ) -> None:
        """A Decode on `feed`: its request's outputs go there (`submit`: as Engine.stream takes it; None: a
        colocated request, submitted as is); it returns once its final delta is written, and aborts the engine's
        request if it leaves before (cancelled by the router, or the feed closed). `times`: the Decode's own,
        observed as its deltas are batched."""
        if key in feed.entries:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "feed_key is in use on this feed")
        done = feed.add(key, times)
        written = False
        try:
            # submitted even on a feed closed meanwhile: the abort below then frees what the request holds (a
            # transferred state's reservation), as the engine frees an aborted request's
            (submit or engine.submit)(req, feed.sink(key))
            written = await done
        finally:
            del feed.entries[key]
            if not written:
                engine.abort(req.request_id)
        if not written:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the token feed closed")
