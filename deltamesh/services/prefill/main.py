"""Prefill worker process."""

from __future__ import annotations

import asyncio

from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.state_exchange import HolderSide, PullerSide
from deltamesh.services.common.worker import Role, Worker, serve_worker
from deltamesh.services.prefill.servicer import PrefillServicer
from deltamesh.transfer import Transport
from deltamesh.v1 import prefill_pb2, prefill_pb2_grpc


class PrefillRole(Role):
    """Prefills prompts and holds their state under leases until a decode worker pulls it over the transport; pulls
    the conversation prefixes decode workers offer (the reverse direction) before computing the rest."""

    holding: HolderSide  # a prefill worker always holds states

    def __init__(self, worker: Worker, transport: Transport):
        self.holding = HolderSide(worker, transport)
        self.leases = self.holding.leases
        self.pulling = PullerSide(worker, transport.puller(settle_grace_s=worker.settings.transfer_timeout_s))
        self.servicer = PrefillServicer(worker, self.holding, self.pulling)
        self.engine = worker.engine

    def services(self) -> list[tuple]:
        name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
        return [(prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer, name)]

    async def on_start(self) -> None:
        await self.holding.start(self.engine.pool_buffers())  # what decode workers warm their reads up with
        await self.pulling.puller.start()

    async def on_stop(self) -> None:
        await self.pulling.puller.close()
        await self.holding.stop()

    def background(self, stop: asyncio.Event) -> list:
        return [self.holding.expire_forever(stop)]


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    await serve_worker(settings, stop, PrefillRole)
