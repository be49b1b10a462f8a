"""Decode worker: set up the side channel to each prefill worker the router names, once and in the
background, so that the first request from a prefill worker does not pay for it (on GPUs: measured 110-150 ms
for a first pull without it, stalling a decode step by 55-68 ms; 1-2 ms and no stall with it)."""

from __future__ import annotations

import asyncio

import structlog
import torch

from deltamesh.v1 import control_pb2
from transfer import RemoteRegion, StatePuller, TransferError

log = structlog.get_logger("deltamesh.decode")


class PeerWarmer:
    def __init__(self, puller: StatePuller, device: torch.device, timeout_s: float):
        self.puller, self.device, self.timeout_s = puller, device, timeout_s
        self._seen: set[tuple] = set()  # (UCX address, remote keys) of every peer warmed or being warmed
        self._tasks: set[asyncio.Task] = set()

    def on_registered(self, reply: control_pb2.RegisterWorkerResponse) -> None:
        """Runs in the registration heartbeat: starts a warm-up for each peer not seen yet, never waits for one."""
        for peer in reply.prefill_peers:
            key = (peer.ucx_address, tuple(peer.region_rkeys))
            if key in self._seen or len(peer.region_addresses) != len(peer.region_rkeys):
                continue
            self._seen.add(key)  # a failed warm-up is not retried: the first pull sets the channel up anyway
            task = asyncio.get_running_loop().create_task(self._warm(peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _warm(self, peer: control_pb2.SideChannel) -> None:
        pools = [RemoteRegion(1, address, rkey) for address, rkey in zip(peer.region_addresses, peer.region_rkeys)]
        words = RemoteRegion(8, peer.lease_words_address, peer.lease_words_rkey) if peer.lease_words_rkey else None
        try:
            seconds = await self.puller.warm(peer.ucx_address, pools, words, self.device, self.timeout_s)
        except TransferError as e:
            log.warning("side channel warm-up failed", error=str(e))
            return
        log.info("side channel warmed", regions=len(pools), seconds=round(seconds, 4))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
