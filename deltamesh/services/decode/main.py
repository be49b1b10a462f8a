"""Decode (or colocated) worker process."""

from __future__ import annotations

import asyncio

from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.worker import Role, Worker, serve_worker
from deltamesh.services.decode.offers import PrefixOffers
from deltamesh.services.decode.peers import PeerWarmer
from deltamesh.services.decode.servicer import DecodeServicer
from deltamesh.services.prefill.servicer import expire_leases
from deltamesh.transfer import LeaseTable, Transport
from deltamesh.v1 import decode_pb2, decode_pb2_grpc


class DecodeRole(Role):
    """Pulls request state from prefill workers and decodes in a continuous batch; a colocated worker prefills its
    own requests and never pulls. A decode worker with a prefix cache also offers the conversations it keeps to
    prefill workers (the reverse pull), holding them under leases of its own."""

    def __init__(self, worker: Worker, transport: Transport):
        timeout_s = worker.settings.transfer_timeout_s
        self.pulls = worker.settings.role == "decode"
        # a holder gets as long to act on an abandon notice as the pull was given
        self.puller = transport.puller(settle_grace_s=timeout_s)
        self.holder = None
        offers = None
        if self.pulls and worker.engine.has_prefix_cache:  # its holder starts with the first offer
            self.leases = LeaseTable(capacity=worker.engine.num_state_slots)
            self.holder = transport.holder(self.leases)
            offers = PrefixOffers(worker, self.leases, self.holder)
        self.servicer = DecodeServicer(worker, self.puller, offers)
        self.warmer = PeerWarmer(self.puller, worker.engine.device, timeout_s)

    def services(self) -> list[tuple]:
        name = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
        return [(decode_pb2_grpc.add_DecodeWorkerServicer_to_server, self.servicer, name)]

    def on_registered(self, reply) -> None:
        if self.pulls:
            self.warmer.on_registered(reply)

    async def on_start(self) -> None:
        if self.pulls:
            await self.puller.start()

    async def on_stop(self) -> None:
        await self.warmer.close()
        await self.puller.close()
        if self.holder is not None:
            await self.holder.stop()

    def background(self, stop: asyncio.Event) -> list:
        return [expire_leases(self.leases, stop)] if self.holder is not None else []


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    await serve_worker(settings, stop, DecodeRole)
