"""The router's side of the token feed (decode.proto `Feed`, #45): one stream per decode (or colocated) worker and
router process, opened by the first request sent to the worker and kept open, carrying every request's deltas in
one message per engine step. Receiving a gRPC message costs the router ~65 µs of CPU; one per step instead of one
per request per step is most of what #45 asks (bench/RESULTS.md).

One reader task per feed demultiplexes: per delta, a dict lookup and an append to the request's `Inbox`, which wakes
the request's own task (the one that writes its client's stream) only if it waits. No task of its own per request.

Backpressure: a slow client must not hold up the other requests of its feed, so the reader never waits on a
request: a request's inbox grows while its client reads slowly. What it can hold is bounded by the request itself
(its max_tokens and the model's context length: the whole output at most, the limits the router already sets),
not by the feed. Without a feed the worker's per-stream flow control merged the backlog into fewer messages
instead; the bytes held are the same order.

Failures: a request's own error still comes as its Decode call's status (the call stays open, streaming nothing),
watched with a done callback that puts the call in the inbox. A feed that breaks (the worker died, its connection
closed) puts an UNAVAILABLE error in every inbox on it: each request then fails, or is retried, exactly as a
broken Decode stream is (legs.py). A worker without `Feed` (UNIMPLEMENTED) is served by per-request streams, as
is any request while a feed cannot be opened (retried after OPEN_RETRY_S)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from typing import Any

import grpc
import structlog

from deltamesh.v1 import decode_pb2

log = structlog.get_logger("deltamesh.feeds")

OPEN_TIMEOUT_S = 5.0  # for the worker's first (empty) message: the feed is open
OPEN_RETRY_S = 1.0  # after a feed could not be opened (or broke), requests stream on their own this long


def feed_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a request on a broken feed raises: the error its own broken Decode stream would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FeedBroken:
    __slots__ = ("code", "details")

    def __init__(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details


class Inbox:
    """A request's items, in order: its deltas from the feed, its Decode call once it ended, or FeedBroken. Its
    request's task takes them itself (legs.py: a future in `waiter` while it waits, no coroutine per item)."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class RouterFeed:
    """One open Feed call and the requests on it, by their feed key."""

    def __init__(self, call, feed_id: str):
        self.call, self.id = call, feed_id
        self.inboxes: dict[int, Inbox] = {}
        self.broken = False
        self._keys = 0
        self.reader: asyncio.Task | None = None

    def join(self) -> tuple[int, Inbox]:
        self._keys += 1
        inbox = self.inboxes[self._keys] = Inbox()
        return self._keys, inbox

    def leave(self, key: int) -> None:
        self.inboxes.pop(key, None)

    async def read(self) -> None:
        call, inboxes = self.call, self.inboxes
        code, details = grpc.StatusCode.UNAVAILABLE, "the token feed ended"
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                for fd in batch.deltas:
                    inbox = inboxes.get(fd.key)
                    if inbox is not None:  # else its request left (cancelled, or failed over)
                        inbox.put(fd.delta)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or details
        except asyncio.CancelledError:  # the channel closed (the worker dropped), or the router stops
            details = "the token feed was closed"
        except Exception:  # a bug: the requests on it must not wait forever
            log.exception("token feed reader failed")
        finally:
            self.broken = True
            call.cancel()
            for inbox in inboxes.values():
                inbox.put(FeedBroken(code, details))
            inboxes.clear()


class _WorkerFeeds:
    """A worker's feed from this router process: the open one, one being opened, or why there is none."""

    __slots__ = ("current", "opening", "retry_at", "unsupported")

    def __init__(self):
        self.current: RouterFeed | None = None
        self.opening: asyncio.Task | None = None
        self.retry_at = 0.0
        self.unsupported = False  # the worker answered UNIMPLEMENTED: per-request streams for this handle


class Feeds:
    def __init__(self, metadata):
        """`metadata`: a callable giving a worker call's metadata (the mesh secret: a feed is authenticated as
        every worker call is)."""
        self.metadata = metadata
        self._tasks: set[asyncio.Task] = set()

    async def of(self, w) -> RouterFeed | None:
        """The worker's open feed, opened now if none is (the request waits for it, a round trip); None: the
        request streams on its own (no feed on that worker, or none could be opened lately)."""
        state = w.feeds  # on the handle: a new handle (a worker added again) has a new channel, so a new feed
        if state is None:
            state = w.feeds = _WorkerFeeds()
        feed = state.current
        if feed is not None and not feed.broken:
            return feed
        if state.unsupported or time.monotonic() < state.retry_at:
            return None
        if state.opening is None:
            state.opening = asyncio.get_running_loop().create_task(self._open(w, state))
        # shielded: a request that goes away while it waits does not cancel the opening the others wait for
        return await asyncio.shield(state.opening)

    async def _open(self, w, state: _WorkerFeeds) -> RouterFeed | None:
        feed_id = secrets.token_hex(16)
        call = w.stub.Feed(decode_pb2.FeedRequest(feed_id=feed_id), metadata=self.metadata())
        try:
            first = await asyncio.wait_for(call.read(), OPEN_TIMEOUT_S)
            if first is grpc.aio.EOF:
                raise feed_error(grpc.StatusCode.UNAVAILABLE, "the feed ended at once")
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.CancelledError) as e:
            call.cancel()
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                state.unsupported = True
                log.info("worker has no token feed: per-request streams", worker=w.address)
            else:
                state.retry_at = time.monotonic() + OPEN_RETRY_S
                log.warning("token feed not opened", worker=w.address, error=code.name if code else repr(e))
            if isinstance(e, asyncio.CancelledError) and _cancelling():
                raise
            return None
        finally:
            state.opening = None
        feed = state.current = RouterFeed(call, feed_id)
        feed.reader = asyncio.get_running_loop().create_task(feed.read())
        self._tasks.add(feed.reader)
        feed.reader.add_done_callback(self._tasks.discard)
        return feed

    async def close(self) -> None:
        """Stop every feed's reader (the router stops; closing the channels would end them too)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
