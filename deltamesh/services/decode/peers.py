"""Decode worker: set the transport up to each prefill worker the router announces, once and in the background, so
that the first request from a prefill worker does not pay for it (a first pull without it stalls a decode step;
figures in docs/notes/transport-seam.md)."""

from __future__ import annotations

import asyncio

import structlog
import torch

from deltamesh.transfer import DescriptorError, StatePuller, TransferError
from deltamesh.v1 import common_pb2

log = structlog.get_logger("deltamesh.decode")


class PeerWarmer:
    def __init__(self, puller: StatePuller, device: torch.device, timeout_s: float):
        self.puller, self.device, self.timeout_s = puller, device, timeout_s
        self._tasks: set[asyncio.Task] = set()

    def warm(self, peer: common_pb2.TransportDescriptor) -> None:
        """Starts a warm-up towards a newly announced holder (PullerSide.on_announced); never waits for it. A failed
        warm-up is not retried: the first pull sets the transport up anyway."""
        task = asyncio.get_running_loop().create_task(self._warm(peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, peer: common_pb2.TransportDescriptor) -> None:
        try:
            seconds = await self.puller.warm(peer, self.device, self.timeout_s)
        except (DescriptorError, TransferError) as e:
            log.warning("side channel warm-up failed", error=str(e))
            return
        log.info("side channel warmed", kind=peer.kind, seconds=round(seconds, 4))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
