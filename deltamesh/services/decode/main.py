"""Decode (or colocated) worker process."""

from __future__ import annotations

import asyncio

from deltamesh.v1 import decode_pb2, decode_pb2_grpc
from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.worker import Worker, serve_worker
from deltamesh.services.decode.peers import PeerWarmer
from deltamesh.services.decode.servicer import DecodeServicer
from deltamesh.transfer import Transport


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    def setup(worker: Worker, transport: Transport):
        # a holder gets as long to act on an abandon notice as the pull was given
        puller = transport.puller(settle_grace_s=settings.transfer_timeout_s)
        servicer = DecodeServicer(worker, puller)
        name = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
        services = [(decode_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer, name)]
        warmer = PeerWarmer(puller, worker.engine.device, settings.transfer_timeout_s)

        async def start() -> None:
            if settings.role == "decode":  # a colocated worker never pulls
                await puller.start()
                worker.on_registered = warmer.on_registered

        async def stop() -> None:
            await warmer.close()
            await puller.close()

        return services, start, stop, lambda s: [], None

    await serve_worker(settings, stop, setup)
