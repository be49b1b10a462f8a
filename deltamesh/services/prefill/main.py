"""Prefill worker process."""

from __future__ import annotations

import asyncio

from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.worker import Role, Worker, serve_worker
from deltamesh.services.prefill.reverse_pull import ReversePuller
from deltamesh.services.prefill.servicer import PrefillServicer, expire_leases
from deltamesh.transfer import LeaseTable, Transport
from deltamesh.v1 import prefill_pb2, prefill_pb2_grpc


class PrefillRole(Role):
    """Prefills prompts and holds their state under leases until a decode worker pulls it over the transport; pulls
    the conversation prefixes decode workers offer (the reverse direction) before computing the rest."""

    def __init__(self, worker: Worker, transport: Transport):
        self.leases = LeaseTable(capacity=worker.engine.num_state_slots)  # a lease holds a state slot
        self.holder = transport.holder(self.leases)
        if worker.engine.rank_memory:  # a parallel engine's states held on its other ranks stay there
            self.holder.add_ranks(worker.engine.rank_memory)
        self.puller = transport.puller(settle_grace_s=worker.settings.transfer_timeout_s)
        self.servicer = PrefillServicer(worker, self.leases, self.holder, ReversePuller(worker, self.puller))

    def services(self) -> list[tuple]:
        name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
        return [(prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, self.servicer, name)]

    def transport_descriptor(self):
        return self.servicer.transport_descriptor()

    async def on_start(self) -> None:
        await self.holder.start()
        await self.puller.start()

    async def on_stop(self) -> None:
        await self.puller.close()
        await self.holder.stop()

    def background(self, stop: asyncio.Event) -> list:
        return [expire_leases(self.leases, stop)]


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    await serve_worker(settings, stop, PrefillRole)
