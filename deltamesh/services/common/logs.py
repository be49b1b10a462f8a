"""structlog JSON logs. A request id minted at the router travels in gRPC metadata (`x-request-id`) and in
request messages; handlers bind it so every line they (and the engine) log about the request carries it."""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_KEY = "x-request-id"
# A request id rides in gRPC metadata to every worker, in every log line, and as the lease id in the side channel's
# done notice (at most 4 KiB). Ids that clients and servers mint are short (a UUID is 36 characters, OpenAI's and
# vLLM's ids under 50), so 128 leaves room for a client's own prefix while keeping all of those small. Visible
# ASCII only: gRPC metadata takes no control characters or non-ASCII, and a space or newline would split a log.
MAX_REQUEST_ID_CHARS = 128


def configure_logging(service: str, level: str = "info", json: bool = True) -> None:
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # one write per line (print would write the line and its newline apart): the processes of a mesh share
        # stderr, and separate writes from two of them interleave into lines that are not JSON
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def bind_request(request_id: str) -> None:
    structlog.contextvars.bind_contextvars(request_id=request_id)


def request_id_problem(request_id: str) -> str | None:
    """Why `request_id` cannot be used as one (None: it can), without echoing it: it may be anything."""
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
    bad = next((i for i, c in enumerate(request_id) if not "!" <= c <= "~"), None)
    if bad is not None:
        return f"request_id must be printable ASCII without spaces; character {bad} is not ({request_id[bad]!a})"
    return None


def request_id_from(context, fallback: str = "") -> str:
    """The request id a caller sent in metadata, else `fallback`."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return value
    return fallback


def write_line(stream, text: str) -> None:
    """`text` and its newline in one write, then flushed: the processes of a mesh share their output streams,
    and print (the text and the newline written apart when the stream is unbuffered) lets another process's
    line land between them."""
    stream.write(text + "\n")
    stream.flush()
