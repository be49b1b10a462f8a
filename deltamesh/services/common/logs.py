"""structlog JSON logs. A request id minted at the router travels in gRPC metadata (`x-request-id`) and in
request messages; handlers bind it so every line they (and the engine) log about the request carries it."""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_KEY = "x-request-id"


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
