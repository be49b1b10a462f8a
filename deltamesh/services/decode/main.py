"""Decode (or colocated) worker process."""

from __future__ import annotations

import asyncio

from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.state_exchange import HolderSide, PullerSide
from deltamesh.services.common.worker import Role, Worker, serve_worker
from deltamesh.services.decode.peers import PeerWarmer
from deltamesh.services.decode.servicer import DecodeServicer
from deltamesh.transfer import Transport
from deltamesh.v1 import decode_pb2, decode_pb2_grpc


class DecodeRole(Role):
    """Pulls request state from prefill workers and decodes in a continuous batch; a colocated worker prefills its
    own requests and never pulls. A decode worker with a prefix cache also offers the conversations it keeps to
    prefill workers (the reverse pull), holding them under leases of its own."""

    def __init__(self, worker: Worker, transport: Transport):
        timeout_s = worker.settings.transfer_timeout_s
        self.pulls = worker.settings.role == "decode"
        # a holder gets as long to act on an abandon notice as the pull was given
        puller = transport.puller(settle_grace_s=timeout_s)
        self.warmer = PeerWarmer(puller, worker.engine.device, timeout_s)
        self.pulling = PullerSide(worker, puller, on_announced=self.warmer.warm)
        self.holding = None
        if self.pulls and worker.engine.has_prefix_cache:
            self.holding = HolderSide(worker, transport)
            self.leases = self.holding.leases
        self.servicer = DecodeServicer(worker, self.pulling, self.holding)

    def services(self) -> list[tuple]:
        name = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
        return [(decode_pb2_grpc.add_DecodeWorkerServicer_to_server, self.servicer, name)]

    async def on_start(self) -> None:
        if self.pulls:
            await self.pulling.puller.start()
        if self.holding is not None:
            # prefill workers do not warm their reads up towards decode workers (the first reverse pull sets the
            # transport up): the description names this worker and its lease words, no pools
            await self.holding.start(pools=[])

    async def on_stop(self) -> None:
        await self.warmer.close()
        await self.pulling.puller.close()
        if self.holding is not None:
            await self.holding.stop()

    def background(self, stop: asyncio.Event) -> list:
        return [self.holding.expire_forever(stop)] if self.holding is not None else []


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    await serve_worker(settings, stop, DecodeRole)
