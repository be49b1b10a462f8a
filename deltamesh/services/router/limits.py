"""The rules both of the router's edges (gRPC and REST) apply to what a client sends, each written once: the same
limit, the same message, and the parameter it is about (REST's error names it; gRPC's message does).

These need no model; the frontend checks what does (a text against the context, token ids against the
vocabulary). Each runs on the event loop before anything is copied on or tokenised, and costs O(count) or
O(bounded bytes), so an oversized field is refused before it can cost the router memory or time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from deltamesh.protocol.requests import RequestError
from deltamesh.protocol.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, check_stop_strings
from deltamesh.services.common.logs import request_id_problem

# Stop strings travel with every worker call of each of a request's choices and are searched for in every new
# token's text, which holds back as many characters of a stream as the longest one has. Real ones are short
# delimiters ("\n\nUser:", "</answer>"); 1,024 characters each and 4 KiB in all leave room for long ones while a
# request of 1,024 choices sends its workers at most 4 MiB of them.
# One request, as it arrives (REST: the body; gRPC: the Generate message): far above a prompt of the longest context
# (262k tokens as text or token ids is 1-2 MB) and gRPC's own default; what a request holds is bounded field by field
# below, and this bounds what is read before those checks can run.
MAX_REQUEST_BYTES = 4 << 20
MAX_STOP_CHARS = 1024
MAX_STOP_BYTES = 4096
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's roles
CHAT_ROLES = get_args(ChatRole)


class InvalidParam(RequestError):
    """A request refused for one parameter, named by `param` (REST's error field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_count(n: int, limit: int, what: str, param: str) -> None:
    if n > limit:
        raise InvalidParam(param, f"too many {what}: {n} (this server takes at most {limit} per request)")


def check_request_id(request_id: str) -> None:
    if (problem := request_id_problem(request_id)) is not None:
        raise InvalidParam("request_id", problem)


def check_stop(stop: Sequence[str]) -> None:
    """Count, then each one's length, before anything reads the strings' contents; then the engine's rule
    (non-empty, well-formed text) and their size together."""
    check_count(len(stop), MAX_STOP_STRINGS, "stop strings", "stop")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidParam("stop", f"a stop string has {longest} characters; at most {MAX_STOP_CHARS}")
    try:
        check_stop_strings(stop)
    except ValueError as e:
        raise InvalidParam("stop", str(e)) from None
    total = sum(len(s.encode()) for s in stop)
    if total > MAX_STOP_BYTES:
        raise InvalidParam("stop", f"the stop strings take {total} bytes (UTF-8) together; at most {MAX_STOP_BYTES}")


def check_logit_bias_count(n: int) -> None:
    """Before a logit_bias is copied out of the request (its entries' values: the engine's rule)."""
    check_count(n, MAX_LOGIT_BIAS, "logit_bias entries", "logit_bias")


def check_roles(roles: Sequence[str]) -> None:
    for role in roles:
        if role not in CHAT_ROLES:
            raise InvalidParam("messages", f"a chat message's role must be one of {', '.join(CHAT_ROLES)}")
