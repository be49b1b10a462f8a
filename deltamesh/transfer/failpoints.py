"""Failpoints: named places in the side channel where a test can inject a fault into a real process,
deterministically (`DELTAMESH_FAILPOINTS="deltamesh.transfer.before_check=drop"`). Unset, they cost one dict lookup.

Points: `deltamesh.transfer.before_reads` (a pull, before it posts its reads), `deltamesh.transfer.before_check`
(after its reads, before it reads the lease word). Actions: `drop` (close the connection to the peer at that
point), `sleep:SECONDS`."""

from __future__ import annotations

import asyncio
import os

import structlog

log = structlog.get_logger("deltamesh.failpoints")


def _parse(spec: str) -> dict[str, str]:
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        points[name.strip()] = action.strip()
    return points


_ACTIVE = _parse(os.environ.get("DELTAMESH_FAILPOINTS", ""))


class InjectedFault(ConnectionError):
    """Raised where a `drop` failpoint fires."""


async def hit(name: str) -> None:
    action = _ACTIVE.get(name)
    if action is None:
        return
    log.warning("failpoint hit", failpoint=name, action=action)
    if action == "drop":
        raise InjectedFault(f"failpoint {name}: connection dropped")
    if action.startswith("sleep:"):
        await asyncio.sleep(float(action.split(":", 1)[1]))
